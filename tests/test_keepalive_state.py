"""The keeper's state machine (`verbs.keepalive.state`) by its transitions, without a server:
each state a kept head passes through, the cost rule and its back-off, the budget it learns,
refusals and worker errors, and the session a tracked body gives a head. The observations
fed in are what `KeepAlive` reads from a worker: a poll's count, a re-warm's record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prefixreg.core.digest import sha256_hex
from prefixreg.core.errors import WorkerHTTPError
from prefixreg.core.frame import Head
from prefixreg.core.judge import Verdict
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import CacheCounters, CallEvidence
from prefixreg.registry.store import Registry
from prefixreg.verbs.keepalive.rewarm import SnapshotRewarm
from prefixreg.verbs.keepalive.state import (
    BACKOFF_S,
    MAX_ERRORS,
    MAX_FAILURES,
    CounterKind,
    KeepState,
    Kept,
)
from prefixreg.verbs.measure.budget import Budget
from prefixreg.verbs.measure.calls import CallRecord

TEXT = "You are a careful assistant. " * 40
PREFIX = Prefix.from_text(sha256_hex(TEXT.encode()), TEXT)
OTHER_TEXT = "You review pull requests. " * 40
OTHER = Prefix.from_text(sha256_hex(OTHER_TEXT.encode()), OTHER_TEXT)


def stores_budget(limit: int = 6, per: int = 2) -> Budget:
    return Budget(limit, "stores", per, "test", "/cache")


def machine(
    *heads: Head,
    budget: Budget | None = None,
    counter: CounterKind | None = "stores",
    slots: int | None = None,
    restores: bool = False,
) -> KeepState:
    kept = {h.sha256: Kept(h, None) for h in heads or (PREFIX,)}
    return KeepState(
        kept=kept,
        budget=budget or stores_budget(),
        counter=counter,
        slots=slots,
        poll_s=0.5,
        restores=restores,
    )


def record(
    prompt: int = 1000,
    cached: int = 990,
    *,
    before: int | None = None,
    after: int | None = None,
    foreign: int = 0,
) -> CallRecord:
    """A re-warm's record: its counts and the `/cache` stores around it (a clean window
    unless `foreign` other requests hit the cache meanwhile)."""
    ev = CallEvidence(
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=1,
        cached_source="usage.prompt_tokens_details.cached_tokens",
        cache_state="reused" if cached else "cold",
        complete=True,
    )
    b = None if before is None else CacheCounters(stores=before, hits=0, misses=0)
    a = None if after is None else CacheCounters(stores=after, hits=1 + foreign, misses=0)
    return CallRecord("keepalive", "0" * 64, ev, b, a)


def poll(s: KeepState, total: float, *, restarted: bool = False) -> None:
    """A poll the worker answered: the counter's `total`."""
    assert s.polled(0.0, (total, restarted))


def rewarm(
    s: KeepState,
    kept: Kept,
    now: float,
    verdict: Verdict = "resumed",
    rec: CallRecord | None = None,
    **kw: Any,
) -> None:
    """Plan, then feed back a re-warm's record as `KeepAlive._rewarm` does around its I/O (on
    `/cache`, the counter after it is the record's closing snapshot)."""
    rec = rec or record()
    if s.counter == "stores" and rec.after is not None:
        kw["after"] = rec.after.stores
    s.rewarmed(kept, s.plan(kept, now), rec, verdict, now, **kw)


def test_a_fresh_head_is_due_its_first_warm_is_cold_by_nature_and_leaves_it_warm() -> None:
    s = machine()
    kept = s.kept[PREFIX.sha256]
    poll(s, 10)
    assert s.status(kept, 0.0) == "fresh"
    assert s.due(0.0) == [kept]
    plan = s.plan(kept, 0.0)
    assert plan.first and plan.since is None and plan.taken is None
    r = s.rewarmed(kept, plan, record(prompt=1000, cached=0, after=12), "cold", 1.0, after=12)
    assert r.since is None and r.verdict == "cold" and r.unit == "stores"
    assert kept.baseline == 12 and s.total == 12 and s.status(kept, 1.0) == "warm"
    # A first warm neither tightens the budget nor counts in the cost rule.
    assert s.budget.limit == 6 and s.summary.budget_changes == [] and s.outcomes == []
    assert s.summary.first_cold == 1 and s.summary.rewarms == 1


