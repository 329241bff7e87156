"""The engine core's step timeline: one JSON line per step, for the benchmarks.

With ``M3_STEP_TIMELINE=FILE`` in its environment, each :class:`~m3_engine.engine_core.EngineCore`
appends one line to ``FILE`` for every :meth:`~m3_engine.engine_core.EngineCore.execute_step`
that ran a step (``m3-serve``'s engine process and an offline ``LLM`` alike); without it,
nothing is recorded. A line (times are ``time.time()`` seconds, comparable across the processes
of one host)::

    {"start": 1733300000.1234, "end": 1733300000.1261,   # execute_step's call, on the host
     "rows": 64, "context_rows": 1, "generation_rows": 63, "prompt_tokens": 1024,
     "device_wait": 0.0021,     # seconds in the runner's wait for the step's sampled tokens
     "since_last": 0.0004,      # seconds since the last step's end: the caller's work, or waiting for requests
     "added": [["r7", 1733300000.1225]],   # requests added since the last step, and when
     "first": ["r7"],           # requests whose first token this step handed out
     "finished": ["r3"]}        # requests this step finished

With async scheduling a line is the call that hands out a step's tokens: its rows are that step's,
``device_wait`` the wait for them (the next step was submitted before it). :func:`read` reads a file
back. A line costs some tens of microseconds of host time a step (the file is opened and closed
for each line).

With ``M3_STEP_PROFILE=FILE``, the same calls also run under ``cProfile`` (:class:`StepProfile`) and
the statistics of all of them are written to ``FILE`` (``pstats`` format) when the process exits:
where a step's host time goes, in the server's engine process as offline.
"""

from __future__ import annotations

import atexit
import cProfile
import json
import os
import time
from typing import Optional

__all__ = ["ENV_VAR", "PROFILE_ENV_VAR", "StepTimeline", "StepProfile", "read"]

ENV_VAR = "M3_STEP_TIMELINE"
PROFILE_ENV_VAR = "M3_STEP_PROFILE"


class StepTimeline:
    """Appends step lines to ``path`` (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        self._added: list = []
        self._started: set = set()     # requests that have their first token and are not finished
        self._last_end: Optional[float] = None

    @classmethod
    def from_environ(cls, environ=None) -> Optional["StepTimeline"]:
        """A timeline writing to ``$M3_STEP_TIMELINE``; None when it is unset or empty."""
        path = (os.environ if environ is None else environ).get(ENV_VAR)
        return cls(path) if path else None

    def added(self, request_id: str) -> None:
        self._added.append((request_id, time.time()))

    def record(self, start: float, step, device_wait: float, outputs: list) -> None:
        """One step: ``start`` the call's ``time.time()``, ``step`` its ``Step``, ``outputs`` its
        ``CoreOutput``s; the end is now."""
        end = time.time()
        first = [o.request_id for o in outputs if o.request_id not in self._started]
        finished = [o.request_id for o in outputs if o.finish_reason is not None]
        self._started.update(first)
        self._started.difference_update(finished)
        generation_rows = int((step.row_index >= step.num_context).sum())
        line = dict(start=start, end=end, rows=len(step.rows), context_rows=len(step.rows) - generation_rows,
                    generation_rows=generation_rows, prompt_tokens=step.num_prompt_tokens,
                    device_wait=device_wait, since_last=None if self._last_end is None else start - self._last_end,
                    added=self._added, first=first, finished=finished)
        self._added, self._last_end = [], end
        with open(self.path, "a") as f:   # opened per line: nothing stays open when the engine goes
            f.write(json.dumps(line) + "\n")

    def forget(self, request_ids) -> None:
        """Requests ended outside a step (aborted, stopped by the front end)."""
        self._started.difference_update(request_ids)


class StepProfile:
    """``cProfile`` over the engine core's step calls (``with profile: ...`` around each), written to
    ``path`` when the process exits (see the module docstring)."""

    def __init__(self, path: str):
        self.path, self.profile = path, cProfile.Profile()
        atexit.register(self.close)

    @classmethod
    def from_environ(cls, environ=None) -> Optional["StepProfile"]:
        """A profile written to ``$M3_STEP_PROFILE``; None when it is unset or empty."""
        path = (os.environ if environ is None else environ).get(PROFILE_ENV_VAR)
        return cls(path) if path else None

    def __enter__(self):
        self.profile.enable()

    def __exit__(self, *exc):
        self.profile.disable()

    def close(self) -> None:
        """Write the statistics (at exit, or sooner: then not again)."""
        atexit.unregister(self.close)
        self.profile.dump_stats(self.path)


def read(path) -> list:
    """The lines of a timeline file as dicts, in order ([] when the file does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
