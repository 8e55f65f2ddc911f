"""Dynamic batching of translation requests onto shapes compiled at start-up (no HTTP: `serving.http` is the API).

    service = TranslationService(params, model_config, tokenizer, ServingLimits(beam_sizes=(4,)))
    service.warm_up()                          # compiles every (beam, length bucket, row count) once
    translations = service.translate(["twenty-one"], beam_size=4)   # from any thread; blocks until done

Each non-empty text becomes one item, keyed by (beam size, source length bucket `inference.length_bucket`). A
worker thread takes the key whose oldest item waited longest and runs a batch when that key holds
`max_batch_size` items or its oldest item has waited `max_wait_ms` (Clipper / TF Serving's batching: a size or
a timeout). A batch goes through `inference.decode_ids` with `batch_size=max_batch_size`, whose row count is
padded to a power of two: so the compiled shapes are beam sizes x length buckets up to `max_input_tokens` x
powers of two up to `max_batch_size`, all compiled by `warm_up()`; afterwards nothing compiles
(`compilations_after_warm_up`, counted from JAX's own compile events). One model in memory whatever the number
of requests; `max_pending_texts` bounds the queue (an over-full queue is refused, so latency stays bounded).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any, Sequence

import jax
import numpy as np

from transformer_jax.config import ModelConfig
from transformer_jax.decoding import generate, inference

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compilations = collections.Counter()


def _count_compilations(event: str, duration: float, **kwargs) -> None:
  if event == _COMPILE_EVENT:
    _compilations["backend"] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compilations)


def backend_compilations() -> int:
  """XLA compilations in this process since this module was imported (JAX's `backend_compile` events)."""
  return _compilations["backend"]


REQUEST_KEYS = ("texts", "beam_size", "truncate")


class RequestError(ValueError):
  """A request that cannot be served as it is: `status` is the HTTP status, the message one line."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass(frozen=True)
class ServingLimits:
  """What requests may ask for and how batches form."""
  beam_sizes: tuple[int, ...] = (4,)  # allowed per-request beam sizes (the first is the default); 1 = greedy
  alpha: float = 0.6  # GNMT length penalty (static: one compiled search per value, so fixed per server)
  extra_len: int = 50  # output limit = source length + extra_len tokens
  max_batch_size: int = 32  # texts per batch (rows; smaller batches pad to a power of two)
  max_wait_ms: float = 5.0  # how long the oldest text of a key waits for more before its batch runs
  max_input_tokens: int = 64  # source tokens (EOS included); longer texts are refused or truncated
  max_texts_per_request: int = 64
  max_pending_texts: int = 1024  # texts queued at once; more are refused (HTTP 503) until the queue drains

  def check(self, max_len: int) -> "ServingLimits":
    if not self.beam_sizes or min(self.beam_sizes) < 1:
      raise ValueError(f"beam sizes {self.beam_sizes}: give at least one, each >= 1")
    if self.max_batch_size < 1 or self.max_texts_per_request < 1 or self.max_pending_texts < 1:
      raise ValueError("max_batch_size, max_texts_per_request and max_pending_texts must be >= 1")
    if not 2 <= self.max_input_tokens <= max_len:
      raise ValueError(f"max_input_tokens={self.max_input_tokens} must be in [2, the model's max_len={max_len}]")
    return self


def _row_counts(max_batch_size: int) -> list[int]:
  """The row counts `decode_ids` pads a batch of 1..max_batch_size to (powers of two, then the maximum)."""
  return sorted({min(max_batch_size, 1 << k) for k in range(max_batch_size.bit_length() + 1)})


class _Item:
  __slots__ = ("ids", "future", "arrived")

  def __init__(self, ids: list[int]):
    self.ids, self.future, self.arrived = ids, concurrent.futures.Future(), time.monotonic()


class Metrics:
  """Requests, lines, latencies (seconds, the last 10,000) and batch sizes; `snapshot()` for /metrics."""

  def __init__(self):
    self.lock = threading.Lock()
    self.requests = self.lines = self.errors = self.in_flight = 0
    self.latencies: collections.deque = collections.deque(maxlen=10_000)
    self.batch_sizes: collections.Counter = collections.Counter()

  def request_started(self) -> None:
    with self.lock:
      self.in_flight += 1

  def request_ended(self) -> None:
    with self.lock:
      self.in_flight -= 1

  def request_done(self, lines: int, seconds: float) -> None:
    with self.lock:
      self.requests += 1
      self.lines += lines
      self.latencies.append(seconds)

  def error(self) -> None:
    with self.lock:
      self.errors += 1

  def batch(self, size: int) -> None:
    with self.lock:
      self.batch_sizes[size] += 1

  def snapshot(self) -> dict:
    with self.lock:
      latencies = np.asarray(self.latencies) * 1000
      percentiles = {f"p{p}": float(np.percentile(latencies, p)) if latencies.size else None for p in (50, 90, 99)}
      batches = sum(self.batch_sizes.values())
      return {"requests": self.requests, "lines": self.lines, "errors": self.errors, "in_flight": self.in_flight,
              "latency_ms": percentiles,
              "batches": batches, "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
              "mean_batch_size": sum(k * v for k, v in self.batch_sizes.items()) / batches if batches else None}


class TranslationService:
  """One model, a queue per (beam size, length bucket) and the worker thread that batches them (module doc)."""

  def __init__(self, params: Any, model_config: ModelConfig, tokenizer, limits: ServingLimits = ServingLimits()):
    self.params, self.model_config, self.tokenizer = params, model_config, tokenizer
    self.limits = limits.check(model_config.max_len)
    self.options = {b: generate.DecodeOptions(strategy="beam", beam_size=b, alpha=float(limits.alpha),
                                              token_log_probs=False).check() for b in limits.beam_sizes}
    self.metrics = Metrics()
    self._queues: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
    self._pending = 0
    self._condition = threading.Condition()
    self._stopping = False
    self._worker = threading.Thread(target=self._run, name="batcher", daemon=True)
    self.compilations_at_warm_up: int | None = None
    self.warm_up_seconds: float | None = None
    self.compiled_shapes = 0

  @property
  def stopping(self) -> bool:
    return self._stopping

  @property
  def pending(self) -> int:
    """Texts queued and not yet in a batch."""
    return self._pending

  def buckets(self) -> list[int]:
    """The source length buckets a text may fall in (up to `max_input_tokens`)."""
    top = min(inference.length_bucket(self.limits.max_input_tokens), self.model_config.max_len)
    return sorted({min(inference.length_bucket(n), top) for n in range(1, self.limits.max_input_tokens + 1)})

  def warm_up(self) -> int:
    """Compiles the search of every (beam size, bucket, row count) and starts the worker; returns the number
    of shapes run."""
    start, shapes = time.time(), 0
    filler = max(self.model_config.pad_id, self.model_config.eos_id) + 1  # any ordinary token
    for beam in self.limits.beam_sizes:
      for bucket in self.buckets():
        for rows in _row_counts(self.limits.max_batch_size):
          sources = [[filler] * (bucket - 1) + [self.model_config.eos_id]] * rows
          self._decode(beam, sources)
          shapes += 1
    self.compilations_at_warm_up = backend_compilations()
    self.warm_up_seconds, self.compiled_shapes = time.time() - start, shapes
    self._worker.start()
    return shapes

  def compilations_after_warm_up(self) -> int | None:
    return None if self.compilations_at_warm_up is None else backend_compilations() - self.compilations_at_warm_up

  def _decode(self, beam: int, sources: Sequence[list[int]]) -> list[list[int]]:
    lists = inference.decode_ids(self.params, self.model_config, sources, self.options[beam],
                                 extra_len=self.limits.extra_len, batch_size=self.limits.max_batch_size)
    return [hyps[0].ids if hyps else [] for hyps in lists]

  def encode(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
    """Each text's source ids (EOS included; `[]` for a blank text). RequestError 413 for a text over
    `max_input_tokens`, unless `truncate` (then its first max_input_tokens - 1 tokens and EOS)."""
    limit, out = self.limits.max_input_tokens, []
    for i, text in enumerate(texts):
      ids = [] if self.tokenizer.is_blank(text) else self.tokenizer.encode(text)
      if len(ids) > limit:
        if not truncate:
          raise RequestError(413, f"texts[{i}] has {len(ids)} tokens (EOS included); the limit is {limit}: "
                                  "shorten it or send \"truncate\": true")
        ids = ids[: limit - 1] + [self.model_config.eos_id]
      out.append(ids)
    return out

  def submit(self, sources: Sequence[list[int]], beam_size: int) -> list[concurrent.futures.Future]:
    """Queues the non-empty sources (RequestError 503 when the queue is full or the service stops); a future
    of output ids per source (already done, `[]`, for an empty one)."""
    items = [_Item(ids) for ids in sources]
    with self._condition:
      waiting = sum(1 for item in items if item.ids)
      if self._stopping:
        raise RequestError(503, "the server is shutting down")
      if self._pending + waiting > self.limits.max_pending_texts:
        raise RequestError(503, f"{self._pending} texts are queued (limit {self.limits.max_pending_texts}): "
                                "retry later")
      for item in items:
        if item.ids:
          bucket = min(inference.length_bucket(len(item.ids)), self.model_config.max_len)
          self._queues[(beam_size, bucket)].append(item)
        else:
          item.future.set_result([])
      self._pending += waiting
      self._condition.notify()
    return [item.future for item in items]

  def translate(self, texts: Sequence[str], beam_size: int | None = None, truncate: bool = False) -> list[str]:
    """Blocking translation of `texts` through the batcher (what the HTTP handler awaits, from any thread)."""
    sources = self.encode(texts, truncate)
    futures = self.submit(sources, self.limits.beam_sizes[0] if beam_size is None else beam_size)
    return [self.tokenizer.decode(f.result()) if ids else "" for f, ids in zip(futures, sources)]

  def parse_request(self, payload: Any) -> tuple[list[str], int, bool]:
    """`(texts, beam_size, truncate)` of a `POST /translate` body `{"texts": [str, ...], "beam_size": int,
    "truncate": bool}` (only `texts` required); RequestError (400 or 413) naming what is wrong."""
    if not isinstance(payload, dict):
      raise RequestError(400, "the body must be a JSON object {\"texts\": [...]}")
    unknown = sorted(set(payload) - set(REQUEST_KEYS))
    if unknown:
      raise RequestError(400, f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(REQUEST_KEYS)}")
    texts = payload.get("texts")
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
      raise RequestError(400, "\"texts\" must be a list of strings")
    if len(texts) > self.limits.max_texts_per_request:
      raise RequestError(413, f"{len(texts)} texts in one request; the limit is {self.limits.max_texts_per_request}")
    beam = payload.get("beam_size", self.limits.beam_sizes[0])
    if isinstance(beam, bool) or beam not in self.limits.beam_sizes:
      raise RequestError(400, f"beam_size={beam!r} is not served; allowed: {list(self.limits.beam_sizes)}")
    truncate = payload.get("truncate", False)
    if not isinstance(truncate, bool):
      raise RequestError(400, f"truncate={truncate!r} must be true or false")
    return texts, beam, truncate

  def _next_batch(self) -> tuple[tuple[int, int], list[_Item]] | None:
    """Waits for a batch to be due (full, or its oldest item `max_wait_ms` old); None once stopped and empty."""
    with self._condition:
      while True:
        ready = [(q[0].arrived, key) for key, q in self._queues.items() if q]
        if not ready:
          if self._stopping:
            return None
          self._condition.wait()
          continue
        oldest, key = min(ready)
        queue = self._queues[key]
        due = oldest + self.limits.max_wait_ms / 1000 - time.monotonic()
        if len(queue) >= self.limits.max_batch_size or due <= 0 or self._stopping:
          batch = [queue.popleft() for _ in range(min(len(queue), self.limits.max_batch_size))]
          self._pending -= len(batch)
          return key, batch
        self._condition.wait(timeout=due)

  def _run(self) -> None:
    while (job := self._next_batch()) is not None:
      (beam, _), batch = job
      self.metrics.batch(len(batch))
      try:
        outputs = self._decode(beam, [item.ids for item in batch])
      except Exception as error:  # pylint: disable=broad-except (handed to the requests that wait on it)
        for item in batch:
          item.future.set_exception(error)
        continue
      for item, ids in zip(batch, outputs):
        item.future.set_result(ids)

  def stop(self) -> None:
    """Refuses new texts, runs every queued one, then ends the worker (the drain of a SIGTERM)."""
    with self._condition:
      self._stopping = True
      self._condition.notify()
    if self._worker.is_alive():
      self._worker.join()
