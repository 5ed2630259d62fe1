"""`verify` checks snapshot records and `gc` knows them, on real files.

verify: each record parses strictly, its file name matches its prefix sha and build id,
and its prefix object exists (`bad_record`, `dangling`; other entries are `unexpected`).
gc: a record keeps its prefix object from `--prune-unnamed` as a name does (even a record
that no longer parses, by its file name); nothing under `snapshots/` is removed unless
`--prune-snapshots` is given, and then only records whose prefix is gone, older than the
grace.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import orjson

from prefixreg.registry.gc import collect_garbage
from prefixreg.registry.snapshots import write_snapshot
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from tests.conftest import run_cli
from tests.test_snapshots import BUILD, make_record, snapshot_record_path

DAY = 86400.0


def _age(path: Path, seconds: float) -> None:
    moment = time.time() - seconds
    os.utime(path, (moment, moment), follow_symlinks=False)


def _snapshots(reg: Registry) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((reg.root / "snapshots").iterdir())}


def test_verify_accepts_good_records_and_reports_bad_and_dangling_ones(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    kept = reg.add("a prefix with a snapshot\n", name="p")
    other = reg.add("another prefix\n", name="q")
    write_snapshot(reg, make_record(kept))
    assert verify_registry(reg).ok, verify_registry(reg).findings

    gone = "e" * 64  # a record of a prefix that is not in the registry
    write_snapshot(reg, make_record(gone))
    moved = snapshot_record_path(reg, other, BUILD.build_id)  # p's record under q's name
    moved.write_bytes(snapshot_record_path(reg, kept, BUILD.build_id).read_bytes())
    extra = orjson.loads(snapshot_record_path(reg, kept, BUILD.build_id).read_bytes())
    extra["n_saved"] = "1153"  # strict parsing: a count as a string is not a count
    strict = snapshot_record_path(reg, "f" * 64, BUILD.build_id)
    strict.write_bytes(orjson.dumps({**extra, "sha256": "f" * 64}))
    garbage = snapshot_record_path(reg, "d" * 64, BUILD.build_id)
    garbage.write_bytes(b"{not json")
    (reg.root / "snapshots" / "notes.txt").write_bytes(b"hello")

    report = verify_registry(reg)
    found = {(f.kind, f.path.removeprefix("snapshots/")) for f in report.findings}
    assert found == {
        ("dangling", gone + f"-{BUILD.build_id}.json"),
        ("bad_record", moved.name),
        ("bad_record", strict.name),
        ("bad_record", garbage.name),
        ("unexpected", "notes.txt"),
    }
    assert not report.ok
    res = run_cli("verify", "--registry", str(reg.root), "--json")
    assert res.returncode == 1
    kinds = sorted(f["kind"] for f in orjson.loads(res.stdout)["findings"])
    assert kinds == ["bad_record", "bad_record", "bad_record", "dangling", "unexpected"]


def test_prune_unnamed_keeps_a_prefix_a_snapshot_record_points_to(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    snapped = reg.add("unnamed, but snapshotted\n")
    broken = reg.add("unnamed, its record no longer parses\n")
    loose = reg.add("unnamed and unreferenced\n")
    write_snapshot(reg, make_record(snapped))
    snapshot_record_path(reg, broken, BUILD.build_id).write_bytes(b"{truncated")
    for sha in (snapped, broken, loose):
        _age(reg.object_path(sha), 30 * DAY)
    before = _snapshots(reg)

    report = collect_garbage(reg, grace_s=14 * DAY, prune_unnamed=True)
    removed = {i.path for i in report.removed}
    assert any(loose in p for p in removed)
    assert not any(snapped in p or broken in p for p in removed)
    assert report.kept[snapped] == "a snapshot record points to it"
    assert report.kept[broken] == "a snapshot record points to it"
    assert reg.read_verified(snapped) and reg.read_verified(broken)
    assert _snapshots(reg) == before  # records are not touched without --prune-snapshots


def test_gc_removes_snapshot_records_only_when_asked_and_their_prefix_is_gone(
    tmp_path: Path,
) -> None:
    reg = Registry(tmp_path / "reg")
    live = reg.add("a prefix still here\n", name="p")
    write_snapshot(reg, make_record(live))
    old_gone, young_gone = "a" * 64, "b" * 64
    write_snapshot(reg, make_record(old_gone))
    write_snapshot(reg, make_record(young_gone))
    for sha in (live, old_gone):
        _age(snapshot_record_path(reg, sha, BUILD.build_id), 30 * DAY)
    before = _snapshots(reg)

    # Not asked: nothing under snapshots/ goes, even an old record whose prefix is gone.
    plain = run_cli("gc", "--prune-unnamed", "--grace", "14d", "--registry", str(reg.root))
    assert plain.returncode == 0, plain.stderr
    assert _snapshots(reg) == before

    dry = collect_garbage(reg, grace_s=14 * DAY, prune_snapshots=True, dry_run=True)
    assert [(i.kind, i.path) for i in dry.removed] == [
        ("snapshot", f"snapshots/{old_gone}-{BUILD.build_id}.json")
    ]
    assert _snapshots(reg) == before  # a dry run changes nothing

    res = run_cli(
        "gc", "--prune-snapshots", "--grace", "14d", "--registry", str(reg.root), "--json"
    )
    assert res.returncode == 0, res.stderr
    body = orjson.loads(res.stdout)
    assert body["prune_snapshots"] is True
    assert [i["kind"] for i in body["removed"]] == ["snapshot"]
    left = set(_snapshots(reg))
    assert left == {f"{live}-{BUILD.build_id}.json", f"{young_gone}-{BUILD.build_id}.json"}
    # What is left: one good record and one dangling young one (verify says so).
    assert {f.kind for f in verify_registry(reg).findings} == {"dangling"}
