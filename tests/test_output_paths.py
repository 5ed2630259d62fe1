"""No output a user names lands inside a registry root (DESIGN §5): every command and API that
writes a user-named path refuses one inside a registry it can see, resolved through symlinks,
with exit 2 (UsageError) before anything runs, and the registry's bytes stay as they were."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from prefixreg.core.errors import UsageError
from prefixreg.registry import layout
from prefixreg.registry.store import Registry
from prefixreg.registry.userfiles import check_output_file
from prefixreg.server.worker import Worker
from prefixreg.verbs.loop import Session
from prefixreg.verbs.measure.metrics import Metrics, write_metrics
from prefixreg.verbs.mirror.snapshots import ship_snapshot
from tests.conftest import run_cli

DEAD = "http://127.0.0.1:9"  # nothing listens: a refusal must come before any call


def make_registry(root: Path) -> Registry:
    reg = Registry(root)
    reg.add("You are a careful coding agent. Keep the house style.\n" * 40, name="loop")
    return reg


def tree(root: Path) -> dict[str, tuple[bytes | str, int]]:
    """Every entry under `root`: its bytes (a link: its target) and mode."""
    out: dict[str, tuple[bytes | str, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = Path(dirpath) / name
            st = p.lstat()
            data: bytes | str = b""
            if p.is_symlink():
                data = str(p.readlink())
            elif p.is_file():
                data = p.read_bytes()
            out[str(p.relative_to(root))] = (data, st.st_mode)
    return out


def assert_untouched(reg: Registry, before: dict[str, tuple[bytes | str, int]]) -> None:
    assert tree(reg.root) == before
    res = run_cli("verify", "--registry", str(reg.root))
    assert res.returncode == 0, res.stdout + res.stderr


def inside(reg: Registry, where: str) -> Path:
    """A path of the registry: an object, a name, a meta record, a journal, the marker."""
    sha = reg.head("loop").sha256
    return (
        reg.root
        / {
            "object": layout.object_relpath(sha),
            "name": layout.name_relpath("loop"),
            "meta": layout.meta_relpath(sha),
            "names.log": layout.NAMES_LOG,
            "marker": layout.MARKER,
            "new-in-objects": f"{layout.OBJECTS}/99/new.txt",
        }[where]
    )


@pytest.mark.parametrize("where", ["object", "name", "meta", "names.log", "marker"])
def test_warm_metrics_file_inside_the_registry_is_refused(tmp_path: Path, where: str) -> None:
    reg = make_registry(tmp_path / "reg")
    before = tree(reg.root)
    target = inside(reg, where)
    args = ("warm", "loop", "--worker", DEAD, "--registry", str(reg.root))
    res = run_cli(*args, "--metrics-file", str(target))
    assert res.returncode == 2, res.stderr
    assert b"inside the registry at" in res.stderr and b"Traceback" not in res.stderr
    assert_untouched(reg, before)


def test_a_new_file_in_a_registry_directory_is_refused(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "reg")
    (reg.root / "objects" / "99").mkdir()
    before = tree(reg.root)
    args = ("warm", "loop", "--worker", DEAD, "--registry", str(reg.root))
    res = run_cli(*args, "--metrics-file", str(inside(reg, "new-in-objects")))
    assert res.returncode == 2, res.stderr
    assert_untouched(reg, before)


@pytest.mark.parametrize(
    "argv",
    [
        ("keepalive", "loop", "--worker", DEAD, "--duration", "1"),
        ("pool", "warm", "loop", "--worker", DEAD),
        ("pool", "doctor", "--worker", DEAD),
    ],
    ids=["keepalive", "pool-warm", "pool-doctor"],
)
def test_keepers_and_pools_refuse_a_metrics_file_inside(tmp_path: Path, argv: tuple[str]) -> None:
    reg = make_registry(tmp_path / "reg")
    before = tree(reg.root)
    res = run_cli(
        *argv, "--registry", str(reg.root), "--metrics-file", str(inside(reg, "names.log"))
    )
    assert res.returncode == 2, res.stderr
    assert b"inside the registry at" in res.stderr
    assert_untouched(reg, before)


def test_audit_html_inside_the_registry_is_refused(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "reg")
    before = tree(reg.root)
    reply = tmp_path / "reply.json"
    reply.write_bytes(orjson.dumps({"usage": {"prompt_tokens": 10, "completion_tokens": 1}}))
    args = ("audit", str(reply), "--registry", str(reg.root))
    res = run_cli(*args, "--html", str(inside(reg, "name")))
    assert res.returncode == 2, res.stderr
    assert b"--html" in res.stderr and b"inside the registry at" in res.stderr
    assert_untouched(reg, before)


def test_a_session_log_inside_the_registry_is_refused(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "reg")
    before = tree(reg.root)
    head = reg.head("loop")
    with pytest.raises(UsageError, match="inside the registry at"):
        Session(head, log=reg.root / "names.log")
    with pytest.raises(UsageError, match="inside the registry at"):
        Session(head, log=str(reg.root / "meta" / "x.jsonl"))
    ok = Session(head, log=tmp_path / "loop.jsonl")  # outside: written as before
    ok.sent(head.body([{"role": "user", "content": "hi"}]))
    assert (tmp_path / "loop.jsonl").read_bytes().count(b"\n") == 1
    assert_untouched(reg, before)


def test_write_metrics_refuses_a_registry_path(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "reg")
    before = tree(reg.root)
    with pytest.raises(UsageError, match="inside the registry at"):
        write_metrics(inside(reg, "object"), Metrics())
    assert_untouched(reg, before)


def test_snapshot_ship_to_a_registry_directory_is_refused(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "reg")
    before = tree(reg.root)
    for to in (reg.root / "objects", reg.root, reg.root / "snapshots" / "new"):
        args = ("snapshot", "ship", "loop", "--registry", str(reg.root), "--to", str(to))
        res = run_cli(*args, "--worker", DEAD)
        assert res.returncode == 2, res.stderr
        assert b"the ship destination" in res.stderr and b"inside the registry" in res.stderr
    with Worker(DEAD) as w, pytest.raises(UsageError, match="inside the registry at"):
        ship_snapshot(reg, reg.head("loop"), [(str(reg.root / "objects"), w)])
    assert_untouched(reg, before)


def test_a_symlink_planted_outside_that_points_in_is_refused(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "reg")
    before = tree(reg.root)
    out = tmp_path / "out"
    out.mkdir()
    (out / "m.prom").symlink_to(inside(reg, "names.log"))  # the file itself a link
    (out / "objects").symlink_to(reg.root / "objects")  # a directory of the path a link
    sha_dir = Path(layout.object_relpath(reg.head("loop").sha256)).parent.name
    for target in (out / "m.prom", out / "objects" / sha_dir / "m.prom"):
        args = ("warm", "loop", "--worker", DEAD, "--registry", str(reg.root))
        res = run_cli(*args, "--metrics-file", str(target))
        assert res.returncode == 2, res.stderr
        assert b"inside the registry at" in res.stderr
    with pytest.raises(UsageError, match="inside the registry at"):
        Session(reg.head("loop"), log=out / "m.prom")  # an append follows the link
    assert_untouched(reg, before)


def test_the_registry_given_by_prefixreg_home_is_protected(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "home-reg")
    before = tree(reg.root)
    env = {"PREFIXREG_HOME": str(reg.root)}
    args = ("warm", "loop", "--worker", DEAD, "--metrics-file", str(inside(reg, "object")))
    res = run_cli(*args, env=env)
    assert res.returncode == 2, res.stderr
    assert b"inside the registry at" in res.stderr
    assert_untouched(reg, before)


def test_a_named_registry_not_made_yet_is_protected(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()  # nothing marks it a registry yet but the flag
    res = run_cli(
        "warm", "loop", "--worker", DEAD, "--registry", str(root), "--metrics-file",
        str(root / "m.prom"),
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert b"inside the registry at" in res.stderr
    assert not list(root.iterdir())


@pytest.mark.parametrize("kind", ["marked", "hand-built"])
def test_a_registry_the_user_did_not_name_is_protected(tmp_path: Path, kind: str) -> None:
    used = make_registry(tmp_path / "used")
    other = tmp_path / "other"
    if kind == "marked":
        make_registry(other)
    else:  # the seed's layout: objects/ beside names/, no REGISTRY.json
        (other / "objects" / "ab").mkdir(parents=True)
        (other / "names").mkdir()
        (other / "names" / "loop").write_text("ab" * 32 + "\n")
    before = tree(other)
    target = other / "names" / "loop"
    args = ("warm", "loop", "--worker", DEAD, "--registry", str(used.root))
    res = run_cli(*args, "--metrics-file", str(target))
    assert res.returncode == 2, res.stderr
    assert f"inside the registry at {other}".encode() in res.stderr
    assert tree(other) == before


def test_paths_outside_every_registry_pass(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "reg")
    beside = tmp_path / "reg.pools"  # a sibling named like it is not inside it
    beside.mkdir()
    assert check_output_file(beside / "m.prom", "--metrics-file") == beside / "m.prom"
    assert check_output_file(str(tmp_path / "m.prom"), "--x") == tmp_path / "m.prom"
    with pytest.raises(UsageError, match="inside the registry"):
        check_output_file(reg.root / "m.prom", "--metrics-file")
    for bad in ("", "a\0b", 5):
        with pytest.raises(UsageError):
            check_output_file(bad, "--x")  # type: ignore[arg-type]


def test_a_pool_files_placement_inside_the_registry_is_refused(tmp_path: Path) -> None:
    reg = make_registry(tmp_path / "reg")
    before = tree(reg.root)
    pool = tmp_path / "pool.toml"
    pool.write_text(f'placement = "{reg.root / "names.log"}"\n[[workers]]\nurl = "{DEAD}"\n')
    res = run_cli("pool", "warm", "loop", "--pool", str(pool), "--registry", str(reg.root))
    assert res.returncode == 2, res.stderr
    assert b"the pool's placement" in res.stderr and b"inside the registry at" in res.stderr
    assert_untouched(reg, before)


def test_a_log_hardlinked_to_a_registry_file_is_never_appended_to(tmp_path: Path) -> None:
    # A hard link is no symlink: the path rule cannot see that it is names.log under
    # another name, so the appender refuses any file with a second name.
    from prefixreg.registry.verify import verify_registry
    from prefixreg.server.calllog import append_line

    reg = Registry(tmp_path / "reg")
    reg.add("head", name="loop")
    journal = reg.root / "names.log"
    before = journal.read_bytes()
    link = tmp_path / "calls.jsonl"
    os.link(journal, link)
    with pytest.raises(UsageError, match="hard links"):
        append_line(link, b'{"format": "prefixreg-call"}\n')
    assert journal.read_bytes() == before
    assert verify_registry(reg).ok
    alone = tmp_path / "alone.jsonl"
    append_line(alone, b"one\n")
    assert alone.read_bytes() == b"one\n"
