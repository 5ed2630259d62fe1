"""`probe` and `keepalive` against a real llama.cpp `llama-server` (issue 7).

The servers are the session fixtures of `tests.peer.fixtures`: `llama_server` (one slot,
`-c 8192`) and `llama_server_small_cache` (two slots, `--cache-ram 0`: a just-used prefix
survives one foreign prompt and is gone after two). llama.cpp has no `/cache`, so the
probe's counter checks are `n/a` and keepalive counts prompts from `/slots`.

Everything asserted comes from the server's own counts (`cached_tokens`), never from
timing. Prefixes are ~300-500 tokens, so a cold call costs 1-2 s on two cores; the whole
module runs in well under two minutes. These tests need the engine: if it cannot be
installed or started they fail, never skip.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.core.records import CallEvidence
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.loop import LoopStats
from prefixreg.verbs.probe.options import ProbeOptions
from prefixreg.verbs.probe.run import run_probe
from tests.conftest import run_cli
from tests.peer.llama_peer import PeerServer

# The first test may pay the install inside its session fixture (see test_llama_server).
pytestmark = pytest.mark.timeout(900)

_WORDS = (
    *("ledger", "harbor", "quartz", "violet", "meadow", "copper", "signal", "lantern"),
    *("orbit", "willow", "granite", "falcon", "ember", "tundra", "saffron", "beacon"),
)


def prose(seed: int, words: int, *, title: str) -> str:
    """Deterministic text, about 1.1 tokens a word on Gemma's tokenizer."""
    rng = random.Random(seed)
    return f"{title} {seed}: " + " ".join(rng.choice(_WORDS) for _ in range(words)) + "\n"


class Tenant:
    """Another tenant of the worker: distinct prompts (~130 tokens) that share nothing with
    the loop's prefix or with each other but the chat template's first tokens."""

    def __init__(self, url: str, seed: int) -> None:
        self.worker = Worker(url)
        self.seed = seed
        self.sent = 0

    def send(self, n: int = 1) -> None:
        for _ in range(n):
            self.sent += 1
            text = prose(self.seed + self.sent, 110, title=f"{self.seed + self.sent} weather log")
            self.worker.chat(text, "hello", max_tokens=1, temperature=0)

    def close(self) -> None:
        self.worker.close()


def covered(ev: CallEvidence, prefix_tokens: int) -> bool:
    """The call's cached count covers the prefix (less the template slack): resumed."""
    return ev.cached_tokens is not None and ev.cached_tokens >= prefix_tokens - 32


@pytest.fixture
def loop_reg(tmp_path: Path) -> Registry:
    reg = Registry(tmp_path / "reg")
    reg.add(prose(11, 420, title="Loop brief"), name="loop")
    return reg


def run_loop(
    url: str, prefix: Prefix, keeper: KeepAlive | None, *, calls: int, foreign: int, seed: int
) -> list[CallEvidence]:
    """`calls` loop calls, `foreign` tenant prompts before each; the keeper steps after
    every tenant prompt (a poll between prompts, as its thread would make)."""
    tenant = Tenant(url, seed)
    out: list[CallEvidence] = []
    try:
        with Worker(url) as loop:
            for _ in range(calls):
                for _ in range(foreign):
                    tenant.send()
                    if keeper is not None:
                        keeper.step()
                _, ev = loop.chat(prefix, fresh_tail(), max_tokens=2, temperature=0)
                assert ev.cache_state != "unverified", ev.reason
                out.append(ev)
                if keeper is not None:
                    keeper.touch(prefix.sha256)
                    keeper.step()
    finally:
        tenant.close()
    return out


