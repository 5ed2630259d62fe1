"""A keeper's thread: `step()` every `poll_s` until `stop()`, a duration ends or something goes
wrong, said in `summary.stopped_because` (a keeper thread never dies mute).

Invariants:
- One thread at a time: `start` refuses a second (one request at a time to the worker).
- `stop` wakes the thread and waits for a step in flight (a re-warm) up to the worker's
  timeouts; `touch`-like calls wake it early through `_wake`.
- A duration is a finite number of seconds above 0 (`UsageError`).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Self

from prefixreg.core.errors import UsageError
from prefixreg.server.worker import Worker
from prefixreg.verbs.keepalive.rewarm import KeepAliveSummary


class Stepper:
    """What a keeper's thread runs: a subclass gives `step`, `worker`, `poll_s`, `summary`."""

    worker: Worker
    poll_s: float
    summary: KeepAliveSummary

    def __init__(self) -> None:
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> Any:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, duration_s: float | None = None) -> KeepAliveSummary:
        """Step every `poll_s` until `stop()`, `duration_s` (finite, above 0) or too many errors."""
        given: object = duration_s  # callers outside the type checker pass anything
        span = given if isinstance(given, int | float) and not isinstance(given, bool) else math.nan
        if given is not None and not (math.isfinite(span) and span > 0):
            raise UsageError(
                f"duration_s must be a finite number of seconds above 0, not {given!r}"
            )
        end = None if given is None else time.monotonic() + span
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 -- a keeper thread must never die mute
                # Not the worker's doing (a record not written, a failing callback): say why.
                self.summary.stopped_because = f"{type(exc).__name__}: {exc}"
                self._stop.set()
                break
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self._wake.wait(self.poll_s if left is None else min(self.poll_s, left))
            self._wake.clear()
        return self.summary

    def start(self) -> Self:
        """Run in a daemon thread (the loop keeps its own thread)."""
        if self._thread is not None:
            raise UsageError("this keeper is already running: one thread, one request at a time")
        self._thread = threading.Thread(target=self.run, name="prefixreg-keepalive", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> KeepAliveSummary:
        """Stop the thread (if any), waiting for a re-warm in flight, and return the summary."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.worker.read_timeout + self.worker.timeout)
        return self.summary

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
