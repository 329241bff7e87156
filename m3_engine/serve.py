"""``m3-serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

    m3-serve MODEL_DIR --framework torch --port 8000 --max-batch 32 --max-context 8192
    python -m m3_engine.serve MODEL_DIR --framework jax --api-key secret --served-model-name m3

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
    client.completions.create(model="m3", prompt="Hello", max_tokens=16)
    client.chat.completions.create(model="m3", messages=[{"role": "user", "content": "Hi"}], stream=True)

Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed (server-sent
  events ``data: {...}``, then ``data: [DONE]``) or not, in OpenAI's shapes;
  ``stream_options.include_usage`` adds a last chunk with ``usage``.
* ``GET /v1/models`` (and ``/v1/models/{name}``; the card adds ``max_model_len``
  and ``vocab_size``), ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes).
* ``GET /health``: 200 ``{"status": "ok", "running", "waiting", "unfinished",
  "kv_pages_used", "kv_pages_total", "in_flight", "failed_steps", "last_error",
  ...the engine's stats}``; 503 when the engine thread is not running or the last
  3 steps all failed.
* ``GET /metrics`` (Prometheus text, label ``model_name``): gauges
  ``m3_num_requests_running`` / ``_waiting`` / ``_unfinished`` (engine),
  ``m3_num_requests_in_flight`` (HTTP requests being answered),
  ``m3_kv_cache_used_pages`` / ``_total_pages`` / ``_usage_perc``,
  ``m3_kv_cache_cached_blocks`` / ``_evictable_blocks`` (prefix caching);
  counters ``m3_prompt_tokens_total``, ``m3_generation_tokens_total``,
  ``m3_engine_steps_total``, ``m3_engine_step_errors_total``,
  ``m3_request_success_total{finished_reason}``, ``m3_request_aborted_total``,
  ``m3_request_refused_total``, ``m3_prefix_cache_queries_total`` / ``_hits_total``
  (tokens), ``m3_spec_decode_num_drafts_total`` / ``_num_draft_tokens_total`` /
  ``_num_accepted_tokens_total`` / ``_draft_seconds_total`` (speculative decoding);
  histograms ``m3_time_to_first_token_seconds``,
  ``m3_time_per_output_token_seconds`` (between two tokens of a request; a step
  that brings several tokens counts each at its share of the gap) and
  ``m3_e2e_request_latency_seconds``. After a load the pool is empty again when
  running, waiting, in-flight and used pages are all 0.

Request fields: OpenAI's ``model``, ``prompt`` (a string, a list of strings,
token ids, a list of token-id lists: one choice per prompt), ``messages``,
``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop``, ``logprobs`` / ``top_logprobs``, ``presence_penalty``,
``frequency_penalty``, ``n`` (1 only), ``echo``, ``stream``, ``stream_options``;
and vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``return_token_ids`` (each choice / chunk gets
``token_ids``, and ``prompt_token_ids``), ``add_generation_prompt`` (chat).
Unknown fields are ignored; fields this engine cannot honour (``logit_bias``,
``best_of`` > 1, ``suffix``, ``tools``, ``response_format`` other than text, ...)
are a 400.

Semantics worth knowing:

* ``max_tokens`` left out = what is left of the context (``max_context`` minus
  the prompt), for completions and chat alike (vLLM's default, not OpenAI's 16
  for completions). A request may ask for more than is left: it then ends with
  ``finish_reason="length"`` at the end of the context.
* A prompt longer than ``max_context`` is a 400 (``code="context_length_exceeded"``).
* ``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the prefix
  cache served (``--enable-prefix-caching``; else 0).
* ``echo`` (completions) puts the prompt text before the completion; with
  ``logprobs`` it is a 400 (the engine computes no prompt logprobs). In chat,
  ``echo`` puts the last message's content first when that message is the
  assistant's (vLLM's rule).
* Sampling defaults a request leaves out come from the model's
  ``generation_config.json`` (``max_new_tokens`` caps the default ``max_tokens``);
  the server passes on only the fields a request sets and the engine fills the
  others, as for ``LLM.generate`` (an explicit ``"temperature": 1.0`` stays 1.0).
  A request with ``seed`` samples
  the same tokens as ``LLM.generate`` with the same parameters.
* ``--max-queue N``: an HTTP request whose prompts would make more than N
  requests wait (admitted to no batch yet) is refused with a 503
  (``code="queue_full"``); a list prompt counts one per prompt.
* Errors are OpenAI's body ``{"error": {"message", "type", "param", "code"}}``:
  400 for a bad request (pydantic's checks and ``SamplingParams``'), 401 for a
  missing or wrong API key (``/v1/*``, ``/tokenize``, ``/detokenize``; ``/health``
  and ``/metrics`` stay open), 404 for an unknown model or path, 503 when the
  waiting queue is full (``--max-queue``) or the server is stopping, 500 when a
  model step fails (the requests of that step fail; the server goes on).

Design: ONE engine thread owns the engine (it is not thread-safe): HTTP handlers
(the asyncio loop) send it ``add`` / ``abort`` commands through a thread-safe
queue, and it hands each request's ``RequestOutput``s back through that HTTP
request's asyncio queue (one ``loop.call_soon_threadsafe`` per step for all of
the step's outputs). Between commands it
runs engine steps while any request is unfinished and blocks on the queue when
idle, so every connection shares the continuous batch. A client that goes away
(a closed stream, a dropped connection while waiting for a non-streamed answer)
has its requests aborted, which frees their cache pages at once. A failed
engine step fails the requests then unfinished (500: the body, or an error
event in a stream) and the loop goes on. SIGTERM (and SIGINT) stop the server
cleanly: no new connections; open requests may finish for ``--shutdown-timeout``
seconds, then the engine thread aborts what is left (each gets a 503 error
body or error event, then ``[DONE]``) and stops; ``llm.close()`` ends
tensor-parallel workers; exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Optional, Union

try:   # first: without the server's packages, name the extra that installs them
    import fastapi  # noqa: F401
    import pydantic  # noqa: F401
    import uvicorn  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"m3-serve needs FastAPI, uvicorn and pydantic ({e.name} is missing): "
                              "pip install 'm3-msa-kernels[server]'", name=e.name) from None
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import engine_class
from .args import CACHE_DTYPES, DTYPE_NAMES, EngineArgs
from .sampling_params import SamplingParams

__all__ = ["main", "build_parser", "create_app", "EngineLoop", "APIError", "CompletionRequest",
           "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest"]

log = logging.getLogger("uvicorn.error")   # uvicorn's configured logger: our lines look like its own

FRAMEWORKS = ("torch", "jax")
DEFAULT_MAX_QUEUE = 1024
UNHEALTHY_AFTER = 3   # consecutive failed engine steps after which /health answers 503


# -- errors ------------------------------------------------------------------------------------------

class APIError(Exception):
    """An error answered with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_of(error: Exception, rename: Optional[dict] = None) -> Optional[str]:
    """The field an engine error names (``"temperature: expected ..."`` -> ``"temperature"``)."""
    head = str(error).split(":", 1)[0].split("[", 1)[0].strip()
    if not head.isidentifier():
        return None
    return (rename or {}).get(head, head)


