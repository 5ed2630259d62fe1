"""warm benchmark: the client's overhead on one warm call, against a bare httpx POST.

Against the simulator at maximum speed (server time near zero, so the client's own work
shows), both sides send the same streamed chat body over a kept-alive connection:

- floor: `httpx.Client.stream("POST", ...)` reading every byte, nothing parsed;
- ours: `Worker.chat` (SSE parsing, evidence, output hash), i.e. the warm call.

Target: <= 1.1x. Also printed for information: a whole `warm` (build read, /cache
snapshots, warm call, resume check, measurement write) against two bare POSTs.
Run: `python benchmarks/warm.py`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from prefixreg.cli.sim import sample_prompt
from prefixreg.core.prefix import fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.measure.calls import WARM_PARAMS
from prefixreg.verbs.measure.warm import warm


def median_of(fn: Callable[[], object], n: int) -> float:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    n = 300
    with tempfile.TemporaryDirectory() as tmp, SimServer(SimConfig(speed=1e9)) as sim:
        reg = Registry(Path(tmp) / "reg")
        sha = reg.add(sample_prompt(), name="p")
        prefix = reg.get(sha)
        tail = fresh_tail()
        body = {
            **WARM_PARAMS,
            "messages": prefix.messages(tail),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        raw = orjson.dumps(body)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        with httpx.Client(base_url=sim.url) as bare, Worker(sim.url) as worker:

            def floor() -> None:
                with bare.stream("POST", "/v1/chat/completions", content=raw, headers=headers) as r:
                    for _ in r.iter_bytes():
                        pass

            def ours() -> None:
                worker.chat(prefix, tail, **WARM_PARAMS)

            for _ in range(20):  # warm both connections and code paths
                floor()
                ours()
            # Interleave the measurements so drift hits both sides alike.
            f_samples, o_samples = [], []
            for _ in range(5):
                f_samples.append(median_of(floor, n // 5))
                o_samples.append(median_of(ours, n // 5))
            f, o = statistics.median(f_samples), statistics.median(o_samples)
            whole = median_of(lambda: warm(reg, reg.head("p"), worker), 30)
    ratio = o / f
    ok = ratio <= 1.1
    print(
        f"warm call  {o * 1e6:8.0f} us  bare httpx POST {f * 1e6:8.0f} us  "
        f"ratio {ratio:.2f}x  target <= 1.1x  {'ok' if ok else 'MISSED'}"
    )
    print(
        f"whole warm (2 calls, /health x2, /cache x3, record) {whole * 1e6:8.0f} us "
        f"= {whole / (2 * f):.2f}x two bare POSTs (information)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
