"""Nothing followed, every file's mode checked, bad input refused (#12, #13 registry rows).

Each test reproduces a row of the issues' tables with real files and the real CLI.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from prefixreg.core.errors import IntegrityError, InvalidNameError, UsageError
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from tests.conftest import run_cli as run

DAY = 86400.0
_BUILD = ServerBuild(profile="halogen", identity={"model": "m"})


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def _outside_with_old_object(tmp_path: Path, registry: Registry, which: str) -> Path:
    """Move `which` (objects or meta) outside and put a symlink in its place; the outside
    directory holds an old unnamed object and its meta record."""
    sha = registry.add("old unnamed\n")
    _age(registry.object_path(sha), 30 * DAY)
    outside = tmp_path / f"outside-{which}"
    (registry.root / which).rename(outside)
    (registry.root / which).symlink_to(outside, target_is_directory=True)
    return outside


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


# ------------------------------------------------------------------ nothing followed


@pytest.mark.parametrize("which", ["objects", "meta"])
def test_gc_refuses_a_symlinked_directory_and_the_outside_file_survives(
    registry: Registry, tmp_path: Path, which: str
) -> None:
    outside = _outside_with_old_object(tmp_path, registry, which)
    before = _files(outside)
    assert before
    result = run("gc", "--registry", str(registry.root), "--prune-unnamed", "--grace", "0")
    assert result.returncode == 3, result.stderr
    assert b"symlink" in result.stderr
    assert b"Traceback" not in result.stderr
    assert _files(outside) == before  # the outside files survive, untouched


def test_ls_refuses_a_symlinked_objects_directory(registry: Registry, tmp_path: Path) -> None:
    _outside_with_old_object(tmp_path, registry, "objects")
    result = run("ls", "--registry", str(registry.root))
    assert result.returncode == 3, result.stderr
    assert result.stdout == b""  # nothing listed through the link


@pytest.mark.parametrize("kind", ["dir", "fifo"])
def test_an_object_that_is_not_a_regular_file_fails_reads_and_is_reported(
    registry: Registry, kind: str
) -> None:
    sha = registry.add("will be replaced\n", name="n")
    path = registry.object_path(sha)
    os.chmod(path, 0o644)
    path.unlink()
    if kind == "dir":
        path.mkdir()
    else:
        os.mkfifo(path)
    with pytest.raises(IntegrityError):
        registry.list_objects()
    with pytest.raises(IntegrityError):
        registry.get("n")
    assert run("ls", "--registry", str(registry.root)).returncode == 3
    assert run("cat", "n", "--registry", str(registry.root)).returncode == 3
    report = verify_registry(registry)
    assert ("corrupt", f"objects/{sha[:2]}/{sha}.txt") in {
        (f.kind, f.path) for f in report.findings
    }
    with pytest.raises(IntegrityError):
        from prefixreg.registry.gc import collect_garbage

        collect_garbage(registry, grace_s=0, prune_unnamed=True)


def test_migrate_refuses_a_symlinked_objects_directory(registry: Registry, tmp_path: Path) -> None:
    outside = _outside_with_old_object(tmp_path, registry, "objects")
    before = _files(outside)
    target = tmp_path / "new"
    result = run("migrate", str(registry.root), "--to", str(target))
    assert result.returncode == 3, result.stderr
    assert not target.exists()
    assert _files(outside) == before
    assert (registry.root / "objects").is_symlink()  # the source is left as it was


def test_a_symlinked_probes_directory_gets_no_receipt(registry: Registry, tmp_path: Path) -> None:
    registry.init()
    outside = tmp_path / "outside-probes"
    outside.mkdir()
    (registry.root / "probes").symlink_to(outside, target_is_directory=True)

    def render(json_path: Path, md_path: Path) -> tuple[bytes, bytes]:
        return b"{}\n", b"# verdict\n"

    with pytest.raises(IntegrityError, match="symlink"):
        registry.write_probe_receipt("20261201T000000.000000Z", render)
    with pytest.raises(IntegrityError, match="symlink"):
        registry.probe_receipts()
    assert list(outside.iterdir()) == []


def test_a_symlinked_locks_directory_gets_no_lock_file(registry: Registry, tmp_path: Path) -> None:
    sha = registry.add("x\n")
    outside = tmp_path / "outside-locks"
    outside.mkdir()
    locks = registry.root / ".locks"
    for entry in locks.iterdir():
        entry.unlink()
    locks.rmdir()
    locks.symlink_to(outside, target_is_directory=True)
    result = run("name", "s1", sha, "--registry", str(registry.root))
    assert result.returncode == 3, result.stderr
    assert list(outside.iterdir()) == []
    assert registry.read_name("s1") is None


# ------------------------------------------------------------------------------ modes


def test_verify_flags_every_file_writable_by_others(registry: Registry) -> None:
    sha = registry.add("x\n", name="n", note="note")
    registry.write_measurement(
        Measurement(sha256=sha, at="2026", kind="warm", build=_BUILD, body={})
    )
    registry.write_probe_receipt(
        "20261201T000000.000000Z", lambda _j, _m: (b"{}\n", b"# verdict\n")
    )
    assert verify_registry(registry).findings == []
    measurement = next((registry.root / "measurements").iterdir())
    targets = [
        "names/n",
        f"meta/{sha}.json",
        "names.log",
        f"measurements/{measurement.name}",
        "probes/20261201T000000.000000Z.json",
        "REGISTRY.json",
    ]
    for rel in targets:
        os.chmod(registry.root / rel, 0o666)  # noqa: S103 -- the insecure mode under test
    flagged = {f.path for f in verify_registry(registry).findings if f.kind == "insecure_mode"}
    assert flagged == set(targets)
    assert not verify_registry(registry).ok


# ------------------------------------------------------------------ bad input (#13)


@pytest.mark.parametrize(
    ("content", "kwargs"),
    [
        (123, {}),
        ("x", {"note": 5}),
        ("x", {"source": None}),
        ("x", {"note": "bad \udcff note"}),
        ("x", {"source": "bad \udcff"}),
        ("bad \ud800 content", {}),
    ],
)
def test_add_refuses_bad_arguments_and_writes_nothing(
    registry: Registry, content: object, kwargs: dict[str, object]
) -> None:
    with pytest.raises(UsageError):
        registry.add(content, **kwargs)  # type: ignore[arg-type]
    assert list(registry.iter_shas()) == []
    assert not (registry.root / "meta").exists() or not any((registry.root / "meta").iterdir())
    assert run("ls", "--registry", str(registry.root)).returncode == 0


def test_cli_add_refuses_a_note_that_is_not_utf8(tmp_path: Path) -> None:
    root = tmp_path / "reg"
    src = tmp_path / "p.txt"
    src.write_bytes(b"hello\n")
    result = run("add", str(src), "--note", os.fsdecode(b"\xff\xfe"), "--registry", str(root))
    assert result.returncode == 2, result.stderr
    assert b"Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (root / "objects").exists() or not any((root / "objects").rglob("*.txt"))


def test_cli_add_of_a_file_whose_name_is_not_utf8(tmp_path: Path) -> None:
    root = tmp_path / "reg"
    src = tmp_path / os.fsdecode(b"caf\xe9.txt")
    src.write_bytes(b"hello\n")
    result = run("add", str(src), "--registry", str(root))
    assert result.returncode == 0, result.stderr
    sha = result.stdout.decode().strip()
    reg = Registry(root)
    assert reg.meta(sha).source == "caf\\xe9.txt"  # an escaped, valid-text label
    assert verify_registry(reg).ok
    assert run("ls", "--registry", str(root)).returncode == 0


def test_names_that_read_as_a_sha_are_refused_but_old_ones_resolve(registry: Registry) -> None:
    a = registry.add("a\n")
    b = registry.add("b\n")
    with pytest.raises(InvalidNameError):
        registry.move_name("deadbeef", a)
    result = run("name", a[:8], b, "--registry", str(registry.root))
    assert result.returncode == 2, result.stderr
    # One written by an older version (journalled, so only the sha warning remains).
    (registry.root / "names" / "cafebabe").write_text(a + "\n")
    with (registry.root / "names.log").open("ab") as log:
        line = {"at": "2026-01-01T00:00:00.000000Z", "name": "cafebabe", "from": None, "to": a}
        log.write(json.dumps(line).encode() + b"\n")
    assert registry.resolve("cafebabe") == a
    report = verify_registry(registry)
    assert report.ok
    assert [(f.kind, f.severity) for f in report.findings] == [("sha_like_name", "warning")]


def test_ls_and_show_escape_control_characters(registry: Registry) -> None:
    note = "\x1b[31mred\x1b[0m\nforged line"
    sha = registry.add("x\n", name="n", note=note)
    for args in (("ls",), ("show", "n")):
        result = run(*args, "--registry", str(registry.root))
        assert result.returncode == 0, result.stderr
        assert b"\x1b" not in result.stdout
        assert b"\\x1b[31mred" in result.stdout
        assert b"\nforged line" not in result.stdout
    data = json.loads(run("ls", "--json", "--registry", str(registry.root)).stdout)
    assert data[0]["note"] == note and data[0]["sha256"] == sha  # JSON stays exact
