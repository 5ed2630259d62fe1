"""keepalive keeps the loop's session on a real llama.cpp `llama-server` (issue 23): session
tracking (`Session` / `track` and `--session FILE`), restore after an eviction, a loop whose
own calls trigger no re-warm, and two heads on a 2-slot server that do not thrash.

The server is the session fixture `llama_server_small_cache` (`-np 2 --cache-ram 0`: a
just-used prompt survives one foreign prompt and is gone after two). Everything asserted
comes from the server's own counts. The head is ~470 tokens and each turn adds ~180, so a
cold call costs a few seconds on two busy cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from prefixreg import Session
from prefixreg.core.errors import UsageError
from prefixreg.core.records import CallEvidence
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.snapshot.run import save_snapshot
from tests.conftest import run_cli
from tests.peer.llama_peer import PeerServer
from tests.test_llama_probe_keepalive import Tenant, prose

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parent.parent
RESULT = "FAILED test_parser line 42 expected 3 got 4\n" * 8  # a tool result, ~160 tokens


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "reg")
    registry.add(prose(11, 420, title="Loop brief"), name="loop")
    registry.add(prose(12, 420, title="Other brief"), name="other")
    return registry


def turns(
    url: str,
    session: Session,
    *,
    n: int,
    foreign: int,
    keeper: KeepAlive | None = None,
    gap_s: float = 0.0,
) -> list[CallEvidence]:
    """`n` loop turns on `session`'s head, `foreign` tenant prompts before each (the keeper,
    if any, steps after each; else it runs in its thread and `gap_s` gives it room)."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    out, tenant = [], Tenant(url, 7000 + 100 * n + foreign)
    try:
        with Worker(url) as loop:
            for turn in range(n):
                for _ in range(foreign):
                    tenant.send()
                    if keeper is not None:
                        keeper.step()
                    time.sleep(gap_s)
                body = session.body(history, max_tokens=4, temperature=0)
                _, ev = loop.chat(session.head, history=history, max_tokens=4, temperature=0)
                assert ev.cache_state != "unverified", ev.reason
                out.append(ev)
                session.sent(body)
                if keeper is not None:
                    keeper.step()
                history.append({"role": "assistant", "content": f"Running the tests, {turn}."})
                history.append({"role": "user", "content": f"Tool result {turn}:\n{RESULT}"})
    finally:
        tenant.close()
    return out


def whole(evs: list[CallEvidence]) -> list[tuple[int | None, int | None]]:
    """(cached, the previous call's prompt) per call after the first: resumed whole when
    the cached count reaches the previous prompt."""
    return [(b.cached_tokens, a.prompt_tokens) for a, b in pairwise(evs)]


def test_a_tracked_session_is_resumed_whole_between_foreign_prompts(
    llama_server_small_cache: PeerServer, reg: Registry
) -> None:
    url, head = llama_server_small_cache.url, reg.head("loop")
    llama_server_small_cache.erase_slots()
    with Worker(url, timeout=5.0) as kw:
        keeper = KeepAlive(kw, [head], registry=reg)
        keeper.step()  # the first warm
        evs = turns(url, Session(head, keeper=keeper), n=4, foreign=2, keeper=keeper)
    pairs = whole(evs)
    assert all(c is not None and p is not None and c >= p - 4 for c, p in pairs), pairs
    s = keeper.summary
    assert s.sessions >= 5 and s.resumed >= s.rewarms - 1 and s.backoffs == 0, str(s)


def test_the_loops_own_calls_trigger_no_rewarm(
    llama_server_small_cache: PeerServer, reg: Registry
) -> None:
    url, head = llama_server_small_cache.url, reg.head("loop")
    llama_server_small_cache.erase_slots()
    with Worker(url, timeout=5.0) as kw:
        keeper = KeepAlive(kw, [head])
        keeper.step()
        evs = turns(url, Session(head, keeper=keeper), n=4, foreign=0, keeper=keeper)
        for _ in range(3):
            keeper.step()
    assert keeper.summary.rewarms == 1, str(keeper.summary)  # the first warm only
    pairs = whole(evs)
    assert all(c is not None and p is not None and c >= p - 4 for c, p in pairs), pairs


def test_an_evicted_head_without_a_snapshot_is_left_to_the_loop_not_re_prefilled(
    llama_server_small_cache: PeerServer, reg: Registry
) -> None:
    # Never slower: re-prefilling an evicted head costs what the loop's next call saves.
    url, head = llama_server_small_cache.url, reg.head("loop")
    llama_server_small_cache.erase_slots()
    with Worker(url, timeout=5.0) as kw, Worker(url) as loop:
        keeper = KeepAlive(kw, [head])
        keeper.step()  # the first warm
        session = Session(head, keeper=keeper)
        a, b = Tenant(url, 9100), Tenant(url, 9200)
        burst = [threading.Thread(target=t.send) for t in (a, b)]  # both slots at once
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        assert keeper.step() == [] and keeper.summary.left_to_loop == 1, str(keeper.summary)
        evs = []
        for _ in range(2):  # the loop prefills it itself, then resumes it
            body = session.body([{"role": "user", "content": "What next?"}], max_tokens=2)
            evs.append(loop.chat(head, "What next?", max_tokens=2)[1])
            session.sent(body)
            keeper.step()
        a.send()  # one foreign prompt: the head is kept again
        done = keeper.step()
        a.close()
        b.close()
    assert [(ev.cached_tokens or 0) >= 400 for ev in evs] == [False, True], evs
    assert [r.verdict for r in done] == ["resumed"], str(keeper.summary)
    s = keeper.summary
    assert (s.rewarms, s.cold, s.left_to_loop) == (2, 1, 1), str(s)  # first warm; the last


