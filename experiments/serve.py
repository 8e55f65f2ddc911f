r"""Serve a trained workdir over HTTP: a JSON API with dynamic batching onto shapes compiled at start-up.

    python -m experiments.serve --workdir=DIR [--port=8000] [--beam_sizes=4,1] [--max_batch_size=32]
        [--max_wait_ms=5] [--max_input_tokens=64] [--quantize=int8]
    curl -s localhost:8000/translate -d '{"texts": ["twenty-one"], "beam_size": 4}'

Compiles every (beam size, length bucket, row count) first, then listens; GET /health answers 200 from then
on, GET /metrics has request counts, latency percentiles, batch sizes and the compilations since warm-up (0).
SIGTERM (or Ctrl-C) finishes the requests in flight and the queued texts, logs "drained and stopped", then
ends (uvicorn re-raises the signal after its graceful shutdown, so the exit status is SIGTERM's). The API: `transformer_jax/serving/http.py`;
docs/serving.md.
"""

import uvicorn
from absl import flags

import launch
from transformer_jax.decoding import quantization
from transformer_jax.run import trained
from transformer_jax.serving import batching, http

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "The training run's --workdir.")
flags.DEFINE_string("checkpoint", None, "A step, or a checkpoint directory (default: the latest).")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_list("beam_sizes", ["4"], "Beam sizes a request may ask for (the first is the default; 1 = greedy).")
flags.DEFINE_float("alpha", 0.6, "Length penalty exponent ((5+|Y|)/6)^alpha, fixed for the server.")
flags.DEFINE_integer("extra_len", 50, "Maximum output length = input length + extra_len.")
flags.DEFINE_integer("max_batch_size", 32, "Texts per batch at most.")
flags.DEFINE_float("max_wait_ms", 5.0, "How long a text waits for others to share its batch.")
flags.DEFINE_integer("max_input_tokens", 64, "Longest source in tokens (EOS included); longer: 413 or truncated.")
flags.DEFINE_integer("max_texts_per_request", 64, "Texts per request at most (more: 413).")
flags.DEFINE_integer("max_pending_texts", 1024, "Texts queued at most (more: 503, retry later).")
flags.DEFINE_integer("max_connections", 256, "Concurrent connections at most (more: 503, uvicorn's limit).")
flags.DEFINE_enum("quantize", "", quantization.MODES, "'' = float weights; int8 = weight-only int8 (qwix).")
flags.mark_flags_as_required(["workdir"])
launch.check_flags(alpha="decode.alpha", extra_len="decode.extra_len")
launch.check_ranges(port=(0, 65535), max_batch_size=(1, 65536), max_wait_ms=(0, 60_000), max_input_tokens=(2, 2147483647),
                    max_texts_per_request=(1, 2147483647), max_pending_texts=(1, 2147483647), max_connections=(1, 2147483647))


def _limits() -> batching.ServingLimits:
  try:
    beams = tuple(int(b) for b in FLAGS.beam_sizes)
  except ValueError:
    raise ValueError(f"--beam_sizes={','.join(FLAGS.beam_sizes)} must be integers") from None
  return batching.ServingLimits(beam_sizes=beams, alpha=FLAGS.alpha, extra_len=FLAGS.extra_len,
                                max_batch_size=FLAGS.max_batch_size, max_wait_ms=FLAGS.max_wait_ms,
                                max_input_tokens=FLAGS.max_input_tokens,
                                max_texts_per_request=FLAGS.max_texts_per_request,
                                max_pending_texts=FLAGS.max_pending_texts)


@launch.program
def main():
  limits = _limits()
  model_config, params, tokenizer = trained.load(FLAGS.workdir, FLAGS.checkpoint)
  params = quantization.quantize_params(params, FLAGS.quantize)
  service = batching.TranslationService(params, model_config, tokenizer, limits)
  shapes = service.warm_up()
  print(f"compiled {shapes} shapes in {service.warm_up_seconds:.1f}s; serving http://{FLAGS.host}:{FLAGS.port}",
        flush=True)
  config = uvicorn.Config(http.create_app(service), host=FLAGS.host, port=FLAGS.port, log_level="warning",
                          limit_concurrency=FLAGS.max_connections, timeout_graceful_shutdown=None)
  uvicorn.Server(config).run()


if __name__ == "__main__":
  launch.run(main)