# -- request models ----------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Optional[bool] = False


class _GenerationRequest(BaseModel):
    """The fields completions and chat share (OpenAI's, then vLLM's extensions)."""
    model_config = ConfigDict(extra="allow")   # unknown fields are ignored, as OpenAI-compatible servers do

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    n: Optional[int] = 1
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    echo: Optional[bool] = False
    add_generation_prompt: bool = True
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's shape)."""
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids -> text."""
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    tokens: list[int]


# -- metrics -----------------------------------------------------------------------------------------

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)


class Histogram:
    """A Prometheus histogram (cumulative buckets, ``_sum``, ``_count``); thread-safe."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        value = max(float(value), 0.0)
        with self._lock:
            self.sum += value
            for i, b in enumerate(self.buckets):
                if value <= b:
                    self.counts[i] += 1
                    break
            else:
                self.counts[-1] += 1

    def lines(self, name: str, labels: str) -> list:
        with self._lock:
            counts, total = list(self.counts), self.sum
        out, cumulative = [], 0
        for b, c in zip(self.buckets + ("+Inf",), counts):
            cumulative += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {cumulative}')
        out += [f"{name}_sum{{{labels}}} {total}", f"{name}_count{{{labels}}} {cumulative}"]
        return out


class Metrics:
    """What ``/metrics`` shows beyond the engine's own counters (written by the engine thread)."""

    def __init__(self):
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished = {"stop": 0, "length": 0}   # finish reason -> requests (the engine's)
        self.aborted = 0                            # requests aborted (client gone, shutdown, failed step)
        self.refused = 0                            # requests refused with a 503 (full queue)
        self.step_errors = 0


# -- the engine thread -------------------------------------------------------------------------------

