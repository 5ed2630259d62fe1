"""Snapshot records, their registry functions, and restore verdicts without a real engine.

The real-engine acceptance is in `test_snapshot_llama.py`. Here: strict record parsing, the
store's no-follow rules, the profile refusal (the Halogen simulator has no slot API), and the
one failure a real llama-server on this machine does not produce: a restore that answers
success with a full `n_restored` while the next call re-prefills (a scripted loopback server).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import orjson
import pytest

from prefixreg.core.errors import (
    CorruptRecordError,
    EvidenceUnverifiedError,
    IntegrityError,
    UsageError,
)
from prefixreg.core.records import ServerBuild
from prefixreg.core.snapshots import SnapshotRecord, snapshot_file_name
from prefixreg.registry.snapshots import (
    digest_snapshot_file,
    hash_snapshot_file,
    list_snapshots,
    read_snapshot,
    snapshot_record_path,
    write_snapshot,
)
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.snapshot.run import restore_and_prove, save_snapshot
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply

BUILD = ServerBuild(profile="llamacpp", identity={"build_info": "b0-unknown", "n_ctx": 8192})
TEXT = "You are a careful coding agent.\n" * 60
PROPS = {
    "build_info": "b0-unknown",
    "model_path": "/m.gguf",
    "default_generation_settings": {"n_ctx": 8192},
    "total_slots": 1,
    "chat_template": "chatml",
}


def make_record(sha: str, build: ServerBuild = BUILD, **kw: Any) -> SnapshotRecord:
    fields: dict[str, Any] = {
        "sha256": sha,
        "build": build,
        "file": snapshot_file_name(sha, build.build_id),
        "n_saved": 1153,
        "n_written": 11_431_436,
        "save_ms": 16.0,
        "slot_id": 0,
        "slot_ctx": 8192,
        "created": "2026-12-01T10:00:00.000000Z",
    }
    fields.update(kw)
    return SnapshotRecord(**fields)


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "reg")
    registry.add(TEXT, name="p1")
    return registry


def test_record_round_trips_and_parses_strictly() -> None:
    rec = make_record(
        "a" * 64, file_sha256="b" * 64, file_blake3="c" * 64, file_bytes=10, slot_dir="/x"
    )
    assert SnapshotRecord.from_dict(orjson.loads(orjson.dumps(rec.to_dict()))) == rec
    good = rec.to_dict()
    bad_cases: list[tuple[str, Any]] = [
        ("n_saved", True),  # a bool is not a count
        ("n_saved", -1),
        ("n_saved", 1.0),
        ("kind", "measurement"),
        ("sha256", "A" * 64),
        ("save_ms", "16"),
    ]
    for key, value in bad_cases:
        with pytest.raises(CorruptRecordError):
            SnapshotRecord.from_dict({**good, key: value})
    with pytest.raises(CorruptRecordError):
        SnapshotRecord.from_dict({**good, "file": {**good["file"], "blake3": "C" * 64}})  # type: ignore[dict-item]
    for name in ("../x.bin", "a/b.bin", ".hidden", ""):
        with pytest.raises(CorruptRecordError):
            SnapshotRecord.from_dict({**good, "file": {**good["file"], "name": name}})  # type: ignore[dict-item]
    forged = {**good, "build": {**good["build"], "build_id": "0" * 16}}  # type: ignore[dict-item]
    with pytest.raises(CorruptRecordError, match="does not match its identity"):
        SnapshotRecord.from_dict(forged)


def test_registry_writes_reads_lists_and_replaces_records(reg: Registry) -> None:
    sha = reg.resolve("p1")
    assert read_snapshot(reg, sha, BUILD.build_id) is None and list_snapshots(reg) == []
    rec = make_record(sha)
    path = write_snapshot(reg, rec)
    assert path == snapshot_record_path(reg, sha, BUILD.build_id)
    assert path.name == f"{sha}-{BUILD.build_id}.json"
    assert read_snapshot(reg, sha, BUILD.build_id) == rec
    newer = dataclasses.replace(rec, n_saved=2000)
    write_snapshot(reg, newer)  # same prefix and build: replaced whole
    assert list_snapshots(reg, sha) == [newer]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    assert verify_registry(reg).ok


def test_a_record_moved_to_stand_for_another_prefix_is_refused(reg: Registry) -> None:
    sha = reg.resolve("p1")
    other = reg.add("another prefix\n")
    write_snapshot(reg, make_record(sha))
    src = snapshot_record_path(reg, sha, BUILD.build_id)
    src.rename(snapshot_record_path(reg, other, BUILD.build_id))
    with pytest.raises(CorruptRecordError, match="records prefix"):
        read_snapshot(reg, other, BUILD.build_id)
    with pytest.raises(CorruptRecordError):
        list_snapshots(reg)


def test_symlinks_are_refused(reg: Registry, tmp_path: Path) -> None:
    sha = reg.resolve("p1")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (reg.root / "snapshots").symlink_to(elsewhere)
    with pytest.raises(IntegrityError):
        write_snapshot(reg, make_record(sha))
    with pytest.raises(IntegrityError):
        list_snapshots(reg)
    assert list(elsewhere.iterdir()) == []
    # A snapshot file that is a symlink is never hashed through.
    (tmp_path / "real.bin").write_bytes(b"kv" * 100)
    (elsewhere / "link.bin").symlink_to(tmp_path / "real.bin")
    with pytest.raises(IntegrityError):
        hash_snapshot_file(elsewhere, "link.bin")
    assert hash_snapshot_file(tmp_path, "real.bin") == (
        hashlib.sha256(b"kv" * 100).hexdigest(),
        200,
    )
    got = digest_snapshot_file(tmp_path, "real.bin")
    assert got.blake3 == blake3.blake3(b"kv" * 100).hexdigest() and got.size == 200
    with pytest.raises(UsageError):
        hash_snapshot_file(tmp_path, "../real.bin")


def test_a_mirror_gets_no_snapshot_record(tmp_path: Path) -> None:
    mirror = Registry(tmp_path / "m")
    mirror.init(role="mirror")
    with pytest.raises(UsageError):
        write_snapshot(mirror, make_record("a" * 64))


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(speed=2000)) as server:
        yield server


def test_a_server_without_a_slot_api_is_refused_with_exit_2(sim: SimServer, reg: Registry) -> None:
    for verb in ("save", "restore"):
        res = run_cli("snapshot", verb, "p1", "--worker", sim.url, "--registry", str(reg.root))
        assert res.returncode == 2, (verb, res.stderr)
        assert b"not supported by this server's profile (halogen)" in res.stderr
        assert res.stdout == b""
    assert reg.measurements() == []


def _llama(srv: FakeServer, *, restore: Reply, cached: int) -> None:
    srv.route("GET", "/health", Reply(json={"status": "ok"}))
    srv.route("GET", "/props", Reply(json=PROPS))
    srv.route("GET", "/slots", Reply(json=[{"id": 0, "n_ctx": 8192, "is_processing": False}]))
    srv.route("POST", "/slots/0", restore)
    usage = {
        "prompt_tokens": 1000,
        "completion_tokens": 1,
        "total_tokens": 1001,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    reply = {
        "choices": [{"index": 0, "finish_reason": "length", "message": {"content": "x"}}],
        "usage": usage,
        "timings": {"cache_n": cached, "prompt_n": 1000 - cached},
    }
    srv.route("POST", "/v1/chat/completions", Reply(json=reply))


def test_a_restore_that_says_success_but_does_not_resume_is_not_restored(
    reg: Registry,
) -> None:
    sha = reg.resolve("p1")
    restored = {"id_slot": 0, "n_restored": 1153, "n_read": 11, "timings": {"restore_ms": 4.2}}
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=restored), cached=0)
        with Worker(srv.url) as w:
            write_snapshot(reg, make_record(sha, w.server_build()))
            result = restore_and_prove(reg, "p1", w, fallback_warm=False)
        chats = [r for r in srv.requests if r.path == "/v1/chat/completions"]
    assert result.verdict == "not_resumed"
    assert "reported restoring 1153 tokens" in result.reason
    assert result.transfer is not None and result.transfer.server_ms == 4.2
    assert [c.json["id_slot"] for c in chats] == [0]  # the check was pinned to the slot
    (m,) = reg.measurements(sha)
    assert m.kind == "restore" and m.body["verdict"] == "not_resumed"
    assert str(m.body["file_check"]).startswith("not checked")


def test_a_restore_the_server_refuses_is_recorded_and_not_restored(reg: Registry) -> None:
    sha = reg.resolve("p1")
    refused = Reply(status=400, json={"error": {"message": "failed to restore", "code": 400}})
    with FakeServer() as srv:
        _llama(srv, restore=refused, cached=900)
        with Worker(srv.url) as w:
            write_snapshot(reg, make_record(sha, w.server_build()))
            result = restore_and_prove(reg, "p1", w, fallback_warm=False)
    assert result.verdict == "restore_failed" and "failed to restore" in result.reason
    assert result.check is None
    (m,) = reg.measurements(sha)
    assert m.body["verdict"] == "restore_failed"


def test_snapshot_ls_lists_records(reg: Registry) -> None:
    sha = reg.resolve("p1")
    write_snapshot(reg, make_record(sha))
    res = run_cli("snapshot", "ls", "--registry", str(reg.root), "--json")
    assert res.returncode == 0, res.stderr
    (listed,) = orjson.loads(res.stdout)
    assert listed["sha256"] == sha and listed["build"]["build_id"] == BUILD.build_id
    plain = run_cli("snapshot", "ls", "p1", "--registry", str(reg.root))
    assert plain.returncode == 0 and sha[:16].encode() in plain.stdout


def test_save_refuses_a_slot_not_shown_to_hold_the_prefix(reg: Registry) -> None:
    with FakeServer() as srv:
        _llama(srv, restore=Reply(status=500), cached=0)  # every call is served cold
        with Worker(srv.url) as w, pytest.raises(EvidenceUnverifiedError, match="nothing saved"):
            save_snapshot(reg, "p1", w)
        slot_posts = [r for r in srv.requests if r.method == "POST" and r.path.startswith("/slots")]
    assert slot_posts == []  # no save request
    assert list_snapshots(reg) == []