def test_a_warm_head_is_due_once_one_more_prompt_could_reach_the_budget() -> None:
    s = machine()
    kept = s.kept[PREFIX.sha256]
    poll(s, 0)
    rewarm(s, kept, 0.0, "cold", record(cached=0, after=0))
    poll(s, 2)  # one foreign prompt: 2 + 2 stores still under 6
    assert s.status(kept, 1.0) == "warm" and s.due(1.0) == []
    poll(s, 4)  # one more could reach it
    assert s.status(kept, 2.0) == "due" and s.due(2.0) == [kept]
    plan = s.plan(kept, 2.0)
    assert plan.since == 4 and not plan.first
    r = s.rewarmed(kept, plan, record(before=4, after=6), "resumed", 3.0, after=6)
    assert r.since == 4 and kept.baseline == 6 and s.status(kept, 3.0) == "warm"
    assert s.summary.resumed == 1 and s.summary.tokens_saved == 990


def test_time_counts_when_the_server_counts_nothing() -> None:
    s = machine(budget=Budget(60.0, "seconds", 0, "test"), counter=None)
    kept = s.kept[PREFIX.sha256]
    assert s.status(kept, 100.0) == "fresh" and s.due(100.0) == [kept]
    rewarm(s, kept, 100.0)
    assert kept.last_used == 100.0 and kept.baseline is None  # no counter: no baseline
    assert s.due(159.0) == [] and s.status(kept, 159.0) == "warm"
    assert s.due(160.0) == [kept]


def test_the_loops_own_calls_are_not_foreign_to_the_other_heads() -> None:
    s = machine(PREFIX, OTHER)
    mine, other = s.kept[PREFIX.sha256], s.kept[OTHER.sha256]
    poll(s, 0)
    rewarm(s, mine, 0.0, rec=record(before=0, after=2))
    assert other.baseline is None  # never warmed: nothing to discount
    rewarm(s, other, 0.0, rec=record(before=2, after=4))
    assert mine.baseline == 2 + 2  # our re-warm of the other head stored 2: not foreign
    s.touch(PREFIX.sha256, 5.0)  # the loop used it
    poll(s, 8)  # the loop's call stored 2, a foreign prompt 2
    assert s.due(5.0) == []
    assert mine.baseline == 8  # its baseline taken at this poll
    assert (
        s.kept[OTHER.sha256].baseline == 4 + 2
    )  # the loop's call taken off the other head's count
    assert s.since(other, 5.0) == 2


def test_a_touched_head_whose_slot_still_serves_the_call_waits_for_a_later_poll() -> None:
    s = machine(budget=Budget(1, "prompts", 1, "test", "/slots"), counter="prompts", slots=4)
    kept = s.kept[PREFIX.sha256]
    poll(s, 0)
    rewarm(s, kept, 0.0, after=0, landed={2})
    assert kept.slot == 2 and kept.baseline == 0
    s.touch(PREFIX.sha256, 1.0)
    poll(s, 3)
    assert s.due(1.0, busy={2}) == []  # its slot is busy (the loop's call): not yet
    assert kept.baseline == 0 and s.touched == {PREFIX.sha256}
    assert s.due(1.5, landed={2}) == []  # the slot counted it: the baseline is taken now
    assert kept.baseline == 3 and s.touched == set()


