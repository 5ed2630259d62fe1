"""KV snapshots against the real llama-server peer: saved, restarted, restored, and proven.

One module fixture starts a server with `--slot-save-path`, saves two ~1,000-token
prefixes (`p1` through the CLI, `p2` through the Python API), and stops it. Every test then
works on its own copy of the registry and the snapshot directory and starts its own server
process, so the save (two cold prefills, the slow part) is paid once.

Restore requests are seen in the server's own log: started with `-v`, llama-server logs
`state_read_meta` when it reads a slot file, and nothing else does.
These tests need the engine: if it cannot be installed or started they fail, never skip.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.registry.snapshots import digest_snapshot_file, read_snapshot, write_snapshot
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.snapshot.run import save_snapshot
from tests.conftest import run_cli
from tests.peer.fixtures import peer_paths
from tests.peer.llama_peer import DEFAULT_FLAGS, PeerServer, start
from tests.test_frames_llama import TOOLS, TOOLS_TEMPLATE
from tests.test_llama_server import prose
from tests.test_store import flip_byte

pytestmark = pytest.mark.timeout(900)

RESTORE_MARK = "state_read_meta"  # logged (with -v) when the server reads a slot file


@dataclasses.dataclass(frozen=True)
class Saved:
    reg: Path
    slots: Path
    port: int
    build_id: str


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    """`python -m prefixreg ARGS`, with room for a cold prefill on a busy machine."""
    return run_cli(*args, timeout=timeout)


def flags_for(slots: Path, *extra: str, base: Sequence[str] = DEFAULT_FLAGS) -> tuple[str, ...]:
    return (*base, "--slot-save-path", str(slots), *extra)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    root = tmp_path_factory.mktemp("snap-save")
    reg_path, slots = root / "reg", root / "slots"
    slots.mkdir()
    reg = Registry(reg_path)
    reg.add(prose(31, 900), name="p1")
    reg.add(prose(32, 900), name="p2")
    server = start(flags_for(slots), paths=peer_paths(), log_dir=root)
    try:
        res = cli(
            "snapshot", "save", "p1", "--worker", server.url, "--slot-dir", str(slots),
            "--registry", str(reg_path), "--json",
        )  # fmt: skip
        assert res.returncode == 0, (res.stdout, res.stderr)
        with Worker(server.url) as w:
            save_snapshot(reg, reg.head("p2"), w, slot_dir=slots)
            build_id = w.server_build().build_id
    finally:
        server.stop()
    yield Saved(reg=reg_path, slots=slots, port=server.port, build_id=build_id)


def copy_of(saved: Saved, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the registry and the snapshot directory."""
    reg, slots = tmp_path / "reg", tmp_path / "slots"
    shutil.copytree(saved.reg, reg)
    shutil.copytree(saved.slots, slots)
    return reg, slots


def restore(reg: Path, url: str, *args: str) -> tuple[subprocess.CompletedProcess[bytes], Any]:
    res = cli("snapshot", "restore", "p1", "--worker", url, "--registry", str(reg), "--json", *args)
    out = orjson.loads(res.stdout) if res.stdout else None
    return res, out


def record_of(reg: Path, sha: str) -> Any:
    """The newest `restore` measurement of `sha`."""
    found = [m for m in Registry(reg).measurements(sha) if m.kind == "restore"]
    return found[-1].body if found else None


def test_restore_after_restart_is_proven_by_the_checks_cached_count(
    saved: Saved, tmp_path: Path
) -> None:
    # Kill and restart: the same port, the same snapshot directory (the record's own).
    reg, _ = copy_of(saved, tmp_path)
    server = start(
        flags_for(saved.slots, "-v"), paths=peer_paths(), log_dir=tmp_path, port=saved.port
    )
    try:
        res, out = restore(reg, server.url)
        log = server.log.read_text(errors="replace")
    finally:
        server.stop()
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert out["verdict"] == "restored"
    assert out["file_check"].startswith("blake3 matched")
    check = out["check"]["evidence"]
    assert check["cached_source"] == "usage.prompt_tokens_details.cached_tokens"
    # The proof: a fresh tail on the restored slot resumed everything before the tail.
    assert check["prompt_tokens"] - check["cached_tokens"] < 45
    assert out["coverage"] >= 0.95
    assert out["restore"]["n_tokens"] >= check["cached_tokens"]
    assert out["erase"]["n_tokens"] == 0  # the baseline: the slot held nothing before
    assert RESTORE_MARK in log
    body = record_of(reg, out["sha256"])
    assert body["verdict"] == "restored"
    assert body["restore"]["server_ms"] is not None and body["restore"]["n_tokens"] > 900
    assert body["cached_tokens"] == check["cached_tokens"]
    assert body["calls"][0]["evidence"]["cache_state"] == "reused"


