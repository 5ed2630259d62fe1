"""Security review, one test each: no shell=True; API keys never leak; symlinks inside the
registry are refused and never followed; modes honour the umask and objects are read-only;
a registry directory other users can write to is reported by verify."""

from __future__ import annotations

import ast
import logging
import os
import socket
import stat
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from prefixreg.core.errors import IntegrityError, PrefixregError, WorkerError
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry.gc import collect_garbage
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from prefixreg.server.worker import Worker
from tests.conftest import run_cli as run
from tests.fakeserver import FakeServer, Reply

ROOT = Path(__file__).resolve().parent.parent
SECRET = "sk-prefixreg-TEST-5f3c9e1d7a2b4c68"
_BUILD = ServerBuild(profile="halogen", identity={"model": "m"})


# ------------------------------------------------------------------------ no shell=True


def _python_sources() -> list[Path]:
    files = sorted((ROOT / "prefixreg").rglob("*.py"))
    for path in sorted((ROOT / "bin").iterdir()):
        if (
            path.is_file()
            and path.read_bytes()[:2] == b"#!"
            and b"python" in path.read_bytes()[:80]
        ):
            files.append(path)
    return files


def test_no_shell_true_anywhere() -> None:
    offenders = []
    for path in _python_sources():
        source = path.read_text()
        if "shell=True" in source.replace(" ", ""):
            offenders.append(f"{path}: text 'shell=True'")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "shell" and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is False
                    ):
                        offenders.append(f"{path}:{node.lineno}: shell={ast.unparse(kw.value)}")
                func = ast.unparse(node.func)
                if func in (
                    "os.system",
                    "os.popen",
                    "subprocess.getoutput",
                    "subprocess.getstatusoutput",
                ):
                    offenders.append(f"{path}:{node.lineno}: {func}")
    assert offenders == []
    assert len(_python_sources()) > 10  # the scan really saw the package


# ------------------------------------------------------------------------ API keys


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _all_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def test_api_key_never_in_exceptions_reprs_or_logs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PREFIXREG_API_KEY", SECRET)
    caplog.set_level(logging.DEBUG)  # httpx/httpcore debug logging included
    texts: list[str] = []
    with Worker(f"http://127.0.0.1:{_closed_port()}") as w:
        texts.append(repr(w))
        with pytest.raises(WorkerError) as refused:
            w.health()
        texts += [str(refused.value), repr(refused.value), str(refused.value.hint)]
        texts.append("".join(traceback.format_exception(refused.value)))
    with FakeServer() as srv:
        # A server that echoes the credential back in its error message.
        echo = {"error": {"message": f"bad key Bearer {SECRET}", "code": "auth"}}
        srv.route("GET", "/health", Reply(status=401, json=echo))
        srv.route("POST", "/v1/chat/completions", Reply(status=500, body=SECRET.encode()))
        with Worker(srv.url) as w:
            for call in (w.health, w.server_build):
                with pytest.raises(PrefixregError) as err:
                    call()
                texts += [str(err.value), "".join(traceback.format_exception(err.value))]
        assert srv.requests[0].headers["authorization"] == f"Bearer {SECRET}"  # it was sent
    texts.append(caplog.text)
    assert all(SECRET not in t for t in texts), [t for t in texts if SECRET in t]


def _has_command(name: str) -> bool:
    return f" {name} " in run("--help").stdout.decode()