def test_a_restart_loses_every_head_a_first_warm_again_restored_when_it_can() -> None:
    prompts = Budget(1, "prompts", 1, "test", "/slots")
    s = machine(PREFIX, OTHER, budget=prompts, counter="prompts", slots=4, restores=True)
    mine, other = s.kept[PREFIX.sha256], s.kept[OTHER.sha256]
    poll(s, 0)
    rewarm(s, mine, 0.0, after=1, landed={1})
    rewarm(s, other, 0.0, after=2, landed={2})
    assert (mine.slot, other.slot) == (1, 2)
    poll(s, 2, restarted=True)  # a counter went backwards: nothing is cached now
    assert all(s.status(k, 1.0) == "lost" for k in (mine, other))
    assert mine.baseline is None and mine.slot is None
    assert s.due(1.0) == [mine, other]
    plan = s.plan(mine, 1.0)
    assert plan.first and plan.taken == frozenset()  # every head is lost: no slot is held
    check = record(prompt=1000, cached=1000)
    snap = SnapshotRewarm("restored", "ok", slot=3, restore_s=0.1, prefill_tokens=1000, check=check)
    assert not s.leave(mine, snap)
    r = s.rewarmed(mine, plan, check, "resumed", 2.0, snap=snap, after=3, landed={3})
    assert r.snapshot is not None and r.snapshot["verdict"] == "restored"
    assert s.summary.restored == 1 and s.summary.prefill_tokens_avoided == 1000
    assert s.status(mine, 2.0) == "warm" and s.kept[PREFIX.sha256].slot == 3
    assert s.plan(other, 2.0).taken == frozenset({3})  # not where the restored head is


def test_an_evicted_head_is_restored_or_left_to_the_loop_never_re_prefilled() -> None:
    prompts = Budget(1, "prompts", 1, "test", "/slots")
    s = machine(PREFIX, OTHER, budget=prompts, counter="prompts", slots=2, restores=True)
    mine, other = s.kept[PREFIX.sha256], s.kept[OTHER.sha256]
    poll(s, 0)
    rewarm(s, mine, 0.0, after=1, landed={0})
    rewarm(s, other, 0.0, after=2, landed={1})
    s.touch(PREFIX.sha256, 0.5)  # the loop tells its calls: the others are foreign
    poll(s, 3)
    assert s.due(0.5, landed={0}) == [] and mine.baseline == 3 and other.baseline == 3
    poll(s, 4)  # a foreign prompt ended in the other head's slot
    assert s.due(1.0, landed={1}) == [mine, other]
    assert other.evicted and not mine.evicted and s.status(other, 1.0) == "evicted"
    plan = s.plan(other, 1.0)
    assert plan.taken == frozenset({0, 1})  # restore it where no kept head (nor it) may be
    miss = SnapshotRewarm("not_proven", "the check was cold")
    assert s.leave(other, miss)  # not restored: left to the loop, nothing sent
    assert s.status(other, 1.0) == "left" and other.left == 4
    assert s.summary.left_to_loop == 1 and s.summary.restore_misses == 1
    assert not s.leave(mine, None)  # not evicted: re-warmed
    poll(s, 5)
    assert other not in s.due(2.0)  # left: 1 prompt since; it takes max(2 slots, 1 + 1)
    poll(s, 6)
    assert (
        other in s.due(3.0) and s.kept[OTHER.sha256].left is None
    )  # as long again: due (not gone)
    assert s.since(other, 3.0) == 1 and not s.kept[OTHER.sha256].evicted


def test_the_cost_rule_backs_off_then_one_probe_decides() -> None:
    s = machine(budget=stores_budget(limit=100, per=2))
    kept = s.kept[PREFIX.sha256]
    poll(s, 0)
    rewarm(s, kept, 0.0, rec=record(after=2))  # the first warm: not in the cost rule
    t, total = 0.0, 2
    for _ in range(3):  # each keeps 100 tokens warm and spends 900: it does not pay
        total += 98
        t += 1.0
        poll(s, total)
        assert s.due(t) == [kept]
        rewarm(s, kept, t, rec=record(prompt=1000, cached=100, after=total))
    total += 98
    poll(s, total)
    assert s.due(t + 1) == []  # backing off, and said why
    assert s.summary.backoffs == 1 and s.summary.backoff_reason is not None
    why = "3 of the last 3 re-warms kept; 300 tokens kept warm <= 2,700 tokens of prefill spent"
    assert s.summary.backoff_reason == why
    assert s.due(t + 1 + BACKOFF_S - 0.1) == []
    assert s.due(t + 1 + BACKOFF_S) == [kept]  # one probe
    rewarm(s, kept, t + 2 + BACKOFF_S, "partial", record(prompt=1000, cached=100, after=total))
    assert s.summary.backoffs == 2  # not kept: a longer back-off
    assert s.gate_until == pytest.approx(t + 2 + 3 * BACKOFF_S)
    later = s.gate_until
    poll(s, total + 98)
    assert s.due(later) == [kept]  # the next probe
    rewarm(s, kept, later, rec=record(prompt=1000, cached=990, after=total + 98))
    assert s.level == 0 and len(s.outcomes) == 1  # kept: afresh from it