def test_two_heads_on_two_slots_do_not_thrash_and_a_third_is_refused(
    llama_server_small_cache: PeerServer, reg: Registry
) -> None:
    url = llama_server_small_cache.url
    loop, other = reg.head("loop"), reg.head("other")
    llama_server_small_cache.erase_slots()
    with Worker(url, timeout=5.0) as kw:
        reg.add(prose(13, 50, title="Third"), name="third")
        with pytest.raises(UsageError, match="3 heads on 2 slots"):
            KeepAlive(kw, [loop, other, reg.head("third")])
        keeper = KeepAlive(kw, [loop, other])
        keeper.step()  # both first warms
        a, b = Session(loop, keeper=keeper), Session(other, keeper=keeper)
        evs = []
        for _ in range(3):  # two loops, one per head, take turns
            evs += turns(url, a, n=1, foreign=0, keeper=keeper)
            evs += turns(url, b, n=1, foreign=0, keeper=keeper)
        for _ in range(5):
            keeper.step()
    s = keeper.summary
    assert s.rewarms == 2 and s.cold == 2, str(s)  # the first warms, and nothing after
    assert all((ev.cached_tokens or 0) >= 400 for ev in evs), [ev.cached_tokens for ev in evs]


def test_a_head_evicted_by_a_burst_comes_back_from_its_snapshot(
    llama_server_small_cache: PeerServer, reg: Registry
) -> None:
    url, head = llama_server_small_cache.url, reg.head("loop")
    slots = Path(
        llama_server_small_cache.argv[llama_server_small_cache.argv.index("--slot-save-path") + 1]
    )
    llama_server_small_cache.erase_slots()
    with Worker(url, timeout=30.0) as kw:
        save_snapshot(reg, head, kw, slot_dir=slots)
        keeper = KeepAlive(kw, [head], registry=reg)
        keeper.step()  # the first warm
        a, b = Tenant(url, 8100), Tenant(url, 8200)
        burst = [threading.Thread(target=t.send) for t in (a, b)]  # both slots at once
        for t in burst:
            t.start()
        for t in burst:
            t.join()
        a.close()
        b.close()
        done = keeper.step()
    assert [r.verdict for r in done] == ["resumed"], done
    assert done[0].snapshot is not None and done[0].snapshot["verdict"] == "restored"
    s = keeper.summary
    assert s.restored == 1 and s.cold == 0, str(s)  # no prefill: the save left it warm
    with Worker(url) as w:  # the loop's next call resumes the restored head
        _, ev = w.chat(head, "What next?", max_tokens=2, temperature=0)
    assert (ev.cached_tokens or 0) >= 400, ev


def test_cli_session_file_on_llamacpp_and_sigterm(
    llama_server_small_cache: PeerServer, reg: Registry, tmp_path: Path
) -> None:
    url, head = llama_server_small_cache.url, reg.head("loop")
    log = tmp_path / "session.jsonl"
    llama_server_small_cache.erase_slots()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "prefixreg", "keepalive", "loop", "--worker", url),
            *("--registry", str(reg.root), "--session", str(log), "--poll", "0.05"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        time.sleep(6.0)  # started, first warm done
        evs = turns(url, Session(head, log=log), n=4, foreign=2, gap_s=1.0)
        time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert b"re-touched the loop's session" in out, out
    pairs = whole(evs)
    assert sum(c is not None and p is not None and c >= p - 4 for c, p in pairs) >= 2, pairs


def test_two_copies_keep_two_concurrent_loop_calls_resumed(
    llama_server_small_cache: PeerServer, reg: Registry
) -> None:
    url, head = llama_server_small_cache.url, reg.head("loop")

    def two_at_once() -> list[CallEvidence]:
        got: list[CallEvidence] = []

        def call() -> None:
            with Worker(url) as w:
                got.append(w.chat(head, "What next?", max_tokens=2, temperature=0)[1])

        calls = [threading.Thread(target=call) for _ in range(2)]
        for t in calls:
            t.start()
        for t in calls:
            t.join()
        return got

    llama_server_small_cache.erase_slots()
    with Worker(url, timeout=5.0) as kw:
        KeepAlive(kw, [head]).step()  # one copy
        one = two_at_once()
        llama_server_small_cache.erase_slots()
        keeper = KeepAlive(kw, [head], copies=2)
        assert [r.verdict for r in keeper.step()] == ["cold", "cold"]  # one per slot
        both = two_at_once()
        with pytest.raises(UsageError, match="2 heads x 2 copies on 2 slots"):
            KeepAlive(kw, [head, reg.head("other")], copies=2)
    assert sorted((ev.cached_tokens or 0) >= 400 for ev in one) == [False, True], one
    assert all((ev.cached_tokens or 0) >= 400 for ev in both), both
    # `warm --copies 2` does the same before a loop starts.
    llama_server_small_cache.erase_slots()
    res = run_cli("warm", "loop", "--copies", "2", "--worker", url, "--registry", str(reg.root))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(b"copy in slot") == 2 and b": resumed" in res.stdout, res.stdout
    warmed = two_at_once()
    assert all((ev.cached_tokens or 0) >= 400 for ev in warmed), warmed
