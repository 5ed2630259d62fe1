"""Snapshots travel (#24): a snapshot proven on llama-server A reaches llama-server B (its own
slot directory) through the mirror layer, over the real sshd on 127.0.0.1 standing for two
hosts (A's slot directory -> this coordinator -> B's), hashed on arrival at each end; B
restores it, proven `restored`, in at most 1/10 of B's own cold warm. A file changed at the
source is refused before anything is sent; one changed after arrival is exit 3 on B with
nothing sent to B's server; another build's file is never shipped.

The prefix is prose of 4,500 words, about 4,900 Gemma tokens: large enough that B's cold warm
(20-50 s on two busy cores) stays well over ten times a restore (0.2-1.4 s under the same
load: erase, restore, pinned check), small enough to keep the module near two minutes.
These tests need the engine and sshd: they fail, never skip, without them.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from prefixreg.core.records import ServerBuild
from prefixreg.registry.snapshots import read_snapshot, write_snapshot
from prefixreg.registry.store import Registry
from prefixreg.server.slots import list_slots, slot_action
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.measure.warm import warm
from prefixreg.verbs.mirror.snapshots import ship_snapshot
from prefixreg.verbs.snapshot.run import restore_and_prove
from tests.conftest import run_cli
from tests.peer.fixtures import peer_paths
from tests.peer.llama_peer import DEFAULT_FLAGS, PeerServer, start
from tests.sshd import SshServer
from tests.test_llama_server import prose
from tests.test_snapshots import saved_record
from tests.test_store import flip_byte

pytestmark = pytest.mark.timeout(900)

WORDS = 4500  # 4,945 prompt tokens with the check's tail, on Gemma 3 270M
RESTORE_MARK = "state_read_meta"  # logged (with -v) when llama-server reads a slot file


@dataclasses.dataclass(frozen=True)
class Fleet:
    reg: Path
    a: PeerServer
    b: PeerServer
    slots_a: Path
    slots_b: Path
    sshd: SshServer
    sha: str
    file: str


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    """`python -m prefixreg ARGS`, with room for a cold prefill on a busy machine."""
    return run_cli(*args, timeout=timeout)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("ship")
    slots_a, slots_b = root / "slots-a", root / "slots-b"
    slots_a.mkdir()
    slots_b.mkdir()
    reg = Registry(root / "reg")
    sha = reg.add(prose(41, WORDS), name="loop")
    sshd = SshServer.start(root / "sshd")
    servers: list[PeerServer] = []
    try:
        for slots, extra in ((slots_a, ()), (slots_b, ("-v",))):
            flags = (*DEFAULT_FLAGS, "--slot-save-path", str(slots), *extra)
            servers.append(start(flags, paths=peer_paths(), log_dir=root))
        a, b = servers
        saved = cli(
            "snapshot", "save", "loop", "--worker", a.url, "--slot-dir", str(slots_a),
            "--registry", str(reg.root), "--json",
        )  # fmt: skip
        assert saved.returncode == 0, saved.stderr
        (file,) = (p.name for p in slots_a.iterdir())
        yield Fleet(reg.root, a, b, slots_a, slots_b, sshd, sha, file)
    finally:
        for server in servers:
            server.stop()
        sshd.stop()


def ship(f: Fleet, *extra: str) -> subprocess.CompletedProcess[bytes]:
    options = [arg for opt in f.sshd.ssh_options for arg in ("--ssh-option", opt)]
    return cli(
        "snapshot", "ship", "loop", "--registry", str(f.reg),
        "--from", f.sshd.dest(f.slots_a), "--to", f.sshd.dest(f.slots_b),
        "--worker", f.b.url, *options, *extra,
    )  # fmt: skip


def restores_seen(server: PeerServer) -> int:
    return server.log.read_text(errors="replace").count(RESTORE_MARK)


def test_a_snapshot_proven_on_a_restores_on_b_in_a_tenth_of_bs_cold_warm(fleet: Fleet) -> None:
    (fleet.slots_b / fleet.file).unlink(missing_ok=True)
    shipped = ship(fleet)
    assert shipped.returncode == 0, shipped.stderr
    line = shipped.stdout.decode()
    assert line.startswith(f"shipped  {fleet.sshd.dest(fleet.slots_b)}: {fleet.file}")
    assert "verified there" in line
    assert (fleet.slots_b / fleet.file).read_bytes() == (fleet.slots_a / fleet.file).read_bytes()

    reg = Registry(fleet.reg)
    head = reg.head("loop")
    with Worker(fleet.b.url, read_timeout=600) as b:
        for slot in list_slots(b):
            slot_action(b, slot.id, "erase")
        began = time.monotonic()
        cold = warm(reg, head, b)
        cold_s = time.monotonic() - began
        began = time.monotonic()
        restored = restore_and_prove(reg, head, b, slot_dir=fleet.slots_b, fallback_warm=False)
        restore_s = time.monotonic() - began
    tokens = restored.check.evidence.prompt_tokens if restored.check else None
    print(
        f"\n{tokens} prompt tokens: B cold warm {cold_s:.2f} s ({cold.verdict}); B restore of "
        f"A's snapshot {restore_s:.2f} s ({restored.verdict}); ratio {restore_s / cold_s:.3f}"
    )
    assert cold.verdict == "resumed"
    assert restored.verdict == "restored", restored.reason
    assert restored.check is not None and (restored.check.evidence.cached_tokens or 0) > WORDS
    assert restore_s <= cold_s / 10

    # The command a user runs on B: warm --restore, proven, exit 0.
    seen = restores_seen(fleet.b)
    res = cli(
        "warm", "loop", "--restore", "--worker", fleet.b.url, "--slot-dir", str(fleet.slots_b),
        "--registry", str(fleet.reg), "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert (out["verdict"], out["resumed_by"]) == ("restored", "restore")
    assert restores_seen(fleet.b) > seen  # B read the shipped file


def test_a_file_changed_in_transit_is_exit_3_on_b_with_nothing_sent(fleet: Fleet) -> None:
    assert ship(fleet).returncode == 0
    flip_byte(fleet.slots_b / fleet.file, offset=4096)  # changed after it arrived
    seen = restores_seen(fleet.b)
    res = cli(
        "warm", "loop", "--restore", "--worker", fleet.b.url, "--slot-dir", str(fleet.slots_b),
        "--registry", str(fleet.reg),
    )  # fmt: skip
    assert res.returncode == 3, res.stderr
    assert b"does not match the record" in res.stderr and b"no restore sent" in res.stderr
    assert restores_seen(fleet.b) == seen  # B's server never read a slot file

    # Changed at the source: refused on arrival at the coordinator, nothing sent to B.
    (fleet.slots_b / fleet.file).unlink()
    good = fleet.slots_a / fleet.file
    kept = fleet.slots_a.parent / "kept.bin"
    shutil.copyfile(good, kept)
    try:
        flip_byte(good, offset=4096)
        refused = ship(fleet)
    finally:
        shutil.copyfile(kept, good)
    assert refused.returncode == 3, refused.stderr
    assert b"changed at the source or in transit; nothing sent" in refused.stderr
    assert not (fleet.slots_b / fleet.file).exists()


def test_another_builds_file_is_never_shipped(fleet: Fleet, tmp_path: Path) -> None:
    reg = Registry(fleet.reg)
    record = read_snapshot(reg, fleet.sha, fleet.file.split("-")[2].removesuffix(".bin"))
    assert record is not None
    identity = {**record.build.identity, "n_ctx": 1}
    other = ServerBuild(profile=record.build.profile, identity=identity)
    foreign = dataclasses.replace(
        record, build=other, file=f"prefixreg-{fleet.sha}-{other.build_id}.bin"
    )
    write_snapshot(reg, foreign)
    shutil.copyfile(fleet.slots_a / fleet.file, fleet.slots_a / foreign.file)
    (fleet.slots_b / fleet.file).unlink(missing_ok=True)
    assert ship(fleet).returncode == 0
    assert sorted(p.name for p in fleet.slots_b.iterdir()) == [fleet.file]

    # A worker of another build (the simulator) gets nothing: exit 1, its directory empty.
    elsewhere = tmp_path / "sim-slots"
    elsewhere.mkdir()
    with SimServer(SimConfig(speed=2000)) as sim:
        res = cli(
            "snapshot", "ship", "loop", "--registry", str(fleet.reg),
            "--to", str(elsewhere), "--worker", sim.url,
        )  # fmt: skip
    assert res.returncode == 1, res.stderr
    assert res.stdout.decode().startswith(f"no_snapshot {elsewhere}: no snapshot of")
    assert list(elsewhere.iterdir()) == []


# -- without the engine: local directories, the simulator's build -----------------------------


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(speed=2000)) as server:
        yield server


def _saved(tmp_path: Path, url: str) -> tuple[Registry, Path, str]:
    reg = Registry(tmp_path / "reg")
    reg.add("a prefix\n" * 50, name="loop")
    record = saved_record(reg, url, tmp_path / "src", ref="loop")  # and its record
    return reg, tmp_path / "src", record.file


def test_one_destination_failing_never_stops_the_others(sim: SimServer, tmp_path: Path) -> None:
    reg, _src, file = _saved(tmp_path, sim.url)
    good, orphan = tmp_path / "good", tmp_path / "missing-parent" / "slots"
    good.mkdir()
    with Worker(sim.url) as w:
        results = ship_snapshot(reg, reg.head("loop"), [(str(orphan), w), (str(good), w)])
    assert [(r.result, r.content) for r in results] == [
        ("failed", "unchecked"),
        ("shipped", "verified"),
    ]
    assert "rsync failed" in str(results[0].error)
    assert (good / file).read_bytes() == (tmp_path / "src" / file).read_bytes()
    res = cli(
        "snapshot", "ship", "loop", "--registry", str(reg.root),
        "--to", str(orphan), "--worker", sim.url, "--to", str(good), "--worker", sim.url,
    )  # fmt: skip
    assert res.returncode == 6, res.stderr
    assert res.stdout.decode().splitlines()[1].startswith(f"shipped  {good}: {file}")


def test_a_worker_that_does_not_answer_exits_5_and_the_others_ship(
    sim: SimServer, tmp_path: Path
) -> None:
    reg, _src, file = _saved(tmp_path, sim.url)
    good, other = tmp_path / "good", tmp_path / "other"
    good.mkdir()
    other.mkdir()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    res = cli(
        "snapshot", "ship", "loop", "--registry", str(reg.root), "--timeout", "5",
        "--to", str(other), "--worker", dead, "--to", str(good), "--worker", sim.url,
    )  # fmt: skip
    assert res.returncode == 5, res.stderr
    lines = res.stdout.decode().splitlines()
    assert lines[0].startswith(f"failed   {other}: worker {dead}")
    assert lines[1].startswith(f"shipped  {good}: {file}")
    assert list(other.iterdir()) == []


def test_a_symlinked_or_changed_source_file_is_never_sent(sim: SimServer, tmp_path: Path) -> None:
    reg, src, file = _saved(tmp_path, sim.url)
    dest = tmp_path / "dest"
    dest.mkdir()
    args = ("snapshot", "ship", "loop", "--registry", str(reg.root), "--to", str(dest))
    (src / file).rename(tmp_path / "real.bin")
    (src / file).symlink_to(tmp_path / "real.bin")
    linked = cli(*args, "--worker", sim.url)
    assert linked.returncode == 6 and b"not a regular file there" in linked.stderr
    (src / file).unlink()
    (tmp_path / "real.bin").rename(src / file)
    flip_byte(src / file)
    changed = cli(*args, "--worker", sim.url)
    assert changed.returncode == 3 and b"nothing sent" in changed.stderr
    assert list(dest.iterdir()) == []


def test_every_destination_needs_its_worker(tmp_path: Path) -> None:
    res = cli("snapshot", "ship", "loop", "--to", "a", "--to", "b", "--worker", "http://x")
    assert res.returncode == 2 and b"2 --to but 1 --worker" in res.stderr
