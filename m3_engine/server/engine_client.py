"""``EngineClient``: what the HTTP routes of ``m3-serve`` talk to: the engine core in its own process.

The engine core (scheduler, runner, sampling) runs in a process of its own
(``m3_engine.server.core_process``); this side, on the server's event loop, is the front end:
:meth:`EngineClient.add` applies the model's generation defaults, registers each request with
the :class:`~m3_engine.output_processor.OutputProcessor` (detokenization, stop strings; a request
of ``n`` completions fans out there into ``n`` engine requests) and sends the group's engine
requests to the core; :meth:`EngineClient.abort` aborts requests there. A reader
task (``zmq.asyncio``) takes the core's one message per step, turns its token ids into
``RequestOutput``s (text, stop strings: a stop string's request is then finished in the core)
and hands each HTTP request's outputs to its :class:`Sink` (an asyncio queue). The core's
answer to an add comes first on that sink: ``("added", None)`` or ``("error", APIError)``.

A failed engine step fails the requests then unfinished (their sinks get an ``APIError`` 500)
and the core goes on. The engine process ending on its own (a crash, a kill) is seen at once
(its sentinel is watched by the event loop): every open request gets a 500 (streams: an error
event), ``/health`` answers 503, and ``on_dead`` is called (``m3-serve`` then stops with exit
status 1). :meth:`EngineClient.stop` fails what is left with a 503 and stops the process.
``/health`` and ``/metrics`` read :attr:`EngineClient.snapshot`, the core's load as of its last
message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from ..output_processor import OutputProcessor
from ..tokenizer import load_tokenizer
from .core_process import (AbortRequests, AddRequests, CoreRequest, EngineOutputs, EngineProcess, params_to_wire)
from .metrics import Metrics
from .protocol import APIError, bad, param_of

__all__ = ["EngineClient", "Sink", "DEFAULT_MAX_QUEUE"]

log = logging.getLogger("uvicorn.error")   # uvicorn's configured logger: our lines look like its own

DEFAULT_MAX_QUEUE = 1024
UNHEALTHY_AFTER = 3   # consecutive failed engine steps after which health() is False (/health: 503)


class Sink:
    """Where one HTTP request's events go: ``("added", None)``, ``("output", RequestOutput)`` or
    ``("error", APIError)``. Lives on the event loop."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, kind: str, value=None) -> None:
        self.queue.put_nowait((kind, value))


