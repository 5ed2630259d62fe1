"""migrate: rename, copy and merge moves; refusals; nothing half-written; history kept byte
for byte; migrations.log; --scan; the one-line hint on an empty default location."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from prefixreg.core.errors import IntegrityError, PrefixregError, RegistryLocationError, UsageError
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry import fsutil, treecopy
from prefixreg.registry import migrate as migrate_mod
from prefixreg.registry.layout import MIGRATIONS_LOG
from prefixreg.registry.location import default_registry_path, legacy_registry_path
from prefixreg.registry.migrate import migrate_registry
from prefixreg.registry.repointing import scan_references
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from tests.conftest import run_cli as run

Snapshot = dict[str, tuple[bytes, int, int]]


def _snapshot(root: Path) -> Snapshot:
    """Every file's bytes, mode and mtime (lock files aside)."""
    out: Snapshot = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".locks" not in p.parts:
            st = p.lstat()
            out[str(p.relative_to(root))] = (
                p.read_bytes(),
                stat.S_IMODE(st.st_mode),
                st.st_mtime_ns,
            )
    return out


def _populate(root: Path) -> Registry:
    reg = Registry(root)
    a = reg.add("alpha prefix\n" * 20, name="alpha", note="first")
    b = reg.add("beta prefix\n" * 30, name="beta")
    reg.add("unnamed\n")
    reg.move_name("alpha", b)
    reg.move_name("alpha", a)
    build = ServerBuild(profile="halogen", identity={"model": "m"})
    for kind in ("warm", "probe"):
        reg.write_measurement(
            Measurement(sha256=a, at="2026-01-01T00:00:00Z", kind=kind, build=build, body={"n": 1})
        )
    (root / "probes").mkdir()
    (root / "probes" / "20260101T000000.000000Z.json").write_bytes(b'{"probe":1}\n')
    fsutil.append_line(root / "mirror.log", b'{"at":"x","ok":true}')
    return reg


def _content(snapshot: Snapshot) -> Snapshot:
    return {k: v for k, v in snapshot.items() if k != MIGRATIONS_LOG}


def _check_moved(before: Snapshot, target: Path, *, method: str) -> None:
    after = _snapshot(target)
    assert _content(after) == before  # bytes, modes and mtimes: history exactly as it was
    lines = (target / MIGRATIONS_LOG).read_bytes().splitlines()
    entry = json.loads(lines[-1])
    assert entry["method"] == method
    assert entry["objects"] == 3
    reg = Registry(target)
    assert verify_registry(reg).findings == []
    assert reg.get("alpha").data == b"alpha prefix\n" * 20


def test_rename_within_one_filesystem(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "state" / "new"
    _populate(old)
    before = _snapshot(old)
    report = migrate_registry(old, new)
    assert report.method == "rename"
    assert report.objects == 3
    assert not old.exists()
    _check_moved(before, new, method="rename")


def test_copy_across_filesystems_preserves_bytes_modes_mtimes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate_mod, "_same_filesystem", lambda _a, _b: False)
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    before = _snapshot(old)
    report = migrate_registry(old, new)
    assert (report.method, report.copied) == ("copy", len(before))
    assert not old.exists()
    _check_moved(before, new, method="copy")
    assert not list(tmp_path.glob(".new.migrating-*"))


def test_exdev_rename_falls_back_to_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    before = _snapshot(old)
    real_rename = Path.rename

    def no_cross_rename(self: Path, target: str | os.PathLike[str]) -> Path:
        if self == old:
            raise OSError(18, "Invalid cross-device link")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", no_cross_rename)
    assert migrate_registry(old, new).method == "copy"
    _check_moved(before, new, method="copy")


def test_default_target_is_the_standard_location(tmp_path: Path) -> None:
    legacy = legacy_registry_path()
    assert legacy == tmp_path / "home" / "prefix-registry"
    _populate(legacy)
    report = migrate_registry(legacy)
    assert Path(report.target) == default_registry_path()
    assert str(default_registry_path()).startswith(str(tmp_path / "xdg-state"))
    assert Registry(default_registry_path()).get("beta").data == b"beta prefix\n" * 30


@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_a_failed_copy_leaves_the_old_registry_intact_and_no_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    monkeypatch.setattr(migrate_mod, "_same_filesystem", lambda _a, _b: False)
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    before = _snapshot(old)
    real_copy, calls = fsutil.copy_durable, [0]

    def flaky(src: Path, dst: Path, *, root: Path | None = None) -> str:
        calls[0] += 1
        if calls[0] == fail_at:
            raise OSError(28, "No space left on device")
        return real_copy(src, dst, root=root)

    monkeypatch.setattr(fsutil, "copy_durable", flaky)
    with pytest.raises(OSError, match="No space"):
        migrate_registry(old, new)
    assert _snapshot(old) == before
    assert not new.exists()
    assert not list(tmp_path.glob(".new.migrating-*"))


