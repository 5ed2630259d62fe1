"""Hostile input against the registry, round three (#22 cases 3, 4, 5, 8): a symlinked
`names/` is never opened through, a name whose target is gone is an integrity failure, a
user's add of a probe slice makes it theirs, a self-consistent frame record nested 100k deep
fails closed, user-named files are regular and capped, and wrong types raise
`PrefixregError`. Real files, real processes, a real inotify watch."""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.errors import IntegrityError, PrefixregError
from prefixreg.registry import fsutil, userfiles
from prefixreg.registry.gc import collect_garbage, parse_grace
from prefixreg.registry.snapshots import list_snapshots, read_snapshot, write_snapshot
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from tests.conftest import run_cli as run

IN_OPEN, IN_ACCESS = 0x20, 0x01


def _opened(directory: Path, action: Callable[[], object]) -> list[str]:
    """What `action` opened or read inside `directory`, by a real inotify watch."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    assert fd >= 0 and libc.inotify_add_watch(fd, bytes(directory), IN_OPEN | IN_ACCESS) >= 0
    try:
        try:
            action()
        except PrefixregError:
            pass
        try:
            events = os.read(fd, 65536)
        except BlockingIOError:
            return []
        names, at = [], 0
        while at < len(events):
            length = int.from_bytes(events[at + 12 : at + 16], "little")
            names.append(events[at + 16 : at + 16 + length].rstrip(b"\0").decode() or ".")
            at += 16 + length
        return names
    finally:
        os.close(fd)


@pytest.fixture(params=["walk", "openat2"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways below the root: the component walk (a short-lived process) and openat2 (a
    process that reads often)."""
    monkeypatch.setattr(fsutil, "_OPENAT2", {})
    monkeypatch.setattr(fsutil, "_WALKS", [0 if request.param == "walk" else 10**9])
    if request.param == "walk":
        fsutil._OPENAT2["fn"] = None
    else:
        assert fsutil._openat2() is not None  # this kernel has it: the test must use it
    return str(request.param)


def test_a_symlinked_names_directory_is_refused_before_anything_is_opened(
    registry: Registry, tmp_path: Path, resolver: str
) -> None:
    sha = registry.add("real\n", name="main")
    outside = tmp_path / "outside-names"
    (registry.root / "names").rename(outside)
    (registry.root / "names").symlink_to(outside, target_is_directory=True)
    for action in (
        lambda: registry.get("main"),
        lambda: registry.head("main"),
        registry.names,
        lambda: registry.move_name("other", sha),
        lambda: run("cat", "main", "--registry", str(registry.root)),
        lambda: run("names", "--registry", str(registry.root)),
    ):
        assert _opened(outside, action) == []
    with pytest.raises(IntegrityError, match=r"reg/names: is a symlink"):
        registry.get("main")  # the component is named, whichever way resolved it
    assert run("cat", "main", "--registry", str(registry.root)).returncode == 3
    assert _opened(outside, lambda: (outside / "main").read_bytes()) != []  # the watch works


def test_every_symlinked_component_is_named_either_way(
    registry: Registry, tmp_path: Path, resolver: str
) -> None:
    sha = registry.add("real\n", name="main")
    fan = registry.object_path(sha).parent
    fan.rename(tmp_path / "fan")
    fan.symlink_to(tmp_path / "fan", target_is_directory=True)
    with pytest.raises(IntegrityError, match=rf"objects/{sha[:2]}: is a symlink"):
        registry.get(sha)
    fan.unlink()
    fan.write_bytes(b"a file where the fan-out should be")
    with pytest.raises(IntegrityError, match=rf"objects/{sha[:2]}: not a directory"):
        registry.get(sha)


def test_a_name_whose_target_is_missing_is_an_integrity_failure(registry: Registry) -> None:
    sha = registry.add("soon gone\n", name="main")
    registry.object_path(sha).unlink()
    for call in (registry.get, registry.head, registry.resolve):
        with pytest.raises(IntegrityError, match=r"points to .*missing"):
            call("main")
    for command in ("cat", "show"):
        result = run(command, "main", "--registry", str(registry.root))
        assert result.returncode == 3, result.stderr
        assert b"no prefix" not in result.stderr


@pytest.mark.parametrize("note", [None, "mine now"])
def test_a_user_add_of_probe_slice_bytes_makes_them_the_users(
    registry: Registry, tmp_path: Path, note: str | None
) -> None:
    text = "a slice a probe sent\n" * 40
    sha = registry.add_probe_slice(text, run_id="r1")
    assert registry.is_probe_slice(sha)
    assert sha[:12].encode() not in run("ls", "--registry", str(registry.root)).stdout
    src = tmp_path / "mine.txt"
    src.write_text(text)
    args = ["add", str(src), "--registry", str(registry.root)]
    assert run(*args, *(["--note", note] if note else [])).returncode == 0
    assert not registry.is_probe_slice(sha)
    meta = registry.meta(sha)
    assert (meta.source, meta.note) == ("mine.txt", note)
    [info] = [o for o in registry.list_objects() if o.sha256 == sha]
    assert not info.probe_slice  # what audit reads: never "a probe slice" again
    assert sha[:12].encode() in run("ls", "--registry", str(registry.root)).stdout
    registry.add_probe_slice(text, run_id="r2")  # a later probe leaves the user's record alone
    assert registry.meta(sha) == meta