class _Sink:
    """Where the engine thread sends one HTTP request's events: ``("added", None)``,
    ``("output", RequestOutput)`` or ``("error", APIError)``. Lives on the event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, kind: str, value=None) -> None:   # any thread
        _push_all([(self, kind, value)])


def _push_all(events) -> None:
    """Hand ``(sink, kind, value)`` events to their sinks' event loops (any thread): one thread-safe
    call per loop, not per event (each is a write to the loop's wake-up pipe; a decode step of 64
    streams made 64 of them)."""
    by_loop: dict = {}
    for sink, kind, value in events:
        by_loop.setdefault(sink.loop, []).append((sink.queue, (kind, value)))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            pass


def _put_all(items) -> None:
    for q, event in items:
        q.put_nowait(event)


class EngineLoop:
    """The thread that owns ``llm.engine``: it runs ``add`` / ``abort`` commands from the HTTP
    handlers and engine steps while requests are unfinished, and blocks when idle.

    max_queue: the most requests that may wait (queued, not yet in the batch); an ``add``
               that would go beyond it is refused with a 503.
    """

    def __init__(self, llm, *, max_queue: Optional[int] = DEFAULT_MAX_QUEUE, metrics: Optional[Metrics] = None):
        self.llm, self.engine = llm, llm.engine
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict = {}           # engine request id -> _Sink (unfinished requests only)
        self._token_times: dict = {}     # engine request id -> (time, tokens) of its last output (TPOT)
        self._lock = threading.Lock()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="m3-engine", daemon=True)
        self.error: Optional[str] = None     # the last failed step's error
        self.failed_steps = 0                # failed steps since the last good one
        self.dead: Optional[str] = None      # why the engine thread ended abnormally
        self.snapshot: dict = {}
        self._publish()

    # -- any thread ------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._thread.is_alive() and self._accepting:
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, items: list, sink: _Sink, arrival: float) -> None:
        """Queue ``[(request_id, prompt, SamplingParams), ...]`` as one group (all are added or none);
        the sink then gets ``("added", None)`` or ``("error", APIError)`` first."""
        with self._lock:
            if not self._accepting or self.dead:
                raise APIError(503, "the server is shutting down" if not self.dead else
                               f"the engine is not running ({self.dead})", type="service_unavailable_error",
                               code="engine_unavailable")
            self._commands.put(("add", items, sink, arrival))

    def abort(self, request_ids: list) -> None:
        with self._lock:
            if self._accepting and request_ids:
                self._commands.put(("abort", list(request_ids)))

    def stop(self, timeout: float = 60.0) -> None:
        """Abort what is left (its clients get a 503 error) and end the thread. Idempotent."""
        with self._lock:
            if self._accepting:
                self._accepting = False
                self._commands.put(("stop",))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                try:
                    command = self._commands.get() if idle else self._commands.get_nowait()
                except queue.Empty:
                    command = None
                while command is not None:
                    if command[0] == "stop":
                        self._fail_all(APIError(503, "the server is shutting down", type="service_unavailable_error",
                                                code="shutting_down"))
                        self._publish()
                        return
                    self._command(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except BaseException as e:   # a bug here: fail everyone rather than leave them waiting forever
            self.dead = f"{type(e).__name__}: {e}"
            log.error("m3-serve: the engine thread failed:\n%s", traceback.format_exc())
            with self._lock:
                self._accepting = False
            error = APIError(500, f"the engine thread failed: {self.dead}", type="internal_server_error")
            for sink in set(self._sinks.values()):
                sink.push("error", error)
            self._sinks.clear()
            while True:   # commands that came in meanwhile
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "add":
                    command[2].push("error", error)

    def _command(self, command) -> None:
        if command[0] == "abort":
            live = [r for r in command[1] if r in self._sinks]
            for r in live:
                self._sinks.pop(r, None)
                self._token_times.pop(r, None)
            if live:
                self.engine.abort_request(live)
                self.metrics.aborted += len(live)
            return
        _, items, sink, arrival = command
        waiting = self.engine.scheduler.num_waiting
        if self.max_queue is not None and waiting + len(items) > self.max_queue:
            self.metrics.refused += len(items)
            sink.push("error", APIError(
                503, f"the server is busy: {waiting} requests are waiting and this one brings {len(items)} more "
                     f"(--max-queue {self.max_queue}); retry later", type="service_unavailable_error",
                code="queue_full"))
            return
        added = []
        try:
            for request_id, prompt, params in items:
                added.append(self.engine.add_request(request_id, prompt, params, arrival_time=arrival))
        except (ValueError, TypeError) as e:
            self.engine.abort_request(added)
            sink.push("error", _bad(str(e), param=_param_of(e)))
            return
        except Exception as e:
            self.engine.abort_request(added)
            log.error("m3-serve: add_request failed:\n%s", traceback.format_exc())
            sink.push("error", APIError(500, f"{type(e).__name__}: {e}", type="internal_server_error"))
            return
        for request_id in added:
            self._sinks[request_id] = sink
        sink.push("added")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.metrics.step_errors += 1
            self.failed_steps += 1
            self.error = f"{type(e).__name__}: {e}"
            log.error("m3-serve: an engine step failed; its requests fail with a 500:\n%s", traceback.format_exc())
            self._fail_all(APIError(500, f"the engine failed in a step: {self.error}", type="internal_server_error",
                                    code="engine_step_failed"))
            return
        self.failed_steps = 0
        now = time.time()
        events = []
        for out in outputs:
            request_id = out.request_id
            sink = self._sinks.get(request_id)
            last = self._token_times.get(request_id)   # (time, tokens) of its previous output
            count = len(out.outputs[0].token_ids)
            if count:
                if last is None:
                    first = out.metrics.first_token_time or now
                    self.metrics.ttft.observe(first - out.metrics.arrival_time)
                elif count > last[1]:   # a verify step may bring several tokens: each gets its share
                    for _ in range(count - last[1]):
                        self.metrics.tpot.observe((now - last[0]) / (count - last[1]))
                self._token_times[request_id] = (now, count)
            if out.finished:
                self._sinks.pop(request_id, None)
                self._token_times.pop(request_id, None)
                reason = out.outputs[0].finish_reason
                self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
                self.metrics.e2e.observe(now - out.metrics.arrival_time)
            if sink is not None:
                events.append((sink, "output", out))
        _push_all(events)

    def _fail_all(self, error: APIError) -> None:
        """Abort every unfinished request and send its client ``error``."""
        request_ids = list(self._sinks)
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            log.error("m3-serve: aborting the requests failed too:\n%s", traceback.format_exc())
        self.metrics.aborted += len(request_ids)
        for sink in {id(s): s for s in self._sinks.values()}.values():
            sink.push("error", error)
        self._sinks.clear()
        self._token_times.clear()

    def _publish(self) -> None:
        """A consistent copy of the engine's load for ``/health`` and ``/metrics`` (other threads)."""
        s = self.engine.scheduler
        total = s.config.num_slots
        self.snapshot = dict(running=s.num_running, waiting=s.num_waiting,
                             unfinished=self.engine.get_num_unfinished_requests(),
                             kv_pages_total=total, kv_pages_used=total - s.num_free_slots, **self.engine.stats)


# -- the HTTP side of a request ----------------------------------------------------------------------

