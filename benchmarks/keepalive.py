"""keepalive benchmark: an agent loop under foreign traffic, with and without keepalive.

Against the simulator with the measured Flash-lane defaults (8-entry LRU, 2 entries per
prompt: a prefix survives 3 foreign prompts), a loop sends one call with a ~8k-token prefix
every `--period` seconds while a foreign tenant sends distinct prompts at two rates. Reported
per rate, from the server's own usage:

- the resumed fraction of the loop's prompt tokens, without and with keepalive
  (target: >= 0.95 with keepalive wherever it is below 0.5 without);
- keepalive's extra prefill tokens (its re-warms' uncached prompt + completion tokens) as a
  share of the prompt tokens it saved the loop (target: <= 5%).

With `--engine llama` the same loop runs against a real llama.cpp `llama-server` with a
deliberately small cache (`tests.peer.llama_peer`, two slots and no RAM cache: a prefix
survives one foreign prompt). The loop's prefix is ~1,500 tokens, the tenant's prompts are
~150 tokens with a leading nonce (so llama.cpp's similarity-based slot choice does not
herd them into one slot), and the loop calls every `--period` seconds (default 3) with
about 2 and 4 foreign prompts in between. Keepalive counts prompts from `/slots` and, with
no probe receipt, re-warms after every foreign prompt. Takes about three minutes.

Run: `python benchmarks/keepalive.py [--calls 20]`, or
`python benchmarks/keepalive.py --engine llama [--calls 8]` (the peer must install: its
wheel is kept under `~/.cache/prefixreg-peer`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefixreg.core.prefix import fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.loop import LoopStats
from prefixreg.verbs.probe.options import builtin_corpus


@dataclass
class Run:
    stats: LoopStats
    spent: int = 0
    rewarms: int = 0


def sim_prompt(n: int) -> str:
    return f"Tenant job {n}: an unrelated system prompt. " * 30


_TENANT_TEXT = builtin_corpus(20_000, seed=7)


def llama_prompt(n: int) -> str:
    """~150 tokens; the number leads, so two tenant prompts share only template tokens."""
    offset = (n * 613) % (len(_TENANT_TEXT) - 600)
    return f"{n * 7919 % 100_003} tenant job. " + _TENANT_TEXT[offset : offset + 550]


def tenant(url: str, rate_hz: float, stop: threading.Event, prompt: Callable[[int], str]) -> None:
    """A foreign tenant: distinct prompts starting at `rate_hz` (paced by start time, so a
    slow prompt does not lower the rate), until stopped."""
    with Worker(url) as w:
        n = 0
        began = time.monotonic()
        while not stop.is_set():
            n += 1
            w.chat(prompt(n), "go", max_tokens=1)
            stop.wait(max(0.0, began + n / rate_hz - time.monotonic()))


def run(
    url: str,
    reg: Registry,
    *,
    rate_hz: float,
    calls: int,
    period: float,
    keep: bool,
    prompt: Callable[[int], str] = sim_prompt,
    poll_s: float = 0.005,
) -> Run:
    prefix = reg.get("loop")
    stop = threading.Event()
    thread = threading.Thread(target=tenant, args=(url, rate_hz, stop, prompt), daemon=True)
    stats = LoopStats()
    with Worker(url) as loop, Worker(url, timeout=2.0) as poller:
        loop.chat(prefix, fresh_tail(), max_tokens=1)  # the loop's first call warms it
        keeper = KeepAlive(poller, [prefix], poll_s=poll_s) if keep else None
        if keeper is not None:
            keeper.touch(prefix.sha256)  # just used: no first warm racing the loop's
            keeper.start()
        thread.start()
        try:
            for _ in range(calls):
                time.sleep(period)
                _, ev = loop.chat(prefix, fresh_tail(), max_tokens=8)
                stats.add(ev)
                if keeper is not None:
                    keeper.touch(prefix.sha256)
        finally:
            stop.set()
            thread.join(timeout=30)
            summary = keeper.stop() if keeper is not None else None
    if summary is None:
        return Run(stats)
    return Run(stats, spent=summary.tokens_spent, rewarms=summary.rewarms)


@contextmanager
def llama_engine() -> Iterator[str]:
    """The small-cache llama-server of the test peer, stopped by its pid on exit."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for `tests.peer`
    from tests.peer.llama_peer import SMALL_CACHE_FLAGS, start

    server = start(SMALL_CACHE_FLAGS)
    try:
        yield server.url
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("sim", "llama"), default="sim")
    parser.add_argument("--calls", type=int, default=None, help="loop calls per run (20; 8)")
    parser.add_argument(
        "--period", type=float, default=None, help="seconds between loop calls (0.25; 3)"
    )
    parser.add_argument("--speed", type=float, default=50.0, help="simulator time compression")
    args = parser.parse_args()
    llama = args.engine == "llama"
    calls = args.calls or (8 if llama else 20)
    period = args.period or (3.0 if llama else 0.25)
    # Foreign prompts between two loop calls: 2x and 5x the simulator's survival (3), or
    # 2x and 4x llama-server's (1 with two slots and no RAM cache).
    counts = (2, 4) if llama else (6, 16)
    ok = True
    with (
        tempfile.TemporaryDirectory() as tmp,
        llama_engine() if llama else SimServer(SimConfig(speed=args.speed)) as engine,
    ):
        url = engine if isinstance(engine, str) else engine.url
        reg = Registry(Path(tmp) / "reg")
        reg.add(builtin_corpus(6_000 if llama else 40_000), name="loop")
        where = "llama-server -np 2 --cache-ram 0" if llama else f"sim x{args.speed:g}"
        print(f"loop: one call every {period:g} s, {calls} calls; {where}")
        prompt = llama_prompt if llama else sim_prompt
        # Every /slots read is a task on llama-server's queue: poll it at 20 Hz, not 200.
        poll_s = 0.05 if llama else 0.005
        for per_call in counts:
            rate = per_call / period
            without = run(
                url,
                reg,
                rate_hz=rate,
                calls=calls,
                period=period,
                keep=False,
                prompt=prompt,
                poll_s=poll_s,
            )
            with_ka = run(
                url,
                reg,
                rate_hz=rate,
                calls=calls,
                period=period,
                keep=True,
                prompt=prompt,
                poll_s=poll_s,
            )
            f0 = without.stats.resumed_fraction or 0.0
            f1 = with_ka.stats.resumed_fraction or 0.0
            saved = with_ka.stats.cached_tokens - without.stats.cached_tokens
            share = with_ka.spent / saved if saved > 0 else float("inf")
            target_ok = (f1 >= 0.95 or f0 >= 0.5) and share <= 0.05
            ok &= target_ok
            print(
                f"~{per_call:>2} foreign prompts between calls: resumed fraction without "
                f"{f0:.3f}, with {f1:.3f}; keepalive spent {with_ka.spent:,} tokens in "
                f"{with_ka.rewarms} re-warms for {saved:,} saved = {share:.2%}  "
                f"{'ok' if target_ok else 'MISSED'}"
            )
    print("all targets met" if ok else "some targets missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