def _deep_frame(registry: Registry) -> str:
    system = registry.add("system\n")
    deep = b"[" * 100_000 + b"]" * 100_000
    raw = (
        b'{"format":"prefix-frame","settings":{"chat_template_kwargs":{"x":'
        + deep
        + b'}},"system":"'
        + system.encode()
        + b'","tools":null,"version":1}\n'
    )
    sha = hashlib.sha256(raw).hexdigest()  # self-consistent: the record hashes to its name
    (registry.root / "frames").mkdir(exist_ok=True)
    (registry.root / "frames" / f"{sha}.json").write_bytes(raw)
    return sha


def test_a_frame_record_nested_100k_deep_fails_closed_everywhere(registry: Registry) -> None:
    sha = _deep_frame(registry)
    root = str(registry.root)
    with pytest.raises(IntegrityError):
        registry.head(sha)
    with pytest.raises(IntegrityError):
        registry.frame(sha)
    report = verify_registry(registry)
    assert ("bad_record", f"frames/{sha}.json") in {(f.kind, f.path) for f in report.findings}
    assert run("verify", "--registry", root).returncode == 1
    with pytest.raises(IntegrityError, match="cannot tell"):
        collect_garbage(registry, grace_s=0, prune_unnamed=True)
    for args in (
        ["gc", "--prune-unnamed", "--grace", "0"],
        ["warm", sha, "--worker", "http://127.0.0.1:9"],
        ["show", sha],
        ["cat", sha],
        ["name", "loop", sha],
    ):
        result = run(*args, "--registry", root)
        assert result.returncode == 3, (args, result.stderr)
        assert b"Traceback" not in result.stderr and b"Recursion" not in result.stderr
    assert "frame" in run("ls", "--registry", root).stdout.decode()  # listed, marked bad


def test_user_named_files_must_be_regular_and_capped(tmp_path: Path) -> None:
    root = str(tmp_path / "reg")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.txt"
    with big.open("wb") as out:
        out.truncate(userfiles.MAX_INPUT_BYTES + 1)  # sparse: all zero bytes, valid UTF-8
    for path, needle in (
        ("/dev/zero", b"not a regular file"),
        (str(fifo), b"not a regular file"),
        (str(tmp_path), b"a directory"),
        (str(tmp_path / "missing"), b"No such file"),
        (str(big), b"larger than"),
    ):
        result = run("add", path, "--registry", root)
        assert result.returncode == 2, (path, result.stderr)
        assert needle in result.stderr and b"Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    flood = run("add", "-", "--registry", root, input_bytes=b"x" * (userfiles.MAX_INPUT_BYTES + 1))
    assert flood.returncode == 2 and b"larger than" in flood.stderr
    assert not (tmp_path / "reg" / "objects").exists() or not any(
        (tmp_path / "reg" / "objects").rglob("*.txt")
    )
    assert run("add", "-", "--registry", root, input_bytes=b"x" * 1000).returncode == 0


WRONG = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@given(value=WRONG)
def test_wrong_types_raise_a_prefixreg_error(
    tmp_path_factory: pytest.TempPathFactory, value: Any
) -> None:
    reg = Registry(tmp_path_factory.mktemp("reg"))
    sha = reg.add("x\n", name="n")
    calls: list[Callable[[], object]] = [
        lambda: Registry(value),
        lambda: reg.get(value),
        lambda: reg.head(value),
        lambda: reg.resolve(value),
        lambda: reg.read_verified(value),
        lambda: reg.meta(value),
        lambda: reg.object_path(value),
        lambda: reg.is_probe_slice(value),
        lambda: reg.read_name(value),
        lambda: reg.add_probe_slice("y\n", run_id=value),
        lambda: reg.move_name(value, sha),
        lambda: reg.move_name("m", value),
        lambda: reg.write_measurement(value),
        lambda: reg.write_probe_receipt(value, lambda _j, _m: (b"", b"")),
        lambda: reg.init(role=value),
        lambda: reg.lock(value).__enter__(),
        lambda: reg.frame(value),
        lambda: reg.add_frame(value),
        lambda: read_snapshot(reg, value, "0" * 16),
        lambda: read_snapshot(reg, sha, value),
        lambda: write_snapshot(reg, value),
        lambda: parse_grace(value),
    ]
    if value is not None:  # None is a real value of these
        calls += [
            lambda: reg.add("y\n", name=value),
            lambda: reg.add("y\n", note=value),
            lambda: reg.measurements(value),
            lambda: reg.move_name("m", sha, expect=value),
            lambda: reg.add_frame(sha, tools=value),
            lambda: list_snapshots(reg, value),
        ]
    if not isinstance(value, bytes):  # bytes are content
        calls.append(lambda: reg.add(value))
    if not isinstance(value, dict | None):  # a mapping is settings
        calls.append(lambda: reg.add_frame(sha, settings=value))
    if not (type(value) in (int, float) and math.isfinite(value) and value >= 0):
        calls.append(lambda: Registry(reg.root, lock_timeout=value))
        calls.append(lambda: collect_garbage(reg, grace_s=value))
    for i, call in enumerate(calls):
        with pytest.raises(PrefixregError):
            call()
            pytest.fail(f"call {i} took {value!r}")


def test_the_examples_of_the_issue(registry: Registry) -> None:
    bad: Any = 123
    for call in (
        lambda: Registry(bad),
        lambda: registry.get(bad),
        lambda: registry.frame(bad),
    ):
        with pytest.raises(PrefixregError):
            call()
    with pytest.raises(PrefixregError):
        registry.get(None)  # type: ignore[arg-type]
