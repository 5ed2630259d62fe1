"""hostile benchmark: what a flooding or trickling worker costs the client (issue 13).

A loopback fault server (`tests.fakeserver`) generates its replies lazily, so a 1 GiB reply
never exists in memory on the server side. Measured:

- peak RSS of `prefixreg warm` (a process of its own, measured by a parent of its own) against
  a normal worker, and against a 1 GiB reply on /health, on the chat stream (SSE) and as a
  non-streamed chat body. Target: each flood exits 5 with an absolute peak (interpreter
  included) under the 64 MiB reply cap + 100 MiB.
- a worker trickling /health or the stream one byte every 50 ms: how long a call with a
  deadline of D seconds takes (in-process `Worker`), and `warm --timeout D` end to end.
  Target: cut at D + at most 1 s.

Run: `python benchmarks/hostile.py`.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefixreg.core.errors import WorkerTimeoutError
from prefixreg.registry.store import Registry
from prefixreg.server.transport import DEFAULT_MAX_BYTES
from prefixreg.server.worker import Worker
from tests.fakeserver import FakeServer, Reply, lazy, sse_flood, sse_frames
from tests.test_worker import HALOGEN_CACHE, HALOGEN_HEALTH, PREFIX, stream_reply

MIB = 1024 * 1024
GIB = 1024 * MIB
CHAT = "/v1/chat/completions"
DEADLINE = 3.0


PROBE = (
    "import resource, subprocess, sys, time\n"
    "t = time.monotonic()\n"
    "r = subprocess.run([sys.executable, '-m', 'prefixreg', *sys.argv[1:]], capture_output=True)\n"
    "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,"
    " time.monotonic() - t)\n"
)


def warm_child(reg: Path, url: str, *extra: str) -> tuple[int, float, float]:
    """(exit code, peak RSS in MiB, wall seconds) of one `prefixreg warm` process."""
    args = ["warm", "loop", "--worker", url, "--registry", str(reg), *extra]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, timeout=300, check=True
    )
    code, kib, wall = out.stdout.split()
    return int(code), int(kib) / 1024, float(wall)


def scenario(
    reg: Path, routes: dict[tuple[str, str], Reply], *extra: str
) -> tuple[int, float, float]:
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, Reply(sse=sse_frames(stream_reply())))
        for (method, path), reply in routes.items():
            srv.route(method, path, reply)
        return warm_child(reg, srv.url, *extra)


def in_process_cut(reply: Reply, path: str) -> float:
    with FakeServer() as srv:
        srv.route("GET" if path == "/health" else "POST", path, reply)
        with Worker(srv.url, timeout=DEADLINE, read_timeout=DEADLINE) as w:
            started = time.monotonic()
            try:
                w.health() if path == "/health" else w.chat(PREFIX, "t")
            except WorkerTimeoutError:
                return time.monotonic() - started
    raise SystemExit(f"{path}: the trickle was not cut")


def main() -> int:
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        reg = Path(tmp) / "reg"
        Registry(reg).add("You are a careful assistant. " * 20, name="loop")
        code, base, _ = scenario(reg, {})
        print(f"baseline warm            exit {code}  peak RSS {base:6.1f} MiB")
        cap = DEFAULT_MAX_BYTES / MIB
        floods = {
            "1 GiB /health": {("GET", "/health"): Reply(generate=lazy(GIB))},
            "1 GiB chat SSE": {
                ("POST", CHAT): Reply(generate=sse_flood(GIB), content_type="text/event-stream")
            },
            "1 GiB chat JSON": {
                ("POST", CHAT): Reply(generate=lazy(GIB), content_type="application/json")
            },
        }
        for label, routes in floods.items():
            code, peak, wall = scenario(reg, routes)
            ok = code == 5 and peak < cap + 100
            failed |= not ok
            print(
                f"{label:<24} exit {code}  peak RSS {peak:6.1f} MiB "
                f"(baseline +{peak - base:5.1f})  {wall:5.2f} s  "
                f"target < cap {cap:.0f} + 100 MiB  {'ok' if ok else 'FAIL'}"
            )
        trickles = {
            "/health": Reply(json=HALOGEN_HEALTH, trickle=0.05),
            CHAT: Reply(sse=sse_frames(stream_reply()), trickle=0.05),
        }
        for path, reply in trickles.items():
            took = in_process_cut(reply, path)
            ok = took <= DEADLINE + 1
            failed |= not ok
            print(
                f"trickled {path:<22} cut after {took:5.2f} s  deadline {DEADLINE:g} s  "
                f"target <= +1 s  {'ok' if ok else 'FAIL'}"
            )
        code, _, wall = scenario(
            reg, {("GET", "/health"): trickles["/health"]}, "--timeout", str(DEADLINE)
        )
        print(
            f"warm --timeout {DEADLINE:g}, trickled /health: exit {code} after {wall:5.2f} s "
            "(interpreter start-up included)"
        )
        failed |= code != 5
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