def test_probe_on_llamacpp_reports_b_resumes_and_checks_not_available(
    llama_server: PeerServer, tmp_path: Path
) -> None:
    llama_server.erase_slots()
    reg = tmp_path / "reg"
    res = run_cli(
        *("probe", "--worker", llama_server.url, "--registry", str(reg)),
        *("--sizes", "1k,2k", "--foreign", "1", "--foreign-chars", "500", "--json"),
    )
    assert res.returncode == 0, (res.stdout, res.stderr)
    receipt: dict[str, Any] = orjson.loads(res.stdout)
    assert receipt["build"]["profile"] == "llamacpp"
    assert receipt["checks_not_available"] == [1, 2, 3, 4, 5, 6]
    assert all("no /cache counters" in c["detail"] for c in receipt["checks"])
    assert any("no /cache counters" in line for line in receipt["follows"])
    legs = {(c["leg"], c["size"]): c for c in receipt["calls"]}
    for size in (1000, 2000):
        b = legs[("B", size)]
        assert b["verdict"] == "resumed", b
        assert b["evidence"]["cache_state"] == "reused"
        assert b["coverage"] >= 0.9
        a1 = legs[("A1", size)]
        # "Cold" on llama.cpp may reuse the template's first tokens: the judge calls that
        # cold or partial, with a coverage that says it did not cover the prefix.
        assert a1["verdict"] in ("cold", "partial") and a1["coverage"] < 0.1, a1
        # One slot, no RAM cache: one foreign prompt evicts the prefix, and C says so.
        assert legs[("C", size)]["verdict"] in ("cold", "partial")
    assert receipt["cmax"] >= legs[("B", 2000)]["evidence"]["cached_tokens"] > 400
    md = Path(receipt["md_path"]).read_text()
    assert "(llamacpp, build" in md and "| resumed |" in md


def test_survival_on_the_small_cache_is_one_and_keepalive_takes_it_as_budget(
    llama_server_small_cache: PeerServer, loop_reg: Registry
) -> None:
    llama_server_small_cache.erase_slots()
    with Worker(llama_server_small_cache.url) as w:
        options = ProbeOptions(sizes=(1000,), foreign=1, foreign_chars=500, survival=True)
        report = run_probe(loop_reg, w, options)
        assert report.outcome == "ok"
        assert report.survival == 1, report.survival_trials
        keeper = KeepAlive(w, [loop_reg.get("loop")], registry=loop_reg)
    assert keeper.budget.unit == "prompts" and keeper.budget.counter == "/slots"
    assert keeper.budget.prompts == 1
    assert keeper.budget.source == f"probe {report.run_id} (survival 1)"


def test_keepalive_keeps_the_loop_resumed_where_foreign_prompts_evict_it(
    llama_server_small_cache: PeerServer, loop_reg: Registry
) -> None:
    url = llama_server_small_cache.url
    prefix = loop_reg.get("loop")
    llama_server_small_cache.erase_slots()
    with Worker(url) as w:
        _, first = w.chat(prefix, fresh_tail(), max_tokens=1, temperature=0)
    assert first.prompt_tokens is not None
    span = first.prompt_tokens - 20  # the prefix's tokens: all but the tail and template end

    # Two foreign prompts between loop calls: the second takes the prefix's slot (LRU).
    without = run_loop(url, prefix, None, calls=3, foreign=2, seed=1000)
    assert not any(covered(ev, span) for ev in without), [ev.cached_tokens for ev in without]
    assert all((ev.cached_tokens or 0) < 40 for ev in without)

    with Worker(url, timeout=5.0) as kw:
        keeper = KeepAlive(kw, [prefix])
        assert keeper.budget.counter == "/slots" and keeper.budget.prompts == 1
        assert keeper.budget.source.startswith("default")
        keeper.step()  # the first warm
        with_ka = run_loop(url, prefix, keeper, calls=4, foreign=2, seed=2000)
    assert all(covered(ev, span) for ev in with_ka), [ev.cached_tokens for ev in with_ka]
    s = keeper.summary
    # One re-warm per foreign prompt (after each, the prefix has used its one survival).
    assert s.rewarms >= 1 + 4 * 2 - 1, str(s)
    assert s.resumed >= s.rewarms - 1 and s.cold <= 1, str(s)
    assert all(r.unit == "prompts" for r in keeper.history)
    assert [r.since for r in keeper.history[1:]] == [1] * (len(keeper.history) - 1)
    # Extra prefill: a fresh tail per re-warm, against a whole prefix saved per loop call.
    assert s.tokens_spent < 0.25 * sum(ev.cached_tokens or 0 for ev in with_ka)