class _Job:
    """One HTTP request's engine requests (one per prompt), seen from the event loop."""

    def __init__(self, server: "_Server", request_ids: list):
        self.server, self.request_ids = server, request_ids
        self.index = {r: i for i, r in enumerate(request_ids)}
        self.sink = _Sink()
        self.outputs: dict = {}          # request id -> its latest RequestOutput
        self.finished: set = set()
        self._open = False

    async def start(self, items: list, arrival: float) -> None:
        self.server.engine_loop.submit(items, self.sink, arrival)
        self._open = True
        self.server.in_flight += 1
        try:
            kind, value = await self.sink.queue.get()
        except BaseException:   # cancelled: the abort follows the add in the engine's queue
            self.close()
            raise
        if kind == "error":
            self._close(abort=False)
            raise value

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)

    async def updates(self) -> list:
        """Wait for news; -> the latest ``RequestOutput`` of each request that moved (several
        steps' worth come as one). An engine error is raised as the ``APIError``."""
        events = [await self.sink.queue.get()]
        while not self.sink.queue.empty():
            events.append(self.sink.queue.get_nowait())
        changed = {}
        for kind, value in events:
            if kind == "error":
                self.finished.update(self.request_ids)   # the engine dropped them already
                raise value
            self.outputs[value.request_id] = changed[value.request_id] = value
            if value.finished:
                self.finished.add(value.request_id)
        return sorted(changed.values(), key=lambda o: self.index[o.request_id])

    async def collect(self, request: Request) -> bool:
        """Wait until every request finished (-> True) or the client went away (-> False)."""
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while not self.done:
                news = asyncio.ensure_future(self.updates())
                await asyncio.wait({news, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not news.done():
                    news.cancel()
                    return False
                news.result()
            return True
        finally:
            gone.cancel()

    def close(self) -> None:
        """Abort what has not finished (the client is gone or the answer failed)."""
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if self._open:
            self._open = False
            self.server.in_flight -= 1
            left = [r for r in self.request_ids if r not in self.finished]
            if abort and left:
                self.server.engine_loop.abort(left)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- the server ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Server:
    llm: Any
    engine_loop: EngineLoop
    model_names: list
    api_key: Optional[str]
    in_flight: int = 0

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_context(self) -> int:
        return self.llm.scheduler_config.max_context

    @property
    def vocab_size(self) -> int:
        return self.llm.config.vocab_size

    @property
    def model(self) -> str:
        return self.model_names[0]

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist (this server has {self.model_names}).",
                           param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else f"token_id:{token_id}"

    def check_ids(self, ids: list, param: str) -> list:
        if not ids:
            raise _bad(f"{param}: empty prompt (expected at least one token)", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise _bad(f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param)
        if len(ids) > self.max_context:
            raise _bad(f"{param}: the prompt has {len(ids)} tokens, more than this server's context of "
                       f"{self.max_context} tokens (--max-context)", param, code="context_length_exceeded")
        return ids

    def encode(self, text: str, param: str, *, add_special_tokens: bool = True) -> list:
        if self.tokenizer is None:
            raise _bad(f"{param}: this model has no tokenizer.json; send token ids", param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _check_unsupported(body: BaseModel, fields: dict) -> None:
    """``fields``: name -> predicate that is True for the values we can honour."""
    for name, fine in fields.items():
        value = getattr(body, name, None)
        if value is not None and not fine(value):
            raise _bad(f"{name}: not supported by this server (got {value!r:.60})", name)


def _sampling_params(server: "_Server", body: _GenerationRequest, *, max_tokens: int, logprobs: Optional[int],
                     rename: dict) -> SamplingParams:
    """The request's ``SamplingParams``, with only the fields it sets (the engine gives the others the
    model's ``generation_config.json`` values, as for ``LLM.generate``)."""
    if body.n is not None and body.n != 1:
        raise _bad(f"n: only n=1 is supported, got {body.n}", "n")
    kwargs = dict(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=body.ignore_eos,
                  include_stop_str_in_output=body.include_stop_str_in_output,
                  skip_special_tokens=body.skip_special_tokens)
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        param = _param_of(e, rename)
        raise _bad(str(e) if param is None or param == _param_of(e) else f"{param}{str(e)[len(_param_of(e)):]}",
                   param) from None


def _default_max_tokens(server: _Server, requested: Optional[int], prompt_len: int) -> int:
    """A request's ``max_tokens``, or: what is left of the context (at most the model's
    ``generation_config.json`` ``max_new_tokens``)."""
    if requested is not None:
        return requested
    left = max(server.max_context - prompt_len, 1)
    return min(left, server.llm.engine.generation_defaults.get("max_tokens", left))


def _stream_flags(body: _GenerationRequest) -> bool:
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options: only allowed with stream=true", "stream_options")
    return bool(body.stream and body.stream_options is not None and body.stream_options.include_usage)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(outputs: list) -> dict:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache served."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _completion_logprobs(server: _Server, token_ids: list, logprobs: list, n: int, offset: int) -> dict:
    """OpenAI's completions logprobs of these tokens: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (the top ``n`` and the sampled token), ``text_offset`` (from ``offset``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, logprobs):
        text = server.token_text(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(entry[token].logprob))
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0))
        out["top_logprobs"].append({server.token_text(t): _finite(lp.logprob) for t, lp in ranked
                                    if (lp.rank is not None and lp.rank <= n) or t == token})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprobs(server: _Server, token_ids: list, logprobs: list, n: int) -> list:
    """OpenAI's chat ``logprobs.content`` of these tokens."""
    content = []
    for token, entry in zip(token_ids, logprobs):
        text = server.token_text(token)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n),
                     key=lambda kv: kv[1].rank)
        content.append({"token": text, "logprob": _finite(entry[token].logprob), "bytes": list(text.encode()),
                        "top_logprobs": [{"token": server.token_text(t), "logprob": _finite(lp.logprob),
                                          "bytes": list(server.token_text(t).encode())} for t, lp in top[:n]]})
    return content


def _messages(messages: list) -> list:
    """OpenAI messages -> the chat template's: content parts ``[{"type": "text", "text"}]`` joined."""
    if not messages:
        raise _bad("messages: expected at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]: expected a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise _bad(f"messages[{i}].content: only text parts are supported, got {kind!r}", "messages")
                texts.append(part["text"])
            m = {**m, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content: expected a string or a list of text parts", "messages")
        out.append(m)
    return out


def _chat_prompt(server: _Server, messages: list, add_generation_prompt: bool) -> tuple:
    """-> (prompt text, prompt ids) of a conversation, with the model's chat template."""
    if server.tokenizer is None:
        raise _bad("messages: this model has no tokenizer.json (chat needs one); use /v1/completions with token ids",
                   "messages")
    try:
        text = server.tokenizer.apply_chat_template(_messages(messages), add_generation_prompt=add_generation_prompt)
    except APIError:
        raise
    except Exception as e:   # jinja2's errors, raise_exception() of the template, our own checks
        raise _bad(f"messages: {e}", "messages") from None
    return text, server.tokenizer.encode(text, add_special_tokens=False)


def create_app(llm, *, served_model_name=None, api_key: Optional[str] = None,
               max_queue: Optional[int] = DEFAULT_MAX_QUEUE) -> FastAPI:
    """The FastAPI app over ``llm`` (an ``m3_torch.LLM`` / ``m3_jax.LLM``). Its lifespan starts the
    engine thread and stops it (it does not close ``llm``: the caller does)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if not names:
        names = [str(llm.args.model_dir)]
    server = _Server(llm=llm, engine_loop=EngineLoop(llm, max_queue=max_queue), model_names=names,
                     api_key=api_key or None)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.engine_loop.start()
        yield
        await asyncio.to_thread(server.engine_loop.stop)

    app = FastAPI(title="m3-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.m3 = server
    if server.api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=server.api_key)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _bad(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}").response()
        param = ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: "
                            f"{err.get('msg')}" for err in errors[:5]) or "invalid request"
        return _bad(message, loc[0] if loc else param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", type=kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        log.error("m3-serve: %s %s failed:\n%s", request.method, request.url.path, traceback.format_exc())
        return APIError(500, f"{type(e).__name__}: {e}", type="internal_server_error").response()

    # -- status ------------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        """200 with the engine's load; 503 when the engine thread is not running or the last
        ``UNHEALTHY_AFTER`` steps all failed (a step that fails now and then is reported in
        ``last_error`` only: its requests failed, the engine serves on)."""
        loop = server.engine_loop
        detail = {**loop.snapshot, "in_flight": server.in_flight, "failed_steps": loop.failed_steps,
                  "last_error": loop.error}
        if loop.dead or not loop.alive:
            return JSONResponse({"status": "error", **detail,
                                 "error": loop.dead or "the engine thread is not running"}, status_code=503)
        if loop.failed_steps >= UNHEALTHY_AFTER:
            return JSONResponse({"status": "error", **detail,
                                 "error": f"the last {loop.failed_steps} engine steps failed"}, status_code=503)
        return {"status": "ok", **detail}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(server, n) for n in server.model_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        server.check_model(name)
        return _model_card(server, name)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_render_metrics(server), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise _bad("tokenize: expected one of 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            _, ids = _chat_prompt(server, body.messages, body.add_generation_prompt)
        else:
            ids = server.encode(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": server.max_context, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [server.token_text(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        server.check_model(body.model)
        if server.tokenizer is None:
            raise _bad("detokenize: this model has no tokenizer.json", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < server.vocab_size]
        if bad:
            raise _bad(f"tokens: token id {bad[0]} is outside the vocabulary [0, {server.vocab_size})", "tokens")
        return {"prompt": server.tokenizer.decode(body.tokens)}

    # -- completions -------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.time()
        server.check_model(body.model)
        _check_unsupported(body, {"best_of": lambda v: v == 1, "suffix": lambda v: v == "",
                                  "logit_bias": lambda v: not v})
        include_usage = _stream_flags(body)
        if body.echo and body.logprobs is not None:
            raise _bad("echo with logprobs: not supported (this engine computes no prompt logprobs)", "echo")
        prompts = _completion_prompts(server, body.prompt)
        base = f"cmpl-{uuid.uuid4().hex}"
        items = []
        for i, (text, ids) in enumerate(prompts):
            params = _sampling_params(server, body, max_tokens=_default_max_tokens(server, body.max_tokens, len(ids)),
                                      logprobs=body.logprobs, rename={})
            items.append((f"{base}-{i}", {"prompt_token_ids": ids, "prompt": text}, params))
        echo = [((text if text is not None else (server.tokenizer.decode(ids) if server.tokenizer else ""))
                 if body.echo else "") for text, ids in prompts]
        job = _Job(server, [r for r, _, _ in items])
        await job.start(items, arrival)
        created = int(arrival)
        n_logprobs = body.logprobs

        def choice_extras(out, sent: int) -> dict:
            extra = {}
            if body.return_token_ids:
                extra["token_ids"] = out.outputs[0].token_ids[sent:]
                if sent == 0:
                    extra["prompt_token_ids"] = out.prompt_token_ids
            return extra

        if not body.stream:
            try:
                if not await job.collect(request):
                    return APIError(499, "the client closed the connection").response()
            finally:
                job.close()
            outs = [job.outputs[r] for r in job.request_ids]
            choices = []
            for i, out in enumerate(outs):
                c = out.outputs[0]
                logprobs = None if n_logprobs is None else \
                    _completion_logprobs(server, c.token_ids, c.logprobs, n_logprobs, len(echo[i]))
                choices.append({"index": i, "text": echo[i] + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                **choice_extras(out, 0)})
            return {"id": base, "object": "text_completion", "created": created, "model": server.model,
                    "choices": choices, "usage": _usage(outs)}

        async def events():
            sent_text = [0] * len(items)
            sent_tokens = [0] * len(items)
            offsets = [len(e) for e in echo]
            while not job.done:
                for out in await job.updates():
                    i = job.index[out.request_id]
                    c = out.outputs[0]
                    new_tokens = c.token_ids[sent_tokens[i]:]
                    delta = c.text[sent_text[i]:]
                    if not new_tokens and not delta and not out.finished:
                        continue
                    if sent_tokens[i] == 0 and echo[i]:
                        delta = echo[i] + delta
                    logprobs = None
                    if n_logprobs is not None:
                        logprobs = _completion_logprobs(server, new_tokens, c.logprobs[sent_tokens[i]:],
                                                        n_logprobs, offsets[i])
                        offsets[i] += sum(len(t) for t in logprobs["tokens"])
                    choice = {"index": i, "text": delta, "logprobs": logprobs,
                              "finish_reason": c.finish_reason if out.finished else None,
                              **choice_extras(out, sent_tokens[i])}
                    if out.finished:
                        choice["stop_reason"] = c.stop_reason
                    sent_text[i], sent_tokens[i] = len(c.text), len(c.token_ids)
                    chunk = {"id": base, "object": "text_completion", "created": created, "model": server.model,
                             "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
            if include_usage:
                yield _sse({"id": base, "object": "text_completion", "created": created, "model": server.model,
                            "choices": [], "usage": _usage([job.outputs[r] for r in job.request_ids])})

        return _EventStream(_events_then_done(events(), job), on_close=job.close)

    # -- chat --------------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        arrival = time.time()
        server.check_model(body.model)
        _check_unsupported(body, {
            "logit_bias": lambda v: not v, "tools": lambda v: not v, "functions": lambda v: not v,
            "tool_choice": lambda v: v == "none", "function_call": lambda v: v == "none",
            "response_format": lambda v: v.get("type") == "text"})
        include_usage = _stream_flags(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise _bad("top_logprobs: needs logprobs=true", "top_logprobs")
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        text, ids = _chat_prompt(server, body.messages, body.add_generation_prompt)
        server.check_ids(ids, "messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        rename = {"logprobs": "top_logprobs",
                  "max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"}
        params = _sampling_params(server, body, max_tokens=_default_max_tokens(server, requested, len(ids)),
                                  logprobs=n_logprobs, rename=rename)
        echo = ""
        last = body.messages[-1]
        if body.echo and last.get("role") == "assistant":
            echo = _messages([last])[0].get("content") or ""
        base = f"chatcmpl-{uuid.uuid4().hex}"
        job = _Job(server, [base])
        await job.start([(base, {"prompt_token_ids": ids, "prompt": text}, params)], arrival)
        created = int(arrival)

        if not body.stream:
            try:
                if not await job.collect(request):
                    return APIError(499, "the client closed the connection").response()
            finally:
                job.close()
            out = job.outputs[base]
            c = out.outputs[0]
            choice = {"index": 0, "message": {"role": "assistant", "content": echo + c.text},
                      "logprobs": None if n_logprobs is None else
                      {"content": _chat_logprobs(server, c.token_ids, c.logprobs, n_logprobs)},
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            response = {"id": base, "object": "chat.completion", "created": created, "model": server.model,
                        "choices": [choice], "usage": _usage([out])}
            if body.return_token_ids:
                response["prompt_token_ids"] = out.prompt_token_ids
            return response

        def chunk(delta: dict, *, finish=None, logprobs=None, extra=None) -> str:
            c = {"id": base, "object": "chat.completion.chunk", "created": created, "model": server.model,
                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                              **(extra or {})}]}
            if include_usage:
                c["usage"] = None
            return _sse(c)

        async def events():
            sent_text = sent_tokens = 0
            yield chunk({"role": "assistant", "content": ""})
            if echo:
                yield chunk({"content": echo})
            while not job.done:
                for out in await job.updates():
                    c = out.outputs[0]
                    new_tokens = c.token_ids[sent_tokens:]
                    delta = c.text[sent_text:]
                    if not new_tokens and not delta and not out.finished:
                        continue
                    logprobs = None if n_logprobs is None else \
                        {"content": _chat_logprobs(server, new_tokens, c.logprobs[sent_tokens:], n_logprobs)}
                    extra = {"token_ids": new_tokens} if body.return_token_ids else {}
                    if out.finished:
                        extra["stop_reason"] = c.stop_reason
                    sent_text, sent_tokens = len(c.text), len(c.token_ids)
                    yield chunk({"content": delta} if delta or not out.finished else {},
                                finish=c.finish_reason if out.finished else None, logprobs=logprobs, extra=extra)
            if include_usage:
                yield _sse({"id": base, "object": "chat.completion.chunk", "created": created,
                            "model": server.model, "choices": [], "usage": _usage([job.outputs[base]])})

        return _EventStream(_events_then_done(events(), job), on_close=job.close)

    return app


async def _events_then_done(events, job: "_Job"):
    """A stream's server-sent events, then ``data: [DONE]``. An error while making them ends the
    stream with an error event in OpenAI's body (an ``APIError``'s own, or a 500 for a bug) instead
    of cutting it; the job's requests are closed however the stream ends (a client that leaves
    closes this generator: no ``[DONE]`` then)."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield _sse(e.body())
    except Exception as e:   # a bug: the client gets an error event, not a cut stream
        log.error("m3-serve: a stream failed:\n%s", traceback.format_exc())
        yield _sse(APIError(500, f"{type(e).__name__}: {e}", type="internal_server_error").body())
    finally:
        await events.aclose()
        job.close()
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (also when the client left
    before the stream began, so that the generator never ran)."""

    def __init__(self, body, *, on_close):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _completion_prompts(server: _Server, prompt) -> list:
    """``prompt`` of a completions request -> ``[(text or None, ids), ...]``, checked."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise _bad("prompt: expected a string, a list of strings, token ids or a list of token-id lists; "
                   "got an empty list", "prompt")
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    out = []
    for p in prompts:
        if isinstance(p, str):
            ids = server.encode(p, "prompt")
            out.append((p, server.check_ids(ids, "prompt")))
        else:
            out.append((None, server.check_ids(list(p), "prompt")))
    return out


def _model_card(server: _Server, name: str) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "m3",
            "root": str(server.llm.args.model_dir), "parent": None, "max_model_len": server.max_context,
            "vocab_size": server.vocab_size,
            "framework": getattr(server.llm, "framework", None)}


