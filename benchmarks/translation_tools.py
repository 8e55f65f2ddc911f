r"""After-training tools side by side: int8 vs float32, corpus translation vs `experiments.translate`, the server.

    python -m benchmarks.translation_tools --workdir=DIR --input=SOURCES [--reference=REFS]
        [--sections=int8,corpus,server] [--output=results.json]

int8: parameter bytes, exact match (with --reference) and lines/s of greedy decoding in this process, float32
and `--quantize=int8` weights alternating (`--repeats` timed passes each after one that compiles; medians). corpus: wall seconds and
lines/s of `experiments.translate` on the file, `experiments.translate_corpus` by 1 process, and by 2
processes joined by jax.distributed (their own start-up included alike), and whether the outputs are equal.
server: `experiments.serve` on 127.0.0.1, N single-text requests at 1 (sequential), 8 and 32 concurrent
clients: requests/s and p50 / p99 latency, mean batch size. Run it alone (`flock -x /tmp/tj-cpu.lock`):
the figures are ratios taken side by side on one machine (docs/serving.md).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
from absl import app, flags

from transformer_jax import metrics, quantization, trained
from transformer_jax.data import parallel_text
from transformer_jax.decoding import inference

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A trained workdir.")
flags.DEFINE_string("input", None, "Source lines.")
flags.DEFINE_string("reference", None, "Reference lines (exact match of the int8 section).")
flags.DEFINE_list("sections", ["int8", "corpus", "server"], "Which comparisons to run.")
flags.DEFINE_integer("beam_size", 1, "Beam size of every section.")
flags.DEFINE_integer("server_requests", 96, "Requests per concurrency level.")
flags.DEFINE_integer("repeats", 3, "Timed passes per mode of the int8 section (after one that compiles).")
flags.DEFINE_integer("lines_per_shard", 0, "Corpus section's --lines_per_shard (0: an eighth of the input).")
flags.DEFINE_string("output", None, "Also write the figures as JSON here.")
flags.mark_flags_as_required(["workdir", "input"])

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
  return dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")


def int8_section(lines: list[str], references: list[str] | None) -> dict:
  model_config, params, tokenizer = trained.load(FLAGS.workdir)
  weights = {mode or "float32": quantization.quantize_params(params, mode) for mode in ("", "int8")}
  seconds, outputs = {name: [] for name in weights}, {}
  for _ in range(1 + FLAGS.repeats):  # the first pass compiles; then float32 and int8 alternate, median of each
    for name, tree in weights.items():
      start = time.perf_counter()
      outputs[name] = inference.translate_texts(tree, model_config, tokenizer, lines, beam_size=FLAGS.beam_size)
      seconds[name].append(time.perf_counter() - start)
  rows = {}
  for name, tree in weights.items():
    row = {"parameter_bytes": quantization.parameter_bytes(tree),
           "lines_per_s": len(lines) / float(np.median(seconds[name][1:])), "seconds": seconds[name][1:]}
    if references is not None:
      row["exact_match"] = 100 * metrics.exact_match(outputs[name], references, lowercase=tokenizer.lowercase)
    rows[name] = row
  rows["bytes_ratio"] = rows["float32"]["parameter_bytes"] / rows["int8"]["parameter_bytes"]
  rows["speed_ratio_int8_over_float32"] = rows["int8"]["lines_per_s"] / rows["float32"]["lines_per_s"]
  rows["same_outputs"] = outputs["float32"] == outputs["int8"]
  return rows


def _timed(commands: list[list[str]]) -> float:
  start = time.perf_counter()
  procs = [subprocess.Popen(c, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
           for c in commands]
  for proc in procs:
    _, err = proc.communicate()
    if proc.returncode:
      raise RuntimeError(err[-2000:])
  return time.perf_counter() - start


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def corpus_section(lines: list[str], tmp: str) -> dict:
  beam = f"--beam_size={FLAGS.beam_size}"
  translate = _timed([[sys.executable, "-m", "experiments.translate", f"--workdir={FLAGS.workdir}", beam,
                       f"--input={FLAGS.input}", f"--output={tmp}/translate.txt"]])
  shard = FLAGS.lines_per_shard or max(1, len(lines) // 8)
  corpus = [sys.executable, "-m", "experiments.translate_corpus", f"--workdir={FLAGS.workdir}", beam,
            f"--input={FLAGS.input}", f"--lines_per_shard={shard}"]
  one = _timed([corpus + [f"--output_dir={tmp}/one", "--parallel_corpus=out"]])
  port = _free_port()
  two = _timed([corpus + [f"--output_dir={tmp}/two", "--distributed", f"--coordinator_address=localhost:{port}",
                          "--num_processes=2", f"--process_id={i}"] for i in range(2)])
  config = trained.workdir_config(FLAGS.workdir).data
  same = (open(f"{tmp}/translate.txt", "rb").read() == open(f"{tmp}/one/out.{config.target_lang}", "rb").read())
  rows = {"lines": len(lines), "lines_per_shard": shard, "translate_s": translate, "corpus_1_process_s": one, "corpus_2_processes_s": two,
          "identical_to_translate": same}
  rows.update({k.replace("_s", "_lines_per_s"): len(lines) / v for k, v in list(rows.items()) if k.endswith("_s")})
  rows["corpus_1_over_translate"] = translate / one
  return rows


def _post(port: int, text: str) -> float:
  body = json.dumps({"texts": [text]}).encode()
  start = time.perf_counter()
  request = urllib.request.Request(f"http://127.0.0.1:{port}/translate", data=body)
  with urllib.request.urlopen(request, timeout=300) as response:
    response.read()
  return time.perf_counter() - start


def _wait_healthy(port: int, proc: subprocess.Popen) -> None:
  while True:
    if proc.poll() is not None:
      raise RuntimeError(proc.communicate()[1][-2000:])
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        if response.status == 200:
          return
    except OSError:
      time.sleep(0.5)


def server_section(lines: list[str]) -> dict:
  port = _free_port()
  proc = subprocess.Popen([sys.executable, "-m", "experiments.serve", f"--workdir={FLAGS.workdir}", f"--port={port}",
                           f"--beam_sizes={FLAGS.beam_size}", "--max_batch_size=32", "--max_wait_ms=5"],
                          cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  rows = {}
  try:
    _wait_healthy(port, proc)
    texts = [t for t in lines if t.strip()][: FLAGS.server_requests]
    for clients in (1, 8, 32):
      before = _metrics(port)
      start = time.perf_counter()
      with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        latencies = np.asarray(list(pool.map(lambda t: _post(port, t), texts))) * 1000
      seconds = time.perf_counter() - start
      after = _metrics(port)
      batches = after["batches"] - before["batches"]
      rows[f"clients_{clients}"] = {"requests_per_s": len(texts) / seconds,
                                    "p50_ms": float(np.percentile(latencies, 50)),
                                    "p99_ms": float(np.percentile(latencies, 99)),
                                    "mean_batch_size": len(texts) / batches if batches else None}
    rows["compilations_after_warm_up"] = _metrics(port)["compilations_after_warm_up"]
  finally:
    proc.terminate()
    proc.wait(timeout=120)
  return rows


def _metrics(port: int) -> dict:
  with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
    return json.loads(response.read())


def main(argv):
  del argv
  lines = parallel_text.read_lines(FLAGS.input)
  references = parallel_text.read_lines(FLAGS.reference) if FLAGS.reference else None
  results = {"input": FLAGS.input, "lines": len(lines), "beam_size": FLAGS.beam_size}
  with tempfile.TemporaryDirectory() as tmp:
    for section in FLAGS.sections:
      if section == "int8":
        results["int8"] = int8_section(lines, references)
      elif section == "corpus":
        results["corpus"] = corpus_section(lines, tmp)
      elif section == "server":
        results["server"] = server_section(lines)
      print(json.dumps({section: results[section]}, indent=1), flush=True)
  if FLAGS.output:
    with open(FLAGS.output, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