def test_changed_snapshot_file_exits_3_and_sends_no_restore(saved: Saved, tmp_path: Path) -> None:
    reg, slots = copy_of(saved, tmp_path)
    record = read_snapshot(Registry(reg), Registry(reg).resolve("p1"), saved.build_id)
    assert record is not None
    flip_byte(slots / record.file, offset=4096)
    server = start(flags_for(slots, "-v"), paths=peer_paths(), log_dir=tmp_path)
    try:
        slots_before = server.slots()
        before = record_of(reg, record.sha256)
        res, _ = restore(reg, server.url, "--slot-dir", str(slots))
        slots_after = server.slots()
        log = server.log.read_text(errors="replace")
    finally:
        server.stop()
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert b"does not match" in res.stderr and b"no restore sent" in res.stderr
    assert RESTORE_MARK not in log  # the server never read a slot file
    assert slots_after == slots_before
    assert record_of(reg, record.sha256) == before  # no restore measurement was written


def test_another_prefixs_state_under_this_record_is_not_restored(
    saved: Saved, tmp_path: Path
) -> None:
    reg_path, slots = copy_of(saved, tmp_path)
    reg = Registry(reg_path)
    p1 = read_snapshot(reg, reg.resolve("p1"), saved.build_id)
    p2 = read_snapshot(reg, reg.resolve("p2"), saved.build_id)
    assert p1 is not None and p2 is not None
    os.chmod(slots / p1.file, 0o644)
    shutil.copyfile(slots / p2.file, slots / p1.file)
    got = digest_snapshot_file(slots, p1.file)
    assert got.sha256 is not None and got.blake3 is not None
    # The integrity check passes: the record now names the file's real digests.
    write_snapshot(
        reg,
        dataclasses.replace(
            p1,
            file_sha256=got.sha256,
            file_blake3=got.blake3,
            file_bytes=got.size,
            slot_dir=str(slots),
        ),
    )
    server = start(flags_for(slots), paths=peer_paths(), log_dir=tmp_path)
    try:
        res, out = restore(reg_path, server.url)
    finally:
        server.stop()
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert out["verdict"] == "not_restored"
    assert out["file_check"].startswith("blake3 matched")
    assert out["restore"]["n_tokens"] > 900  # the server called it a success
    assert "did not resume" in out["reason"]
    assert out["check"]["evidence"]["cached_tokens"] < 50
    body = record_of(reg_path, p1.sha256)
    assert body["verdict"] == "not_restored" and "did not resume" in body["reason"]
    # ...and then a normal warm, which does resume.
    assert out["fallback"]["body"]["verdict"] == "resumed"


def test_worker_with_another_context_size_does_not_use_the_snapshot(
    saved: Saved, tmp_path: Path
) -> None:
    reg, slots = copy_of(saved, tmp_path)
    other = tuple(f if f != "8192" else "4096" for f in DEFAULT_FLAGS)
    server = start(flags_for(slots, "-v", base=other), paths=peer_paths(), log_dir=tmp_path)
    try:
        res, out = restore(reg, server.url, "--no-warm")
        log = server.log.read_text(errors="replace")
    finally:
        server.stop()
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert out["verdict"] == "no_snapshot"
    assert out["build"]["build_id"] != saved.build_id
    assert "not used" in out["reason"] and "n_ctx 8192 -> 4096" in out["reason"]
    assert out["restore"] is None and RESTORE_MARK not in log


def test_snapshot_restores_on_a_second_server_process(saved: Saved, tmp_path: Path) -> None:
    reg_path, _ = copy_of(saved, tmp_path)
    reg = Registry(reg_path)
    record = read_snapshot(reg, reg.resolve("p1"), saved.build_id)
    assert record is not None
    other_dir = tmp_path / "other-slots"
    other_dir.mkdir()
    shutil.copyfile(saved.slots / record.file, other_dir / record.file)
    server: PeerServer = start(flags_for(other_dir), paths=peer_paths(), log_dir=tmp_path)
    try:
        assert server.port != saved.port
        res, out = restore(reg_path, server.url, "--slot-dir", str(other_dir))
    finally:
        server.stop()
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert out["verdict"] == "restored" and out["file_check"].startswith("blake3 matched")
    assert out["fallback"] is None


