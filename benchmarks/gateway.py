"""gateway benchmark: what `prefixreg gateway` adds to a call, against the simulator.

Three ways to the same `prefixreg sim` (a separate process; a call takes 0.2 s of model
time, or none): direct; through a bare forwarder (Starlette + uvicorn + httpx,
the stack the gateway stands on, doing nothing else: the floor, measured in the same run);
through `prefixreg gateway --worker URL`. Each in its own process. Printed:

- added latency p50/p99 (gateway minus direct, and the floor's), concurrency 1 and 16,
  non-streamed chat completions; targets p50 <= 2 ms, p99 <= 10 ms;
- throughput through the gateway over direct, concurrency 1 and 16 (target >= 0.9x).
  Both twice: against a simulator whose call takes 0.2 s (a short real call: the targets
  are checked there), and with no model time at all, where every process is CPU-bound on
  the two shared cores and the ratio is the forwarder's CPU per call against the
  simulator's (printed beside the floor's, not judged);
- streamed time to first token (first `data:` event), gateway minus direct, median
  (target within 5 ms);
- peak memory (VmHWM of the forwarding process, a fresh one per load) under four 10 MB
  bodies at once and under 1,000 concurrent streams, beside the floor's.

Rounds alternate direct / floor / gateway (ABAB), so drifting machine load weighs on each.
The targets are printed as holding or not; no absolute time is asserted.

Run: `python benchmarks/gateway.py [--requests 400] [--streams 1000]`. About four minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = Path(tempfile.gettempdir()) / f"prefixreg-gateway-bench-{os.getpid()}"  # removed after
TARGET_P50_MS, TARGET_P99_MS, TARGET_THROUGHPUT, TARGET_TTFT_MS = 2.0, 10.0, 0.9, 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    parts = urlsplit(url)
    try:
        conn = http.client.HTTPConnection(str(parts.hostname), parts.port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


@contextmanager
def process(argv: Sequence[str], url: str, what: str) -> Iterator[subprocess.Popen[bytes]]:
    """Spawn `argv`, wait until `url`/health answers 200, stop it by its pid on exit."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode(errors="replace")[-800:] if proc.stderr else ""
                raise RuntimeError(f"{what} did not start: {err}")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def sim(port: int, *, decode_tps: float, speed: float) -> list[str]:
    return [
        sys.executable, "-m", "prefixreg", "sim", "--port", str(port),
        "--slots", "4000", "--slot-ctx", "100000000", "--queue-timeout", "600",
        "--decode-tps", str(decode_tps), "--speed", str(speed), "--answer-tokens", "24",
    ]  # fmt: skip


def gateway(worker: str, port: int) -> list[str]:
    """The gateway as a user runs it, writing its call log."""
    LOG_DIR.mkdir(exist_ok=True)
    log = LOG_DIR / f"calls-{port}.jsonl"
    return [
        sys.executable, "-m", "prefixreg", "gateway", "--worker", worker,
        "--listen", f"127.0.0.1:{port}", "--call-log", str(log),
    ]  # fmt: skip


def bare(worker: str, port: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--bare-proxy", worker, str(port)]


def bare_proxy(upstream: str, port: int) -> None:
    """The floor: a forwarder on the gateway's stack that does nothing but forward."""
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=600.0)

    async def forward(request: Request) -> StreamingResponse:
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        req = client.build_request(request.method, request.url.path, content=body, headers=headers)
        reply = await client.send(req, stream=True)
        keep = {k: v for k, v in reply.headers.items() if k.lower() == "content-type"}
        return StreamingResponse(
            reply.aiter_raw(),
            status_code=reply.status_code,
            headers=keep,
            background=BackgroundTask(reply.aclose),
        )

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def chat_body(n: int, *, stream: bool = False, size: int = 0) -> bytes:
    content = f"call {n}: say hi" if not size else "x" * size
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 24,
        "stream": stream,
    }  # fmt: skip
    return json.dumps(body).encode()


class Client:
    """One keep-alive connection: a call's latency from request to the whole body."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = str(parts.hostname), int(parts.port or 80)
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def call(self, body: bytes) -> float:
        began = time.perf_counter()
        try:
            self.conn.request(
                "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            reply = self.conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # The server closed an idle keep-alive connection (uvicorn: after 5 s), as any
            # client sees it: connect again and send once more (nothing was answered).
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            began = time.perf_counter()
            self.conn.request(
                "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            reply = self.conn.getresponse()
        reply.read()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}")
        if reply.getheader("connection", "").lower() == "close" or reply.version == 10:
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        return time.perf_counter() - began

    def first_token(self, body: bytes) -> float:
        """Seconds to the first `data:` event of a stream (then reads it to the end)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        began = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        first = 0.0
        while line := reply.fp.readline():
            if line.startswith(b"data:") and not first:
                first = time.perf_counter() - began
            if line.strip() == b"data: [DONE]":
                break
        conn.close()
        return first


