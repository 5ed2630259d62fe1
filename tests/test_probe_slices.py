"""Probe slices: marked in their meta, hidden from `ls`, never audit's shared prefix, kept by
the receipts that list them (`gc --prune-unnamed`). Real files, the simulator, real CLI."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from prefixreg.core.errors import UsageError
from prefixreg.registry.gc import collect_garbage
from prefixreg.registry.names import receipt_shas
from prefixreg.registry.objects import is_probe_source
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.audit.identity import PromptSeen, check_identity, system_prompt
from prefixreg.verbs.audit.report import PrefixSpan
from prefixreg.verbs.audit.run import Known, match_prefix, run_audit
from prefixreg.verbs.probe.options import ProbeOptions
from prefixreg.verbs.probe.run import ProbeReport, run_probe
from tests.conftest import run_cli
from tests.test_audit import Row, _call, response

USER = "You are a careful coding agent.\n" * 200
MONTH = 30 * 86400.0


@pytest.fixture
def probed(tmp_path: Path) -> Iterator[tuple[Registry, ProbeReport]]:
    """A registry holding one named user prefix and one probe run's slices."""
    reg = Registry(tmp_path / "reg")
    reg.add(USER, name="coding-loop")
    with SimServer(SimConfig(speed=5000)) as sim, Worker(sim.url) as w:
        report = run_probe(reg, w, ProbeOptions(sizes=(4000, 8000), foreign=2))
    yield reg, report


def slice_shas(report: ProbeReport) -> set[str]:
    return {c.sha256 for c in report.calls if c.leg in ("A1", "A2", "B", "C")}


def test_probe_registers_every_slice_as_a_probe_slice(
    probed: tuple[Registry, ProbeReport],
) -> None:
    reg, report = probed
    slices = slice_shas(report)
    assert len(slices) == 2
    for sha in slices:
        meta = reg.meta(sha)
        assert meta.source == f"probe/{report.run_id}"
        assert reg.is_probe_slice(sha)
        assert reg.get(sha).sha256 == sha  # the same verified object as any prefix
    user = reg.resolve("coding-loop")
    assert not reg.is_probe_slice(user)
    flags = {o.sha256: o.probe_slice for o in reg.list_objects()}
    assert flags == {user: False} | dict.fromkeys(slices, True)
    assert verify_registry(reg).ok  # format v1: the meta records are ordinary ones


