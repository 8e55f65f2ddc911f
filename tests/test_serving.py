"""The translation server: the batcher's rules with a stand-in model (cheap), the HTTP server end to end (slow).

End to end: `experiments.serve` on 127.0.0.1 with a tiny trained model, a bounded number of concurrent
clients (urllib), outputs compared with file-mode `experiments.translate`, batches > 1, no compilation after
warm-up, every bad request answered with its status and one line while the server keeps serving, SIGTERM drains.
"""

import concurrent.futures
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import helpers

from transformer_jax.config import ModelConfig
from transformer_jax.serving import batching

REPO = helpers.REPO


class _WordTokenizer:
  """A word as the id 10 + its length (EOS 3), enough for the batcher's encode/decode."""

  def is_blank(self, text):
    return not text.strip()

  def encode(self, text):
    return [10 + len(w) for w in text.split()] + [3]

  def decode(self, ids):
    return " ".join("x" * (i - 10) for i in ids)


class _FakeService(batching.TranslationService):
  """The batcher with its model replaced: echoes each source (EOS dropped) and records each batch."""

  def __init__(self, limits, delay=0.0):
    super().__init__(None, ModelConfig(vocab_size=64, max_len=64), _WordTokenizer(), limits)
    self.batches, self.delay = [], delay

  def _decode(self, beam, sources):
    self.batches.append((beam, [len(s) for s in sources]))
    time.sleep(self.delay)
    return [list(s[:-1]) for s in sources]


def test_batches_form_by_size_or_wait_and_by_length_bucket():
  service = _FakeService(batching.ServingLimits(beam_sizes=(2,), max_batch_size=4, max_wait_ms=200))
  service._worker.start()
  texts = ["a bb", "ccc", "dd e f", "g", "hh"] + ["w " * 12]  # five in bucket 8, one in bucket 16
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    outputs = list(pool.map(lambda t: service.translate([t])[0], texts))
  service.stop()
  assert outputs == [" ".join("x" * len(w) for w in t.split()) for t in texts]
  sizes = sorted(len(b) for _, b in service.batches)
  assert sizes == [1, 1, 4] and all(len({batching.inference.length_bucket(n) for n in b}) == 1
                                    for _, b in service.batches)


def test_requests_are_checked_and_a_full_queue_is_refused():
  service = _FakeService(batching.ServingLimits(beam_sizes=(4, 1), max_texts_per_request=3, max_input_tokens=4,
                                                max_pending_texts=2))
  assert service.parse_request({"texts": ["a", ""]}) == (["a", ""], 4, False)
  for payload, status, needle in [([], 400, "JSON object"), ({"texts": "a"}, 400, "list of strings"),
                                  ({"texts": ["a"], "beam": 4}, 400, "unknown option(s) beam"),
                                  ({"texts": ["a"] * 4}, 413, "4 texts in one request; the limit is 3"),
                                  ({"texts": ["a"], "beam_size": 2}, 400, "beam_size=2 is not served"),
                                  ({"texts": ["a"], "truncate": 1}, 400, "truncate=1")]:
    with pytest.raises(batching.RequestError, match=needle.replace("(", r"\(").replace(")", r"\)")) as error:
      service.parse_request(payload)
    assert error.value.status == status
  with pytest.raises(batching.RequestError, match="has 6 tokens") as error:
    service.encode(["a b c d e"], truncate=False)
  assert error.value.status == 413 and service.encode(["a b c d e"], truncate=True) == [[11, 11, 11, 3]]
  service.submit([[11, 3], [11, 3]], 4)  # worker not started: they stay queued
  with pytest.raises(batching.RequestError, match="2 texts are queued") as error:
    service.submit([[11, 3]], 4)
  assert error.value.status == 503 and service.submit([[]], 4)[0].result() == []  # an empty text needs no queue


def test_stop_runs_what_is_queued_then_refuses():
  service = _FakeService(batching.ServingLimits(beam_sizes=(1,), max_batch_size=2, max_wait_ms=10_000), delay=0.05)
  futures = service.submit([[11, 3]] * 5, 1)
  service._worker.start()
  service.stop()
  assert [f.result(timeout=0) for f in futures] == [[11]] * 5
  with pytest.raises(batching.RequestError, match="shutting down"):
    service.submit([[11, 3]], 1)


# ---------------------------------------------------------------------------------------------------------------
# The server end to end.

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("run")
  helpers.train_tiny(workdir)
  return workdir