@dataclass
class Load:
    latencies: list[float]
    wall_s: float

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall_s


def load(url: str, *, concurrency: int, requests: int) -> Load:
    per = max(1, requests // concurrency)
    results: list[list[float]] = [[] for _ in range(concurrency)]
    clients = [Client(url) for _ in range(concurrency)]
    for c in clients:  # connect and warm each connection outside the timing
        c.call(chat_body(-1))

    def worker(i: int) -> None:
        for k in range(per):
            results[i].append(clients[i].call(chat_body(i * per + k)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    return Load([x for r in results for x in r], wall)


def pct(values: Sequence[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def hwm_mb(pid: int) -> float:
    """Peak resident memory of `pid` so far (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _one_stream(host: str, port: int, n: int) -> bool:
    reader, writer = await asyncio.open_connection(host, port)
    body = chat_body(n, stream=True)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return b"[DONE]" in data


async def _streams(url: str, count: int) -> int:
    parts = urlsplit(url)
    host, port = str(parts.hostname), int(parts.port or 80)
    done = await asyncio.gather(*(_one_stream(host, port, n) for n in range(count)))
    return sum(done)


async def _big(url: str, count: int, size: int) -> int:
    parts = urlsplit(url)
    host, port = str(parts.hostname), int(parts.port or 80)

    async def one(n: int) -> int:
        reader, writer = await asyncio.open_connection(host, port)
        body = chat_body(n, size=size)
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        writer.write(head + body)
        await writer.drain()
        data = await reader.read()
        writer.close()
        return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0

    statuses = await asyncio.gather(*(one(n) for n in range(count)))
    return sum(1 for s in statuses if s == 200)


def peak_under(
    spawn: Callable[[str, int], list[str]], what: str, work: Callable[[str], int]
) -> tuple[float, float, int]:
    """(idle RSS, peak RSS, work result) of a fresh forwarding process under `work`, in front
    of a fresh simulator (streams that last ~3 s each: 24 tokens at 8 tokens/s)."""
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    with process(sim(sim_port, decode_tps=8, speed=1), sim_url, "sim"):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with process(spawn(sim_url, port), url, what) as proc:
            idle = rss_mb(proc.pid)
            got = work(url)
            return idle, hwm_mb(proc.pid), got


@dataclass(frozen=True)
class Timing:
    """How long the simulator takes over a call: `decode_tps` tokens a second, time sped up
    `speed` times."""

    name: str
    decode_tps: float
    speed: float
    judged: bool  # the targets are checked on this timing


TIMINGS = (
    # A short real call: 24 tokens at 120 tokens/s, 0.2 s. What a loop's worker costs at the
    # least, so the ratios say what the gateway costs a loop.
    Timing("a 0.2 s call (24 tokens at 120 tok/s)", 120, 1, True),
    # Time compressed to the simulator's own overhead: every process on two shared cores
    # is CPU-bound, so the ratio is CPU per call, gateway or floor, against the simulator's.
    Timing("no model time (CPU per call only)", 60, 1e6, False),
)


def leg_load(
    name: str, spawn: Callable[[str, int], list[str]] | None, conc: int, requests: int,
    timing: Timing,
) -> Load:  # fmt: skip
    """One leg of one round against a fresh simulator (and a fresh forwarder in front of it):
    no process of the simulator serves more than one leg."""
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    with process(sim(sim_port, decode_tps=timing.decode_tps, speed=timing.speed), sim_url, "sim"):
        if spawn is None:
            return load(sim_url, concurrency=conc, requests=requests)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with process(spawn(sim_url, port), url, name):
            return load(url, concurrency=conc, requests=requests)


def load_legs(timing: Timing, conc: int, requests: int, rounds: int) -> bool:
    """Direct, floor and gateway in ABAB rounds; prints added latency and throughput. Whether
    the targets hold (always True on a timing that is not judged)."""
    spawners = {"floor": bare, "gateway": gateway}
    got: dict[str, list[Load]] = {k: [] for k in ("direct", "floor", "gateway")}
    for r in range(rounds):
        order = list(got) if r % 2 == 0 else list(reversed(got))
        for name in order:
            got[name].append(leg_load(name, spawners.get(name), conc, requests, timing))
    lat = {k: [x for g in v for x in g.latencies] for k, v in got.items()}
    rps = {k: sum(g.rps for g in v) / len(v) for k, v in got.items()}
    d50, d99 = pct(lat["direct"], 50), pct(lat["direct"], 99)
    print(f"  concurrency {conc}: {len(lat['direct'])} calls a leg, direct {rps['direct']:.0f}/s")
    ok = True
    for name in ("floor", "gateway"):
        a50 = (pct(lat[name], 50) - d50) * 1e3
        a99 = (pct(lat[name], 99) - d99) * 1e3
        ratio = rps[name] / rps["direct"]
        line = (
            f"    {name:<8} added p50 {a50:+6.2f} ms  p99 {a99:+6.2f} ms"
            f"  throughput {ratio:4.2f}x direct"
        )
        if name == "gateway" and timing.judged:
            held = a50 <= TARGET_P50_MS and a99 <= TARGET_P99_MS
            held_t = ratio >= TARGET_THROUGHPUT
            ok = held and held_t
            line += (
                f"  (latency {'holds' if held else 'MISSES'},"
                f" throughput {'holds' if held_t else 'MISSES'})"
            )
        print(line)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="calls per leg and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument(
        "--bare-proxy", nargs=2, metavar=("UPSTREAM", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.bare_proxy:
        bare_proxy(args.bare_proxy[0], int(args.bare_proxy[1]))
        return 0
    ok = True
    sim_port = free_port()
    sim_url = f"http://127.0.0.1:{sim_port}"
    for timing in TIMINGS:
        print(f"non-streamed chat completions, {timing.name}:")
        for conc in (1, 16):
            # A leg of a modelled call lasts as many calls as a few seconds of it hold.
            n = args.requests if timing.speed > 1 else min(args.requests, conc * 60)
            ok = load_legs(timing, conc, n, args.rounds) and ok
    # Streams: a modelled prefill and decode, so a first token has somewhere to be late from.
    with process(sim(sim_port, decode_tps=60, speed=20), sim_url, "sim"):
        gw_port, bare_port = free_port(), free_port()
        gw_url, bare_url = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{bare_port}"
        with (
            process(gateway(sim_url, gw_port), gw_url, "gateway"),
            process(bare(sim_url, bare_port), bare_url, "bare forwarder"),
        ):
            legs = {"direct": sim_url, "floor": bare_url, "gateway": gw_url}
            firsts: dict[str, list[float]] = {k: [] for k in legs}
            for n in range(60):
                order = list(legs) if n % 2 == 0 else list(reversed(legs))
                for name in order:
                    firsts[name].append(Client(legs[name]).first_token(chat_body(n, stream=True)))
            base = statistics.median(firsts["direct"])
            print(f"streamed first token: median direct {base * 1e3:.1f} ms (60 streams a leg)")
            for name in ("floor", "gateway"):
                delta = (statistics.median(firsts[name]) - base) * 1e3
                line = f"  {name:<8} first token {delta:+6.2f} ms vs direct"
                if name == "gateway":
                    held = abs(delta) <= TARGET_TTFT_MS
                    ok = ok and held
                    line += f"  ({'holds' if held else 'MISSES'}: within {TARGET_TTFT_MS:.0f} ms)"
                print(line)
    # Memory: a fresh simulator and forwarder per load, the streams all open at once.
    print("peak memory (VmHWM of a fresh forwarding process)")
    for name, spawn in (("floor", bare), ("gateway", gateway)):
        idle, peak, done = peak_under(
            spawn, name, lambda u: asyncio.run(_big(u, 4, 10 * 1024 * 1024))
        )
        print(f"  {name:<8} 4 x 10 MB bodies at once: idle {idle:5.1f} MB, peak {peak:6.1f} MB"
              f" ({done}/4 answered 200)")  # fmt: skip
        idle, peak, done = peak_under(spawn, name, lambda u: asyncio.run(_streams(u, args.streams)))
        print(f"  {name:<8} {args.streams} concurrent streams: idle {idle:5.1f} MB,"
              f" peak {peak:6.1f} MB ({done}/{args.streams} ended with [DONE])")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    finally:
        shutil.rmtree(LOG_DIR, ignore_errors=True)
