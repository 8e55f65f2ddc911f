r"""Transformer (base) on WMT 2014 English -> German: the paper's recipe (Vaswani et al., 2017; Table 3, sec. 5-6).

Prepare the data once on a machine with network (see docs/reproducing.md), then, on 8 accelerators:

    python -m experiments.train --config=experiments/configs/wmt14_ende_base.py --workdir=$WORKDIR \
        --config.data.tfds_data_dir=$TFDS_DIR

On fewer accelerators keep tokens_per_batch x grad_accum_steps = 26,624 slots per side (~25k real tokens):

    1 accelerator:  --config.data.tokens_per_batch=3328 --config.grad_accum_steps=8
    2 accelerators: --config.data.tokens_per_batch=13312 --config.grad_accum_steps=2
    4 accelerators: --config.data.tokens_per_batch=6656 --config.grad_accum_steps=4

Then average the last `decode.average_last` checkpoints and score newstest2014 with beam 4, alpha 0.6:

    python -m experiments.average_checkpoints --workdir=$WORKDIR --last=5
    python -m experiments.evaluate --workdir=$WORKDIR --checkpoint=$WORKDIR/averaged \
        --source=newstest2014.en --reference=newstest2014.de --beam_size=4 --alpha=0.6 --extra_len=50 \
        --tokenized_bleu

Paper: 27.3 BLEU on newstest2014 (tokenized, compound-split), 25.8 BLEU / 4.92 perplexity on newstest2013.
"""

import dataclasses

import ml_collections

from transformer_jax import config as model_presets

# The paper's batch: ~25,000 source + ~25,000 target tokens per step (section 5.1). `tokens_per_batch` counts
# packed slots per side (padding included): 104 rows x 256 slots = 26,624 slots, 13 rows per device on 8
# devices. First-fit packing of WMT-like lengths fills ~90% of the source and ~98% of the target slots
# (English is the shorter side), i.e. ~24k source + ~26k target real tokens; the run logs the real padding
# efficiency at start-up.
TOKENS_PER_STEP = 26_624
ROW_LENGTH = 256


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Model: Transformer (base), Table 3: N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1, post-LN,
  # sinusoidal positions, shared source/target/softmax embedding scaled by sqrt(d_model), no attention or ReLU
  # dropout. vocab_size is replaced by the size of the trained vocabulary. max_len only sizes the sinusoid
  # table and caps decoding (source length + 50); it is larger than data.max_len so that long test sentences
  # (eval and test splits are not length-filtered) still fit.
  config.model = ml_collections.ConfigDict(dataclasses.asdict(model_presets.base(vocab_size=37000, max_len=512)))

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "wmt14_translate/de-en"   # tfds: train = Europarl v7 + CommonCrawl + News Commentary v9
  config.data.builder_config = ""                 # (number_words only; the WMT config is in the dataset name)
  config.data.source_lang = "en"                  # the paper translates English -> German
  config.data.target_lang = "de"
  config.data.download = False                    # True: tfds downloads and prepares it (network, hours)
  config.data.tfds_data_dir = ""                  # where the prepared data lives; default: <workdir>/tfds
  config.data.vocab_path = ""                     # default: <workdir>/vocab/spm.model, trained on first run
  config.data.vocab_size = 37000                  # one shared BPE vocabulary of ~37k tokens (section 5.1)
  config.data.vocab_model_type = "bpe"
  config.data.vocab_max_sentences = 2_000_000     # uniform sample of training lines (both sides) for BPE
  config.data.train_split = "train"
  config.data.eval_splits = ("validation",)       # newstest2013 (the paper's dev set)
  config.data.test_split = "test"                 # newstest2014
  config.data.max_len = ROW_LENGTH                # longest training pair kept (tokens), and the packed row length
  config.data.tokens_per_batch = TOKENS_PER_STEP  # slots per side per micro-batch, across all devices

  # Optimisation (section 5.3-5.4): Adam(0.9, 0.98, 1e-9), lr = d_model^-0.5 * min(step^-0.5,
  # step * 4000^-1.5) (peak 7.0e-4 at step 4000), label smoothing 0.1, 100k steps.
  config.num_train_steps = 100_000
  config.warmup_steps = 4000
  config.learning_rate = 1.0              # multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
  config.adam_b1 = 0.9
  config.adam_b2 = 0.98
  config.adam_eps = 1e-9
  config.label_smoothing = 0.1
  # Micro-batches per step: tokens_per_batch x grad_accum_steps is the batch of one optimizer step. The default
  # (1) is for 8 accelerators; on fewer, divide tokens_per_batch and multiply this (see the module docstring).
  config.grad_accum_steps = 1

  config.log_every_steps = 100
  config.eval_every_steps = 5000          # loss / perplexity on newstest2013
  config.attention_diagnostics_rows = 16  # attention entropy per layer/head on this many eval pairs (0 = off)
  config.eval_tokens_per_batch = 16384
  # Section 6.1: a checkpoint every 10 minutes; keep enough to average the last 5.
  config.checkpoint_every_steps = 0
  config.checkpoint_every_minutes = 10.0
  config.checkpoint_keep = 5
  config.checkpoint_best_metric = ""      # the paper averages the newest checkpoints, not the best
  config.async_checkpointing = True

  # Periodic greedy sacreBLEU on the first examples of newstest2013 (a progress signal, not the paper's score).
  config.bleu_every_steps = 10_000
  config.bleu_max_examples = 1000
  config.bleu_beam_size = 1
  config.bleu_alpha = 0.6

  # Decoding and averaging for the reported score (section 6.1): beam 4, length penalty alpha 0.6, outputs up to
  # input length + 50, on the average of the last 5 checkpoints (base) / 20 (big).
  config.decode = ml_collections.ConfigDict()
  config.decode.beam_size = 4
  config.decode.alpha = 0.6
  config.decode.extra_len = 50
  config.decode.average_last = 5

  # Device mesh ('data', 'fsdp', 'tensor'): plain data parallelism over every device by default. The rows of a
  # micro-batch (tokens_per_batch / max_len) must divide over data x fsdp. distributed=True initialises
  # jax.distributed for multi-host runs (TPU pods, SLURM, ...).
  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1
  config.mesh.fsdp = 1
  config.mesh.tensor = 1
  config.distributed = False

  # After training (experiments/train.py): translate newstest2014 with the paper's beam. For the paper's
  # number, average checkpoints and run experiments/evaluate.py (docs/reproducing.md).
  config.final_eval = ml_collections.ConfigDict()
  config.final_eval.split = "test"
  config.final_eval.beam_size = 4
  config.final_eval.max_examples = 0      # 0 = the whole split
  return config
