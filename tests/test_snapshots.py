"""Snapshot records, their registry functions, and restore verdicts without a real engine.

The real-engine acceptance is in `test_snapshot_llama.py`. Here: strict record parsing and
binding (#22 case 1), the store's no-follow rules, the profile refusal (the Halogen
simulator has no slot API), strict `/slots` fields (#22 case 8), and what a real
llama-server on this machine does not produce: a restore that loads nothing while the slot
still answers from the cache (#20 case 3), a restore that says success while the next call
re-prefills, an erase reply without its count (scripted loopback servers).
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
    WorkerHTTPError,
)
from prefixreg.core.records import ServerBuild
from prefixreg.core.snapshots import SnapshotRecord, snapshot_file_name
from prefixreg.registry.snapshots import (
    digest_snapshot_file,
    list_snapshots,
    read_snapshot,
    write_snapshot,
)
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from prefixreg.server.slots import idle_slot, list_slots
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.snapshot.run import restore_and_prove, save_snapshot
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, Request

BUILD = ServerBuild(profile="llamacpp", identity={"build_info": "b0-unknown", "n_ctx": 8192})
TEXT = "You are a careful coding agent.\n" * 60
PROPS = {
    "build_info": "b0-unknown",
    "model_path": "/m.gguf",
    "default_generation_settings": {"n_ctx": 8192},
    "total_slots": 1,
    "chat_template": "chatml",
}
ERASED = {"id_slot": 0, "n_erased": 0}
RESTORED = {"id_slot": 0, "n_restored": 1153, "n_read": 11, "timings": {"restore_ms": 4.2}}
IDLE = [{"id": 0, "n_ctx": 8192, "is_processing": False}]


def snapshot_record_path(reg: Registry, sha: str, build_id: str) -> Path:
    """Where the record of `sha` on `build_id` lives (DESIGN §3)."""
    return reg.root / "snapshots" / f"{sha}-{build_id}.json"


def make_record(sha: str, build: ServerBuild = BUILD, **kw: Any) -> SnapshotRecord:
    fields: dict[str, Any] = {
        "sha256": sha,
        "build": build,
        "file": snapshot_file_name(sha, build.build_id),
        "file_sha256": "b" * 64,
        "file_blake3": "c" * 64,
        "file_bytes": 10_000,
        "slot_dir": "/nonexistent/slots",
        "n_saved": 1153,
        "n_written": 11_431_436,
        "save_ms": 16.0,
        "slot_id": 0,
        "slot_ctx": 8192,
        "created": "2026-12-01T10:00:00.000000Z",
    }
    fields.update(kw)
    return SnapshotRecord(**fields)


def saved_record(
    reg: Registry, url: str, slots: Path, ref: str = "p1", data: bytes = b"kv" * 5000
) -> SnapshotRecord:
    """A record of `ref` on the server at `url`, and its file in `slots`, as a save leaves them."""
    with Worker(url) as w:
        record = make_record(reg.head(ref).sha256, w.server_build(), slot_dir=str(slots))
    slots.mkdir(exist_ok=True)
    (slots / record.file).write_bytes(data)
    got = digest_snapshot_file(slots, record.file)
    assert got.sha256 is not None and got.blake3 is not None
    record = dataclasses.replace(
        record, file_sha256=got.sha256, file_blake3=got.blake3, file_bytes=got.size
    )
    write_snapshot(reg, record)
    return record


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "reg")
    registry.add(TEXT, name="p1")
    return registry


def test_record_round_trips_and_parses_strictly() -> None:
    rec = make_record("a" * 64)
    good = rec.to_dict()
    assert SnapshotRecord.from_dict(orjson.loads(orjson.dumps(good))) == rec
    bad_cases: list[tuple[str, Any]] = [
        ("n_saved", True),  # a bool is not a count
        ("n_saved", -1),
        ("n_saved", 1.0),
        ("kind", "measurement"),
        ("sha256", "A" * 64),
        ("save_ms", "16"),
        ("save_ms", -1.0),
    ]
    for key, value in bad_cases:
        with pytest.raises(CorruptRecordError):
            SnapshotRecord.from_dict({**good, key: value})
    file_cases: list[tuple[str, Any]] = [
        ("blake3", "C" * 64),
        # #22 case 1: the hashes and the size are required, the directory too, absolute.
        ("sha256", None),
        ("blake3", None),
        ("bytes", None),
        ("slot_dir", None),
        ("slot_dir", "relative/slots"),
        # The file name is derived from the head's sha and the build, never chosen.
        ("name", "passwd"),
        ("name", snapshot_file_name("b" * 64, BUILD.build_id)),
        ("name", "../x.bin"),
    ]
    for key, value in file_cases:
        with pytest.raises(CorruptRecordError):
            SnapshotRecord.from_dict({**good, "file": {**good["file"], key: value}})  # type: ignore[dict-item]
    forged = {**good, "build": {**good["build"], "build_id": "0" * 16}}  # type: ignore[dict-item]
    with pytest.raises(CorruptRecordError, match="does not match its identity"):
        SnapshotRecord.from_dict(forged)
    with pytest.raises(CorruptRecordError, match="not 'prefixreg-"):
        make_record("a" * 64, file="passwd")


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
        digest_snapshot_file(elsewhere, "link.bin")
    got = digest_snapshot_file(tmp_path, "real.bin")
    assert got.sha256 == hashlib.sha256(b"kv" * 100).hexdigest() and got.size == 200
    assert got.blake3 == blake3.blake3(b"kv" * 100).hexdigest()
    with pytest.raises(UsageError):
        digest_snapshot_file(tmp_path, "../real.bin")


def test_a_mirror_gets_no_snapshot_record(tmp_path: Path) -> None:
    mirror = Registry(tmp_path / "m")
    mirror.init(role="mirror")
    with pytest.raises(UsageError):
        write_snapshot(mirror, make_record("a" * 64))


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(speed=2000)) as server:
        yield server


def test_a_server_without_a_slot_api_is_refused_with_exit_2(
    sim: SimServer, reg: Registry, tmp_path: Path
) -> None:
    for verb in ("save", "restore"):
        res = run_cli(
            "snapshot", verb, "p1", "--worker", sim.url, "--registry", str(reg.root),
            "--slot-dir", str(tmp_path),
        )  # fmt: skip
        assert res.returncode == 2, (verb, res.stderr)
        assert b"not supported by this server's profile (halogen)" in res.stderr
        assert res.stdout == b""
    assert reg.measurements() == []


def _llama(
    srv: FakeServer,
    *,
    restore: Reply,
    cached: int,
    erase: Reply | None = None,
    slots: list[dict[str, Any]] = IDLE,
) -> None:
    """A scripted llama.cpp server: every chat call reports `cached` of 1,000 tokens."""
    erase = erase or Reply(json=ERASED)

    def slot_action(req: Request) -> Reply:
        return restore if req.json else erase  # an erase posts `{}`

    srv.route("GET", "/health", Reply(json={"status": "ok"}))
    srv.route("GET", "/props", Reply(json=PROPS))
    srv.route("GET", "/slots", Reply(json=slots))
    for slot in slots:
        srv.route("POST", f"/slots/{slot['id']}", slot_action)
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


def slot_posts(srv: FakeServer) -> list[tuple[str, Any]]:
    return [(r.path, r.json) for r in srv.requests if r.method == "POST" and "/slots" in r.path]


def test_a_restore_that_says_success_but_does_not_resume_is_not_restored(
    reg: Registry, tmp_path: Path
) -> None:
    sha = reg.resolve("p1")
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=0)
        record = saved_record(reg, srv.url, tmp_path / "slots")
        with Worker(srv.url) as w:
            result = restore_and_prove(reg, reg.head("p1"), w, fallback_warm=False)
        chats = [r for r in srv.requests if r.path == "/v1/chat/completions"]
        posts = slot_posts(srv)
    assert result.verdict == "not_restored"
    assert "did not resume the head (cold" in result.reason
    assert result.transfer is not None and result.transfer.server_ms == 4.2
    # The baseline first: the slot erased, then restored, then the pinned check.
    assert posts == [("/slots/0", {}), ("/slots/0", {"filename": record.file})]
    assert [c.json["id_slot"] for c in chats] == [0]
    (m,) = reg.measurements(sha)
    assert m.kind == "restore" and m.body["verdict"] == "not_restored"
    assert str(m.body["file_check"]).startswith("blake3 matched")


def test_a_restore_that_loads_nothing_is_not_restored_though_the_slot_answers(
    reg: Registry, tmp_path: Path
) -> None:
    """#20 case 3: `n_restored: 0`, while the pinned check still finds the prefix cached."""
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json={**RESTORED, "n_restored": 0}), cached=990)
        saved_record(reg, srv.url, tmp_path / "slots")
        res = run_cli("snapshot", "restore", "p1", "--worker", srv.url, "--registry",
                      str(reg.root), "--no-warm", "--json")  # fmt: skip
        text = run_cli("snapshot", "restore", "p1", "--worker", srv.url, "--registry",
                       str(reg.root), "--no-warm")  # fmt: skip
    assert res.returncode == 1, res.stderr
    out = orjson.loads(res.stdout)
    assert out["verdict"] == "not_restored" and out["reason"] == "the server restored 0 tokens"
    assert out["check"]["evidence"]["cached_tokens"] == 990  # the check alone would say resumed
    assert out["erase"]["n_tokens"] == 0 and out["restore"]["n_tokens"] == 0
    assert text.returncode == 1 and b"verdict  NOT_RESTORED" in text.stdout


