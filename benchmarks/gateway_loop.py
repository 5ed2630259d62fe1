"""gateway loop benchmark: a real third-party loop keeps its cache with a tenant beside it.

mini-swe-agent (PyPI, through litellm; `tests.loops`) runs against a real llama-server with
two slots and no RAM cache (`-np 2 --cache-ram 0`: a prompt survives one foreign prompt, not
two) while a second client, the tenant, sends distinct ~150-token prompts after each of the
loop's calls, `--gap` seconds (the loop's tool time; by default 1.5x a cold prefill of the
loop's size, measured first, so a re-warm fits in it; 0.5 s on the direct legs, where no
keeper waits for it) before its next one. Printed per leg,
from the server's own counts as litellm hands them to the loop: the loop's cached share (the
sum of `cached_tokens` over the sum of `prompt_tokens` of its calls). Legs:

- `alone`: the loop direct, no tenant (the share to reach);
- `direct, tenant`: both direct, the tenant's two prompts one after the other;
- `gateway, tenant direct`: the loop through `prefixreg gateway --keep-warm`, the tenant
  direct as before (its second prompt takes the loop's slot; the gateway saved that slot
  after the loop's call and restores it in the tool time);
- `gateway, tenant burst`: both through `prefixreg gateway --keep-warm --own-slots`, the
  tenant's two prompts at once right after each loop call (the loop's session owns a slot);
- `nonce`, `nonce --strip`, `no nonce`: a small loop of our own whose `system[0]` carries a
  per-request nonce line (Claude Code's billing header), through the gateway without and
  with `--strip`, and the same loop without the nonce.

Legs run in ABAB order (`--runs` rounds, the second reversed) from erased slots, so drifting
machine load weighs on each. Targets (issue 32): the gateway legs within 0.05 of `alone`;
`nonce --strip` within 0.05 of `no nonce`. Prints shares and differences, never times.

Gateway legs also print the loop's share from the gateway's call log (its session's lines),
which must agree with what litellm handed the loop.

Run: `python benchmarks/gateway_loop.py [--steps 6] [--runs 2] [--only loop|nonce]`
(installs the llama peer when needed; several minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for `tests.*`
from prefixreg.verbs.probe.options import builtin_corpus
from tests.gateway_peer import serve_gateway
from tests.loops import STRIP, messages_loop, run_mini_swe_agent
from tests.peer.llama_peer import PeerServer, start

# Two slots, no host-RAM cache, 8,192 tokens a slot: the loop's history fits, and a slot a
# foreign prompt takes is really gone (reference llama-server.md §4.2).
FLAGS = (
    *("-c", "16384", "-np", "2", "-t", "2", "-tb", "2"),
    *("--swa-full", "--cache-ram", "0", "--metrics"),
)
TARGET = 0.05
_TEXT = builtin_corpus(40_000, seed=11)


def tenant_prompt(n: int) -> str:
    """~150 tokens; a number leads, so two tenant prompts share only template tokens."""
    offset = (n * 613) % (len(_TEXT) - 600)
    return f"{n * 7919 % 100_003} tenant job. " + _TEXT[offset : offset + 550]


class Tenant:
    """A second client: plain chat completions, distinct prompts, one token each."""

    def __init__(self, url: str, *, burst: bool) -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.burst = burst
        self.sent = 0
        self._client = httpx.Client(timeout=120.0)

    def _one(self, n: int) -> None:
        body = {
            "model": "peer",
            "messages": [{"role": "user", "content": tenant_prompt(n)}],
            "max_tokens": 1,
            "temperature": 0,
        }
        self._client.post(self.url, json=body).raise_for_status()

    def two(self) -> None:
        """Two foreign prompts: one after the other, or both at once (`burst`)."""
        first, second = self.sent + 1, self.sent + 2
        self.sent += 2
        if not self.burst:
            self._one(first)
            self._one(second)
            return
        threads = [threading.Thread(target=self._one, args=(n,)) for n in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def close(self) -> None:
        self._client.close()


@dataclass(frozen=True)
class Leg:
    name: str
    gateway: tuple[str, ...] | None  # the gateway's flags, or None: the loop goes direct
    tenant: str  # "none" | "direct" | "gateway-burst"


LEGS = (
    Leg("alone", None, "none"),
    Leg("direct, tenant", None, "direct"),
    Leg("gateway, tenant direct", ("--keep-warm",), "direct"),
    Leg("gateway, tenant burst", ("--keep-warm", "--own-slots"), "gateway-burst"),
)
NONCE_LEGS: tuple[tuple[str, bool, tuple[str, ...]], ...] = (
    ("no nonce", False, ()),
    ("nonce", True, ()),
    ("nonce --strip", True, ("--strip", STRIP)),
)


def pacer(tenant: Tenant | None, gap_s: float) -> Callable[[], None]:
    def after_call() -> None:
        if tenant is not None:
            tenant.two()
        time.sleep(gap_s)

    return after_call


@contextmanager
def maybe_gateway(server: PeerServer, flags: tuple[str, ...] | None, log: Path) -> Iterator[str]:
    if flags is None:
        yield server.url
        return
    with serve_gateway("--worker", server.url, "--call-log", str(log), *flags) as url:
        yield url


def log_share(log: Path, session: str) -> float:
    """The loop's cached share from the gateway's call log (its session's lines)."""
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    mine = [ln["evidence"] for ln in lines if ln["gateway"]["session"] == session]
    prompt = sum(int(e["prompt_tokens"] or 0) for e in mine)
    return sum(int(e["cached_tokens"] or 0) for e in mine) / prompt if prompt else 0.0


def run_leg(server: PeerServer, leg: Leg, tmp: Path, *, steps: int, gap_s: float) -> str:
    server.erase_slots()
    log = tmp / f"calls-{time.monotonic_ns()}.jsonl"
    with maybe_gateway(server, leg.gateway, log) as url:
        tenant = None
        if leg.tenant != "none":
            burst = leg.tenant == "gateway-burst"
            tenant = Tenant(url if burst else server.url, burst=burst)
        # Tool time only matters where a keeper must re-warm in it: direct legs skip the wait.
        gap = gap_s if leg.gateway is not None else 0.5
        try:
            run = run_mini_swe_agent(url, steps=steps, seed=1, after_call=pacer(tenant, gap))
        finally:
            if tenant is not None:
                tenant.close()
    out = f"{run.cached_share:6.1%} ({run.cached_tokens:,}/{run.prompt_tokens:,})"
    if leg.gateway is not None:
        session = run.calls[-1].headers.get("x-prefixreg-session", "")
        out += f"  call log {log_share(log, session):6.1%}"
    SHARES.setdefault(leg.name, []).append(run.cached_share)
    return out


def run_nonce_leg(server: PeerServer, name: str, nonce: bool, flags: tuple[str, ...],
                  tmp: Path, *, turns: int) -> str:  # fmt: skip
    server.erase_slots()
    log = tmp / f"nonce-{time.monotonic_ns()}.jsonl"
    with serve_gateway("--worker", server.url, "--call-log", str(log), *flags) as url:
        replies = messages_loop(url, nonce=nonce, turns=turns, max_tokens=8)
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    prompt = sum(int(ln["evidence"]["prompt_tokens"] or 0) for ln in lines)
    share = sum(int(ln["evidence"]["cached_tokens"] or 0) for ln in lines) / prompt
    SHARES.setdefault(name, []).append(share)
    drift = replies[1].headers.get("x-prefixreg-drift", "none") if len(replies) > 1 else "none"
    return f"{share:6.1%}  second call's drift: {drift}"


SHARES: dict[str, list[float]] = {}


def cold_prefill_s(server: PeerServer) -> float:
    """Seconds of one cold call about the size of the loop's prompts (~900 tokens)."""
    server.erase_slots()
    body = {
        "model": "peer",
        "messages": [{"role": "user", "content": " ".join(tenant_prompt(-n) for n in range(6))}],
        "max_tokens": 1,
    }
    began = time.monotonic()
    httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()
    return time.monotonic() - began


@contextmanager
def engine() -> Iterator[PeerServer]:
    server = start(FLAGS)
    try:
        yield server
    finally:
        server.stop()


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def verdict(name: str, ref: str) -> str:
    gap = mean(SHARES[ref]) - mean(SHARES[name])
    return f"{ref} - this = {gap:+.3f} ({'holds' if gap <= TARGET else 'MISSES'})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="model calls per loop run")
    parser.add_argument("--runs", type=int, default=2, help="ABAB rounds (even: balanced)")
    parser.add_argument(
        "--gap", type=float, help="tool time after each call, s (default: 1.5x a cold prefill)"
    )
    parser.add_argument("--only", choices=("loop", "nonce"), help="run one part")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, engine() as server:
        if args.gap is None:  # a re-warm needs the time of one cold prefill of the loop's size
            args.gap = max(0.5, round(1.5 * cold_prefill_s(server), 1))
        print(
            f"llama-server {' '.join(FLAGS[:4])} --cache-ram 0 (Gemma 3 270M);"
            f" {args.steps} calls a run, tool time {args.gap} s, {args.runs} ABAB rounds"
        )
        if args.only != "nonce":
            print("mini-swe-agent via litellm; tenant: 2 foreign prompts after each loop call")
            for r in range(args.runs):
                order = LEGS if r % 2 == 0 else tuple(reversed(LEGS))
                for leg in order:
                    got = run_leg(server, leg, Path(tmp), steps=args.steps, gap_s=args.gap)
                    print(f"  round {r + 1} {leg.name:<24} loop cached share {got}")
        if args.only != "loop":
            print("a Claude-Code-like Messages loop through the gateway, a request id in system[0]")
            for r in range(args.runs):
                legs = NONCE_LEGS if r % 2 == 0 else tuple(reversed(NONCE_LEGS))
                for label, nonce, flags in legs:
                    got = run_nonce_leg(server, label, nonce, flags, Path(tmp), turns=args.steps)
                    print(f"  round {r + 1} {label:<24} cached share {got}")
    print("cached share, mean over rounds (target: within 0.05 of the reference)")
    ok = True
    for name, ref in (
        ("alone", None), ("direct, tenant", None), ("gateway, tenant direct", "alone"),
        ("gateway, tenant burst", "alone"), ("no nonce", None), ("nonce", None),
        ("nonce --strip", "no nonce"),
    ):  # fmt: skip
        if name not in SHARES:
            continue
        runs = " ".join(f"{s:.1%}" for s in SHARES[name])
        line = f"  {name:<24} {mean(SHARES[name]):6.1%}  [{runs}]"
        if ref is not None:
            line += "  " + verdict(name, ref)
            ok = ok and mean(SHARES[ref]) - mean(SHARES[name]) <= TARGET
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
