"""The decoding flags that `translate`, `evaluate` and `tune_decoding` share, their checks, and ensembles.

`define_flags(...)` adds `--strategy`, `--temperature`, `--top_k`, `--top_p`, `--seed`, `--ensemble`, `--quantize`
(and, where the program prints hypotheses, `--nbest`); `options(beam_size, alpha)` turns them into a
`generate.DecodeOptions` checked by `DecodeOptions.check`, the one place decoding options are checked (a bad value
is a one-line ValueError naming its flag, before any decoding); `load_models(workdir, checkpoint)` loads the
model, or every model of `--ensemble` (refusing another architecture or vocabulary), as a list of parameters.
"""

from __future__ import annotations

from absl import flags
from etils import epath

from transformer_jax.decoding import generate, inference, quantization
from transformer_jax.run import trained

FLAGS = flags.FLAGS


def define_flags(*, nbest: bool) -> None:
  """Defines the shared decoding flags (with `nbest`: also `--nbest`)."""
  flags.DEFINE_enum("strategy", "beam", list(generate.STRATEGIES),
                    "greedy | beam (beam search, --beam_size; 1 = greedy) | sample (ancestral sampling).")
  flags.DEFINE_string("sampling", None, "Renamed: --strategy.")
  flags.register_validator("sampling", lambda value: value is None,
                           "--sampling is now --strategy (greedy | beam | sample)")
  flags.DEFINE_float("temperature", 1.0, "Sampling: softmax(logits / temperature); > 0.")
  flags.DEFINE_integer("top_k", 0, "Sampling: only the k most probable tokens (0 = all).")
  flags.DEFINE_float("top_p", 1.0, "Sampling: only the nucleus of this probability (Holtzman et al., 2020); "
                     "in (0, 1], 1 = all.")
  flags.DEFINE_integer("seed", 0, "Sampling's seed: line i samples with fold_in(PRNGKey(seed), i), the same "
                       "outputs whatever the batching; in [0, 2**32) (a key's 32 bits).", lower_bound=0,
                       upper_bound=inference.MAX_SEED)
  flags.DEFINE_list("ensemble", [], "More models decoded with --workdir's as one (per-step log-probs averaged): "
                    "steps of --workdir, checkpoint directories, or other workdirs of the same architecture and "
                    "vocabulary. With --ensemble, --checkpoint is the first model.")
  flags.DEFINE_enum("quantize", "", quantization.MODES, "'' = float weights; int8 = weight-only int8 through qwix "
                    "(transformer_jax/decoding/quantization.py; docs/serving.md has its bytes, quality and speed).")
  if nbest:
    flags.DEFINE_integer("nbest", 1, "Hypotheses per input line (<= --beam_size; beam search only).")


def options(beam_size: int, alpha: float, *, nbest: int = 1, mbr_utility: str = "", alignment: bool = False,
            token_log_probs: bool = False) -> generate.DecodeOptions:
  """The flags as a checked `DecodeOptions` (per-token log-probs only where the caller prints them); a bad value
  or combination is a ValueError naming its flag (`DecodeOptions.check`'s message, which starts with the option's
  name, as a flag: `--top_p=1.5 must be in (0, 1]`)."""
  chosen = generate.DecodeOptions(strategy=FLAGS.strategy, beam_size=beam_size, alpha=float(alpha), nbest=nbest,
                                  temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p,
                                  mbr_utility=mbr_utility, alignment=alignment, token_log_probs=token_log_probs)
  try:
    return chosen.check()
  except ValueError as error:
    raise ValueError(f"--{error}") from None


def load_models(workdir: str, checkpoint: str | None):
  """`(model_config, params list, tokenizer)`: `--workdir` at `checkpoint`, then each `--ensemble` entry, each
  quantized as `--quantize` asks.

  An entry is a step of `workdir` (digits), a workdir (a folder with config.json: its latest checkpoint) or a
  checkpoint directory (read with `workdir`'s config). ValueError when an entry's architecture or vocabulary
  differs from the first model's, naming the entry.
  """
  model_config, params, tokenizer = trained.load(workdir, checkpoint)
  params_list = [params]
  for entry in FLAGS.ensemble:
    if (epath.Path(entry) / "config.json").is_file():
      other_config, other_params, other_tokenizer = trained.load(entry, None)
    else:
      other_config, other_params, other_tokenizer = trained.load(workdir, entry)
    if other_config != model_config:
      raise ValueError(f"--ensemble={entry}: another architecture than --workdir's model ({other_config} vs "
                       f"{model_config}); an ensemble needs one architecture")
    if _pieces(other_tokenizer) != _pieces(tokenizer):
      raise ValueError(f"--ensemble={entry}: another vocabulary than --workdir's; an ensemble needs one vocabulary")
    params_list.append(other_params)
  return model_config, [quantization.quantize_params(p, FLAGS.quantize) for p in params_list], tokenizer


def _pieces(tokenizer) -> list[str]:
  return tokenizer.pieces(range(tokenizer.vocab_size))