def test_api_key_never_in_cli_output_debug_output_or_registry_files(tmp_path: Path) -> None:
    reg_root = tmp_path / "reg"
    env = {"PREFIXREG_API_KEY": SECRET, "PREFIXREG_HOME": str(reg_root)}
    prefix = tmp_path / "p.txt"
    prefix.write_text("a prefix\n")
    dead = f"http://127.0.0.1:{_closed_port()}"
    runs = [
        run("add", str(prefix), "--name", "main", "--debug", env=env),
        run("cat", "nope-not-here", "--debug", env=env),
        run("verify", "--debug", env=env),
        run("gc", "--grace", "bogus", "--debug", env=env),
        run("migrate", str(tmp_path / "missing"), "--debug", env=env),
    ]
    # Worker-facing commands, where present in this build, against a closed port.
    for command in ("warm", "probe", "doctor", "keepalive"):
        if _has_command(command):
            args = [command, "main"] if command in ("warm", "keepalive") else [command]
            runs.append(run(*args, "--worker", dead, "--debug", env=env))
    code = (
        "from prefixreg.server.worker import Worker\n"
        f"Worker({dead!r}).health()\n"  # an uncaught WorkerError: a full traceback
    )
    runs.append(
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            env={**os.environ, **env},
            timeout=60,
            check=False,
        )
    )
    assert runs[-1].returncode != 0 and b"WorkerUnreachableError" in runs[-1].stderr
    for proc in runs:
        assert SECRET.encode() not in proc.stdout + proc.stderr, proc.args
    assert SECRET.encode() not in _all_bytes(reg_root)
    assert b"Traceback" in runs[1].stderr  # --debug really showed the traceback


# ------------------------------------------------------------------------ symlinks


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside.txt"
    path.write_bytes(b"not the registry's\n")
    os.utime(path, (1_000_000_000, 1_000_000_000))
    return path


def _untouched(path: Path) -> None:
    st = path.stat()  # before our own read below updates the access time
    assert st.st_atime == 1_000_000_000  # not even read
    assert st.st_mtime == 1_000_000_000
    assert path.read_bytes() == b"not the registry's\n"


def test_symlinked_object_is_refused(registry: Registry, outside: Path) -> None:
    sha = registry.add("real\n")
    obj = registry.object_path(sha)
    obj.unlink()
    obj.symlink_to(outside)
    for call in (lambda: registry.get(sha), lambda: registry.add("real\n")):
        with pytest.raises(IntegrityError, match="symlink"):
            call()
    assert "symlink" in {f.kind for f in verify_registry(registry).findings}
    _untouched(outside)


def test_symlinked_meta_is_refused(registry: Registry, outside: Path) -> None:
    sha = registry.add("real\n")
    meta = registry.root / "meta" / f"{sha}.json"
    meta.unlink()
    meta.symlink_to(outside)
    with pytest.raises(IntegrityError, match="symlink"):
        registry.meta(sha)
    with pytest.raises(IntegrityError, match="symlink"):
        registry.add("real\n", note="a new note")
    with pytest.raises(IntegrityError):
        registry.list_objects()
    assert "symlink" in {f.kind for f in verify_registry(registry).findings}
    _untouched(outside)


def test_symlinked_name_is_refused(registry: Registry, outside: Path) -> None:
    sha = registry.add("real\n", name="main")
    name = registry.root / "names" / "main"
    name.unlink()
    name.symlink_to(outside)
    for call in (
        lambda: registry.get("main"),
        lambda: registry.move_name("main", sha),
        registry.names,
    ):
        with pytest.raises(IntegrityError, match="symlink"):
            call()
    assert "symlink" in {f.kind for f in verify_registry(registry).findings}
    _untouched(outside)


def test_symlinked_measurement_is_refused(registry: Registry, outside: Path) -> None:
    sha = registry.add("real\n")
    path = registry.write_measurement(
        Measurement(sha256=sha, at="2026", kind="warm", build=_BUILD, body={})
    )
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(IntegrityError, match="symlink"):
        registry.measurements(sha)
    assert "symlink" in {f.kind for f in verify_registry(registry).findings}
    _untouched(outside)