def test_threaded_keepalive_against_a_concurrent_tenant(
    llama_server_small_cache: PeerServer, loop_reg: Registry
) -> None:
    url = llama_server_small_cache.url
    prefix = loop_reg.get("loop")
    llama_server_small_cache.erase_slots()
    stop = threading.Event()

    sent = [0]  # the tenant's prompts so far: the loop paces itself by them, not by a clock

    def tenant() -> None:
        t = Tenant(url, 3000)
        try:
            while not stop.is_set():
                began = time.monotonic()
                t.send()
                sent[0] += 1
                # Gaps between prompts: room for a poll and a re-warm, which the keeper never
                # sends while a prompt runs; on a loaded machine a prompt takes longer, so
                # the gap grows with it. (With two slots a loop call that arrives while both
                # are busy, one of them with the keeper's re-warm, is served from the other
                # slot: a miss keepalive cannot prevent.)
                stop.wait(max(0.7, 2 * (time.monotonic() - began)))
        finally:
            t.close()

    stats = LoopStats(head=prefix)
    evidence: list[CallEvidence] = []
    with (
        Worker(url, timeout=5.0) as kw,
        KeepAlive(kw, [prefix], poll_s=0.05) as keeper,
        Worker(url) as loop,
    ):
        _, first = loop.chat(prefix, fresh_tail(), max_tokens=1, temperature=0)
        keeper.touch(prefix.sha256)
        thread = threading.Thread(target=tenant, daemon=True)
        thread.start()
        try:
            for _ in range(5):
                until, deadline = sent[0] + 2, time.monotonic() + 120
                while sent[0] < until and time.monotonic() < deadline:  # two tenant prompts
                    time.sleep(0.05)
                tail = fresh_tail()
                _, ev = loop.chat(prefix, tail, max_tokens=2, temperature=0)
                evidence.append(stats.add(ev, body={"messages": prefix.messages(tail)}))
                keeper.touch(prefix.sha256)
        finally:
            stop.set()
            thread.join(timeout=30)
    assert first.prompt_tokens is not None
    span = first.prompt_tokens - 20
    hits = sum(covered(ev, span) for ev in evidence)
    assert hits >= 4, [ev.cached_tokens for ev in evidence]
    assert keeper.summary.rewarms >= 3 and keeper.summary.stopped_because is None


def test_cli_keepalive_on_llamacpp_counts_prompts(
    llama_server_small_cache: PeerServer, loop_reg: Registry
) -> None:
    res = run_cli(
        *("keepalive", "loop", "--worker", llama_server_small_cache.url),
        *("--registry", str(loop_reg.root), "--duration", "1", "--poll", "0.1", "--json"),
    )
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["budget"]["unit"] == "prompts" and out["budget"]["counter"] == "/slots"
    assert out["rewarms"] == 1  # the first warm; no foreign prompt since, so no other
    (m,) = [m for m in loop_reg.measurements() if m.kind == "keepalive"]
    assert m.body["since_prompts"] is None and m.build.profile == "llamacpp"


def test_pool_on_llamacpp_refuses_two_spellings_of_one_worker_and_proves_what_it_keeps(
    llama_server_small_cache: PeerServer, loop_reg: Registry
) -> None:
    # Issue 20 case 2: `--worker U --worker U/v1` counted a 2-slot server twice (capacity 4).
    url, root = llama_server_small_cache.url, str(loop_reg.root)
    res = run_cli(
        "pool", "warm", "loop", "--worker", url, "--worker", f"{url}/v1", "--registry", root
    )
    assert res.returncode == 2 and b"listed twice" in res.stderr, res.stderr
    llama_server_small_cache.erase_slots()
    res = run_cli("pool", "warm", "loop", "--worker", url, "--registry", root, "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["capacity"] == 2 and [h["resident"] for h in out["workers"][0]["holds"]] == [True]
    check = run_cli("warm", "loop", "--check-only", "--worker", url, "--registry", root)
    assert check.returncode == 0, check.stdout