def test_a_copy_that_does_not_match_is_discarded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate_mod, "_same_filesystem", lambda _a, _b: False)
    old, new = tmp_path / "old", tmp_path / "new"
    reg = _populate(old)
    before = _snapshot(old)
    real_copy = fsutil.copy_durable
    victim = reg.object_path(reg.resolve("beta"))

    def corrupting(src: Path, dst: Path, *, root: Path | None = None) -> str:
        data = real_copy(src, dst, root=root)
        if src == victim:  # a bad disk at the target: the copy is not what was read
            os.chmod(dst, 0o644)
            dst.write_bytes(b"flipped")
        return data

    monkeypatch.setattr(fsutil, "copy_durable", corrupting)
    with pytest.raises(IntegrityError):
        migrate_registry(old, new)
    assert _snapshot(old) == before
    assert not new.exists()


def test_a_rename_that_does_not_verify_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    before = _snapshot(old)
    real_check, calls = treecopy.check_verifies, [0]

    def second_fails(reg: Registry, what: str) -> list[str]:
        calls[0] += 1
        if calls[0] == 2:
            raise IntegrityError("simulated: the moved registry does not verify")
        return real_check(reg, what)

    monkeypatch.setattr(treecopy, "check_verifies", second_fails)
    with pytest.raises(IntegrityError, match="simulated"):
        migrate_registry(old, new)
    assert _snapshot(old) == before
    assert not new.exists()


def _copy_tree(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst, symlinks=True, copy_function=shutil.copy2)


