r"""After-training tools side by side: int8 vs float32, corpus translation vs `experiments.translate`, the server.

    python -m benchmarks.translation_tools --workdir=DIR --input=SOURCES [--reference=REFS]
        [--sections=int8,corpus,ctranslate2,server] [--kill_restart] [--output=results.json]

int8: parameter bytes, exact match (with --reference) and lines/s of greedy decoding in this process, float32
and `--quantize=int8` weights alternating (`--repeats` timed passes each after one that compiles; medians). corpus: wall seconds and
lines/s of `experiments.translate` on the file, `experiments.translate_corpus` by 1 process, and by 2
processes joined by jax.distributed (their own start-up included alike), and whether the outputs are equal;
with --kill_restart also 2 processes SIGKILLed part-way and rerun: bytes against the 1-process run.
ctranslate2: the same lines and beam through the model exported to CTranslate2 float32 (loading included).
server: `experiments.serve` on 127.0.0.1, N single-text requests at 1 (sequential), 8 and 32 concurrent
clients: requests/s and p50 / p99 latency, mean batch size. Run it alone (`flock -x /tmp/tj-cpu.lock`):
the figures are ratios taken side by side on one machine (docs/serving.md).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import sentencepiece
from absl import app, flags

from transformer_jax.data import parallel_text
from transformer_jax.data.marian_vocab import TARGET_SPM
from transformer_jax.decoding import inference, quantization
from transformer_jax.evaluation import metrics
from transformer_jax.interop import ctranslate2 as ct2
from transformer_jax.interop import marian
from transformer_jax.run import trained

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A trained workdir.")
flags.DEFINE_string("input", None, "Source lines.")
flags.DEFINE_string("reference", None, "Reference lines (exact match of the int8 section).")
flags.DEFINE_list("sections", ["int8", "corpus", "server"], "Which comparisons to run.")
flags.DEFINE_integer("beam_size", 1, "Beam size of every section.")
flags.DEFINE_integer("server_requests", 96, "Requests per concurrency level.")
flags.DEFINE_integer("repeats", 3, "Timed passes per mode of the int8 section (after one that compiles).")
flags.DEFINE_integer("lines_per_shard", 0, "Corpus section's --lines_per_shard (0: an eighth of the input).")
flags.DEFINE_bool("corpus_two_processes", True, "Corpus section: also time 2 processes joined by jax.distributed.")
flags.DEFINE_bool("kill_restart", False, "Corpus section: also run 2 processes, SIGKILL both once process 1 has "
                  "written its first shard, rerun the command, and compare the bytes with the 1-process run.")
flags.DEFINE_integer("ct2_threads", 2, "ctranslate2 section: CTranslate2 intra-op threads (this host's cores).")
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
  seconds = time.perf_counter() - start
  output = [a for a in commands[0] if a.startswith("--output")]
  print(f"{seconds:.1f} s: {len(commands)} x {commands[0][2]} {' '.join(output)}", file=sys.stderr, flush=True)
  return seconds


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _corpus_command(tmp: str, name: str, shard: int, processes: int = 1, port: int = 0) -> list[list[str]]:
  command = [sys.executable, "-m", "experiments.translate_corpus", f"--workdir={FLAGS.workdir}",
             f"--beam_size={FLAGS.beam_size}", f"--input={FLAGS.input}", f"--lines_per_shard={shard}",
             f"--output_dir={tmp}/{name}", "--parallel_corpus=out"]
  if processes == 1:
    return [command]
  return [command + ["--distributed", f"--coordinator_address=localhost:{port}", f"--num_processes={processes}",
                     f"--process_id={i}"] for i in range(processes)]


def _tree_bytes(root: str) -> dict:
  return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
          for d, _, names in os.walk(root) for f in names}


def _killed_and_restarted(tmp: str, shard: int) -> dict:
  """2 processes, both SIGKILLed once process 1 wrote its first shard, then the same command again."""
  start = time.perf_counter()
  procs = [subprocess.Popen(c, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
           for c in _corpus_command(tmp, "killed", shard, 2, _free_port())]
  first_of_process_1 = os.path.join(tmp, "killed", "shards", "part-00001-of-")
  while not any(os.path.join(tmp, "killed", "shards", n).startswith(first_of_process_1) and not n.endswith(".tmp")
                for n in (os.listdir(os.path.join(tmp, "killed", "shards"))
                          if os.path.isdir(os.path.join(tmp, "killed", "shards")) else [])):
    if any(p.poll() is not None for p in procs):
      raise RuntimeError("a corpus process ended before the kill")
    time.sleep(0.05)
  for proc in procs:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  kept = sorted(n for n in os.listdir(os.path.join(tmp, "killed", "shards")) if not n.endswith(".tmp"))
  restart = _timed(_corpus_command(tmp, "killed", shard, 2, _free_port()))
  return {"shards_kept_after_kill": len(kept), "killed_after_s": time.perf_counter() - start - restart,
          "restart_s": restart, "identical_to_1_process": _tree_bytes(f"{tmp}/killed") == _tree_bytes(f"{tmp}/one")}


def corpus_section(lines: list[str], tmp: str) -> dict:
  translate = _timed([[sys.executable, "-m", "experiments.translate", f"--workdir={FLAGS.workdir}",
                       f"--beam_size={FLAGS.beam_size}", f"--input={FLAGS.input}", f"--output={tmp}/translate.txt"]])
  shard = FLAGS.lines_per_shard or max(1, -(-len(lines) // 8))
  one = _timed(_corpus_command(tmp, "one", shard))
  config = trained.workdir_config(FLAGS.workdir).data
  same = (open(f"{tmp}/translate.txt", "rb").read() == open(f"{tmp}/one/out.{config.target_lang}", "rb").read())
  rows = {"lines": len(lines), "lines_per_shard": shard, "translate_s": translate, "corpus_1_process_s": one}
  if FLAGS.corpus_two_processes:
    rows["corpus_2_processes_s"] = _timed(_corpus_command(tmp, "two", shard, 2, _free_port()))
    rows["two_identical_to_one"] = _tree_bytes(f"{tmp}/two") == _tree_bytes(f"{tmp}/one")
  rows.update({k.replace("_s", "_lines_per_s"): len(lines) / v for k, v in list(rows.items()) if k.endswith("_s")})
  rows.update(identical_to_translate=same, corpus_1_over_translate=translate / one)
  if FLAGS.kill_restart:
    rows["kill_restart"] = _killed_and_restarted(tmp, shard)
  return rows


def ctranslate2_section(lines: list[str], tmp: str) -> dict:
  """The same lines and beam through the model exported to CTranslate2 (float32), in this process: wall seconds
  from loading the exported model to detokenised text (the export itself not timed)."""
  model_config, params, tokenizer = trained.load(FLAGS.workdir)
  try:
    model_dir = ct2.export_ctranslate2(params, model_config, f"{tmp}/ct2", tokenizer_path=tokenizer.path)
  except marian.UnsupportedModelError as error:  # e.g. relative keys beside absolute positions
    return {"error": str(error)}
  start = time.perf_counter()
  translator = ct2.translator(model_dir, compute_type="float32", threads=FLAGS.ct2_threads)
  pieces = ct2.translate_pieces(translator, ct2.source_pieces(model_dir, lines), beam_size=FLAGS.beam_size,
                                length_penalty=0.0, max_len=model_config.max_len, min_decoding_length=0)
  target_spm = sentencepiece.SentencePieceProcessor(model_file=os.path.join(model_dir, TARGET_SPM))
  outputs = [target_spm.decode_pieces(p) for p in pieces]
  seconds = time.perf_counter() - start
  return {"lines": len(outputs), "ctranslate2_fp32_s": seconds, "ctranslate2_fp32_lines_per_s": len(lines) / seconds,
          "threads": FLAGS.ct2_threads}


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
      elif section == "ctranslate2":
        results["ctranslate2"] = ctranslate2_section(lines, tmp)
        if "corpus" in results and "error" not in results["ctranslate2"]:
          results["ctranslate2"]["corpus_1_process_over_ctranslate2"] = (
              results["ctranslate2"]["ctranslate2_fp32_s"] / results["corpus"]["corpus_1_process_s"])
      elif section == "server":
        results["server"] = server_section(lines)
      print(json.dumps({section: results[section]}, indent=1), flush=True)
  if FLAGS.output:
    with open(FLAGS.output, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
