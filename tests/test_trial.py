"""`Trial`, the one measuring path: its calls chained by `/cache`, judged against the span the
server counted on this build, its record filed under the head; against the simulator."""

from __future__ import annotations

from pathlib import Path

import orjson

from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimServer
from prefixreg.verbs.measure.trial import Trial
from prefixreg.verbs.measure.warm import warm

SYSTEM = "You are a careful coding agent. Keep every test honest and every change small.\n" * 30


def test_a_trials_calls_are_bracketed_by_one_chain_of_cache_snapshots(
    sim: SimServer, registry: Registry
) -> None:
    head = registry.get(registry.add(SYSTEM))
    with Worker(sim.url) as worker:
        trial = Trial(registry, worker, head)
        first, second = trial.call("warm"), trial.call("check")
    assert first.record.after is not None
    assert second.record.before == first.record.after  # one snapshot between two calls
    assert trial.last == second.record.after
    assert first.verdict == "cold" and second.verdict == "resumed", second.judgement.reason
    assert first.record.tail_sha256 != second.record.tail_sha256  # a fresh tail each call


def test_a_trial_judges_against_the_span_its_build_counted_and_files_under_the_head(
    sim: SimServer, registry: Registry
) -> None:
    head = registry.get(registry.add(SYSTEM))
    with Worker(sim.url) as worker:
        proven = warm(registry, head, worker)
        assert proven.verdict == "resumed", proven.reason
        trial = Trial(registry, worker, head)
        counted = proven.calls[-1].evidence.cached_tokens
        assert trial.span == counted  # the resumed check's count, read once
        step = trial.call("check")
        assert step.judgement.span_source == "measured" and step.judgement.span == counted
        measurement, path = trial.finish("warm", {"verdict": step.verdict, "reason": "test"})
    assert measurement.kind == "warm" and measurement.sha256 == head.sha256
    on_disk = orjson.loads(Path(path).read_bytes())
    assert on_disk["build"]["build_id"] == trial.build.build_id
    assert "frame" not in on_disk["body"]  # a bare prefix names no frame


def test_a_trial_without_a_registry_reads_no_span_and_its_build_is_checked_again(
    sim: SimServer, registry: Registry
) -> None:
    head = registry.get(registry.add(SYSTEM))
    with Worker(sim.url) as worker:
        trial = Trial(None, worker, head)
        assert trial.span is None
        assert trial.changed() is None
        assert trial.same_build("resumed", "why") == ("resumed", "why")
