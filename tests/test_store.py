"""The store: exact bytes, verify-at-use, names, measurements, bad input."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

import prefixreg
from prefixreg.core.errors import (
    AmbiguousRefError,
    CorruptRecordError,
    IntegrityError,
    InvalidContentError,
    InvalidDigestError,
    InvalidNameError,
    RefNotFoundError,
    RegistryLocationError,
    UsageError,
)
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry.store import NameConflictError, Registry
from prefixreg.registry.verify import verify_registry

TRICKY = "line one\r\nline two with trailing spaces   \r\n\tcafé 🚀 𝔘𝔫𝔦 no final newline".encode()


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes (for 'nothing was written' checks)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def flip_byte(path: Path, offset: int = 0) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    os.chmod(path, 0o444)


def test_add_keeps_exact_bytes_and_object_file_is_named_by_its_sha(registry: Registry) -> None:
    sha = registry.add(TRICKY, name="tricky")
    path = registry.object_path(sha)
    assert path.read_bytes() == TRICKY
    assert hashlib.sha256(path.read_bytes()).hexdigest() == path.name.removesuffix(".txt") == sha
    assert path.parent.name == sha[:2]
    assert registry.get("tricky").data == TRICKY
    assert registry.get("tricky").text.encode() == TRICKY
    assert path.stat().st_mode & 0o777 == 0o444


def test_add_is_idempotent_and_refreshes_mtime(registry: Registry) -> None:
    sha = registry.add("hello")
    path = registry.object_path(sha)
    os.utime(path, (1_000_000, 1_000_000))
    assert registry.add("hello") == sha
    assert path.stat().st_mtime > 1_000_000
    assert len(list(registry.iter_shas())) == 1
    assert verify_registry(registry).findings == []


def test_meta_records_size_source_and_note(registry: Registry) -> None:
    sha = registry.add("abc", note="first", source="x.txt")
    meta = registry.meta(sha)
    assert (meta.sha256, meta.bytes, meta.source, meta.note) == (sha, 3, "x.txt", "first")
    registry.add("abc", note="second")
    assert registry.meta(sha).note == "second"
    assert registry.meta(sha).created == meta.created


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"", InvalidContentError),
        (b"\xff\xfe bad", InvalidContentError),
        (b"a\xc3", InvalidContentError),
    ],
)
def test_bad_content_is_refused_and_nothing_is_written(
    registry: Registry, content: bytes, error: type[Exception]
) -> None:
    with pytest.raises(error):
        registry.add(content)
    assert tree(registry.root) == {}


@pytest.mark.parametrize(
    "name", ["a" * 64, "A" * 64, "has/slash", ".hidden", "-dash", "", "x" * 129, "sp ace", "é"]
)
def test_bad_names_are_refused_and_nothing_is_written(registry: Registry, name: str) -> None:
    with pytest.raises(InvalidNameError):
        registry.add("content", name=name)
    assert tree(registry.root) == {}


def test_flipped_byte_fails_closed_on_every_read_path(registry: Registry) -> None:
    sha = registry.add("the exact prefix", name="p")
    flip_byte(registry.object_path(sha))
    for call in (registry.get, registry.head):
        with pytest.raises(IntegrityError) as info:
            call("p")
        assert info.value.expected == sha
        assert info.value.actual is not None and info.value.actual != sha
        assert info.value.path == registry.object_path(sha)
        assert str(registry.object_path(sha)) in str(info.value)
    with pytest.raises(IntegrityError):
        registry.add("the exact prefix")
    with pytest.raises(IntegrityError):
        registry.move_name("q", sha)
    report = verify_registry(registry)
    assert not report.ok
    assert [f.kind for f in report.findings] == ["corrupt"]


def test_symlinked_object_is_refused_never_followed(registry: Registry, tmp_path: Path) -> None:
    sha = registry.add("real")
    path = registry.object_path(sha)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"real")
    os.chmod(path, 0o644)
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(IntegrityError, match="symlink"):
        registry.get(sha)
    assert "symlink" in [f.kind for f in verify_registry(registry).findings]


def test_references_name_full_sha_and_unique_abbreviation(registry: Registry) -> None:
    sha = registry.add("one", name="first")
    assert registry.resolve("first") == sha
    assert registry.resolve(sha) == sha
    assert registry.resolve(sha[:8]) == sha
    assert registry.resolve(sha[:8].upper()) == sha
    assert registry.get("first").name == "first"
    assert registry.get(sha).name is None


def test_ambiguous_abbreviation_lists_candidates(registry: Registry) -> None:
    sha = registry.add("one")
    # A second object file sharing the first 8 hex digits (a real collision is out of reach).
    twin = sha[:8] + ("0" if sha[8] != "0" else "1") + sha[9:]
    registry.object_path(twin).write_bytes(b"twin")
    with pytest.raises(AmbiguousRefError) as info:
        registry.resolve(sha[:8])
    assert set(info.value.candidates) == {sha, twin}
    assert registry.resolve(sha[:9]) == sha


@pytest.mark.parametrize("ref", ["../etc/passwd", "a/b", "abc", "zzzzzzzzzz", "nope", "1234567"])
def test_unknown_or_pathlike_refs_are_usage_errors(registry: Registry, ref: str) -> None:
    registry.add("x")
    with pytest.raises((RefNotFoundError, InvalidDigestError, InvalidNameError)):
        registry.resolve(ref)


def test_names_move_with_compare_and_swap_and_journal(registry: Registry) -> None:
    a = registry.add("a", name="n")
    b = registry.add("b")
    assert registry.move_name("n", b, expect=a) is not None
    with pytest.raises(NameConflictError):
        registry.move_name("n", a, expect=a)
    assert registry.move_name("n", b) is None  # already there: no journal line
    log = registry.name_log()
    assert [(m.name, m.from_sha, m.to_sha) for m in log] == [("n", None, a), ("n", a, b)]
    assert registry.names() == {"n": b}


def test_registry_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RegistryLocationError, match="is a file"):
        Registry(f)


def test_unmarked_directory_with_files_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    with pytest.raises(RegistryLocationError, match=r"no REGISTRY\.json"):
        Registry(d)
    assert tree(d) == {"precious.txt": b"keep me"}


def test_newer_format_is_refused(registry: Registry) -> None:
    registry.add("x")
    marker = registry.root / "REGISTRY.json"
    marker.write_text('{"format":"prefix-registry","version":2,"role":"origin"}')
    with pytest.raises(RegistryLocationError, match="newer"):
        Registry(registry.root)


def test_meta_that_is_not_json_is_a_corrupt_record(registry: Registry) -> None:
    sha = registry.add("x")
    meta = registry.root / "meta" / f"{sha}.json"
    os.chmod(meta, 0o644)
    meta.write_text("{not json")
    with pytest.raises(CorruptRecordError):
        registry.meta(sha)
    assert [f.kind for f in verify_registry(registry).findings] == ["bad_record"]


def test_measurements_are_written_once_and_listed_per_prefix(registry: Registry) -> None:
    sha = registry.add("x")
    other = registry.add("y")
    build = ServerBuild(profile="halogen", identity={"model": "m", "version": {"api": "0.7.0"}})
    paths = [
        registry.write_measurement(
            Measurement(sha256=s, at=f"2026-01-0{i}T00:00:00Z", kind="warm", build=build, body={})
        )
        for i, s in enumerate([sha, sha, other], 1)
    ]
    assert len(set(paths)) == 3
    assert all(p.stat().st_mode & 0o222 == 0 for p in paths)
    assert [m.at for m in registry.measurements(sha)] == [
        "2026-01-01T00:00:00Z",
        "2026-01-02T00:00:00Z",
    ]
    assert registry.measurements(other)[0].build.build_id == build.build_id
    assert verify_registry(registry).ok


def test_tampered_measurement_build_id_is_refused(registry: Registry) -> None:
    sha = registry.add("x")
    build = ServerBuild(profile="halogen", identity={"model": "m"})
    path = registry.write_measurement(
        Measurement(sha256=sha, at="t", kind="warm", build=build, body={})
    )
    os.chmod(path, 0o644)
    path.write_text(path.read_text().replace('"model":"m"', '"model":"other"'))
    with pytest.raises(CorruptRecordError, match="build_id"):
        registry.measurements(sha)


def test_verify_reports_strays_as_warnings_distinct_from_corruption(registry: Registry) -> None:
    sha = registry.add("x")
    (registry.object_path(sha).parent / f".{sha}.txt.abc123.tmp").write_bytes(b"partial")
    report = verify_registry(registry)
    assert report.ok
    assert [(f.kind, f.severity) for f in report.findings] == [("stray", "warning")]


def test_verify_reports_dangling_names(registry: Registry) -> None:
    registry.add("x", name="n")
    (registry.root / "names" / "ghost").write_text("f" * 64 + "\n")
    report = verify_registry(registry)
    assert not report.ok
    # A hand-written name is also not in names.log: both are reported.
    assert sorted(f.kind for f in report.findings) == ["dangling", "journal"]


def test_verify_scans_the_root_and_probes(registry: Registry, tmp_path: Path) -> None:
    registry.add("x", name="x")
    root = registry.root
    (root / ".README.md.ab12.tmp").write_bytes(b"half")
    (root / "probes").mkdir()
    (root / "probes" / "20260101T000000.000000Z.md").write_bytes(b"a receipt\n")
    (root / "probes" / ".p.json.cd34.tmp").write_bytes(b"half")
    (root / "junk-at-root").write_bytes(b"?")
    (root / "mirror.log").write_bytes(b"")
    (root / "migrations.log").write_bytes(b"")
    (root / "probes" / "evil.json").symlink_to(tmp_path / "elsewhere")
    (root / "names.log.bak").symlink_to(root / "names.log")
    found = {(f.kind, f.path, f.severity) for f in verify_registry(registry).findings}
    assert found == {
        ("stray", ".README.md.ab12.tmp", "warning"),
        ("stray", "probes/.p.json.cd34.tmp", "warning"),
        ("unexpected", "junk-at-root", "problem"),
        ("symlink", "probes/evil.json", "problem"),
        ("symlink", "names.log.bak", "problem"),
    }


def test_verify_reports_a_symlinked_directory_once(registry: Registry, tmp_path: Path) -> None:
    registry.add("x", name="x")
    (tmp_path / "elsewhere").mkdir()
    (registry.root / "probes").symlink_to(tmp_path / "elsewhere")
    assert [(f.kind, f.path) for f in verify_registry(registry).findings] == [("symlink", "probes")]


def test_writes_on_a_mirror_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    """A mirror is written by `prefixreg mirror` only: anything else would be deleted by
    the next mirror run without a word."""
    origin = Registry(tmp_path / "origin")
    sha = origin.add("on the origin", name="n")
    mirror = Registry(tmp_path / "mirror")
    mirror.init(role="mirror")  # what a mirror destination is made with
    for sub in ("objects", "meta", "names"):
        (mirror.root / sub).mkdir(exist_ok=True)
    before = tree(mirror.root)
    build = ServerBuild(profile="halogen", identity={"model": "m"})
    measurement = Measurement(
        sha256=sha, at="2026-01-01T00:00:00Z", kind="warm", build=build, body={"n": 1}
    )
    for write in (
        lambda: mirror.add("worker-local prefix"),
        lambda: mirror.add("worker-local prefix", name="local"),
        lambda: mirror.move_name("local", sha),
        lambda: mirror.write_measurement(measurement),
    ):
        with pytest.raises(UsageError, match="is a mirror") as info:
            write()
        assert info.value.hint is not None and "origin" in info.value.hint
    assert tree(mirror.root) == before
    assert verify_registry(Registry(tmp_path / "mirror")).ok  # reads still work


def test_public_api_matches_design(tmp_path: Path) -> None:
    reg = prefixreg.open_registry(tmp_path / "api")
    sha = reg.add("You are a coding agent.", name="coding-loop")
    p = reg.get("coding-loop")
    assert p.sha256 == sha
    assert p.messages("user tail") == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "user tail"},
    ]
    assert sorted(prefixreg.__all__) == prefixreg.__all__


def test_open_registry_honours_env_then_xdg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert prefixreg.open_registry().root == tmp_path / "xdg-state" / "prefix-registry"
    monkeypatch.setenv("PREFIXREG_HOME", str(tmp_path / "env"))
    assert prefixreg.open_registry().root == tmp_path / "env"
    assert prefixreg.open_registry(tmp_path / "flag").root == tmp_path / "flag"


def test_object_file_names_are_recognised_by_one_rule() -> None:
    from prefixreg.registry.layout import object_relpath, object_sha

    sha = "ab" + "0" * 62
    assert object_sha(f"objects/ab/{sha}.txt") == sha == object_sha(object_relpath(sha))
    for fan, name in [
        ("cd", f"{sha}.txt"),
        ("ab", sha),
        ("ab", f"{sha.upper()}.txt"),
        ("ab", f".{sha}.txt.x.tmp"),
        ("ab", "ab12.txt"),
    ]:
        assert object_sha(f"objects/{fan}/{name}") is None
