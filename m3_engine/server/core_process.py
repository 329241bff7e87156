"""The engine core in a process of its own (vLLM's engine-core process), over ZMQ and msgspec.

``m3-serve``'s HTTP process (FastAPI, tokenization, chat templates, detokenization, stop
strings, server-sent events) and the model's steps would share one interpreter lock; here the
engine core (``m3_engine.engine_core.EngineCore``: scheduler, runner, sampling) runs in a
process started with ``multiprocessing``'s spawn (the runner's CUDA / JAX state is made there,
never in the server), and the two talk over two ZMQ PUSH/PULL sockets on IPC paths that the
server binds:

* in (server -> core): :class:`AddRequests` (a group of requests, all added or none: token ids,
  the resolved ``SamplingParams`` fields), :class:`AbortRequests`, :class:`Shutdown`.
* out (core -> server): first :class:`Ready` (the model's facts) or :class:`StartFailed` (the
  exception that stopped the model load), then one :class:`EngineOutputs` per step, carrying all
  of the step's :class:`~m3_engine.engine_core.CoreOutput`s (new token ids, logprobs, finish
  reasons), the groups added or refused since the last one, and the core's load (``stats``); a
  round of commands without a step sends one too (the load changed).

The core loop: take every command waiting, run a step while any request is unfinished, send its
outputs, then the EAGLE-3 draft pass; idle, it waits for a command. A step that raises fails the
requests then unfinished (:class:`StepFailed`; the loop goes on); anything else that raises ends
the process with status 1, which the server sees (``EngineProcess.sentinel``). The core also
ends when the server process is gone. SIGINT is ignored here: the server stops the core
(:class:`Shutdown`) once it has drained.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional, Union

try:   # without the server's packages, name the extra that installs them
    import msgspec
    import zmq
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"m3-serve needs pyzmq and msgspec ({e.name} is missing): "
                              "pip install 'm3-msa-kernels[server]'", name=e.name) from None

from .. import load_class
from ..engine_core import CoreOutput, EngineCore
from ..sampling_params import SamplingParams
from ..structured_outputs import StructuredOutputsParams

__all__ = ["EngineProcess", "EngineStartError", "AddRequests", "AbortRequests", "Shutdown", "CoreRequest",
           "EngineOutputs", "Rejected", "StepFailed", "Ready", "StartFailed", "run_engine_core",
           "params_to_wire", "params_from_wire"]

USER_ERRORS = ("ValueError", "TypeError", "FileNotFoundError")   # a bad option or model folder, not a bug
PARENT_CHECK_S = 1.0   # how often the core looks whether the server process is still there


# -- messages ---------------------------------------------------------------------------------------

class CoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict                  # ``params_to_wire``: every SamplingParams field, generation defaults applied


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    group: int                    # answered in EngineOutputs.added or .rejected
    requests: list[CoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    reason: str = "abort"         # or "stop": a stop string the server found


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = Union[AddRequests, AbortRequests, Shutdown]


class Rejected(msgspec.Struct, array_like=True):
    """A group the core refused: ``status`` 400 (a bad request: ``message`` names the field), 503
    (the waiting queue is full: ``code="queue_full"``) or 500."""
    group: int
    status: int
    message: str
    code: Optional[str] = None


class StepFailed(msgspec.Struct, array_like=True):
    error: str                    # "ExceptionType: message"
    request_ids: list[str]        # the requests it failed (aborted in the core)


class EngineOutputs(msgspec.Struct, array_like=True):
    outputs: list[CoreOutput]
    stats: dict                   # EngineCore.stats, and "unfinished"
    stepped: bool                 # a step ran (and did not fail)
    added: list[int] = []
    rejected: list[Rejected] = []
    failed: Optional[StepFailed] = None


class Ready(msgspec.Struct, tag="ready"):
    facts: dict                   # framework, max_model_len, vocab_size, max_num_seqs, num_kv_pages, ...


class StartFailed(msgspec.Struct, tag="failed"):
    kind: str                     # the exception's type name
    message: str


def params_to_wire(params: SamplingParams) -> dict:
    return msgspec.to_builtins(params)


def params_from_wire(fields: dict) -> SamplingParams:
    structured = fields.get("structured_outputs")
    if structured is not None:
        fields = {**fields, "structured_outputs": StructuredOutputsParams(**structured)}
    return SamplingParams(**fields)


class EngineStartError(RuntimeError):
    """The engine process did not get ready: ``kind`` is the exception type that stopped it
    (None when the process died without saying), ``user_error`` whether it is a bad option or
    model folder (``ValueError``, ``TypeError``, ``FileNotFoundError``)."""

    def __init__(self, message: str, kind: Optional[str] = None):
        super().__init__(message)
        self.kind = kind

    @property
    def user_error(self) -> bool:
        return self.kind in USER_ERRORS


# -- the server's side ------------------------------------------------------------------------------

class EngineProcess:
    """Start the engine core's process and wait until it is ready (or raise :class:`EngineStartError`).

    llm_class: ``"module:Name"`` of the ``LLM`` class the process builds (``"m3_torch:LLM"``),
               imported there only.
    model_dir, options: ``LLM(model_dir, **options)``.
    max_queue: the most requests that may wait; an ``AddRequests`` beyond it is refused (503).

    ``input`` (PUSH) and ``output`` (PULL) are its sockets, ``facts`` what :class:`Ready` said,
    ``sentinel`` a file descriptor readable once the process has ended.
    """

    def __init__(self, llm_class: str, model_dir, options: dict, *, max_queue: Optional[int]):
        self._dir = tempfile.mkdtemp(prefix="m3-engine-")
        self._context = zmq.Context()
        self.input = self._context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)   # never block the server's event loop on a busy core
        self.input.setsockopt(zmq.LINGER, 0)
        self.output = self._context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.setsockopt(zmq.LINGER, 0)
        in_address, out_address = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self.input.bind(in_address)
        self.output.bind(out_address)
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="m3-engine-core",
            args=(llm_class, str(model_dir), options, max_queue, in_address, out_address))
        try:
            self.process.start()
            self.facts = self._wait_ready()
        except BaseException:
            self.close(timeout=5)
            raise
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def death(self) -> str:
        """How the process ended: "exited with status N" or "was killed by SIGKILL"."""
        self.process.join(1)
        code = self.process.exitcode
        if code is None:
            return "is running"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def _wait_ready(self) -> dict:
        decoder = msgspec.msgpack.Decoder(Union[Ready, StartFailed])
        while True:
            if self.output.poll(100):
                message = decoder.decode(self.output.recv())
                if isinstance(message, StartFailed):
                    raise EngineStartError(message.message, message.kind)
                return message.facts
            if not self.process.is_alive() and not self.output.poll(0):
                raise EngineStartError(f"the engine process {self.death()} before it was ready")

    def send(self, command) -> bool:
        """Hand the core a command; -> False when it is not listening any more (its process ended)."""
        try:
            self.input.send(self._encoder.encode(command), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self, timeout: float = 30.0) -> None:
        """Ask the core to stop (it aborts what is left), wait ``timeout`` seconds for it, then
        terminate it. Idempotent; blocks."""
        if self.process.is_alive():
            try:
                self.input.send(msgspec.msgpack.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if not self._context.closed:
            self.input.close(linger=0)
            self.output.close(linger=0)
            self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


# -- the engine's side ------------------------------------------------------------------------------

def run_engine_core(llm_class: str, model_dir: str, options: dict, max_queue: Optional[int], in_address: str,
                    out_address: str) -> None:
    """The engine process: build the ``LLM``, say :class:`Ready` (or :class:`StartFailed`), run the
    core loop until :class:`Shutdown` or the server process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context()
    output = context.socket(zmq.PUSH)
    output.setsockopt(zmq.SNDHWM, 0)
    output.connect(out_address)
    commands = context.socket(zmq.PULL)
    commands.setsockopt(zmq.RCVHWM, 0)
    commands.connect(in_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        llm = load_class(llm_class)(Path(model_dir), **options)
    except Exception as e:
        if type(e).__name__ not in USER_ERRORS:
            traceback.print_exc()
        output.send(encoder.encode(StartFailed(type(e).__name__, str(e))))
        output.close(linger=10_000)
        context.term()
        sys.exit(1)
    try:
        sc = llm.scheduler_config
        output.send(encoder.encode(Ready(dict(
            framework=llm.framework, max_model_len=llm.max_model_len, vocab_size=llm.config.vocab_size,
            max_num_seqs=sc.max_batch, num_kv_pages=sc.num_slots, generation_defaults=llm.engine.generation_defaults,
            stats=_stats(llm.engine.core), pid=os.getpid(), startup_times=llm.startup_times))))
        _CoreLoop(llm.engine.core, commands, output, encoder, max_queue).run()
    finally:
        llm.close()
        output.close(linger=1000)
        commands.close(linger=0)
        context.term()


def _stats(core: EngineCore) -> dict:
    return dict(core.stats, unfinished=core.get_num_unfinished_requests())


class _CoreLoop:
    def __init__(self, core: EngineCore, commands, output, encoder, max_queue: Optional[int]):
        self.core, self.commands, self.output, self.encoder = core, commands, output, encoder
        self.max_queue = max_queue
        self.decoder = msgspec.msgpack.Decoder(Command)
        self.parent = multiprocessing.parent_process()
        self.added: list = []
        self.rejected: list = []

    def run(self) -> None:
        checked = time.monotonic()
        while True:
            if not self.core.has_unfinished_requests():
                if not self.commands.poll(PARENT_CHECK_S * 1000):   # idle: wait for a command
                    if not self.parent.is_alive():
                        return
                    continue
            elif time.monotonic() - checked > PARENT_CHECK_S:
                if not self.parent.is_alive():
                    return
                checked = time.monotonic()
            handled = False
            while True:
                try:
                    frame = self.commands.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                command = self.decoder.decode(frame)
                if isinstance(command, Shutdown):
                    return
                handled = True
                if isinstance(command, AbortRequests):
                    self.core.finish_request(command.request_ids, command.reason)
                else:
                    self._add(command)
            if self.core.has_unfinished_requests():
                self._step()
            elif handled:
                self._send([], stepped=False)

    def _add(self, command: AddRequests) -> None:
        waiting = self.core.scheduler.num_waiting
        if self.max_queue is not None and waiting + len(command.requests) > self.max_queue:
            self.rejected.append(Rejected(
                command.group, 503, f"the server is busy: {waiting} requests are waiting and this one brings "
                f"{len(command.requests)} more (--max-queue {self.max_queue}); retry later", "queue_full"))
            return
        added = []
        try:
            for r in command.requests:
                self.core.add_request(r.request_id, r.prompt_token_ids, params_from_wire(r.params))
                added.append(r.request_id)
        except (ValueError, TypeError) as e:
            self.core.finish_request(added)
            self.rejected.append(Rejected(command.group, 400, str(e)))
            return
        except Exception as e:
            self.core.finish_request(added)
            traceback.print_exc()
            self.rejected.append(Rejected(command.group, 500, f"{type(e).__name__}: {e}"))
            return
        self.added.append(command.group)

    def _step(self) -> None:
        try:
            outputs = self.core.execute_step()
        except Exception as e:
            self._fail_all(e)
            return
        self._send(outputs, stepped=True)   # the server detokenizes while the draft model runs
        try:
            self.core.propose_drafts()
        except Exception as e:
            self._fail_all(e)

    def _fail_all(self, e: Exception) -> None:
        """A failed step (or draft pass): abort every unfinished request and tell the server."""
        error = f"{type(e).__name__}: {e}"
        sys.stderr.write(f"m3-serve engine: a step failed; its requests fail with a 500:\n{traceback.format_exc()}")
        request_ids = self.core.unfinished_request_ids()
        self.core.finish_request(request_ids)
        self._send([], stepped=False, failed=StepFailed(error, request_ids))

    def _send(self, outputs: list, *, stepped: bool, failed: Optional[StepFailed] = None) -> None:
        message = EngineOutputs(outputs, _stats(self.core), stepped, self.added, self.rejected, failed)
        self.added, self.rejected = [], []
        self.output.send(self.encoder.encode(message))