def test_an_erase_reply_without_its_count_is_no_baseline(reg: Registry, tmp_path: Path) -> None:
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=990, erase=Reply(json={"id_slot": 0}))
        saved_record(reg, srv.url, tmp_path / "slots")
        res = run_cli("snapshot", "restore", "p1", "--worker", srv.url, "--registry",
                      str(reg.root), "--no-warm", "--json")  # fmt: skip
    assert res.returncode == 4, res.stderr
    out = orjson.loads(res.stdout)
    assert out["verdict"] == "unverified" and "no baseline of the slot" in out["reason"]


def test_a_restore_the_server_refuses_is_recorded_and_not_restored(
    reg: Registry, tmp_path: Path
) -> None:
    sha = reg.resolve("p1")
    refused = Reply(status=400, json={"error": {"message": "failed to restore", "code": 400}})
    with FakeServer() as srv:
        _llama(srv, restore=refused, cached=900)
        saved_record(reg, srv.url, tmp_path / "slots")
        with Worker(srv.url) as w:
            result = restore_and_prove(reg, reg.head("p1"), w, fallback_warm=False)
    assert result.verdict == "restore_failed" and "failed to restore" in result.reason
    assert result.check is None
    (m,) = reg.measurements(sha)
    assert m.body["verdict"] == "restore_failed"


