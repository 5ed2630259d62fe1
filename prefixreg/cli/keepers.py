"""How `keepalive` runs its keepers: one per worker (`--pool`: each head on the worker that
holds it), in this thread or in threads, until `--duration`, Ctrl-C or SIGTERM (a systemd
stop), each finishing its re-warm in flight so its summary is complete; what a keeper gives
up (a session, a head whose re-warms keep failing) is said on stderr when it happens."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from prefixreg.cli._common import info, write_metrics_file
from prefixreg.core.frame import Head
from prefixreg.registry.store import Registry
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.measure.metrics import Metrics

_WRITING = threading.Lock()  # keepers in threads share the one metrics file


def placed(reg: Registry, heads: list[Head], pool: Path) -> dict[str, list[Head]]:
    """The heads by the pool worker that holds each (its placement; UsageError: unplaced)."""
    from prefixreg.verbs.pool.live import Pool
    from prefixreg.verbs.pool.spec import pool_spec

    groups: dict[str, list[Head]] = {}
    with Pool(pool_spec((), pool_file=pool), reg) as live:
        for head in heads:
            groups.setdefault(live.assignment(head).worker, []).append(head)
    return groups


def run_keepers(keepers: list[KeepAlive], seconds: float | None) -> None:
    """Run one keeper here, several in threads, until `seconds`, Ctrl-C or SIGTERM (a
    systemd stop): each stops after its re-warm in flight, its summary complete. Both
    signals only set a flag (an interrupt raised inside a library callback could be
    swallowed and the keeper run on); a second Ctrl-C interrupts the call in flight."""
    stop = threading.Event()
    for k in keepers:
        if k.on_note is None:
            where = f"{k.worker.url}: " if len(keepers) > 1 else ""
            k.on_note = lambda note, where=where: info(f"keepalive: {where}{note}")

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


def write_keeper_metrics(path: Path | None, keepers: list[KeepAlive]) -> None:
    """Every keeper's counters so far to `--metrics-file`, labelled by worker (a file that
    cannot be written is a warning: the heads are what is kept)."""
    if path is None:
        return
    out = Metrics()
    for k in keepers:
        out.update(k.summary.metrics({"worker": k.worker.url}))
    with _WRITING:
        write_metrics_file(path, out)