def test_a_miss_tightens_the_budget_and_starts_the_cost_rule_afresh() -> None:
    s = machine(budget=stores_budget(limit=20, per=2))
    kept = s.kept[PREFIX.sha256]
    poll(s, 0)
    rewarm(s, kept, 0.0, rec=record(after=0))
    poll(s, 2)
    rewarm(s, kept, 1.0, rec=record(prompt=1000, cached=100, after=2))
    assert s.outcomes == [(100, 900)]
    poll(s, 20)
    rewarm(s, kept, 2.0, "cold", record(prompt=1000, cached=0, before=20, after=22))
    assert s.budget.limit == 9 and s.budget.source == "tightened after a cold re-warm"
    assert s.summary.budget_changes == [
        "budget 20 -> 9 stores: a re-warm after 18 stores came back cold"
    ]
    assert s.outcomes == []  # older outcomes speak of the old budget


def test_a_burst_between_two_polls_is_said_only_more_entries_can_help() -> None:
    s = machine(budget=stores_budget(limit=6, per=2))
    kept = s.kept[PREFIX.sha256]
    poll(s, 0)
    rewarm(s, kept, 0.0, rec=record(after=0))
    poll(s, 8)  # 8 stores landed between two polls; a head survives 6
    rewarm(s, kept, 1.0, "cold", record(prompt=1000, cached=0, before=8, after=10))
    assert s.summary.bursts == 1 and s.summary.burst_landed == 8
    assert s.summary.burst_survives == 6 and s.summary.burst_unit == "stores"


def test_a_stores_rebase_counts_only_what_our_request_stored() -> None:
    s = machine(PREFIX, OTHER)
    mine, other = s.kept[PREFIX.sha256], s.kept[OTHER.sha256]
    poll(s, 0)
    rewarm(s, other, 0.0, rec=record(after=0))
    poll(s, 10)
    rewarm(s, mine, 1.0, rec=record(before=10, after=13))  # a clean window: 3 of ours
    assert other.baseline == 3 and mine.baseline == 13 and s.budget.per_request == 3
    rewarm(s, mine, 2.0, rec=record(before=13))  # no closing snapshot: ours assumed
    assert mine.baseline == 13 + 3 and other.baseline == 6 and s.total == 13


def test_refusals_back_a_head_off_drop_its_session_then_give_it_up() -> None:
    s = machine()
    kept = s.kept[PREFIX.sha256]
    kept.session = [{"role": "user", "content": "hi"}]
    exc = WorkerHTTPError("HTTP 400: bad request", status_code=400)
    poll(s, 0)
    assert s.refused(kept, exc, 10.0) is None
    assert kept.retry_at == 10.0 + 0.5 * 2 and s.status(kept, 10.5) == "backing off"
    assert s.due(10.5) == [] and s.due(11.0) == [kept]
    for _ in range(MAX_FAILURES - 2):
        assert s.refused(kept, exc, 11.0) is None
    note = s.refused(kept, exc, 11.0)
    assert note is not None and "its session dropped" in note
    assert s.kept[PREFIX.sha256].session is None
    assert kept.failures == 0 and kept.given_up is None
    assert s.summary.to_dict()["stopped_by_worker"] is False
    for _ in range(MAX_FAILURES - 1):
        assert s.refused(kept, exc, 12.0) is None
    note = s.refused(kept, exc, 12.0)
    assert note is not None and note.endswith("no longer kept")
    assert s.status(kept, 1e9) == "given up" and s.due(1e9) == []
    assert s.summary.dropped == [s.summary.dropped[0], note]
    assert s.summary.stopped_by_worker and s.summary.stopped_because is not None
    assert s.summary.errors == 2 * MAX_FAILURES