def _post(port, body: bytes, timeout=60):
  request = urllib.request.Request(f"http://127.0.0.1:{port}/translate", data=body,
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as error:
    return error.code, json.loads(error.read())


def _get(port, path):
  with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
    return json.loads(response.read())


def _start_server(workdir, port):
  proc = subprocess.Popen([sys.executable, "-m", "experiments.serve", f"--workdir={workdir}", f"--port={port}",
                           "--beam_sizes=2", "--max_batch_size=8", "--max_input_tokens=16", "--max_wait_ms=20",
                           "--max_texts_per_request=64"], cwd=REPO, env=helpers.program_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 400
  while time.time() < deadline:
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    try:
      if _get(port, "/health")["status"] == "ok":
        return proc
    except (urllib.error.URLError, ConnectionError):
      time.sleep(0.5)
  proc.kill()
  raise AssertionError("the server did not become healthy")


def _texts(count):
  from transformer_jax.data import number_words
  return [number_words.english(n * 7919 % 99_991 + 1) if n % 11 else "" for n in range(count)]


BAD_REQUESTS = [
    (b'{"texts": ["one"', 400, "malformed JSON"),
    (b'{"texts": ["one"], "temperature": 0.5}', 400, "unknown option(s) temperature"),
    (b'{"texts": ["one"], "beam_size": 3}', 400, "beam_size=3 is not served; allowed: [2]"),
    (json.dumps({"texts": ["one"] * 65}).encode(), 413, "65 texts in one request; the limit is 64"),
    (json.dumps({"texts": ["one two three " * 6]}).encode(), 413, "the limit is 16"),
]


@pytest.mark.slow
def test_server_batches_concurrent_requests_like_file_mode_and_drains_on_sigterm(trained, tmp_path):
  texts = _texts(48)
  (tmp_path / "in.txt").write_text("".join(t + "\n" for t in texts))
  subprocess.run([sys.executable, "-m", "experiments.translate", f"--workdir={trained}", "--beam_size=2",
                  f"--input={tmp_path / 'in.txt'}", f"--output={tmp_path / 'out.txt'}"], cwd=REPO,
                 env=helpers.program_env(), check=True, capture_output=True, timeout=300)
  expected = (tmp_path / "out.txt").read_text().splitlines()
  port = helpers.free_port()
  server = _start_server(trained, port)
  try:
    requests = [texts[i:i + 3] for i in range(0, len(texts), 3)]  # 16 requests, 8 clients at a time
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      answers = list(pool.map(lambda chunk: _post(port, json.dumps({"texts": chunk}).encode()), requests))
    assert [s for s, _ in answers] == [200] * len(requests)
    assert sum((a["translations"] for _, a in answers), []) == expected
    for body, status, needle in BAD_REQUESTS:
      got_status, answer = _post(port, body)
      assert (got_status, needle in answer["error"], "\n" in answer["error"]) == (status, True, False), answer
    assert _post(port, json.dumps({"texts": texts[:2]}).encode()) == (200, {"translations": expected[:2]})
    metrics = _get(port, "/metrics")
    assert max(int(k) for k in metrics["batch_sizes"]) > 1 and metrics["compilations_after_warm_up"] == 0
    assert metrics["requests"] == len(requests) + 1 and metrics["errors"] == len(BAD_REQUESTS)
    _check_sigterm_drains(server, port, texts, expected)
  finally:
    if server.poll() is None:
      server.kill()


def _check_sigterm_drains(server, port, texts, expected):
  """SIGTERM while requests are queued: every one of them still gets its translations, then the server exits 0."""
  results = []
  body = json.dumps({"texts": texts}).encode()
  clients = [threading.Thread(target=lambda: results.append(_post(port, body))) for _ in range(4)]
  for client in clients:
    client.start()
  deadline = time.time() + 30
  while _get(port, "/metrics")["in_flight"] < len(clients) and time.time() < deadline:
    time.sleep(0.005)  # all four received (a connection not yet accepted is not in flight)
  server.send_signal(signal.SIGTERM)
  for client in clients:
    client.join(timeout=120)
  output = server.communicate(timeout=120)[0]
  assert results == [(200, {"translations": expected})] * 4
  # uvicorn re-raises SIGTERM once its graceful shutdown is over: the status says how the server stopped
  assert server.returncode in (0, -signal.SIGTERM) and "drained and stopped after" in output, output[-2000:]