def _restore_cli(reg: Registry, url: str, *args: str) -> tuple[int, bytes, bytes]:
    res = run_cli("snapshot", "restore", "p1", "--worker", url, "--registry", str(reg.root), *args)
    return res.returncode, res.stdout, res.stderr


def _write_raw(reg: Registry, record: SnapshotRecord, **file: Any) -> None:
    """Write a record file by hand, with `file` fields a constructor would refuse."""
    raw = record.to_dict()
    raw["file"] = {**raw["file"], **file}  # type: ignore[dict-item]
    snapshot_record_path(reg, record.sha256, record.build_id).write_bytes(orjson.dumps(raw))


def test_a_record_that_is_not_bound_exits_3_and_sends_nothing(
    reg: Registry, tmp_path: Path
) -> None:
    """#22 case 1: null hashes, another file (`passwd` in `/etc`), a missing slot_dir."""
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=990)
        record = saved_record(reg, srv.url, tmp_path / "slots")
        cases: list[dict[str, Any]] = [
            {"sha256": None, "blake3": None, "bytes": None},
            {"name": "passwd", "slot_dir": "/etc"},
            {"slot_dir": None},
        ]
        for fields in cases:
            _write_raw(reg, record, **fields)
            code, out, err = _restore_cli(reg, srv.url)
            assert code == 3, (fields, err)
            assert out == b"" and err.count(b"\n") <= 2 and b"Traceback" not in err
        assert slot_posts(srv) == []
        assert [r.path for r in srv.requests if r.path == "/v1/chat/completions"] == []
    assert reg.measurements() == []


def test_the_file_is_checked_in_the_recorded_directory_or_slot_dir(
    reg: Registry, tmp_path: Path
) -> None:
    """The recorded directory gone (or unreadable): exit 3, nothing sent; `--slot-dir` names
    where it is now; a `--slot-dir` that is no directory is exit 2."""
    slots = tmp_path / "slots"
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=990)
        record = saved_record(reg, srv.url, slots)
        moved = tmp_path / "moved"
        slots.rename(moved)
        code, _, err = _restore_cli(reg, srv.url)
        assert code == 3 and b"not readable here" in err and b"no restore sent" in err
        (moved / record.file).write_bytes(b"kv" * 4999 + b"KV")  # tampered, same size
        code, _, err = _restore_cli(reg, srv.url, "--slot-dir", str(moved))
        assert code == 3 and b"does not match" in err
        (moved / record.file).unlink()
        code, _, err = _restore_cli(reg, srv.url, "--slot-dir", str(moved))
        assert code == 3 and b"missing" in err
        code, _, err = _restore_cli(reg, srv.url, "--slot-dir", str(moved / "nope"))
        assert code == 2 and b"not a readable directory" in err
        assert slot_posts(srv) == []
        (moved / record.file).write_bytes(b"kv" * 5000)
        code, _, err = _restore_cli(reg, srv.url, "--slot-dir", str(moved), "--no-warm")
        assert code == 0, err
        assert [p for p, _ in slot_posts(srv)] == ["/slots/0", "/slots/0"]