def test_a_re_warm_answered_ends_the_heads_refusal_streak_a_poll_does_not() -> None:
    s = machine()
    kept = s.kept[PREFIX.sha256]
    poll(s, 0)
    s.refused(kept, WorkerHTTPError("HTTP 400", status_code=400), 0.0)
    poll(s, 0)
    assert kept.failures == 1  # an answered poll is not an answered re-warm
    rewarm(s, kept, 5.0, rec=record(after=2))
    assert kept.failures == 0


def test_worker_errors_in_a_row_stop_the_keeper_an_answered_poll_ends_the_streak() -> None:
    s = machine()
    for _ in range(MAX_ERRORS - 1):
        s.polled(0.0, "error")
    poll(s, 0)
    assert s.errors == 0
    for i in range(MAX_ERRORS):
        assert not s.summary.stopped_by_worker
        s.worker_error(float(i), backoff=False)
    assert s.summary.stopped_because == f"{MAX_ERRORS} worker errors in a row"
    assert s.summary.errors == 2 * MAX_ERRORS - 1
    assert s.summary.skipped_polls == MAX_ERRORS - 1


def test_a_busy_poll_waits_longer_each_time_capped() -> None:
    s = machine()
    waits = []
    for _ in range(8):
        s.polled(100.0, "busy")
        waits.append(s.backoff_until - 100.0)
    assert waits[:3] == [1.0, 2.0, 4.0] and waits[-1] == 30.0
    assert s.summary.errors == 0 and s.summary.skipped_polls == 8
    assert not s.polled(100.0, "empty")  # nothing to count: skipped, no wait added
    assert s.backoff_until == 130.0 and s.summary.polls == 9


def test_a_prompt_running_holds_every_re_warm() -> None:
    s = machine(budget=Budget(1, "prompts", 1, "test", "/slots"), counter="prompts", slots=4)
    poll(s, 0)
    assert s.due(0.0, busy={3}) == []  # a re-warm now would race it
    assert len(s.due(0.5)) == 1


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "reg")
    registry.add(TEXT, name="system")
    tools = json.dumps([{"type": "function", "function": {"name": "run_tests"}}])
    registry.add_frame("system", tools=tools, name="loop")
    return registry


def test_a_tracked_body_is_the_session_of_the_head_it_sends_unchanged(reg: Registry) -> None:
    frame, prefix = reg.frame("loop"), reg.get("system")
    s = machine(prefix, frame)
    history = [{"role": "user", "content": "run the tests"}]
    assert s.track(frame.body(history, model="m"), 3.0) == frame.sha256
    assert s.kept[frame.sha256].session == history and s.kept[prefix.sha256].session is None
    assert s.touched == {frame.sha256} and s.kept[frame.sha256].last_used == 3.0
    kwargs = prefix.body([]) | {"extra_body": {"cache_prompt": True}}  # openai kwargs
    assert s.track(kwargs, 4.0) == prefix.sha256
    assert s.kept[prefix.sha256].session is None  # the head alone: no history to re-touch
    other_tools = prefix.body(history) | {"tools": [{"type": "function"}]}
    assert s.track(other_tools, 5.0) is None  # the frame's tools differ; a prefix sends none
    drifted = {"messages": [{"role": "system", "content": "another prompt"}, *history]}
    assert s.track(drifted, 6.0) is None
    no_role = prefix.body([]) | {"messages": [*prefix.body([])["messages"], {"content": "x"}]}
    assert s.track(no_role, 6.0) is None  # nothing the keeper could re-send


def test_a_session_is_re_touched_by_its_re_warms_and_counted(reg: Registry) -> None:
    prefix = reg.get("system")
    s = machine(prefix)
    history = [{"role": "user", "content": "hi"}]
    s.track(prefix.body(history), 1.0)
    poll(s, 0)
    kept = s.kept[prefix.sha256]
    plan = s.plan(kept, 1.0)
    assert plan.session == history
    s.rewarmed(kept, plan, record(after=2), "resumed", 2.0)
    assert s.summary.sessions == 1 and kept.baseline == 2
    s.rewarmed(kept, s.plan(kept, 3.0), record(after=4), "resumed", 3.0)
    assert s.summary.sessions == 2 and s.summary.rewarms == 2