class EngineClient:
    """The engine of ``llm_class(model_dir, **options)`` in a process of its own, started now (this
    blocks until the model is loaded; a failed start raises
    :class:`~m3_engine.server.core_process.EngineStartError`). :meth:`start` (on the event loop)
    begins reading its outputs; :meth:`stop` or :meth:`close` ends it.

    llm_class:     ``"module:Name"`` of the ``LLM`` class, e.g. ``"m3_torch:LLM"``.
    max_queue:     the most requests that may wait (queued, not yet in the batch); an ``add``
                   that would go beyond it is refused with a 503.
    chat_template: a Jinja chat template that replaces the model folder's (None: the folder's).
    on_dead:       called with the reason when the engine process ends on its own.
    """

    def __init__(self, llm_class: str, model_dir, options: dict, *, max_queue: Optional[int] = DEFAULT_MAX_QUEUE,
                 chat_template: Optional[str] = None, metrics: Optional[Metrics] = None,
                 on_dead: Optional[Callable[[str], None]] = None):
        self.model_dir = Path(model_dir)
        self.process = EngineProcess(llm_class, model_dir, options, max_queue=max_queue)
        try:
            self.tokenizer = load_tokenizer(self.model_dir)
        except BaseException:
            self.process.close()
            raise
        # what the routes need of the model, fixed while the server runs
        facts = self.process.facts
        self.framework: Optional[str] = facts["framework"]
        self.max_model_len: int = facts["max_model_len"]
        self.vocab_size: int = facts["vocab_size"]
        self.max_num_seqs: int = facts["max_num_seqs"]
        self.num_kv_pages: int = facts["num_kv_pages"]
        self.generation_defaults: dict = facts["generation_defaults"]
        self.startup_times: dict = facts["startup_times"]   # LLM.startup_times: seconds to ready, by part
        self.chat_template = chat_template
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.on_dead = on_dead
        self.processor = OutputProcessor(self.tokenizer)
        self._sinks: dict = {}           # request id -> Sink (unfinished requests only)
        self._groups: dict = {}          # group number -> (Sink, request ids) until the core answers
        self._numbers = itertools.count()
        self._token_times: dict = {}     # (request id, completion index) -> (time, tokens) of its last output
        self._accepting = True
        self._stopped = False
        self._reader: Optional[asyncio.Task] = None
        self._closing: Optional[asyncio.Future] = None   # stop()'s closing of the process
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.error: Optional[str] = None     # the last failed step's error
        self.failed_steps = 0                # failed steps since the last good one
        self.dead: Optional[str] = None      # why the engine process ended on its own
        self.snapshot: dict = {}
        self._publish(facts["stats"])

    # -- the event loop --------------------------------------------------------------------------

    def start(self) -> None:
        """Read the engine's outputs and watch its process (call on the event loop that serves)."""
        if self._reader is not None or self._stopped:
            return
        self._loop = asyncio.get_running_loop()
        self._output = zmq.asyncio.Socket.from_socket(self.process.output)
        self._reader = self._loop.create_task(self._read())
        self._loop.add_reader(self.process.sentinel, self._process_ended)

    @property
    def alive(self) -> bool:
        return self.dead is None and self.process.is_alive()

    def add(self, items: list, sink: Sink, arrival: float) -> None:
        """Send ``[(request_id, {"prompt_token_ids": ids, "prompt": text or None}, SamplingParams), ...]``
        as one group (all are added or none); the sink then gets ``("added", None)`` or
        ``("error", APIError)`` first, then each request's ``RequestOutput`` (all its completions)
        when one of its completions moved."""
        if self.dead or not self._accepting:
            raise APIError(503, f"the engine is not running ({self.dead})" if self.dead else
                           "the server is shutting down", type="service_unavailable_error",
                           code="engine_unavailable")
        group = next(self._numbers)
        requests, request_ids = [], []
        try:
            for request_id, prompt, params in items:
                params = params.with_defaults(self.generation_defaults)
                ids = prompt["prompt_token_ids"]
                children = self.processor.add_request(request_id, prompt.get("prompt"), ids, params,
                                                      arrival_time=arrival)
                request_ids.append(request_id)
                self._sinks[request_id] = sink
                requests += [CoreRequest(child_id, ids, params_to_wire(p)) for child_id, p in children]
        except BaseException:
            self._drop(request_ids)
            raise
        self._groups[group] = (sink, request_ids)
        if not self.process.send(AddRequests(group, requests)):
            self._drop(request_ids)
            del self._groups[group]
            raise APIError(503, "the engine is not running", type="service_unavailable_error",
                           code="engine_unavailable")

    def abort(self, request_ids: list) -> None:
        """Abort these requests (unknown or finished ones are ignored)."""
        live = [r for r in request_ids if r in self._sinks]
        if live:
            self.metrics.aborted += len(live)
            self.process.send(AbortRequests(self._drop(live)))

    def health(self) -> tuple:
        """-> ``(healthy, detail)``: unhealthy when the engine process is not running or the last
        ``UNHEALTHY_AFTER`` steps all failed (a step that fails now and then is reported in
        ``last_error`` only: its requests failed, the engine serves on)."""
        detail = {**self.snapshot, "failed_steps": self.failed_steps, "last_error": self.error,
                  "engine_pid": self.process.pid, "startup_times": self.startup_times}
        if not self.alive:
            return False, {**detail, "error": self.dead or "the engine process is not running"}
        if self.failed_steps >= UNHEALTHY_AFTER:
            return False, {**detail, "error": f"the last {self.failed_steps} engine steps failed"}
        return True, detail

    async def stop(self, timeout: float = 60.0) -> None:
        """Fail what is left (its clients get a 503 error) and stop the engine process. Idempotent."""
        if self._closing is None:
            self._stopped = True
            self._accepting = False
            self._fail_all(APIError(503, "the server is shutting down", type="service_unavailable_error",
                                    code="shutting_down"))
            self._stop_reading()
            self._closing = asyncio.ensure_future(asyncio.to_thread(self.process.close, timeout))
        await asyncio.shield(self._closing)

    def close(self) -> None:
        """Stop the engine process (blocks; for a server that never ran its event loop). Idempotent."""
        self._stopped = True
        self.process.close()

    # -- the engine's messages -------------------------------------------------------------------

    async def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineOutputs)
        while True:
            frame = await self._output.recv()
            try:
                self._handle(decoder.decode(frame), time.time())
            except Exception as e:   # a bug here: fail everyone rather than leave them waiting forever
                log.error("m3-serve: the engine's outputs could not be handled:\n%s", traceback.format_exc())
                self._engine_lost(f"the engine's outputs could not be handled: {type(e).__name__}: {e}")
                self.process.close(timeout=5)
                return

    def _handle(self, message: EngineOutputs, now: float) -> None:
        for group in message.added:
            sink, _ = self._groups.pop(group)
            sink.push("added")
        for refusal in message.rejected:
            sink, request_ids = self._groups.pop(refusal.group)
            self._drop(request_ids)
            if refusal.code == "queue_full":
                self.metrics.refused += len(request_ids)
                sink.push("error", APIError(refusal.status, refusal.message, type="service_unavailable_error",
                                            code=refusal.code))
            elif refusal.status == 400:
                sink.push("error", bad(refusal.message, param=param_of(ValueError(refusal.message))))
            else:
                sink.push("error", APIError(refusal.status, refusal.message, type="internal_server_error"))
        if message.failed is not None:
            self._step_failed(message.failed.error, message.failed.request_ids)
        elif message.stepped:
            self.failed_steps = 0
        outputs, stopped = self.processor.process(message.outputs, now)
        self._publish(message.stats)   # after process(): the counts hold this message's tokens
        if stopped:   # a stop string ended them: the core does not know
            self.process.send(AbortRequests(stopped, "stop"))
        for out in outputs:
            request_id = out.request_id
            sink = self._sinks.get(request_id)
            for c in out.outputs:   # each completion: its first token, its later ones, its end
                key = (request_id, c.index)
                last = self._token_times.get(key)   # (time, tokens) of its previous output
                count = len(c.token_ids)
                if last is not None and last[1] < 0:
                    continue   # finished and counted
                if count:
                    if last is None:
                        self.metrics.ttft.observe(now - out.metrics.arrival_time)
                    elif count > last[1]:   # a verify step may bring several tokens: each gets its share
                        for _ in range(count - last[1]):
                            self.metrics.tpot.observe((now - last[0]) / (count - last[1]))
                    self._token_times[key] = (now, count)
                if c.finish_reason is not None:
                    self._token_times[key] = (now, -1)
                    self.metrics.finished[c.finish_reason] = self.metrics.finished.get(c.finish_reason, 0) + 1
            if out.finished:
                self._sinks.pop(request_id, None)
                for c in out.outputs:
                    self._token_times.pop((request_id, c.index), None)
                self.metrics.e2e.observe(now - out.metrics.arrival_time)
            if sink is not None:
                sink.push("output", out)

    def _step_failed(self, error: str, request_ids: list) -> None:
        self.metrics.step_errors += 1
        self.failed_steps += 1
        self.error = error
        log.error("m3-serve: an engine step failed; its requests fail with a 500: %s", error)
        failure = APIError(500, f"the engine failed in a step: {error}", type="internal_server_error",
                           code="engine_step_failed")
        parents = list(dict.fromkeys(p for p in map(self.processor.parent_id, request_ids) if p is not None))
        self.metrics.aborted += len(parents)
        for sink in {id(s): s for s in (self._sinks.get(r) for r in parents) if s is not None}.values():
            sink.push("error", failure)
        self._drop(parents)

    def _process_ended(self) -> None:
        """The event loop saw the engine process end: fail everything; tell ``on_dead`` unless we stopped it."""
        self._loop.remove_reader(self.process.sentinel)
        if self._stopped:
            return
        reason = f"the engine process {self.process.death()}"
        log.error("m3-serve: %s", reason)
        self._engine_lost(reason)

    def _engine_lost(self, reason: str) -> None:
        self.dead = reason
        self._accepting = False
        self._fail_all(APIError(500, f"{reason}; the server stops", type="internal_server_error", code="engine_dead"))
        self._stop_reading()
        if self.on_dead is not None:
            self.on_dead(reason)

    def _fail_all(self, error: APIError) -> None:
        """Send every open request (and every add not answered yet) ``error`` and forget them."""
        sinks = {id(s): s for s in self._sinks.values()}
        sinks.update({id(s): s for s, _ in self._groups.values()})
        self.metrics.aborted += len(self._sinks)
        for sink in sinks.values():
            sink.push("error", error)
        self._drop(list(self._sinks))
        self._groups.clear()

    def _drop(self, request_ids: list) -> list:
        """Forget these requests; -> their engine requests that had not finished."""
        now = time.time()
        children = []
        for r in request_ids:
            self._sinks.pop(r, None)
            children += self.processor.abort_request(r, now)
        dropped = set(request_ids)
        for key in [k for k in self._token_times if k[0] in dropped]:
            del self._token_times[key]
        return children

    def _stop_reading(self) -> None:
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.process.sentinel)

    def _publish(self, stats: dict) -> None:
        """A consistent copy of the engine's load for ``/health`` and ``/metrics``."""
        self.snapshot = dict(running=stats["running_requests"], waiting=stats["waiting_requests"],
                             unfinished=stats["unfinished"], kv_pages_total=stats["total_pages"],
                             kv_pages_used=stats["total_pages"] - stats["free_pages"],
                             **{k: v for k, v in stats.items() if k not in ("unfinished", "generation_tokens")},
                             generation_tokens=self.processor.num_generation_tokens)   # the tokens clients got