@pytest.mark.parametrize("which", ["fan", "objects", "meta", "names", "measurements"])
def test_symlinked_directories_are_refused_for_reads_and_writes(
    registry: Registry, tmp_path: Path, which: str
) -> None:
    sha = registry.add("real\n", name="main")
    registry.write_measurement(
        Measurement(sha256=sha, at="2026", kind="warm", build=_BUILD, body={})
    )
    rel = {"fan": f"objects/{sha[:2]}"}.get(which, which)
    real = registry.root / rel
    elsewhere = tmp_path / f"elsewhere-{which}"
    real.rename(elsewhere)
    real.symlink_to(elsewhere, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}

    read: Callable[[], object] = {
        "fan": lambda: registry.get(sha),
        "objects": lambda: registry.get(sha),
        "meta": lambda: registry.meta(sha),
        "names": lambda: registry.get("main"),
        "measurements": lambda: registry.measurements(sha),
    }[which]
    with pytest.raises(IntegrityError, match="symlink"):
        read()
    write: Callable[[], object] = {
        "fan": lambda: registry.add("real\n"),
        "objects": lambda: registry.add("real\n"),
        "meta": lambda: registry.add("brand new\n"),
        "names": lambda: registry.move_name("fresh-name", sha),
        "measurements": lambda: registry.write_measurement(
            Measurement(sha256=sha, at="2027", kind="warm", build=_BUILD, body={})
        ),
    }[which]
    with pytest.raises(IntegrityError, match="symlink"):
        write()
    after = {p.name: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    assert after == before  # nothing written through the link
    report = verify_registry(registry)
    assert not report.ok
    assert "symlink" in {f.kind for f in report.findings}
    # gc fails closed on any symlink below the root: it never prunes blind or follows it.
    with pytest.raises(IntegrityError, match="symlink"):
        collect_garbage(registry, grace_s=0, prune_unnamed=True)
    assert {p.name: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before


def test_a_symlinked_root_is_the_users_choice(tmp_path: Path) -> None:
    real = tmp_path / "real"
    Registry(real).add("x\n", name="n")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    reg = Registry(link)
    assert reg.get("n").data == b"x\n"
    assert verify_registry(reg).findings == []


# ------------------------------------------------------------------------ modes


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode)
        for p in [root, *root.rglob("*")]
        if ".locks" not in p.parts or p.name == ".locks"
    }


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_modes_honour_the_umask_and_objects_are_read_only(tmp_path: Path, mask: int) -> None:
    root = tmp_path / "reg"
    with umask(mask):
        reg = Registry(root)
        sha = reg.add("content\n", name="main", note="n")
        reg.add("content\n", note="changed note")  # meta rewritten by replace_atomic
        reg.write_measurement(
            Measurement(sha256=sha, at="2026", kind="warm", build=_BUILD, body={})
        )
        assert os.umask(mask) == mask  # writing never changed the umask
    modes = _modes(root)
    for rel, mode in modes.items():
        path = root / rel
        if path.is_dir():
            assert mode == 0o777 & ~mask, rel
        elif rel.startswith(("objects/", "meta/", "measurements/")):
            assert mode == 0o444 & ~mask, rel  # read-only, and never more open than umask
        else:
            assert mode == 0o644 & ~mask, rel
        assert mode & ~(0o777 & ~mask) == 0, rel
    assert verify_registry(Registry(root)).findings == []


def test_migrate_keeps_modes(tmp_path: Path) -> None:
    from prefixreg.registry import migrate

    with umask(0o077):
        Registry(tmp_path / "old").add("content\n", name="main")
    before = _modes(tmp_path / "old")
    migrate.migrate_registry(tmp_path / "old", tmp_path / "new")
    after = {k: v for k, v in _modes(tmp_path / "new").items() if k != "migrations.log"}
    assert after == before


@pytest.mark.parametrize("where", [".", "names", "objects"])
def test_a_directory_writable_by_others_is_reported(registry: Registry, where: str) -> None:
    registry.add("content\n", name="main")
    directory = registry.root / where
    directory.chmod(stat.S_IMODE(directory.stat().st_mode) | 0o002)
    report = verify_registry(registry)
    found = [f for f in report.findings if f.kind == "insecure_mode"]
    assert [(f.path, f.severity) for f in found] == [(where, "problem")]
    assert not report.ok
    proc = run("verify", "--registry", str(registry.root))
    assert proc.returncode == 1
    assert b"insecure_mode" in proc.stdout
    directory.chmod(stat.S_IMODE(directory.stat().st_mode) & ~0o002)
    assert verify_registry(registry).ok
