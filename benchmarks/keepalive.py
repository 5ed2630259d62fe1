"""keepalive benchmark: an agent loop under foreign traffic, with and without keepalive.

Against the simulator with the measured Flash-lane defaults (8-entry LRU, 2 entries per
prompt: a prefix survives 3 foreign prompts), a loop sends one call with a ~8k-token prefix
every `--period` seconds while a foreign tenant sends distinct prompts at two rates. Reported
per rate, from the server's own usage:

- the resumed fraction of the loop's prompt tokens, without and with keepalive
  (target: >= 0.95 with keepalive wherever it is below 0.5 without);
- keepalive's extra prefill tokens (its re-warms' uncached prompt + completion tokens) as a
  share of the prompt tokens it saved the loop (target: <= 5%).

Run: `python benchmarks/keepalive.py [--calls 20]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prefixreg.corpus import builtin_corpus
from prefixreg.keepalive import KeepAlive
from prefixreg.loopstats import LoopStats
from prefixreg.prefix import fresh_tail
from prefixreg.sim import SimConfig, SimServer
from prefixreg.store import Registry
from prefixreg.worker import Worker


@dataclass
class Run:
    stats: LoopStats
    spent: int = 0
    rewarms: int = 0


def tenant(url: str, rate_hz: float, stop: threading.Event) -> None:
    """A foreign tenant: distinct prompts at `rate_hz`, until stopped."""
    with Worker(url) as w:
        n = 0
        while not stop.is_set():
            n += 1
            w.chat(f"Tenant job {n}: an unrelated system prompt. " * 30, "go", max_tokens=1)
            stop.wait(1.0 / rate_hz)


def run(url: str, reg: Registry, *, rate_hz: float, calls: int, period: float, keep: bool) -> Run:
    prefix = reg.get("loop")
    stop = threading.Event()
    thread = threading.Thread(target=tenant, args=(url, rate_hz, stop), daemon=True)
    stats = LoopStats()
    with Worker(url) as loop, Worker(url, timeout=2.0) as poller:
        keeper = KeepAlive(poller, [prefix], poll_s=0.005) if keep else None
        if keeper is not None:
            keeper.start()
        loop.chat(prefix, fresh_tail(), max_tokens=1)  # the loop's first call warms it
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="loop calls per run")
    parser.add_argument("--period", type=float, default=0.25, help="seconds between loop calls")
    parser.add_argument("--speed", type=float, default=50.0, help="simulator time compression")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp, SimServer(SimConfig(speed=args.speed)) as sim:
        reg = Registry(Path(tmp) / "reg")
        reg.add(builtin_corpus(40_000), name="loop")
        print(f"loop: one call every {args.period:g} s, {args.calls} calls; sim x{args.speed:g}")
        for per_call in (6, 16):  # foreign prompts between two loop calls: 2x and 5x survival
            rate = per_call / args.period
            without = run(
                sim.url, reg, rate_hz=rate, calls=args.calls, period=args.period, keep=False
            )
            with_ka = run(
                sim.url, reg, rate_hz=rate, calls=args.calls, period=args.period, keep=True
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
