"""The HTTP JSON API of a `batching.TranslationService`, on Starlette (served by uvicorn: `experiments.serve`).

    POST /translate  {"texts": ["twenty-one", ""], "beam_size": 4, "truncate": false}
                     -> 200 {"translations": ["einundzwanzig", ""]}
    GET  /health     -> 200 {"status": "ok", ...} (503 while warming up or draining)
    GET  /metrics    -> 200 {"requests", "lines", "errors", "in_flight", "latency_ms": {"p50", "p90", "p99"},
                              "batch_sizes", "mean_batch_size", "pending", "compiled_shapes",
                              "compilations_after_warm_up"}

Errors are `{"error": "<one line>"}` with the status: 400 malformed JSON, an unknown option, a wrong type, a beam
size not served; 413 a body over `max_body_bytes`, too many texts, a text over the token limit (unless
"truncate": true); 503 the queue full or the server draining. Empty strings translate as empty strings.
Starlette rather than FastAPI: three routes whose validation must refuse unknown keys and answer in one line, which
FastAPI's pydantic layer would answer as a multi-line 422 list; Starlette is the ASGI toolkit FastAPI is built on,
without the extra layer (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from transformer_jax.serving.batching import RequestError, TranslationService, backend_compilations


def _error(status: int, message: str) -> JSONResponse:
  return JSONResponse({"error": " ".join(message.split())}, status_code=status)


def create_app(service: TranslationService, *, max_body_bytes: int = 1 << 20) -> Starlette:
  """The ASGI app around `service` (warmed up or not: /health says which); its shutdown drains the batcher."""

  async def translate(request: Request) -> JSONResponse:
    service.metrics.request_started()
    try:
      return await _translate(request)
    finally:
      service.metrics.request_ended()

  async def _translate(request: Request) -> JSONResponse:
    start = time.perf_counter()
    try:
      body = await request.body()
      if len(body) > max_body_bytes:
        raise RequestError(413, f"the body has {len(body)} bytes; the limit is {max_body_bytes}")
      try:
        payload = json.loads(body)
      except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(400, f"malformed JSON: {error}") from None
      texts, beam, truncate = service.parse_request(payload)
      sources = service.encode(texts, truncate)
      outputs = await asyncio.gather(*(asyncio.wrap_future(f) for f in service.submit(sources, beam)))
    except RequestError as error:
      service.metrics.error()
      return _error(error.status, str(error))
    translations = [service.tokenizer.decode(ids) if src else "" for ids, src in zip(outputs, sources)]
    service.metrics.request_done(len(texts), time.perf_counter() - start)
    return JSONResponse({"translations": translations})

  async def health(request: Request) -> JSONResponse:
    status = "draining" if service.stopping else "ok" if service.compilations_at_warm_up is not None else "warming up"
    return JSONResponse({"status": status, "beam_sizes": list(service.limits.beam_sizes),
                         "max_input_tokens": service.limits.max_input_tokens},
                        status_code=200 if status == "ok" else 503)

  async def metrics(request: Request) -> JSONResponse:
    return JSONResponse({**service.metrics.snapshot(), "pending": service.pending,
                         "compiled_shapes": service.compiled_shapes, "warm_up_seconds": service.warm_up_seconds,
                         "compilations_total": backend_compilations(),
                         "compilations_after_warm_up": service.compilations_after_warm_up()})

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    await run_in_threadpool(service.stop)  # uvicorn has finished the requests in flight: run what is queued
    logging.info("serving: drained and stopped after %d requests", service.metrics.snapshot()["requests"])

  return Starlette(routes=[Route("/translate", translate, methods=["POST"]), Route("/health", health),
                           Route("/metrics", metrics)], lifespan=lifespan)