def test_slots_fields_are_read_strictly(reg: Registry, tmp_path: Path) -> None:
    """#22 case 8: `is_processing: "yes"` (or missing, or 1) is not idle: unknown is busy."""
    odd: list[dict[str, Any]] = [
        {"id": 0, "n_ctx": 8192, "is_processing": "yes"},
        {"id": 1, "n_ctx": 8192},
        {"id": 2, "n_ctx": 8192, "is_processing": 1},
        {"id": 3, "n_ctx": 8192, "is_processing": False},
    ]
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json={**RESTORED, "id_slot": 3}), cached=990, slots=odd)
        saved_record(reg, srv.url, tmp_path / "slots")
        with Worker(srv.url) as w:
            assert [s.idle for s in list_slots(w)] == [False, False, False, True]
            assert [s.is_processing for s in list_slots(w)] == [None, None, None, False]
            assert idle_slot(w).id == 3 and idle_slot(w, prefer=0).id == 3
            result = restore_and_prove(reg, reg.head("p1"), w, fallback_warm=False)
        assert result.verdict == "restored"
        assert {p for p, _ in slot_posts(srv)} == {"/slots/3"}
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=990, slots=odd[:3])
        with Worker(srv.url) as w, pytest.raises(WorkerHTTPError, match="no slot is idle"):
            idle_slot(w)


def test_snapshot_ls_lists_records(reg: Registry) -> None:
    sha = reg.resolve("p1")
    write_snapshot(reg, make_record(sha))
    res = run_cli("snapshot", "ls", "--registry", str(reg.root), "--json")
    assert res.returncode == 0, res.stderr
    (listed,) = orjson.loads(res.stdout)
    assert listed["sha256"] == sha and listed["build"]["build_id"] == BUILD.build_id
    plain = run_cli("snapshot", "ls", "p1", "--registry", str(reg.root))
    assert plain.returncode == 0 and sha[:16].encode() in plain.stdout


@pytest.mark.parametrize("kind", ["junk", "fifo", "symlink", "directory"])
def test_snapshot_ls_names_an_entry_that_is_no_record_and_exits_3(
    reg: Registry, tmp_path: Path, kind: str
) -> None:
    # Before (issue 33): exit 0, the entry skipped in silence.
    import os

    sha = reg.resolve("p1")
    good = write_snapshot(reg, make_record(sha))
    name = f"{sha}-{'0' * 16}.json" if kind != "junk" else "notes.txt"
    bad = good.parent / name
    if kind == "junk":
        bad.write_bytes(b"not a record\n")
    elif kind == "fifo":
        os.mkfifo(bad)
    elif kind == "symlink":
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_bytes(good.read_bytes())
        bad.symlink_to(elsewhere)
    else:
        bad.mkdir()
    runs = [run_cli("snapshot", "ls", "--registry", str(reg.root), "--json")]
    if kind != "junk":  # named for p1: listing p1 alone names it too
        runs.append(run_cli("snapshot", "ls", "p1", "--registry", str(reg.root)))
    for res in runs:
        assert res.returncode == 3, (res.stdout, res.stderr)
        assert name.encode() in res.stderr and b"not a snapshot record" in res.stderr
        assert b"Traceback" not in res.stderr and res.stdout == b""
    with pytest.raises(CorruptRecordError, match="not a snapshot record"):
        list_snapshots(reg)


def test_save_refuses_a_slot_not_shown_to_hold_the_prefix(reg: Registry, tmp_path: Path) -> None:
    with FakeServer() as srv:
        _llama(srv, restore=Reply(status=500), cached=0)  # every call is served cold
        with Worker(srv.url) as w, pytest.raises(EvidenceUnverifiedError, match="nothing saved"):
            save_snapshot(reg, reg.head("p1"), w, slot_dir=tmp_path)
        assert slot_posts(srv) == []  # no save request
        srv.requests.clear()
        res = run_cli("snapshot", "save", "p1", "--worker", srv.url, "--registry", str(reg.root))
        assert res.returncode == 2 and b"needs --slot-dir" in res.stderr
        assert srv.requests == []  # the CLI refused before connecting
    assert list_snapshots(reg) == []


def test_a_reference_string_is_no_head(reg: Registry, tmp_path: Path) -> None:
    """The verbs take the object `Registry.head` returns, resolved once, never a string."""
    with Worker("http://127.0.0.1:9") as w:
        with pytest.raises(UsageError, match=r"Registry\.head"):
            save_snapshot(reg, "p1", w, slot_dir=tmp_path)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match=r"Registry\.head"):
            restore_and_prove(reg, "p1", w)  # type: ignore[arg-type]
    assert reg.measurements() == []