def test_an_identical_target_is_fine(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    _copy_tree(old, new)
    before = _snapshot(old)
    report = migrate_registry(old, new)
    assert (report.method, report.copied) == ("merge", 0)
    assert not old.exists()
    assert _content(_snapshot(new)).keys() == before.keys()


def test_a_partial_copy_is_completed(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    reg = _populate(old)
    _copy_tree(old, new)
    # An earlier copy taken before more was written: fewer names, a shorter journal.
    for rel in ("names/beta", "probes/20260101T000000.000000Z.json"):
        (new / rel).unlink()
    journal = (new / "names.log").read_bytes().splitlines(keepends=True)
    (new / "names.log").write_bytes(b"".join(journal[:2]))
    before = {k: v[0] for k, v in _snapshot(old).items()}
    names = reg.names()
    report = migrate_registry(old, new)
    assert report.method == "merge"
    assert report.copied == 3
    assert {k: v[0] for k, v in _content(_snapshot(new)).items()} == before
    assert Registry(new).names() == names
    assert not old.exists()


@pytest.mark.parametrize("difference", ["object", "name", "role", "measurement"])
def test_a_different_registry_at_the_target_is_refused(tmp_path: Path, difference: str) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    if difference == "role":
        Registry(new).init(role="mirror")
    else:
        _copy_tree(old, new)
        other = Registry(new)
        if difference == "object":
            other.add("only at the target\n")
        elif difference == "name":
            other.move_name("beta", other.resolve("alpha"))
        else:
            sha = other.resolve("alpha")
            (new / "measurements" / f"{sha}-20990101T000000.000000Z.json").write_bytes(b"{}")
    before_old, before_new = _snapshot(old), _snapshot(new)
    with pytest.raises(RegistryLocationError, match="different registry"):
        migrate_registry(old, new)
    assert _snapshot(old) == before_old
    assert _snapshot(new) == before_new


def test_unmarked_files_at_the_target_are_refused(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    new.mkdir()
    (new / "notes.txt").write_text("mine")
    with pytest.raises(RegistryLocationError, match=r"no REGISTRY\.json"):
        migrate_registry(old, new)
    assert (new / "notes.txt").read_text() == "mine"
    assert Registry(old).get("alpha").sha256


def test_an_empty_target_directory_is_used(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    new.mkdir()
    assert migrate_registry(old, new).method == "rename"
    assert Registry(new).get("alpha").sha256


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_same_or_nested_paths_are_refused(tmp_path: Path, where: str) -> None:
    old = tmp_path / "reg"
    _populate(old)
    target = {"same": old, "inside": old / "sub", "around": tmp_path}[where]
    with pytest.raises(UsageError):
        migrate_registry(old, target)


def test_a_source_that_does_not_verify_is_not_moved(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    reg = _populate(old)
    obj = reg.object_path(reg.resolve("alpha"))
    os.chmod(obj, 0o644)
    obj.write_bytes(b"tampered")
    os.chmod(obj, 0o444)
    with pytest.raises(IntegrityError, match="does not verify"):
        migrate_registry(old, new)
    assert not new.exists()
    assert old.exists()


def test_a_symlink_in_the_source_is_refused(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    (tmp_path / "elsewhere.json").write_text("{}")
    (old / "probes" / "link.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(IntegrityError, match="symlink"):
        migrate_registry(old, new)
    assert not new.exists()


def test_no_registry_at_old_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(RegistryLocationError, match="no registry"):
        migrate_registry(tmp_path / "missing", tmp_path / "new")


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    before = _snapshot(old)
    report = migrate_registry(old, new, dry_run=True)
    assert (report.method, report.dry_run, report.objects) == ("rename", True, 3)
    assert _snapshot(old) == before
    assert not new.exists()


def test_a_second_migration_appends_to_migrations_log(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _populate(a)
    migrate_registry(a, b)
    migrate_registry(b, c)
    lines = [json.loads(x) for x in (c / MIGRATIONS_LOG).read_bytes().splitlines()]
    assert [(x["from"], x["to"]) for x in lines] == [(str(a), str(b)), (str(b), str(c))]


# ---------------------------------------------------------------------------------- scan


def test_scan_lists_every_file_line_naming_the_old_path(tmp_path: Path) -> None:
    home = Path.home()
    old = home / "prefix-registry"
    _populate(old)
    conf = tmp_path / "conf"
    (conf / "systemd").mkdir(parents=True)
    (conf / "agent.toml").write_text(
        f'registry = "{old}"\nother = "~/prefix-registry-old"\nnone = 1\n'
        'again = "~/prefix-registry/objects"\n'
    )
    (conf / "systemd" / "mirror.service").write_text(
        "[Service]\nExecStart=prefix-mirror --registry %h/prefix-registry\n"
        "Environment=PREFIXREG_HOME=$HOME/prefix-registry\n"
    )
    (conf / "blob.bin").write_bytes(b"\0\0~/prefix-registry\n")
    (conf / ".git").mkdir()
    (conf / ".git" / "config").write_text("~/prefix-registry\n")
    found = {(Path(r.path).name, r.line) for r in scan_references(old, [conf])}
    assert found == {
        ("agent.toml", 1),
        ("agent.toml", 4),
        ("mirror.service", 2),
        ("mirror.service", 3),
    }


def test_cli_migrate_scan_and_summary(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    units = tmp_path / "units"
    units.mkdir()
    (units / "a.service").write_text(f"x\nExecStart=prefix-mirror --registry {old}\n")
    proc = run("migrate", str(old), "--to", str(new), "--scan", str(units))
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout.decode()
        == f"{units / 'a.service'}:2: ExecStart=prefix-mirror --registry {old}\n"
    )
    assert b"by rename: 3 objects verified" in proc.stderr
    assert b"1 references" in proc.stderr
    # Coming back later for --scan only: nothing to move, references still listed.
    again = run("migrate", str(old), "--to", str(new), "--scan", str(units), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["method"] == "none"
    assert len(json.loads(again.stdout)["stale"]) == 1


def test_cli_refusal_exit_codes(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    Registry(new).add("someone else's\n")
    proc = run("migrate", str(old), "--to", str(new))
    assert proc.returncode == 2
    assert b"different registry" in proc.stderr
    assert b"Traceback" not in proc.stderr
    missing = run("migrate", str(tmp_path / "nothing"), "--to", str(new))
    assert missing.returncode == 2


# ---------------------------------------------------------------------------------- hint


def test_hint_when_the_default_is_empty_and_the_old_location_exists(tmp_path: Path) -> None:
    _populate(legacy_registry_path())
    proc = run("ls")
    assert proc.returncode == 0, proc.stderr
    hints = [line for line in proc.stderr.decode().splitlines() if line.startswith("hint:")]
    assert hints == [
        "hint: found a registry at ~/prefix-registry; run prefixreg migrate ~/prefix-registry"
    ]
    # An explicit registry is the user's choice: no hint.
    explicit = run("ls", "--registry", str(tmp_path / "other"))
    assert b"hint:" not in explicit.stderr
    # After the move the default holds the registry: no hint either.
    assert run("migrate", str(legacy_registry_path())).returncode == 0
    after = run("ls")
    assert b"hint:" not in after.stderr
    assert len(after.stdout.splitlines()) == 3


def test_no_hint_without_an_old_registry(tmp_path: Path) -> None:
    proc = run("ls")
    assert proc.returncode == 0
    assert proc.stderr == b""


# -- writes during a move, symlinked roots ------------------------------------------------


def test_a_symlinked_source_root_moves_the_directory_not_the_link(tmp_path: Path) -> None:
    real, link, new = tmp_path / "disk" / "reg", tmp_path / "home-reg", tmp_path / "state" / "reg"
    _populate(real)
    link.symlink_to(real)
    before = _snapshot(real)
    report = migrate_registry(link, new)
    assert report.method == "rename"
    assert not new.is_symlink() and new.is_dir()
    _check_moved(before, new, method="rename")
    assert not real.exists() and link.is_symlink() and not link.exists()  # dangles
    assert any("symlink" in w for w in report.warnings)
    entry = json.loads((new / MIGRATIONS_LOG).read_bytes().splitlines()[-1])
    assert entry["from"] == str(link)
    again = migrate_registry(link, new)  # a re-run (for --scan) finds the move done
    assert again.method == "none" and "nothing to move" in again.warnings[0]


def test_a_symlinked_source_root_is_copied_across_filesystems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate_mod, "_same_filesystem", lambda _a, _b: False)
    real, link, new = tmp_path / "disk" / "reg", tmp_path / "home-reg", tmp_path / "new"
    _populate(real)
    link.symlink_to(real)
    before = _snapshot(real)
    assert migrate_registry(link, new).method == "copy"
    _check_moved(before, new, method="copy")
    assert not real.exists()


def _late_writes(old: Path) -> dict[str, object]:
    """What an agent loop (no lock needed) and a mirror run write while a move copies."""
    reg = Registry(old)
    late = reg.add("added by the agent loop during the migration\n")
    noted = reg.resolve("beta")
    reg.add("beta prefix\n" * 30, note="a note added meanwhile")  # meta replaced
    build = ServerBuild(profile="halogen", identity={"model": "m"})
    measured = reg.write_measurement(
        Measurement(sha256=late, at="2026-01-02T00:00:00Z", kind="warm", build=build, body={})
    )
    fsutil.append_line(old / "mirror.log", b'{"at":"y","ok":true}')
    return {"late": late, "noted": noted, "measured": measured.name}


@pytest.mark.parametrize("method", ["copy", "merge"])
def test_writes_during_a_copy_or_merge_are_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    monkeypatch.setattr(migrate_mod, "_same_filesystem", lambda _a, _b: False)
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    if method == "merge":
        _copy_tree(old, new)
        (new / "mirror.log").unlink()
    name = "_move_by_copy" if method == "copy" else "_move_by_merge"
    real_move = getattr(migrate_mod, name)
    written: dict[str, object] = {}

    def move_then_write(*args: object, **kwargs: object) -> object:
        out = real_move(*args, **kwargs)
        written.update(_late_writes(old))
        return out

    monkeypatch.setattr(migrate_mod, name, move_then_write)
    report = migrate_registry(old, new)
    assert report.method == method and written
    assert not old.exists()
    assert not list(tmp_path.glob(".old.migrated-*"))
    reg = Registry(new)
    assert verify_registry(reg).ok, verify_registry(reg).findings
    assert str(written["late"]) in set(reg.iter_shas())
    assert reg.meta(str(written["late"])) is not None
    assert reg.meta(str(written["noted"])).note == "a note added meanwhile"
    assert (new / "measurements" / str(written["measured"])).is_file()
    assert (new / "mirror.log").read_bytes().endswith(b'{"at":"y","ok":true}\n')
    assert report.files == len(_content(_snapshot(new)))


def test_a_write_landing_after_the_source_was_renamed_aside_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate_mod, "_same_filesystem", lambda _a, _b: False)
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    real_catch_up = treecopy.catch_up
    landed: list[str] = []

    def catch_up(source: Path, *args: object) -> list[str]:
        if source.name.startswith(".old.migrated-") and not landed:
            # An in-flight append that completes just after the rename.
            fsutil.append_line(source / "mirror.log", b'{"at":"z","ok":true}')
            landed.append(source.name)
        return real_catch_up(source, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(treecopy, "catch_up", catch_up)
    migrate_registry(old, new)
    assert landed and not old.exists()
    assert (new / "mirror.log").read_bytes().endswith(b'{"at":"z","ok":true}\n')


def test_a_file_changed_at_both_ends_keeps_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate_mod, "_same_filesystem", lambda _a, _b: False)
    old, new = tmp_path / "old", tmp_path / "new"
    _populate(old)
    real_move = migrate_mod._move_by_copy

    def move_then_diverge(*args: object, **kwargs: object) -> list[str]:
        out = real_move(*args, **kwargs)  # type: ignore[arg-type]
        fsutil.append_line(old / "mirror.log", b'{"at":"origin side"}')
        fsutil.append_line(new / "mirror.log", b'{"at":"target side"}')
        return out

    monkeypatch.setattr(migrate_mod, "_move_by_copy", move_then_diverge)
    with pytest.raises(PrefixregError, match="changed both"):
        migrate_registry(old, new)
    assert (old / "REGISTRY.json").is_file() and verify_registry(Registry(old)).ok
    assert (old / "mirror.log").read_bytes().endswith(b'{"at":"origin side"}\n')
    assert not list(tmp_path.glob(".old.migrated-*"))