def test_warm_restore_after_restart_exits_0_and_records_the_proof(
    saved: Saved, tmp_path: Path
) -> None:
    reg, _ = copy_of(saved, tmp_path)
    server = start(
        flags_for(saved.slots, "-v"), paths=peer_paths(), log_dir=tmp_path, port=saved.port
    )
    try:
        res = cli(
            "warm", "p1", "--restore", "--worker", server.url, "--registry", str(reg), "--json"
        )
        log = server.log.read_text(errors="replace")
    finally:
        server.stop()
    assert res.returncode == 0, (res.stdout, res.stderr)
    out = orjson.loads(res.stdout)
    assert out["verdict"] == "restored" and out["resumed_by"] == "restore"
    assert out["fallback"] is None and RESTORE_MARK in log
    check = out["check"]["evidence"]
    assert check["prompt_tokens"] - check["cached_tokens"] < 45  # resumed all but the tail
    body = record_of(reg, out["sha256"])
    assert body["verdict"] == "restored"
    assert body["restore"]["server_ms"] is not None  # restore time, as the server measured it
    assert body["restore"]["n_tokens"] > 900  # tokens restored
    assert body["cached_tokens"] == check["cached_tokens"] > 900  # the check's evidence
    assert body["calls"][0]["evidence"]["cache_state"] == "reused"
    assert body["calls"][0]["evidence"]["wall_s"] > 0


def test_a_frames_head_is_saved_and_restored_after_a_restart(tmp_path: Path) -> None:
    """#21: a frame (system + tools, rendered by a tool-aware template) is saved under its
    own sha, and `warm FRAME --restore` and `snapshot restore FRAME` restore it, proven."""
    slots, template = tmp_path / "slots", tmp_path / "tools.jinja"
    slots.mkdir()
    template.write_text(TOOLS_TEMPLATE)
    flags = flags_for(slots, "-v", "--jinja", "--chat-template-file", str(template))
    reg = Registry(tmp_path / "reg")
    reg.add(prose(33, 900), name="sys")
    frame = reg.add_frame(
        "sys", tools=orjson.dumps(TOOLS), settings={"tool_choice": "auto"}, name="loop"
    )
    where = ("--registry", str(reg.root), "--json")
    server = start(flags, paths=peer_paths(), log_dir=tmp_path)
    try:
        res = cli(
            "snapshot", "save", "loop", "--worker", server.url, "--slot-dir", str(slots), *where
        )
    finally:
        server.stop()
    assert res.returncode == 0, (res.stdout, res.stderr)
    record = orjson.loads(res.stdout)["snapshot"]
    assert record["sha256"] == frame and frame in record["file"]["name"]
    server = start(flags, paths=peer_paths(), log_dir=tmp_path, port=server.port)
    try:
        first = cli("warm", "loop", "--restore", "--worker", server.url, *where)
        again = cli("snapshot", "restore", "loop", "--no-warm", "--worker", server.url, *where)
        log = server.log.read_text(errors="replace")
    finally:
        server.stop()
    assert first.returncode == 0, (first.stdout, first.stderr)
    out = orjson.loads(first.stdout)
    assert out["verdict"] == "restored" and out["kind"] == "frame" and out["sha256"] == frame
    assert out["resumed_by"] == "restore" and out["erase"]["n_tokens"] == 0
    assert again.returncode == 0, (again.stdout, again.stderr)
    second = orjson.loads(again.stdout)
    # The slot held the frame this time: the erase forgot it first, so the proof still stands.
    assert second["verdict"] == "restored" and second["erase"]["n_tokens"] > 900
    check = second["check"]["evidence"]
    assert check["prompt_tokens"] - check["cached_tokens"] < 45
    assert log.count(RESTORE_MARK) >= 2
    restores = [m for m in reg.measurements(reg.resolve("sys")) if m.kind == "restore"]
    assert [m.outcome.frame for m in restores] == [frame, frame]
