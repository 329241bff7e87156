"""Tensor parallelism for ``m3_torch.LLM``: worker processes, the process group, the all-reduce.

    with m3_torch.LLM(model_dir, tensor_parallel_size=2) as llm:   # this process is rank 0
        llm.generate([[1, 2, 3]], max_new_tokens=16)

What ``LLM(..., tensor_parallel_size=N)`` does, as vLLM's ``LLM`` does:

* spawns N-1 worker processes (``torch.multiprocessing``, spawn context, so
  a script that builds an engine at import time needs the usual ``if __name__
  == "__main__":`` guard) and joins them and itself in a ``torch.distributed``
  group: NCCL on GPUs (rank ``r`` on CUDA device ``index + r``), gloo on a
  CPU; rendezvous through a ``FileStore`` in a temporary directory;
* every rank loads ITS slices of the checkpoint (``m3_engine.tp``,
  ``checkpoint.iter_weights(shard=...)``), allocates its pool (its KV heads and
  the whole index-K) and, on GPUs, its own CUDA graphs;
* rank 0 (the calling process) runs the scheduler; before each step it sends
  the step (the scheduler's numpy arrays and plan, and the current ``tuning``
  overrides) to every worker through the worker's pipe, then every rank runs
  the same model step. (Pipes, not ``broadcast_object_list`` over a gloo
  group: on the H200 machine that cost ~1.4 ms a step at batch 8, more than
  the step's CUDA graph; a round trip of a 64 KiB step through a pipe takes
  ~0.25 ms on a CPU, ``benchmarks.host``. A worker whose rank 0 is gone sees
  the pipe close and exits.) The partial sums of ``o_proj`` and of each MLP are summed by :func:`all_reduce` (``torch.distributed.all_reduce``,
  inside the captured graphs on GPUs);
* the embedding and ``lm_head`` are vocab-parallel (``m3_engine.tp``): each
  rank looks up its rows (:func:`all_reduce` completes the embedding) and
  computes its slice of the logits, which :func:`all_gather` puts side by
  side on every rank; rank 0 samples them. No rank reads the whole head;
  the gather moves ``rows x vocab`` logits a step. With
  ``enable_expert_parallel`` each rank holds ``E / tp`` whole experts and runs
  the pairs routed to them (``m3_torch.model.local_experts``); the MoE's
  all-reduce sums the ranks' outputs as it does for the inside split.

Failures: a worker that raises (while loading or in a step) sends its
traceback to rank 0 through a pipe and exits; rank 0's pending collective then
fails (gloo: at once; NCCL: rank 0 polls its step's completion and the
workers' health) and :meth:`LLM.step_logits` / the constructor raise a
``RuntimeError`` carrying the worker's traceback. Any failure inside a step
ends the engine: every worker is terminated, the process group destroyed,
later calls raise. ``close()`` (or leaving the ``with`` block, or the
interpreter's exit) stops the workers cleanly.

Only one tensor-parallel engine can live in a process at a time (it owns the
default process group); a process that already has one (e.g. under
``torchrun``) is refused with a clear error.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import shutil
import tempfile
import time
import traceback
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from m3_kernels import tuning
from m3_engine.tp import TPPlan

from .rank import RankRunner, rank_device

__all__ = ["Workers", "all_reduce", "all_gather", "portable", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # a collective (or start-up) that waits longer fails
ERROR_GRACE_S = 1.0                               # after a failed step: how long to wait for workers' tracebacks

_live: "weakref.WeakSet[Workers]" = weakref.WeakSet()


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """The model's tensor-parallel hook: ``t`` summed over the ranks, in place (the default group)."""
    dist.all_reduce(t)
    return t


# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """The model's vocab-parallel hook: ``t [L, n]`` of every rank side by side, in rank order -> ``[L, ranks * n]``."""
    parts = t.new_empty((dist.get_world_size() * t.shape[0], t.shape[1]))
    _gather_into(parts, t.contiguous())
    return parts.view(-1, *t.shape).transpose(0, 1).reshape(t.shape[0], -1)


