"""gc: strays older than the grace go; unnamed objects only with prune_unnamed; never a named
or recently measured one; under the registry lock; dry runs change nothing."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from prefixreg.core.errors import IntegrityError, LockTimeoutError, UsageError
from prefixreg.core.jsonio import JSONValue
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry import gc as gc_mod
from prefixreg.registry.gc import collect_garbage, parse_grace
from prefixreg.registry.objects import Objects
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from tests.conftest import run_cli as run

DAY = 86400.0


def _age(path: Path, seconds: float) -> None:
    moment = time.time() - seconds
    os.utime(path, (moment, moment), follow_symlinks=False)


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".locks" not in p.parts
    }


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("14d", 14 * DAY), ("12h", 43200), ("30m", 1800), ("45s", 45), ("0", 0), ("2w", 14 * DAY)],
)
def test_parse_grace(text: str, seconds: float) -> None:
    assert parse_grace(text) == seconds


@pytest.mark.parametrize("text", ["", "14", "-1d", "1y", "d", "1.5.2h", "1 d x"])
def test_parse_grace_refuses_nonsense(text: str) -> None:
    with pytest.raises(UsageError):
        parse_grace(text)


def test_strays_older_than_grace_are_removed_young_ones_kept(registry: Registry) -> None:
    sha = registry.add("content\n", name="n")
    old = registry.root / "objects" / sha[:2] / f".{sha}.txt.abc123.tmp"
    young = registry.root / "meta" / f".{sha}.json.def456.tmp"
    root_stray = registry.root / ".REGISTRY.json.x.tmp"
    for p in (old, young, root_stray):
        p.write_bytes(b"partial")
    _age(old, 15 * DAY)
    _age(root_stray, 15 * DAY)

    dry = collect_garbage(registry, grace_s=14 * DAY, dry_run=True)
    assert {i.path for i in dry.removed} == {
        str(old.relative_to(registry.root)),
        ".REGISTRY.json.x.tmp",
    }
    assert old.exists() and root_stray.exists()  # a dry run changes nothing

    report = collect_garbage(registry, grace_s=14 * DAY)
    assert [i.kind for i in report.removed] == ["stray", "stray"]
    assert not old.exists() and not root_stray.exists()
    assert young.exists()
    assert registry.get("n").data == b"content\n"


def test_unnamed_objects_only_go_with_prune_unnamed(registry: Registry) -> None:
    named = registry.add("named\n", name="keep")
    unnamed = registry.add("unnamed\n")
    for sha in (named, unnamed):
        _age(registry.object_path(sha), 30 * DAY)

    report = collect_garbage(registry, grace_s=14 * DAY)
    assert report.removed == []
    assert set(registry.iter_shas()) == {named, unnamed}

    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    assert [(i.kind, i.path) for i in report.removed] == [
        ("object", f"objects/{unnamed[:2]}/{unnamed}.txt"),
        ("meta", f"meta/{unnamed}.json"),
    ]
    assert set(registry.iter_shas()) == {named}
    assert not (registry.root / "meta" / f"{unnamed}.json").exists()
    assert verify_registry(registry).findings == []


def test_young_unnamed_objects_are_kept(registry: Registry) -> None:
    sha = registry.add("fresh\n")
    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    assert report.removed == []
    assert report.kept[sha] == "used within the grace period"


def test_re_adding_refreshes_age(registry: Registry) -> None:
    sha = registry.add("again\n")
    _age(registry.object_path(sha), 30 * DAY)
    registry.add("again\n")  # re-use refreshes the mtime
    assert collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True).removed == []
    assert sha in set(registry.iter_shas())


def _measure(reg: Registry, sha: str) -> Path:
    build = ServerBuild(profile="halogen", identity={"model": "m"})
    m = Measurement(sha256=sha, at="2026-01-01T00:00:00.000000Z", kind="warm", build=build, body={})
    return reg.write_measurement(m)


def test_recent_measurement_protects_an_unnamed_object(registry: Registry) -> None:
    sha = registry.add("measured\n")
    _age(registry.object_path(sha), 30 * DAY)
    _measure(registry, sha)  # written now: newer than the grace
    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    assert report.removed == []
    assert "measurement" in report.kept[sha]


def test_old_measurement_does_not_protect_and_is_never_removed(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = registry.add("measured long ago\n")
    _age(registry.object_path(sha), 30 * DAY)
    monkeypatch.setattr("prefixreg.registry.layout.utc_now", lambda: time.time() - 30 * DAY)
    path = _measure(registry, sha)
    monkeypatch.undo()
    _age(path, 30 * DAY)
    before = path.read_bytes()
    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    assert {i.kind for i in report.removed} == {"object", "meta"}
    assert path.read_bytes() == before  # history stays, byte for byte


def test_a_concurrent_re_add_during_the_claim_keeps_the_object(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = registry.add("racing\n")
    _age(registry.object_path(sha), 30 * DAY)
    real_claim = gc_mod._claim

    def claim_then_touch(path: Path) -> Path | None:
        claimed = real_claim(path)
        if claimed is not None and path.suffix == ".txt":
            os.utime(claimed)  # what add's mtime refresh does to the same inode
        return claimed

    monkeypatch.setattr(gc_mod, "_claim", claim_then_touch)
    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    assert report.removed == []
    assert report.kept[sha] == "re-added while gc ran"
    assert registry.get(sha).data == b"racing\n"
    assert registry.meta(sha).sha256 == sha
    assert verify_registry(registry).findings == []


def test_gc_takes_the_registry_lock(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg", lock_timeout=0.2)
    reg.add("x\n")
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with Registry(tmp_path / "reg").lock():
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(10)
        with pytest.raises(LockTimeoutError):
            collect_garbage(reg, grace_s=0)
    finally:
        release.set()
        thread.join()
    collect_garbage(reg, grace_s=0)  # free again


def test_gc_never_creates_a_registry(tmp_path: Path) -> None:
    report = collect_garbage(Registry(tmp_path / "none"), grace_s=0, prune_unnamed=True)
    assert report.removed == []
    assert not (tmp_path / "none").exists()


def test_prune_is_refused_on_a_mirror(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "mirror")
    reg.init(role="mirror")
    with pytest.raises(UsageError, match="mirror"):
        collect_garbage(reg, grace_s=0, prune_unnamed=True)
    collect_garbage(reg, grace_s=0)  # strays may still go


def test_strays_on_a_mirror_still_go_despite_the_mirror_write_guard(tmp_path: Path) -> None:
    """The store refuses add/name/measurement writes on a mirror; gc's removals are not
    such writes and keep working there."""
    reg = Registry(tmp_path / "mirror")
    reg.init(role="mirror")
    stray = reg.root / "names" / ".n.abc123.tmp"
    (reg.root / "names").mkdir(exist_ok=True)
    stray.write_bytes(b"half")
    _age(stray, 2 * DAY)
    report = collect_garbage(reg, grace_s=DAY)
    assert [item.path for item in report.removed] == ["names/.n.abc123.tmp"]
    assert not stray.exists()


def test_gc_does_not_walk_into_a_symlinked_directory(registry: Registry, tmp_path: Path) -> None:
    registry.init()
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / ".victim.tmp"
    victim.write_bytes(b"not ours")
    _age(victim, 30 * DAY)
    (registry.root / "probes").symlink_to(outside)
    with pytest.raises(IntegrityError, match="symlink"):
        collect_garbage(registry, grace_s=0, prune_unnamed=True)
    assert victim.read_bytes() == b"not ours"


def test_cli_gc_json_and_dry_run(tmp_path: Path) -> None:
    root = tmp_path / "reg"
    reg = Registry(root)
    sha = reg.add("cli\n")
    _age(reg.object_path(sha), 30 * DAY)
    before = _tree(root)

    dry = run("gc", "--registry", str(root), "--prune-unnamed", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    data = json.loads(dry.stdout)
    assert data["dry_run"] is True
    assert {i["kind"] for i in data["removed"]} == {"object", "meta"}
    assert _tree(root) == before

    plain = run("gc", "--registry", str(root), "--prune-unnamed", "--grace", "1d")
    assert plain.returncode == 0, plain.stderr
    assert b"removed object" in plain.stdout
    assert b"1 unnamed objects" in plain.stderr
    assert list(reg.iter_shas()) == []

    bad = run("gc", "--registry", str(root), "--grace", "soon")
    assert bad.returncode == 2
    assert b"error: invalid grace period" in bad.stderr


def test_young_strays_survive_even_a_zero_grace(registry: Registry) -> None:
    registry.init()
    in_flight = registry.root / "meta" / ".abc.json.x1.tmp"
    in_flight.write_bytes(b"being written")
    assert collect_garbage(registry, grace_s=0).removed == []
    assert in_flight.exists()
    report = collect_garbage(registry, grace_s=0, now=time.time() + gc_mod.MIN_AGE_S + 1)
    assert [i.path for i in report.removed] == ["meta/.abc.json.x1.tmp"]


def test_add_republishes_an_object_gc_removed_under_it(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = registry.add("vanishing\n")
    real, calls = Objects.read, [0]

    def vanish_after_check(self: Objects, s: str) -> bytes:
        data = real(self, s)
        if calls[0] == 0:  # gc claims the object between add's check and its mtime refresh
            calls[0] += 1
            registry.object_path(s).unlink()
        return data

    monkeypatch.setattr(Objects, "read", vanish_after_check)
    assert registry.add("vanishing\n") == sha
    monkeypatch.undo()
    assert registry.get(sha).data == b"vanishing\n"


def test_a_name_never_moves_to_an_object_gc_removed_meanwhile(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixreg.core.errors import RefNotFoundError

    sha = registry.add("short-lived\n")
    real = Objects.read

    def removed_before_the_lock(self: Objects, s: str) -> bytes:
        data = real(self, s)
        registry.object_path(s).unlink()  # gc ran between the check and the locked write
        return data

    monkeypatch.setattr(Objects, "read", removed_before_the_lock)
    with pytest.raises(RefNotFoundError):
        registry.move_name("n", sha)
    monkeypatch.undo()
    assert registry.names() == {}
    assert registry.name_log() == []


TOOLS_A = '[{"type": "function", "function": {"name": "a"}}]'
TOOLS_B = '[{"type": "function", "function": {"name": "b"}}]'


def _age_all(reg: Registry, seconds: float) -> None:
    for sub in ("objects", "frames"):
        for path in (reg.root / sub).rglob("*"):
            if path.is_file():
                _age(path, seconds)


def test_prune_unnamed_removes_an_old_unnamed_frame_first_then_the_parts_it_held(
    registry: Registry,
) -> None:
    """An unnamed frame is debris like an unnamed prefix: gone with --prune-unnamed, its
    record before its parts, and a part another (named) frame holds stays."""
    loose_system = registry.add("a system nobody names\n")
    registry.add("the named system\n", name="sys")
    unnamed = registry.add_frame(loose_system, tools=TOOLS_A)
    shared_tools = registry.add_frame(loose_system, tools=TOOLS_B)  # unnamed too
    named = registry.add_frame("sys", tools=TOOLS_B, name="head")  # holds TOOLS_B
    tools_a = registry.frame(unnamed).tools_sha256 or ""
    tools_b = registry.frame(named).tools_sha256 or ""
    _age_all(registry, 30 * DAY)
    before = _tree(registry.root)

    dry = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True, dry_run=True)
    assert _tree(registry.root) == before  # a dry run decides the same way, changes nothing

    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    removed = [(i.kind, i.path) for i in report.removed]
    assert removed == [(i.kind, i.path) for i in dry.removed]
    frames = {("frame", f"frames/{unnamed}.json"), ("frame", f"frames/{shared_tools}.json")}
    assert set(removed[:2]) == frames  # the records first: no frame outlives a part
    assert set(removed[2:]) == {
        ("object", f"objects/{loose_system[:2]}/{loose_system}.txt"),
        ("meta", f"meta/{loose_system}.json"),
        ("object", f"objects/{tools_a[:2]}/{tools_a}.txt"),
        ("meta", f"meta/{tools_a}.json"),
    }
    assert registry.frame("head").tools == registry.frame(named).tools  # named: intact
    assert tools_b in set(registry.iter_shas())  # the named frame still holds it
    assert verify_registry(registry).findings == []


def test_an_unnamed_frame_that_is_kept_says_why_and_keeps_its_parts(registry: Registry) -> None:
    system = registry.add("system\n")
    measured = registry.add_frame(system, tools=TOOLS_A)
    young = registry.add_frame(system, tools=TOOLS_B)
    _age_all(registry, 30 * DAY)
    _age(registry.root / "frames" / f"{young}.json", 0)
    build = ServerBuild(profile="halogen", identity={"model": "m"})
    body: dict[str, JSONValue] = {"frame": measured, "verdict": "resumed"}
    at = "2026-01-01T00:00:00.000000Z"
    registry.write_measurement(
        Measurement(sha256=system, at=at, kind="warm", build=build, body=body)
    )

    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    assert report.removed == []
    assert "measurement" in report.kept[measured]
    assert report.kept[young] == "used within the grace period"
    # Both frames verify: their parts (held by a kept frame, so not debris) are all there,
    # and each is listed as kept, saying why.
    assert {registry.frame(sha).sha256 for sha in (measured, young)} == {measured, young}
    frames = [registry.frame(sha) for sha in (measured, young)]
    parts = {system} | {f.tools_sha256 for f in frames if f.tools_sha256 is not None}
    assert len(parts) == 3 and all(
        report.kept[p].startswith("a frame kept holds it") for p in parts
    )


def test_re_registering_a_frame_refreshes_its_age(registry: Registry) -> None:
    system = registry.add("system\n")
    frame = registry.add_frame(system, tools=TOOLS_A)
    _age_all(registry, 30 * DAY)
    assert registry.add_frame(system, tools=TOOLS_A) == frame  # a loop registering it again
    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    assert report.removed == []
    assert report.kept[frame] == "used within the grace period"
    assert registry.frame(frame).sha256 == frame


def test_a_frame_re_registered_during_the_claim_is_put_back(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = registry.add("system\n")
    frame = registry.add_frame(system, tools=TOOLS_A)
    _age_all(registry, 30 * DAY)
    real_claim = gc_mod._claim

    def claim_then_touch(path: Path) -> Path | None:
        claimed = real_claim(path)
        if claimed is not None and path.parent.name == "frames":
            os.utime(claimed)  # what add_frame's refresh does to the same inode
        return claimed

    monkeypatch.setattr(gc_mod, "_claim", claim_then_touch)
    report = collect_garbage(registry, grace_s=14 * DAY, prune_unnamed=True)
    assert report.removed == []
    assert report.kept[frame] == "re-added while gc ran"
    assert registry.frame(frame).sha256 == frame  # its parts stayed with it
    assert verify_registry(registry).findings == []


def test_cli_gc_lists_the_unnamed_frames_it_removes(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    system = reg.add("system\n")
    frame = reg.add_frame(system, tools=TOOLS_A)
    _age_all(reg, 30 * DAY)
    res = run("gc", "--prune-unnamed", "--grace", "0", "--json", "--registry", str(reg.root))
    assert res.returncode == 0, res.stderr
    removed = [(i["kind"], i["path"]) for i in json.loads(res.stdout)["removed"]]
    assert removed[0] == ("frame", f"frames/{frame}.json")
    assert {kind for kind, _path in removed} == {"frame", "object", "meta"}
    assert run("ls", "--json", "--registry", str(reg.root)).stdout.strip() == b"[]"
