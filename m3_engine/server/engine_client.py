"""``EngineClient``: what the HTTP routes of ``m3-serve`` talk to: the engine behind one thread.

ONE engine thread owns the engine (it is not thread-safe): HTTP handlers (the asyncio
loop) send it ``add`` / ``abort`` commands through a thread-safe queue (:meth:`EngineClient.add`,
:meth:`EngineClient.abort`), and it hands each request's ``RequestOutput``s back through that
HTTP request's :class:`Sink` (an asyncio queue; one ``loop.call_soon_threadsafe`` per step for
all of the step's outputs). Between commands it runs engine steps while any request is
unfinished and blocks on the queue when idle, so every connection shares the continuous batch.
A failed engine step fails the requests then unfinished (their sinks get an ``APIError``) and
the loop goes on. :meth:`EngineClient.stop` aborts what is left (a 503 to each) and ends the
thread. ``/health`` and ``/metrics`` read :attr:`EngineClient.snapshot`, a copy of the engine's
load made by the engine thread after every step.

The routes use nothing else of the engine: its model facts (``tokenizer``, ``max_model_len``,
``vocab_size``, ``generation_defaults``, ...) are plain attributes, the commands and outputs
plain data, so the engine can move to a process of its own behind this same interface.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from typing import Optional

from .metrics import Metrics
from .protocol import APIError, bad, param_of

__all__ = ["EngineClient", "Sink", "push_all", "DEFAULT_MAX_QUEUE"]

log = logging.getLogger("uvicorn.error")   # uvicorn's configured logger: our lines look like its own

DEFAULT_MAX_QUEUE = 1024
UNHEALTHY_AFTER = 3   # consecutive failed engine steps after which health() is False (/health: 503)


class Sink:
    """Where the engine thread sends one HTTP request's events: ``("added", None)``,
    ``("output", RequestOutput)`` or ``("error", APIError)``. Lives on the event loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, kind: str, value=None) -> None:   # any thread
        push_all([(self, kind, value)])


def push_all(events) -> None:
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


class EngineClient:
    """The engine of ``llm`` (an ``m3_torch.LLM`` / ``m3_jax.LLM``) behind its own thread, which
    runs ``add`` / ``abort`` commands from the HTTP handlers and engine steps while requests are
    unfinished, and blocks when idle. It does not close ``llm``: its owner does.

    max_queue:     the most requests that may wait (queued, not yet in the batch); an ``add``
                   that would go beyond it is refused with a 503.
    chat_template: a Jinja chat template that replaces the model folder's (None: the folder's).
    """

    def __init__(self, llm, *, max_queue: Optional[int] = DEFAULT_MAX_QUEUE, chat_template: Optional[str] = None,
                 metrics: Optional[Metrics] = None):
        self.engine = llm.engine
        # what the routes need of the model, fixed while the server runs
        self.tokenizer = llm.tokenizer
        self.max_model_len: int = llm.max_model_len
        self.vocab_size: int = llm.config.vocab_size
        self.eos_token_ids = frozenset(llm.config.eos_token_ids)
        self.model_dir = llm.args.model_dir
        self.framework: Optional[str] = getattr(llm, "framework", None)
        self.generation_defaults: dict = llm.engine.generation_defaults
        self.chat_template = chat_template
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict = {}           # engine request id -> Sink (unfinished requests only)
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

    def add(self, items: list, sink: Sink, arrival: float) -> None:
        """Queue ``[(request_id, prompt, SamplingParams), ...]`` as one group (all are added or none);
        the sink then gets ``("added", None)`` or ``("error", APIError)`` first."""
        with self._lock:
            if not self._accepting or self.dead:
                raise APIError(503, "the server is shutting down" if not self.dead else
                               f"the engine is not running ({self.dead})", type="service_unavailable_error",
                               code="engine_unavailable")
            self._commands.put(("add", items, sink, arrival))

    def abort(self, request_ids: list) -> None:
        """Abort these requests (unknown or finished ones are ignored)."""
        with self._lock:
            if self._accepting and request_ids:
                self._commands.put(("abort", list(request_ids)))

    def health(self) -> tuple:
        """-> ``(healthy, detail)``: unhealthy when the engine thread is not running or the last
        ``UNHEALTHY_AFTER`` steps all failed (a step that fails now and then is reported in
        ``last_error`` only: its requests failed, the engine serves on)."""
        detail = {**self.snapshot, "failed_steps": self.failed_steps, "last_error": self.error}
        if self.dead or not self.alive:
            return False, {**detail, "error": self.dead or "the engine thread is not running"}
        if self.failed_steps >= UNHEALTHY_AFTER:
            return False, {**detail, "error": f"the last {self.failed_steps} engine steps failed"}
        return True, detail

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
        waiting = self.engine.stats["waiting_requests"]
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
            sink.push("error", bad(str(e), param=param_of(e)))
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
        push_all(events)

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
        stats = self.engine.stats
        self.snapshot = dict(running=stats["running_requests"], waiting=stats["waiting_requests"],
                             unfinished=self.engine.get_num_unfinished_requests(),
                             kv_pages_total=stats["total_pages"],
                             kv_pages_used=stats["total_pages"] - stats["free_pages"], **stats)
