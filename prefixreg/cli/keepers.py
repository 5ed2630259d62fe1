"""How `keepalive` runs its keepers: one per worker (`--pool`: each head on the worker that
holds it), in this thread or in threads, until `--duration`, Ctrl-C or SIGTERM (a systemd
stop), each finishing its re-warm in flight so its summary is complete."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from prefixreg.core.frame import Head
from prefixreg.registry.store import Registry
from prefixreg.verbs.keepalive.run import KeepAlive


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
    systemd stop): each stops after its re-warm in flight, its summary complete."""
    stop = threading.Event()

    def on_term(*_: object) -> None:
        stop.set()
        for k in keepers:
            k.stop()

    stopped = signal.signal(signal.SIGTERM, on_term)
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
        signal.signal(signal.SIGTERM, stopped)
        for k in keepers:
            k.stop()