def _render_metrics(server: _Server) -> str:
    loop, m = server.engine_loop, server.engine_loop.metrics
    s = loop.snapshot
    labels = 'model_name="' + server.model.replace("\\", "\\\\").replace('"', '\\"') + '"'
    lines = []

    def metric(name, kind, help_, value=None, extra=""):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        if value is not None:
            lines.append(f"{name}{{{labels}{extra}}} {value}")

    metric("m3_num_requests_running", "gauge", "Requests in the running batch.", s["running"])
    metric("m3_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", s["waiting"])
    metric("m3_num_requests_unfinished", "gauge", "Requests the engine holds (running + waiting).",
           s["unfinished"])
    metric("m3_num_requests_in_flight", "gauge", "HTTP requests being answered.", server.in_flight)
    metric("m3_kv_cache_used_pages", "gauge", "KV pool pages (128 tokens) reserved by requests.",
           s["kv_pages_used"])
    metric("m3_kv_cache_total_pages", "gauge", "KV pool pages (128 tokens) in all.", s["kv_pages_total"])
    metric("m3_kv_cache_usage_perc", "gauge", "Fraction of the KV pool in use (1 = full).",
           s["kv_pages_used"] / max(s["kv_pages_total"], 1))
    metric("m3_kv_cache_cached_blocks", "gauge", "Pool pages holding a prefix-cached block (held or not).",
           s.get("cached_blocks", 0))
    metric("m3_kv_cache_evictable_blocks", "gauge", "Prefix-cached pages no request holds (reusable, or "
           "handed out when the pool needs them).", s.get("evictable_blocks", 0))
    metric("m3_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           s.get("prefix_cache_query_tokens", 0))
    metric("m3_prefix_cache_hits_total", "counter", "Prompt tokens served by the prefix cache.",
           s.get("prefix_cache_hit_tokens", 0))
    metric("m3_prompt_tokens_total", "counter", "Prompt tokens prefilled.", s.get("prompt_tokens", 0))
    metric("m3_generation_tokens_total", "counter", "Tokens generated.", s.get("generation_tokens", 0))
    metric("m3_engine_steps_total", "counter", "Engine steps run.", s.get("steps", 0))
    metric("m3_engine_step_errors_total", "counter", "Engine steps that failed.", m.step_errors)
    metric("m3_spec_decode_num_drafts_total", "counter", "Speculative decoding: request rows that verified drafts.",
           s.get("spec_drafts", 0))
    metric("m3_spec_decode_num_draft_tokens_total", "counter", "Speculative decoding: draft tokens proposed.",
           s.get("spec_draft_tokens", 0))
    metric("m3_spec_decode_num_accepted_tokens_total", "counter", "Speculative decoding: draft tokens accepted.",
           s.get("spec_accepted_tokens", 0))
    metric("m3_spec_decode_draft_seconds_total", "counter", "Speculative decoding: seconds spent proposing drafts.",
           s.get("spec_draft_time_s", 0.0))
    metric("m3_request_success_total", "counter", "Requests finished, by finish reason.")
    for reason, count in sorted(m.finished.items()):
        lines.append(f'm3_request_success_total{{{labels},finished_reason="{reason}"}} {count}')
    metric("m3_request_aborted_total", "counter", "Requests aborted (client gone, shutdown, failed step).",
           m.aborted)
    metric("m3_request_refused_total", "counter", "Requests refused because the queue was full (503).",
           m.refused)
    for name, hist, help_ in (("m3_time_to_first_token_seconds", m.ttft, "Time to the first token."),
                              ("m3_time_per_output_token_seconds", m.tpot, "Time between two output tokens."),
                              ("m3_e2e_request_latency_seconds", m.e2e, "Arrival to finish of a request.")):
        metric(name, "histogram", help_)
        lines += hist.lines(name, labels)
    return "\n".join(lines) + "\n"


class _APIKeyMiddleware:
    """401 for ``/v1/*``, ``/tokenize`` and ``/detokenize`` without ``Authorization: Bearer <key>``."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.PROTECTED):
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 type="authentication_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- command line ------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def _int_list(text: str) -> list:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ints separated by commas, got {text!r}") from None


# EngineArgs fields with their own flags below; any other field (an option a later issue adds)
# gets a generic --field-name flag from its default (see _engine_flags).
_ENGINE_FLAGS = ("dtype", "device", "max_batch", "max_context", "max_cache_pages", "max_num_tokens", "prefill_chunk",
                 "graph_batch_sizes", "tensor_parallel_size", "kv_cache_dtype", "index_cache_dtype", "seed",
                 "enforce_eager", "enable_prefix_caching", "speculative_config")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="m3-serve", description="An OpenAI-compatible server (completions, chat, "
                                "streaming) over a MiniMax-M3 checkpoint, with the torch or the JAX engine.")
    p.add_argument("model", type=Path, metavar="MODEL_DIR",
                   help="folder with config.json, *.safetensors and (for text and chat) tokenizer.json")
    p.add_argument("--framework", choices=FRAMEWORKS, default="torch", help="engine: m3_torch.LLM (default) or "
                   "m3_jax.LLM")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=_non_negative_int, default=8000, help="default 8000; 0 picks a free port (the "
                   "'listening on' line shows it)")
    p.add_argument("--api-key", default=os.environ.get("M3_API_KEY"), help="require 'Authorization: Bearer KEY' "
                   "on /v1/*, /tokenize and /detokenize (default: $M3_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) requests use and /v1/models lists (default: MODEL_DIR)")
    p.add_argument("--max-queue", type=_non_negative_int, default=DEFAULT_MAX_QUEUE,
                   help=f"waiting requests beyond which new ones get a 503 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="on SIGTERM, seconds open requests may still take before they are aborted (default 5)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true", help="no line per HTTP request")
    engine = p.add_argument_group("engine options (m3_engine.args.EngineArgs)")
    engine.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="auto",
                        help="weights and activations (default auto: the checkpoint's)")
    engine.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: a GPU when there is one)")
    engine.add_argument("--max-batch", type=_positive_int, default=8, help="requests per step (default 8)")
    engine.add_argument("--max-context", type=_positive_int, default=None,
                        help="KV tokens per request, prompt + generated (default min(8192, the model's))")
    engine.add_argument("--max-cache-pages", type=_positive_int, default=None,
                        help="KV pool pages of 128 tokens (default: max-batch requests of max-context)")
    engine.add_argument("--max-num-tokens", type=_positive_int, default=None, help="query tokens per step")
    engine.add_argument("--prefill-chunk", type=_positive_int, default=None,
                        help="prompt tokens per request per step")
    engine.add_argument("--graph-batch-sizes", type=_int_list, default=None, metavar="B1,B2,...",
                        help="decode batch sizes for CUDA graphs / jitted steps")
    engine.add_argument("--tensor-parallel-size", "--tp", type=_positive_int, default=1, metavar="N",
                        help="split the model over N ranks (default 1)")
    engine.add_argument("--kv-cache-dtype", choices=_cache_dtypes(CACHE_DTYPES), default="auto")
    engine.add_argument("--index-cache-dtype", choices=_cache_dtypes(CACHE_DTYPES), default="auto")
    engine.add_argument("--seed", type=int, default=0, help="the engine's seed (requests without their own)")
    engine.add_argument("--enforce-eager", action="store_true", help="torch: no CUDA graphs")
    engine.add_argument("--enable-prefix-caching", action="store_true",
                        help="reuse the KV pages of full 128-token prompt blocks across requests")
    engine.add_argument("--speculative-config", type=_json, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    _engine_flags(engine)
    return p


def _cache_dtypes(names) -> list:
    return list(dict.fromkeys(names))


def _engine_flags(group) -> None:
    """A ``--field-name`` flag for each ``EngineArgs`` field without one above."""
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model" or field.name in _ENGINE_FLAGS:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        help_ = f"an engine option (m3_engine.args.EngineArgs.{field.name}; default {default!r})"
        if isinstance(default, bool):
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_)
        elif isinstance(default, int):
            group.add_argument(flag, dest=field.name, type=int, default=default, help=help_)
        elif isinstance(default, float):
            group.add_argument(flag, dest=field.name, type=float, default=default, help=help_)
        else:
            group.add_argument(flag, dest=field.name, type=_scalar, default=default,
                               help=help_ + "; a number, a name or a JSON value")


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from None


def _scalar(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def engine_options(args: argparse.Namespace) -> dict:
    """The ``LLM(model, **options)`` keyword arguments of the parsed flags."""
    options = {}
    for field in dataclasses.fields(EngineArgs):
        if field.name != "model" and hasattr(args, field.name):
            options[field.name] = getattr(args, field.name)
    if options.get("dtype") == "auto":
        options["dtype"] = None
    return options


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _uvicorn_server_class():
    class UvicornServer(uvicorn.Server):
        """uvicorn's server, whose shutdown ends open requests itself after ``grace`` seconds: the
        engine loop stops and hands each open request a 503 error (a stream ends with an error
        event and ``[DONE]``) instead of uvicorn cancelling the request tasks."""

        def __init__(self, config, *, engine_loop: EngineLoop, grace: float):
            super().__init__(config)
            self.engine_loop, self.grace = engine_loop, grace

        async def shutdown(self, sockets=None):
            async def drain():
                await asyncio.sleep(self.grace)
                await asyncio.to_thread(self.engine_loop.stop)

            task = asyncio.ensure_future(drain())
            try:
                await super().shutdown(sockets)
            finally:
                task.cancel()

    return UvicornServer


def _UvicornServer(config, **kwargs):
    return _uvicorn_server_class()(config, **kwargs)


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"MODEL_DIR: {args.model} has no config.json (expected a transformers-format checkpoint)")
    # SIGTERM / SIGINT: exit 0 (also while the model loads). uvicorn replaces these handlers while it
    # serves, shuts down gracefully, then raises the signal again, which lands here.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    signal.signal(signal.SIGINT, _exit_cleanly)
    try:
        sock = _listen(args.host, args.port)   # before loading: a busy port fails at once
    except OSError as e:
        parser.error(f"--host/--port: cannot listen on {args.host}:{args.port}: {e}")

    llm = None
    try:
        try:
            llm = engine_class(args.framework)(args.model, **engine_options(args))
        except (ValueError, TypeError, FileNotFoundError) as e:
            parser.error(str(e))
        app = create_app(llm, served_model_name=args.served_model_name or [str(args.model)], api_key=args.api_key,
                         max_queue=args.max_queue)
        config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                                timeout_graceful_shutdown=args.shutdown_timeout + 30, lifespan="on")
        server = _UvicornServer(config, engine_loop=app.state.m3.engine_loop, grace=args.shutdown_timeout)
        host, port = sock.getsockname()[:2]
        sc = llm.scheduler_config
        print(f"m3-serve: {args.framework} engine over {args.model} (max_batch {sc.max_batch}, max_context "
              f"{sc.max_context}, {sc.num_slots} KV pages); listening on http://{host}:{port}", flush=True)
        server.run(sockets=[sock])
        if server.started is False and not server.should_exit:
            return 1
    finally:
        if llm is not None:
            llm.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
