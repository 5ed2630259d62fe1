"""`keepalive` over workers: one keeper per worker (the caller groups the heads by worker;
`--pool`: each on the worker that holds it), in this thread or in threads, until the
duration, Ctrl-C or SIGTERM (a systemd stop), each finishing its re-warm in flight so its
summary is complete; the run as a typed result (`KeepRun`: its JSON, its text, `outcome`).

Invariants:
- Signals only set a flag (an interrupt raised inside a library callback could be
  swallowed and the keeper run on); a second Ctrl-C interrupts the call in flight.
- The metrics sink gets every keeper's counters after every re-warm and at the end, one
  writer at a time (keepers in threads share the one file).
- A run in which no re-warm came back with counts the judge could read proved nothing of
  "these heads were kept warm": it is never `ok`.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Head
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.keepalive.rewarm import Rewarm
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.measure.metrics import Metrics

Say = Callable[[str], None]


def parse_duration(text: str) -> float:
    """`90`, `30s`, `10m`, `2h`, `1d` -> seconds (above 0)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip().lower())
    units = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
    seconds = 0.0 if match is None else float(match.group(1)) * units[match.group(2)]
    if seconds <= 0:
        raise UsageError(f"bad duration {text!r}: seconds above 0, or a number with s, m, h, d")
    return seconds


def rewarm_line(rewarm: Rewarm) -> str:
    """One re-warm as a person reads it on stderr."""
    ev = rewarm.record.evidence
    since = "first warm" if rewarm.since is None else f"after {rewarm.since:g} {rewarm.unit}"
    what = rewarm.sha256[:12] if rewarm.frame is None else f"frame {rewarm.frame[:12]}"
    kept = "kept" if rewarm.verdict == "resumed" else "not kept"
    return (
        f"re-warmed {what} ({since}): {rewarm.verdict} ({kept}), cached {ev.cached_tokens}/"
        f"{ev.prompt_tokens}"
    )


@dataclass(frozen=True, slots=True)
class KeepRun:
    """The keepers of one run, stopped; `pooled`: one per pool worker (the JSON lists them)."""

    keepers: list[KeepAlive]
    pooled: bool

    def _verdict(self) -> tuple[str, str | None]:
        for summary in (k.summary for k in self.keepers):
            if summary.stopped_because:
                outcome = "worker_error" if summary.stopped_by_worker else "stopped"
                return outcome, f"stopped: {summary.stopped_because}"
            if summary.succeeded == 0:
                why = f"{summary.errors} worker errors" if summary.errors else "no verified counts"
                outcome = "worker_error" if summary.errors else "unverified"
                return outcome, f"no re-warm succeeded in this run ({why})"
        return "ok", None

    @property
    def outcome(self) -> str:
        """`ok`; `worker_error`, `stopped` or `unverified` from the first keeper that failed."""
        return self._verdict()[0]

    @property
    def note(self) -> str | None:
        """Why the run failed, for stderr (None: it did not)."""
        return self._verdict()[1]

    def to_dict(self) -> JSONObject:
        out: list[JSONValue] = [
            {"worker": k.worker.url, "budget": k.budget.to_dict(), **k.summary.to_dict()}
            for k in self.keepers
        ]
        if self.pooled:
            return {"workers": out}
        first = self.keepers[0]
        return {"budget": first.budget.to_dict(), **first.summary.to_dict()}

    def text(self, _exit_code: int = 0) -> str:
        lines: list[str] = []
        for k in self.keepers:
            lines += [f"{k.worker.url}:"] if self.pooled else []
            lines += [str(k.summary), *(f"  {change}" for change in k.summary.budget_changes)]
        return "\n".join(lines) + "\n"


def run_keepers(keepers: list[KeepAlive], seconds: float | None, say: Say) -> None:
    """Run one keeper here, several in threads, until `seconds`, Ctrl-C or SIGTERM: each
    stops after its re-warm in flight, its summary complete; a keeper's notes go to `say`."""
    stop = threading.Event()
    for k in keepers:
        if k.on_note is None:
            where = f"{k.worker.url}: " if len(keepers) > 1 else ""
            k.on_note = lambda note, where=where: say(f"keepalive: {where}{note}")

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()
        for k in keepers:  # this thread's keeper sees the flag; threads are joined below
            if not k.alive:
                k.stop()
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    before = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if len(keepers) == 1:
            keepers[0].run(seconds)
            return
        for k in keepers:
            k.start()
        end = None if seconds is None else time.monotonic() + seconds
        while any(k.alive for k in keepers) and not stop.is_set():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            stop.wait(0.2 if left is None else min(0.2, left))
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for k in keepers:
            k.stop()


def keep_heads(
    registry: Registry,
    groups: dict[str, list[Head]],
    *,
    duration_s: float | None,
    say: Say,
    progress: Say | None = None,
    metrics: Callable[[Metrics], None] | None = None,
    pooled: bool = False,
    budget: int | None = None,
    interval_s: float | None = None,
    poll_s: float = 0.5,
    session: Path | None = None,
    copies: int = 1,
) -> KeepRun:
    """Keep each group's heads on its worker (a `KeepAlive` each, with `budget` to `copies`)
    until `duration_s`, Ctrl-C or SIGTERM. `say` hears the keepers' notes,
    `progress` (None: quiet) each keeper's budget and each re-warm; `metrics` gets every
    keeper's counters after every re-warm and at the end. Raises as `KeepAlive`."""
    keepers: list[KeepAlive] = []
    writing = threading.Lock()

    def write_metrics() -> None:
        if metrics is None:
            return
        out = Metrics()
        for k in keepers:
            out.update(k.summary.metrics({"worker": k.worker.url}))
        with writing:
            metrics(out)

    def on_rewarm(rewarm: Rewarm) -> None:
        if progress is not None:
            progress(rewarm_line(rewarm))
        write_metrics()

    with ExitStack() as stack:
        for url, held in groups.items():
            w = stack.enter_context(Worker(url, timeout=5.0))
            keepers.append(
                KeepAlive(
                    w,
                    held,
                    registry=registry,
                    budget=budget,
                    interval_s=interval_s,
                    poll_s=poll_s,
                    on_rewarm=on_rewarm,
                    session=session,
                    copies=copies,
                )
            )
            b = keepers[-1].budget
            if progress is not None:
                progress(f"keeping {len(held)} heads on {url}; budget {b.describe()} ({b.source})")
        run_keepers(keepers, duration_s, say)
        write_metrics()
    return KeepRun(keepers, pooled)