def portable(step):
    """``step`` as the workers get it: without the scheduler's request objects, and without the
    device copies rank 0 may have cached on its prefill plan (a step run twice, e.g. by a benchmark)."""
    plan = step.plan
    prefill = plan.context.prefill
    if prefill is not None and any(key[0] == "torch" for key in prefill._cache):
        host = {key: value for key, value in prefill._cache.items() if key[0] != "torch"}
        plan = dataclasses.replace(plan, context=dataclasses.replace(
            plan.context, prefill=dataclasses.replace(prefill, _cache=host)))
    return dataclasses.replace(step, rows=(), plan=plan)


class Workers:
    """Rank 0's side of a tensor-parallel engine: the worker processes and the process group.

    plan:        the tensor-parallel plan (``plan.size`` ranks).
    device:      rank 0's device (CUDA: NCCL, ranks on consecutive devices; CPU: gloo).
    runner_args: the keyword arguments of ``m3_torch.rank.RankRunner`` every rank shares.
    timeout:     collectives and start-up steps that wait longer raise.

    Construction starts the workers and joins the group; :meth:`wait_ready`
    returns once every worker has loaded its weights (rank 0 loads its own in
    between). Then :meth:`run_step` per step, :meth:`close` at the end.
    """

    def __init__(self, plan: TPPlan, device: torch.device, runner_args: dict, *,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT):
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1: this process already has a torch.distributed process "
                               "group (another tensor-parallel LLM that is not closed, or torchrun); the engine "
                               "creates and owns its own: close the other one first")
        self.size, self.timeout = plan.size, timeout
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.closed = False
        self.before_destroy: Callable | None = None   # rank 0's clean-up before the group goes (its graphs)
        self._owns_group = False
        self.procs, self.conns = [], []
        self._dir = tempfile.mkdtemp(prefix="m3-tp-")
        init_method = "file://" + os.path.join(self._dir, "store")
        ctx = torch.multiprocessing.get_context("spawn")
        try:
            for rank in range(1, plan.size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, name=f"m3-tp-rank{rank}", daemon=True,
                                   args=(rank, plan, device, runner_args, init_method, self.backend, timeout, child))
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
            self._expect("started", "starting")
            if self.backend == "nccl":
                torch.cuda.set_device(device)
            dist.init_process_group(self.backend, init_method=init_method, rank=0, world_size=plan.size,
                                    timeout=timeout)
            self._owns_group = True
        except BaseException:
            self.close(force=True)
            raise
        _live.add(self)

    # -- start-up ----------------------------------------------------------------------------

    def wait_ready(self):
        """Block until every worker has loaded its weights and allocated its pool."""
        self._expect("ready", "loading the model")

    def _expect(self, kind: str, doing: str) -> list:
        """The next message of every worker, which must be ``kind``: -> their payloads. A worker
        that reports an error, exits or stays silent past the timeout raises RuntimeError."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        payloads = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.05):
                if not proc.is_alive() and not conn.poll(0):
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) while {doing}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank}: no answer after {self.timeout} while {doing}")
            got, payload = conn.recv()
            if got == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed while {doing}:\n{payload}")
            if got != kind:
                raise RuntimeError(f"tensor-parallel rank {rank}: expected {kind!r}, got {got!r} (a bug)")
            payloads.append(payload)
        return payloads

    # -- steps -------------------------------------------------------------------------------

    def run_step(self, step, runner) -> torch.Tensor:
        """Broadcast ``step``, run rank 0's part (``runner``) -> float32 logits. Any failure ends the engine."""
        self._check_open()
        try:
            self._broadcast(("step", (portable(step), tuning.current_overrides())))
            logits = runner.run(step).float()
            if logits.is_cuda:
                self._wait(logits)
            return logits
        except BaseException as e:
            self._fail(e)

    def call(self, fn: Callable, args: tuple, runner) -> list:
        """``fn(runner, *args)`` on every rank -> the results, rank 0's first."""
        self._check_open()
        try:
            self._broadcast(("call", (fn, args)))
        except BaseException as e:
            self._fail(e)
        mine = error = None
        try:
            mine = fn(runner, *args)
        except Exception as e:   # the workers ran theirs: collect their answers first
            error = e
        try:
            theirs = self._expect("result", f"running {getattr(fn, '__name__', fn)}")
        except BaseException as e:
            self._fail(e)
        if error is not None:
            raise error
        return [mine] + theirs

    def _broadcast(self, message):
        for conn in self.conns:
            conn.send(message)

    def _wait(self, tensor: torch.Tensor):
        """GPU: wait for ``tensor``'s step while watching the workers (NCCL waits for a dead peer
        until its timeout; a worker's traceback arrives through its pipe at once)."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensor.device))
        last_check = time.monotonic()
        while not done.query():
            if time.monotonic() - last_check > 0.1:
                last_check = time.monotonic()
                for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
                    if conn.poll(0) or not proc.is_alive():
                        raise RuntimeError(f"tensor-parallel rank {rank} stopped during a step")

    def _fail(self, error: BaseException):
        """End the engine after a failed step and raise: the workers' tracebacks, if any, else ``error``."""
        reports, deadline = [], time.monotonic() + ERROR_GRACE_S
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                while time.monotonic() < deadline and not conn.poll(0.05):
                    if not proc.is_alive() and not conn.poll(0):
                        break
                if conn.poll(0):
                    kind, payload = conn.recv()
                    if kind == "error":
                        reports.append(f"tensor-parallel rank {rank} failed:\n{payload}")
            except (EOFError, OSError):
                pass
        self.close(force=True)
        if reports:
            raise RuntimeError("\n".join(reports) + "\n(the engine is closed)") from error
        raise error

    def _check_open(self):
        if self.closed:
            raise RuntimeError("this LLM is closed (close() was called, or a tensor-parallel rank failed)")

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, force: bool = False):
        """Stop the workers (``force``: terminate them at once, for a group in an unknown state)
        and destroy the process group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _live.discard(self)
        if self.before_destroy is not None:
            try:
                self.before_destroy()
            except Exception:
                force = True
        if not force and self._owns_group and all(p.is_alive() for p in self.procs):
            try:
                self._broadcast(("stop", None))
                self._expect("stopping", "freeing its graphs")   # bounded: a worker that dies here is seen
                # NCCL's communicator shutdown pairs up across ranks: destroy ours while the workers
                # destroy theirs (waiting for them to exit first would wait forever)
                self._owns_group = False
                dist.destroy_process_group()
            except Exception:
                force = True
        for proc in self.procs:
            proc.join(timeout=0 if force else self.timeout.total_seconds())
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if self._owns_group:
            self._owns_group = False
            try:
                if force and self.backend == "nccl":
                    dist.distributed_c10d._abort_process_group()
                dist.destroy_process_group()
            except Exception:
                pass
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> list:
        """Per worker: is its process running."""
        return [p.is_alive() for p in self.procs]


@atexit.register
def _close_all():
    for workers in list(_live):
        workers.close()


# -- the worker process ------------------------------------------------------------------------

def _worker_main(rank: int, plan: TPPlan, device: torch.device, runner_args: dict, init_method: str, backend: str,
                 timeout: datetime.timedelta, conn):
    """A worker's life: join the group, load its slices, then run what rank 0 sends until "stop"."""
    try:
        conn.send(("started", os.getpid()))
        if backend == "nccl":
            torch.cuda.set_device(rank_device(device, rank))
        else:   # share the CPU with the other ranks instead of each taking every core
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.size))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=plan.size, timeout=timeout)
        runner = RankRunner(tp=plan, rank=rank, device=device, all_reduce=all_reduce, all_gather=all_gather,
                            **runner_args)
        conn.send(("ready", None))
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:   # rank 0 is gone without saying "stop"
                os._exit(0)
            if kind == "stop":
                if backend == "nccl":
                    torch.cuda.synchronize()
                if runner.graphs is not None:
                    runner.graphs.release()   # before the group (see _DecodeGraphs.release)
                conn.send(("stopping", None))
                break
            if kind == "step":
                step, overrides = payload
                with tuning.override(**overrides):
                    runner.run(step)
            elif kind == "call":
                fn, args = payload
                conn.send(("result", fn(runner, *args)))
            else:
                raise RuntimeError(f"unknown message {kind!r} from rank 0")
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
            conn.close()
        finally:
            os._exit(1)   # no clean-up: the peers' pending collectives fail at once
    dist.destroy_process_group()
    conn.close()