def test_the_probe_label_is_reserved_and_the_old_label_still_recognised(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    with pytest.raises(UsageError, match="reserved"):
        reg.add("text", source="probe/forged")
    assert not reg.exists  # refused before anything was written
    old = reg.add("old slice", source="probe", note="probe 20250101T000000Z-ab12")
    plain = reg.add("a file named probe", source="probe")  # `prefixreg add ./probe`
    assert reg.is_probe_slice(old) and not reg.is_probe_slice(plain)
    assert not reg.is_probe_slice("f" * 64)  # no meta record: not a slice
    assert is_probe_source("probe/x") and not is_probe_source("probe.txt", "probe run")
    with pytest.raises(UsageError):
        reg.add_probe_slice("text", run_id="\udcff")


def test_ls_hides_probe_slices_unless_asked(probed: tuple[Registry, ProbeReport]) -> None:
    reg, report = probed
    slices = slice_shas(report)
    root = str(reg.root)
    plain = run_cli("ls", "--registry", root)
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.decode().splitlines()
    assert len(lines) == 1 and "coding-loop" in lines[0]
    assert b"2 probe slices hidden" in plain.stderr
    listing = orjson.loads(run_cli("ls", "--all", "--json", "--registry", root).stdout)
    assert {e["sha256"]: e["probe_slice"] for e in listing} == {
        reg.resolve("coding-loop"): False
    } | dict.fromkeys(slices, True)
    only = orjson.loads(run_cli("ls", "--probe", "--json", "--registry", root).stdout)
    assert {e["sha256"] for e in only} == slices
    text_all = run_cli("ls", "-a", "--registry", root)
    assert len(text_all.stdout.decode().splitlines()) == 3 and b"hidden" not in text_all.stderr
    # A slice the user names is theirs: listed (still marked) without --all.
    named = sorted(slices)[0]
    reg.move_name("kept-slice", named)
    again = run_cli("ls", "--registry", root)
    out = again.stdout.decode()
    assert "kept-slice  [probe]" in out and len(out.splitlines()) == 2
    assert b"1 probe slice hidden" in again.stderr


def test_gc_keeps_the_slices_a_receipt_lists_and_prunes_the_rest(
    probed: tuple[Registry, ProbeReport],
) -> None:
    reg, report = probed
    slices = slice_shas(report)
    (_path, raw), *_ = reg.probe_receipts()
    assert slices <= (receipt_shas(raw) or set())
    orphan = reg.add_probe_slice("a slice no receipt lists", run_id="gone")
    unnamed = reg.add("an unnamed user prefix")
    # A month on: every object and measurement is older than the grace period.
    later = time.time() + MONTH
    report_gc = collect_garbage(reg, grace_s=86400, prune_unnamed=True, now=later)
    removed = {item.path for item in report_gc.removed if item.kind == "object"}
    assert removed == {f"objects/{s[:2]}/{s}.txt" for s in (orphan, unnamed)}
    for sha in slices:
        assert report_gc.kept[sha] == "a probe receipt refers to it"
        assert reg.get(sha).sha256 == sha
    assert reg.resolve("coding-loop")
    assert verify_registry(reg).ok


def test_a_receipt_that_does_not_parse_keeps_every_probe_slice(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    slice_sha = reg.add_probe_slice("slice of an unreadable run", run_id="r1")
    unnamed = reg.add("an unnamed user prefix")
    reg.write_probe_receipt("20250101T000000.000000Z", lambda _j, _m: (b"{not json", b"# v\n"))
    report = collect_garbage(reg, grace_s=0, prune_unnamed=True, now=time.time() + MONTH)
    assert report.kept[slice_sha] == "a probe receipt refers to it"
    assert [i.path for i in report.removed if i.kind == "object"] == [
        f"objects/{unnamed[:2]}/{unnamed}.txt"
    ]


def test_match_never_names_a_probe_slice() -> None:
    probe_sha, user_sha, marked = "a" * 64, "b" * 64, "c" * 64
    spans = [
        PrefixSpan(probe_sha, "b1", 10_000, 0, "2025-01-02T00:00:00Z", "probe-B"),
        PrefixSpan(marked, "b1", 10_005, 0, "2025-01-02T00:00:00Z", "warm"),
        PrefixSpan(user_sha, "b1", 10_020, 0, "2025-01-01T00:00:00Z", "warm"),
    ]
    known = Known(probe_slices=frozenset({marked}))
    m = match_prefix([_call(10_000)], spans, known=known)
    assert m is not None and m.sha256 == user_sha  # the closer probe spans are not candidates
    assert match_prefix([_call(10_000)], spans[:2], known=known) is None
    # Records of a probe slice name no shared prefix either.
    assert match_prefix([_call(10_000, sha=probe_sha, build="b1")], spans) is None
    own = [_call(10_000, sha=marked, build="b1")]
    assert match_prefix(own, spans, known=known) is None


def test_audit_of_probe_traffic_names_no_shared_prefix(
    probed: tuple[Registry, ProbeReport], tmp_path: Path
) -> None:
    reg, report = probed
    b = next(c for c in report.calls if c.leg == "B" and c.size == 8000)
    cached = b.record.evidence.cached_tokens
    assert cached
    batch = tmp_path / "calls.jsonl"
    rows = [orjson.dumps(response(Row(cached + 30, cached, 5))) for _ in range(3)]
    batch.write_bytes(b"\n".join(rows) + b"\n")
    audit = run_audit([batch], registry=reg)
    assert audit.prefix is None
    text = run_cli("audit", "--registry", str(reg.root), str(batch))
    assert b.sha256[:12].encode() not in text.stdout


def test_identity_prefers_the_users_prefix_over_a_probe_slice() -> None:
    def seen(i: int, text: str) -> PromptSeen:
        request = {"messages": [{"role": "system", "content": text}]}
        return PromptSeen(f"r{i}", system_prompt(request))

    slice_text, user_text = "probe slice text", USER
    prompts = [seen(0, slice_text), seen(1, slice_text), seen(2, user_text)]
    every = lambda _sha, _size: ()  # noqa: E731 -- both registered
    probe_sha = prompts[0].system.sha256
    ident = check_identity(prompts, every, {probe_sha} if probe_sha else set())
    assert ident is not None and ident.batch_sha == prompts[2].system.sha256
    assert not ident.batch_probe_slice
    only = check_identity(prompts[:2], every, {probe_sha} if probe_sha else set())
    assert only is not None and only.batch_probe_slice
    assert "a probe slice" in only.text_lines()[0]
