"""`prefixreg mirror` with the real rsync, locally and over a real sshd on 127.0.0.1.

What is proven here: byte-identical trees; a no-change run sends nothing and still
verifies, every object hashed at the destination; an object or record changed there in
place (size and mtime kept) is found by the plain run and repaired; changes at the origin
arrive and worker-side additions disappear; every guard refuses with one line, the right
exit code, and the destination tree unchanged; the ordering promise (no name or meta record
before its object, deletions last) both from the passes' own itemized output and from a
reader polling the worker during a slow transfer while the origin is being written to; an
interrupted transfer is repaired by the next run and recorded in mirror.log; the example
systemd units.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import orjson
import pytest

from prefixreg.core.errors import IntegrityError, MirrorError, UsageError
from prefixreg.registry.store import Registry
from prefixreg.verbs.mirror import PassRecord, mirror, rsync
from prefixreg.verbs.mirror.rsync import (
    EXCLUDES,
    Change,
    build_rsync_argv,
    build_ssh_command,
    parse_destination,
    parse_itemized,
    parse_ssh_options,
)
from prefixreg.verbs.mirror.session import Session
from tests.conftest import run_cli
from tests.sshd import SshServer, require_tools
from tests.test_store import flip_byte, tree

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "bin" / "prefix-mirror"
NOT_MIRRORED = ("REGISTRY.json", "mirror.log")


@pytest.fixture(scope="module", autouse=True)
def _tools() -> None:
    require_tools()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    server = SshServer.start(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.stop()


def run_mirror_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 90
) -> subprocess.CompletedProcess[bytes]:
    """`bin/prefix-mirror ARGS` as a real process (the same command as `prefixreg mirror`)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(BIN), *args],
        capture_output=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )


def make_origin(root: Path, count: int = 5, size: int = 200) -> Registry:
    reg = Registry(root)
    for i in range(count):
        reg.add(f"prefix {i}\n" + "x" * size, name=f"p{i}", note=f"note {i}")
    return reg


def content(root: Path) -> dict[str, bytes]:
    """The mirrored part of a registry tree (what must be byte-identical)."""
    return {
        k: v for k, v in tree(root).items() if k not in NOT_MIRRORED and not k.startswith(".locks")
    }


def outside_reg(files: dict[str, bytes]) -> dict[str, bytes]:
    """A tmp_path tree without the source registry (whose log and lock files may change)."""
    return {k: v for k, v in files.items() if not k.startswith("reg/")}


def log_lines(reg: Registry) -> list[dict[str, object]]:
    path = reg.root / "mirror.log"
    return [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def role_of(root: Path) -> object:
    return orjson.loads((root / "REGISTRY.json").read_bytes())["role"]


def one_error_line(res: subprocess.CompletedProcess[bytes]) -> str:
    lines = [ln for ln in res.stderr.decode().splitlines() if not ln.startswith("hint:")]
    assert b"Traceback" not in res.stderr
    assert len(lines) == 1, res.stderr.decode()
    return lines[0]


# -- pure parts ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "path"),
    [
        ("/srv/mirror", None, "/srv/mirror"),
        ("w1:/srv/mirror", "w1", "/srv/mirror"),
        ("root@worker-2.lan:reg", "root@worker-2.lan", "reg"),
        ("[::1]:/srv/m", "[::1]", "/srv/m"),
        ("user@[::1]:/p", "user@[::1]", "/p"),
        ("u@[fe80::1]:mirror", "u@[fe80::1]", "mirror"),
        ("host:~/mirror", "host", "~/mirror"),
        ("host:./mirror", "host", "./mirror"),
    ],
)
def test_parse_destination_accepts_paths_and_host_paths(
    text: str, host: str | None, path: str
) -> None:
    dest = parse_destination(text)
    assert (dest.host, dest.path) == (host, path)


def test_parse_destination_relative_local_path_becomes_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_destination("./a:b").path == str(tmp_path / "a:b")
    assert parse_destination("./a:b").host is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty"),
        ("-rf", "starts with '-'"),
        ("--delete", "starts with '-'"),
        ("host:", "no path"),
        ("host:-x", "starts with '-'"),
        ("rsync://h/m", "daemon"),
        ("host::module", "daemon"),
        ("bad host:/x", "not a host"),
        ("-oProxyCommand=x:/p", "starts with '-'"),
        ("h:/a b", "remote paths"),
        ("h:/a;rm -rf /", "remote paths"),
        ("/tmp/a\nb", "control"),
        ("host:.", "home directory"),
        ("host:./", "home directory"),
        ("host:~", "home directory"),
        ("host:~/", "home directory"),
        ("host:~/.", "home directory"),
        ("host:~other", "home directory"),
        ("host:a/..", "home directory"),
        ("host:..", "home directory"),
        ("host:/", "home directory"),
        ("user@[::1]:", "no path"),
        ("user@[::1]:.", "home directory"),
    ],
)
def test_parse_destination_refuses_bad_input(text: str, needle: str) -> None:
    with pytest.raises(MirrorError, match=needle):
        parse_destination(text)


def test_ipv6_host_with_a_user_keeps_user_and_unbracketed_address_for_ssh() -> None:
    dest = parse_destination("user@[::1]:/p")
    assert dest.ssh_host == "user@::1" and dest.target("x") == "user@[::1]:/p/x"


def test_build_rsync_argv_compare_is_an_itemized_delete_dry_run_with_excludes() -> None:
    argv = build_rsync_argv("compare-records", "/reg/", "w:/m/", rsh=["ssh", "-o", "BatchMode=yes"])
    assert argv[:3] == ["rsync", "-e", "ssh -o BatchMode=yes"]
    assert {"-a", "--delete", "--dry-run", "-O", "--checksum", "--exclude=/objects/"} <= set(argv)
    assert [f"--exclude={e}" for e in EXCLUDES] == [a for a in argv if a.startswith("--exclude")][
        : len(EXCLUDES)
    ]
    assert argv[-3:] == ["--", "/reg/", "w:/m/"]
    objects = build_rsync_argv("compare-objects", "/r/", "/m/")
    # Objects by size and mtime only: their content is hashed at the destination.
    assert "--checksum" not in objects and objects[-3:] == ["--", "/r/", "/m/"]
    assert objects.index("--include=/objects/***") < objects.index("--exclude=*")


def test_build_rsync_argv_send_and_delete_use_a_files_from_list() -> None:
    send = build_rsync_argv("send", "/r/", "/m/", files_from="/tmp/l", bwlimit=100)
    assert {"--files-from=/tmp/l", "--from0", "--bwlimit=100"} <= set(send)
    assert "--delete" not in send and "--delete-missing-args" not in send
    assert {"--ignore-missing-args", "-ii"} <= set(send)
    delete = build_rsync_argv("delete", "/r/", "/m/", files_from="/tmp/l")
    # Deleting only: a path back at the source must be neither created nor updated.
    assert {"--delete-missing-args", "--existing", "--ignore-existing"} <= set(delete)
    with pytest.raises(ValueError, match="files_from"):
        build_rsync_argv("send", "/r/", "/m/")


def test_ssh_command_puts_batchmode_first_and_quotes_spaces_for_rsync() -> None:
    cmd = build_ssh_command(
        parse_ssh_options(["Port=2222", "ProxyCommand=nc -x p %h %p"]), control_path=None
    )
    assert cmd[:3] == ["ssh", "-o", "BatchMode=yes"]
    argv = build_rsync_argv("list", "w:/m/", "", rsh=cmd)
    assert "'ProxyCommand=nc -x p %h %p'" in argv[2]
    for bad in ("Port", "-F/etc/x=1", "A='x'"):
        with pytest.raises(UsageError):  # a bad argument (exit 2), not a refused mirror
            parse_ssh_options([bad])


def test_parse_itemized_restores_escaped_names() -> None:
    out = (
        b"created directory /x\n"
        b"*deleting  |0|we ird\\#012nl\n"
        b">f+++++++++|45|objects/ab/x.txt\n"
        b"cd+++++++++|0|./\n"
        b"cd+++++++++|0|meta/\n"
        b"*deleting  |0|back\\#134#041slash\n"
    )
    assert parse_itemized(out) == [
        Change("*deleting  ", 0, "we ird\nnl"),
        Change(">f+++++++++", 45, "objects/ab/x.txt"),
        Change("cd+++++++++", 0, "."),
        Change("cd+++++++++", 0, "meta"),
        Change("*deleting  ", 0, "back\\#041slash"),
    ]


# -- local mirrors ------------------------------------------------------------------------


def test_local_mirror_is_byte_identical_and_a_second_run_sends_nothing(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    (reg.root / "objects" / ".stray.txt.abc.tmp").write_bytes(b"temp")
    dest = tmp_path / "worker" / "mirror"
    (tmp_path / "worker").mkdir()
    first = run_mirror_cli("--registry", str(reg.root), "--to", str(dest))
    assert first.returncode == 0, first.stderr
    assert content(dest) == {k: v for k, v in content(reg.root).items() if not k.endswith(".tmp")}
    assert role_of(dest) == "mirror" and role_of(reg.root) == "origin"
    assert not (dest / ".locks").exists() and not (dest / "mirror.log").exists()
    assert Registry(dest).get("p3").data.startswith(b"prefix 3")
    assert b"ok" in first.stderr and b"verified" in first.stderr

    before = tree(dest)
    second = run_mirror_cli("--registry", str(reg.root), "--to", str(dest), "--json")
    assert second.returncode == 0, second.stderr
    report = orjson.loads(second.stdout)
    (d,) = report["destinations"]
    assert (d["sent"], d["deleted"], d["bytes"], d["verified"], d["result"]) == (
        0,
        0,
        0,
        True,
        "ok",
    )
    assert tree(dest) == before
    lines = log_lines(reg)
    assert [x["result"] for x in lines] == ["ok", "ok"]
    assert lines[0]["sent"] == len(content(dest)) and lines[0]["objects_verified"] == 5
    assert set(lines[0]) >= {"destination", "sent", "deleted", "bytes", "seconds", "verified"}


def test_changes_at_the_origin_arrive_and_worker_side_files_disappear(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    new_sha = reg.add("a new prefix", name="fresh")
    reg.move_name("p0", new_sha)
    (dest / "names" / "worker-junk").write_text("x")
    (dest / "junkdir").mkdir()
    (dest / "junkdir" / "file").write_text("x")
    report = mirror(reg, [str(dest)])
    (r,) = report.results
    assert r.ok and r.verified and r.deleted == 3
    assert content(dest) == content(reg.root)
    assert Registry(dest).resolve("p0") == new_sha
    assert report.objects_verified == 1  # only what was sent is re-hashed


def test_a_named_frame_travels_with_its_parts_before_its_name(tmp_path: Path) -> None:
    from prefixreg.registry.verify import verify_registry

    reg = make_origin(tmp_path / "reg")
    tools = '[{"type":"function","function":{"name":"read_file","parameters":{}}}]'
    sha = reg.add_frame("p1", tools=tools, settings={"tool_choice": "auto"}, name="head")
    dest = tmp_path / "m"
    report = mirror(reg, [str(dest)])
    assert report.ok, report.results[0].error
    worker = Registry(dest)
    frame = worker.frame("head")  # verified there: record and both parts arrived
    assert frame.sha256 == sha and frame.tools_data == tools.encode()
    assert verify_registry(worker).ok
    (r,) = report.results
    kinds = [p.kind for p in r.passes]
    # The frame's record is at the worker before the name that points to it.
    (frames,) = [p.kind for p in r.passes if any(c.path.startswith("frames/") for c in p.changes)]
    assert kinds.index(frames) < kinds.index("names"), kinds

    # A frame named later, whose record the plan never saw, still travels with its name.
    later = reg.add_frame("p2", settings={"tool_choice": "none"})
    reg.move_name("later", later)
    assert mirror(reg, [str(dest)]).ok
    assert Registry(dest).frame("later").sha256 == later


def _change_in_place(path: Path) -> None:
    """Flip a byte of `path` and put its mtime back: rsync's quick check cannot see it."""
    st = path.stat()
    os.chmod(path, 0o644)
    flip_byte(path)
    os.chmod(path, st.st_mode & 0o7777)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_plain_run_finds_and_repairs_a_worker_file_changed_in_place(tmp_path: Path) -> None:
    """#20 case 8: "verified" means hashed. An object changed in place with its size and
    mtime kept is found by the plain nightly run (hashed at the destination), sent again
    and hashed again; so is a name record (compared by content)."""
    from prefixreg.registry.verify import verify_registry

    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    sha = reg.resolve("p1")
    _change_in_place(dest / "objects" / sha[:2] / f"{sha}.txt")
    _change_in_place(dest / "names" / "p2")
    assert not verify_registry(Registry(dest)).ok
    dry = mirror(reg, [str(dest)], dry_run=True).results[0]
    assert dry.content == "mismatch" and not dry.verified and dry.changed_in_place == 1
    assert {c.path for c in dry.changes} == {f"objects/{sha[:2]}/{sha}.txt", "names/p2"}
    (r,) = mirror(reg, [str(dest)]).results
    assert r.ok and r.content == "verified" and r.changed_in_place == 1 and r.sent == 2
    assert r.hashed == 5 and r.read_back == 1
    assert content(dest) == content(reg.root) and verify_registry(Registry(dest)).ok
    (again,) = mirror(reg, [str(dest)]).results
    assert (again.sent, again.changed_in_place, again.content) == (0, 0, "verified")
    log = log_lines(reg)
    assert [x["content"] for x in log] == ["verified"] * 3 and log[1]["changed_in_place"] == 1


def test_a_worker_object_that_is_a_symlink_to_good_bytes_is_not_hashed_but_replaced(
    tmp_path: Path,
) -> None:
    """The sweep hashes regular files only, never through a link: a symlink at an object's
    place (to a copy with the right bytes) is not counted as hashed, and is replaced."""
    reg = make_origin(tmp_path / "reg", count=2)
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    sha = reg.resolve("p0")
    obj = dest / "objects" / sha[:2] / f"{sha}.txt"
    good = tmp_path / "good.txt"
    good.write_bytes(obj.read_bytes())
    os.chmod(obj.parent, 0o755)  # noqa: S103 (a test making room for the swap)
    obj.unlink()
    obj.symlink_to(good)
    dry = mirror(reg, [str(dest)], dry_run=True).results[0]
    assert dry.hashed == 1 and dry.content == "mismatch"
    (r,) = mirror(reg, [str(dest)]).results
    assert r.ok and r.verified and r.read_back == 1 and not obj.is_symlink()
    assert content(dest) == content(reg.root)


def test_check_hashes_judges_each_listed_object_and_ignores_strays() -> None:
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    out = (
        f"objects/aa/{a}.txt\n{a}  objects/aa/{a}.txt\n"
        f"objects/bb/{b}.txt\n"  # listed, but sha256sum could not read it
        f"objects/cc/{c}.txt\n{a}  objects/cc/{c}.txt\n"  # other bytes
        f"\\{a}  objects/aa/x\\ny.txt\n{a}  objects/aa/{a}.txt/inner.txt\n"  # strays
        f"{b}  objects/aa/{b}.txt\n"  # not under its own fan directory
    ).encode()
    assert rsync.check_hashes(out) == {
        f"objects/aa/{a}.txt": None,
        f"objects/bb/{b}.txt": "cannot be read",
        f"objects/cc/{c}.txt": f"hashes to {a}",
    }
    twice = rsync.check_hashes(f"{a}  objects/aa/{a}.txt\n{a}  objects/aa/{a}.txt\n".encode())
    assert twice == {f"objects/aa/{a}.txt": "hashed twice"}


def test_full_verify_rehashes_every_source_object(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    plain = mirror(reg, [str(dest)])
    assert plain.objects_verified == 0 and plain.results[0].hashed == 5
    report = mirror(reg, [str(dest)], full_verify=True)
    assert report.ok and report.objects_verified == 5 and report.results[0].verified


def test_dry_run_prints_itemized_changes_and_changes_nothing(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    reg.add("another", name="another")
    (dest / "junk").write_text("x")
    before, log_before = tree(dest), log_lines(reg)
    res = run_mirror_cli("--registry", str(reg.root), "--to", str(dest), "--dry-run")
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    assert "*deleting   junk" in out and ">f+++++++++ names/another" in out
    assert tree(dest) == before and log_lines(reg) == log_before
    new = tmp_path / "new"
    res = run_mirror_cli("--registry", str(reg.root), "--to", str(new), "--dry-run")
    assert res.returncode == 0 and not new.exists()


# -- guards -----------------------------------------------------------------------------


def test_unmarked_empty_and_missing_sources_are_refused_with_exit_6(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "keep").write_text("worker file")
    unmarked = tmp_path / "unmarked"
    unmarked.mkdir()
    (unmarked / "objects").mkdir()
    (unmarked / "file").write_text("x")
    empty_reg = tmp_path / "empty-reg"
    Registry(empty_reg).init()
    for source in (unmarked, empty_reg, tmp_path / "missing", tmp_path / "emptydir"):
        before = tree(dest)
        res = run_mirror_cli("--registry", str(source), "--to", str(dest))
        assert res.returncode == 6, (source, res.stderr)
        one_error_line(res)
        assert tree(dest) == before
    assert not (tmp_path / "missing").exists()


def test_reversed_direction_is_refused_both_ways(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    origin_before, mirror_before = tree(reg.root), tree(dest)
    res = run_mirror_cli("--registry", str(dest), "--to", str(reg.root))
    assert res.returncode == 6
    assert "not an origin" in one_error_line(res)
    other = make_origin(tmp_path / "other", count=1)
    res = run_mirror_cli("--registry", str(other.root), "--to", str(reg.root))
    assert res.returncode == 6
    assert "origin registry" in one_error_line(res)
    assert tree(reg.root) == origin_before and tree(dest) == mirror_before


def test_destination_holding_other_files_is_refused_and_nothing_deleted(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "home"
    dest.mkdir()
    (dest / "precious.txt").write_text("do not delete")
    afile = tmp_path / "afile"
    afile.write_text("x")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "REGISTRY.json").symlink_to(tmp_path / "m-elsewhere.json")
    (tmp_path / "m-elsewhere.json").write_bytes(b'{"format":"prefix-registry","role":"mirror"}')
    (linked / "data").write_text("keep")
    fake = tmp_path / "fake"
    (fake / "REGISTRY.json").mkdir(parents=True)
    (fake / "REGISTRY.json" / "x").write_text("keep")
    origin = content(reg.root)
    for target in (dest, afile, reg.root / "sub", tmp_path, linked, fake):
        before = tree(tmp_path)
        res = run_mirror_cli("--registry", str(reg.root), "--to", str(target))
        assert res.returncode == 6, (target, res.stderr)
        one_error_line(res)
        assert outside_reg(tree(tmp_path)) == outside_reg(before)
        assert content(reg.root) == origin


@pytest.mark.parametrize("dest", ["-rf", "--delete", "host:", "host:-x", "h:/a b", "rsync://h/m"])
def test_bad_destination_is_one_line_exit_6_and_nothing_touched(tmp_path: Path, dest: str) -> None:
    reg = make_origin(tmp_path / "reg")
    before = tree(tmp_path)
    res = run_mirror_cli("--registry", str(reg.root), "--to", dest)
    assert res.returncode == 6
    one_error_line(res)
    assert tree(tmp_path) == before


def test_no_destination_is_a_usage_error_and_env_destinations_are_used(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    res = run_mirror_cli("--registry", str(reg.root))
    assert res.returncode == 2
    assert "no mirror destination" in one_error_line(res)
    with pytest.raises(UsageError):
        mirror(reg, [])
    res = run_mirror_cli(
        "--registry", str(reg.root), env={"PREFIXREG_MIRROR_TO": f"{tmp_path}/a {tmp_path}/b"}
    )
    assert res.returncode == 0, res.stderr
    assert content(tmp_path / "a") == content(tmp_path / "b") == content(reg.root)
    bad = run_mirror_cli(
        "--registry", str(reg.root), "--to", str(tmp_path / "c"), "--ssh-option", "Port"
    )
    assert bad.returncode == 2 and "is not Key=Value" in one_error_line(bad)  # a bad argument
    assert not (tmp_path / "c").exists()


def test_tampered_source_object_refuses_everything_with_exit_3(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    reg.add("new and fine", name="fine")
    sha = reg.resolve("p2")
    flip_byte(reg.object_path(sha))
    new_dest = tmp_path / "new"
    before = tree(tmp_path / "m")
    res = run_mirror_cli("--registry", str(reg.root), "--to", str(dest), "--to", str(new_dest))
    assert res.returncode == 3, res.stderr
    assert sha in one_error_line(res)
    assert tree(dest) == before and not new_dest.exists()
    assert [x["result"] for x in log_lines(reg)[-2:]] == ["refused", "refused"]
    with pytest.raises(IntegrityError):
        mirror(reg, [str(dest)], full_verify=True)


def test_rsync_missing_is_one_line_exit_6(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").symlink_to(sys.executable)
    res = run_mirror_cli(
        "--registry", str(reg.root), "--to", str(tmp_path / "m"), env={"PATH": str(bindir)}
    )
    assert res.returncode == 6
    assert "rsync" in one_error_line(res)
    assert not (tmp_path / "m").exists()


# -- the nightly job (#24) ----------------------------------------------------------------


def _unit(path: Path) -> dict[str, list[str]]:
    """{key: its values} of a systemd unit file (keys repeat, e.g. Environment=)."""
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_the_example_units_write_their_local_destination_and_verify_fully_weekly(
    tmp_path: Path,
) -> None:
    """ProtectSystem=strict leaves only StateDirectory and ReadWritePaths writable: systemd
    creates the registry's directory (it need not exist first) and every local destination
    is listed; a weekly timer runs --full-verify; systemd's own parser accepts all four units
    as shipped (before, ExecStart named /usr/bin/prefix-mirror, which `pip install .` never
    creates, and verify failed on it)."""
    examples = ROOT / "examples"
    for name, args in (
        ("prefix-mirror.service", ""),
        ("prefix-mirror-full.service", " --full-verify"),
    ):
        unit = _unit(examples / name)
        env = dict(v.strip('"').split("=", 1) for v in unit["Environment"])
        writable = [Path(p.lstrip("-")) for value in unit["ReadWritePaths"] for p in value.split()]
        local = [Path(d) for d in env["PREFIXREG_MIRROR_TO"].split() if d.startswith("/")]
        assert local and unit["ProtectSystem"] == ["strict"], name
        assert all(any(d.is_relative_to(w) for w in writable) for d in local), name
        (state,) = unit["StateDirectory"]  # made by systemd, under /var/lib, owned by User
        assert Path(env["PREFIXREG_HOME"]) == Path("/var/lib") / state, name
        assert unit["ExecStart"] == [f"/usr/bin/env prefix-mirror{args}"], name
        assert env["PATH"].split(":")[:2] == ["/opt/prefixreg/bin", "/usr/local/bin"], name
    assert _unit(examples / "prefix-mirror-full.timer")["OnCalendar"] == ["Sun *-*-* 05:00:00"]
    names = ["prefix-mirror.service", "prefix-mirror-full.service"]
    names += ["prefix-mirror.timer", "prefix-mirror-full.timer"]
    argv = ["systemd-analyze", "verify", "--man=no", *(str(examples / n) for n in names)]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr


def test_the_unit_runs_prefix_mirror_where_pip_install_puts_it(tmp_path: Path) -> None:
    """`python3 -m venv /opt/prefixreg && /opt/prefixreg/bin/pip install .`, as the unit's
    comment says (here under tmp_path, offline): the unit's ExecStart, on the unit's PATH,
    runs the installed console script."""
    venv = tmp_path / "opt" / "prefixreg"
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, str(ROOT)], check=True, capture_output=True, timeout=300)
    assert (venv / "bin" / "prefix-mirror").is_file()
    unit = _unit(ROOT / "examples" / "prefix-mirror.service")
    env = dict(v.strip('"').split("=", 1) for v in unit["Environment"])
    path = env["PATH"].replace("/opt/prefixreg", str(venv))
    (start,) = unit["ExecStart"]
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [*start.split(), "--help"],
        env={**clean, "PATH": path},
        cwd=tmp_path,  # not this checkout: the installed copy must be the one that runs
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "mirror" in res.stdout.lower()
    where = subprocess.run(
        [python, "-c", "import prefixreg; print(prefixreg.__file__)"],
        env={**clean, "PATH": path}, cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert where.stdout.startswith(str(venv)), where.stdout  # the installed copy ran


# -- the ordering promise -------------------------------------------------------------------


SentNames = dict[int, dict[str, str]]


@pytest.fixture
def sent_names(monkeypatch: pytest.MonkeyPatch) -> SentNames:
    """For each recorded pass (by id): what every name it sent said *at the worker*.

    Read from the local destination right after the pass, so the ordering checks judge
    what was sent, not the origin's state by the time the test looks.
    """
    recorded: SentNames = {}
    real_pass = Session._pass

    def recording_pass(self: Session, kind: str, paths: Sequence[str]) -> set[str]:
        count = len(self.result.passes)
        out = real_pass(self, kind, paths)
        if len(self.result.passes) > count:
            record = self.result.passes[-1]
            recorded[id(record)] = {
                c.path: (Path(self.dest.path) / c.path).read_text().strip()
                for c in record.changes
                if c.path.startswith("names/") and c.kind == "file" and not c.is_delete
            }
        return out

    monkeypatch.setattr(Session, "_pass", recording_pass)
    return recorded


def _assert_pass_order(passes: list[PassRecord], arrived: set[str], sent: SentNames) -> None:
    """From the itemized output: every name/meta sent finds its object already sent (or
    there before the run); deletions come after all sends; objects are deleted last."""
    kinds = [p.kind for p in passes if p.changes]
    seen_delete = False
    for p in passes:
        if p.kind == "confirm":
            seen_delete = False
            continue
        if p.kind.startswith("delete"):
            seen_delete = True
        elif p.changes:
            assert not seen_delete, f"a send after a deletion: {kinds}"
        for c in p.changes:
            if c.is_delete:
                if c.is_object and c.kind == "file":
                    arrived.discard(c.path.split("/")[-1].removesuffix(".txt"))
                continue
            if c.is_object and c.kind == "file":
                arrived.add(c.path.split("/")[-1].removesuffix(".txt"))
            elif c.path.startswith("meta/") and c.kind == "file":
                assert c.path[5:-5] in arrived, f"meta before object: {c.path} in {kinds}"
            elif c.path.startswith("names/") and c.kind == "file":
                target = sent[id(p)][c.path]
                assert target in arrived, f"name before object: {c.path} in {kinds}"
    deletes = [p.kind for p in passes if p.kind.startswith("delete") and p.changes]
    assert deletes == sorted(deletes), "objects must be deleted after names and meta"


def test_passes_send_objects_before_names_and_meta_and_delete_last(
    tmp_path: Path, sent_names: SentNames
) -> None:
    reg = make_origin(tmp_path / "reg", count=4)
    dest = tmp_path / "m"
    first = mirror(reg, [str(dest)]).results[0]
    _assert_pass_order(first.passes, set(), sent_names)
    arrived = set(reg.iter_shas())
    # Retire p3's object at the origin (as gc would, after its name moved away),
    # add objects, move names: the next run must delete last, objects after names/meta.
    old = reg.resolve("p3")
    new = reg.add("replacement", name="p3")
    reg.add("brand new", name="brand-new")
    os.chmod(reg.object_path(old), 0o644)
    reg.object_path(old).unlink()
    (reg.root / "meta" / f"{old}.json").unlink()
    (reg.root / "names" / "p2").unlink()
    res = mirror(reg, [str(dest)]).results[0]
    assert res.ok and res.deleted == 3
    _assert_pass_order(res.passes, arrived, sent_names)
    kinds = [p.kind for p in res.passes if p.changes and p.kind != "dirs"]
    assert kinds == ["objects", "meta", "names", "rest", "delete", "delete-objects"]
    (objects,) = [p for p in res.passes if p.kind == "objects"]
    assert new in {c.path.split("/")[-1][:64] for c in objects.changes}
    assert content(dest) == content(reg.root)


def _dest_consistent(dest: Path) -> list[str]:
    """Every name and meta record at the worker whose object is not there."""
    bad = []
    for sub in ("names", "meta"):
        directory = dest / sub
        for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
            sha = entry.read_text().strip() if sub == "names" else entry.name[:64]
            if not (dest / "objects" / sha[:2] / f"{sha}.txt").is_file():
                bad.append(f"{sub}/{entry.name} -> {sha[:12]}")
    return bad


def test_a_name_deleted_then_recreated_during_the_run_never_arrives_before_its_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delete pass only deletes: a planned deletion whose path came back at the
    origin (a new object behind it) is not sent early, and the object the worker's copy
    still points to is not deleted under it; the next round sends both in order."""
    reg = make_origin(tmp_path / "reg", count=2)
    old = reg.add("the old content of foo", name="foo")
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    # At the origin: foo is removed and its (now unnamed) object pruned, as gc would.
    (reg.root / "names" / "foo").unlink()
    os.chmod(reg.object_path(old), 0o644)
    reg.object_path(old).unlink()
    (reg.root / "meta" / f"{old}.json").unlink()
    checks: list[tuple[str, list[str]]] = []
    real_pass = Session._pass
    injected: list[str] = []

    def hooked(self: Session, kind: str, paths: Sequence[str]) -> set[str]:
        if kind == "delete" and not injected:
            # Between plan and delete pass: an agent loop re-creates foo -> a new object.
            injected.append(reg.add("foo, re-created meanwhile", name="foo"))
        out = real_pass(self, kind, paths)
        checks.append((kind, _dest_consistent(dest)))
        return out

    monkeypatch.setattr(Session, "_pass", hooked)
    (r,) = mirror(reg, [str(dest)], max_rounds=5).results
    assert injected, "the delete pass never ran"
    assert r.ok, r.error
    assert [bad for _kind, bad in checks if bad] == [], checks
    assert content(dest) == content(reg.root)
    assert Registry(dest).resolve("foo") == injected[0]


def _reader(dest: Path, stop: threading.Event, violations: list[str], reads: list[int]) -> None:
    """Poll the worker like a reader would: every visible name and meta needs its object."""
    while not stop.is_set():
        n = 0
        for sub in ("names", "meta"):
            directory = dest / sub
            if not directory.is_dir():
                continue
            for entry in os.scandir(directory):
                if entry.name.startswith("."):
                    continue  # rsync's in-flight temp files are not names
                try:
                    sha = (
                        Path(entry.path).read_text().strip()
                        if sub == "names"
                        else entry.name.removesuffix(".json")
                    )
                except FileNotFoundError:
                    continue  # deleted (last) by the mirror between listing and reading
                obj = dest / "objects" / sha[:2] / f"{sha}.txt"
                try:
                    data = obj.read_bytes()
                except FileNotFoundError:
                    violations.append(f"{sub}/{entry.name} visible before objects/{sha}")
                    continue
                if hashlib.sha256(data).hexdigest() != sha:
                    violations.append(f"{sub}/{entry.name}: object {sha} incomplete")
                n += 1
        reads.append(n)


def test_a_reader_on_the_worker_never_sees_a_name_or_meta_before_its_object(
    tmp_path: Path,
) -> None:
    """A slow transfer (bwlimit) while the origin keeps adding and moving names."""
    reg = make_origin(tmp_path / "reg", count=30, size=40_000)
    dest = tmp_path / "m"
    violations: list[str] = []
    reads: list[int] = []
    stop = threading.Event()
    reader = threading.Thread(target=_reader, args=(dest, stop, violations, reads))
    reader.start()

    def writer() -> None:
        for i in range(15):
            sha = reg.add(f"written during the mirror {i}\n" + "y" * 30_000, name=f"live{i % 4}")
            reg.move_name(f"p{i}", sha)
            time.sleep(0.05)

    try:
        first = threading.Thread(target=writer)
        first.start()
        report = mirror(reg, [str(dest)], bwlimit=800, max_rounds=10)
        first.join()
        assert report.ok, report.results[0].error
        second = threading.Thread(target=writer)
        second.start()
        mirror(reg, [str(dest)], bwlimit=800, max_rounds=10)
        second.join()
        final = mirror(reg, [str(dest)])
        assert final.ok
    finally:
        stop.set()
        reader.join()
    assert violations == []
    assert sum(1 for n in reads if n) > 5  # the reader really watched the transfer
    assert content(dest) == content(reg.root)


# -- over ssh -------------------------------------------------------------------------


def ssh_args(server: SshServer) -> list[str]:
    out = []
    for opt in server.ssh_options:
        out += ["--ssh-option", opt]
    return out


def test_ssh_mirror_is_byte_identical_and_a_second_run_sends_nothing(
    tmp_path: Path, sshd: SshServer
) -> None:
    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "remote"
    res = run_mirror_cli("--registry", str(reg.root), "--to", sshd.dest(dest), *ssh_args(sshd))
    assert res.returncode == 0, res.stderr
    assert content(dest) == content(reg.root) and role_of(dest) == "mirror"
    reg.add("more", name="more")
    (dest / "junk").write_text("worker side")
    res = run_mirror_cli(
        "--registry",
        str(reg.root),
        "--to",
        sshd.dest(dest),
        "--json",
        "--full-verify",
        env={"PREFIXREG_SSH_OPTS": " ".join(sshd.ssh_options)},
    )
    assert res.returncode == 0, res.stderr
    (d,) = orjson.loads(res.stdout)["destinations"]
    assert d["deleted"] == 1 and d["verified"] and d["content"] == "verified"
    assert content(dest) == content(reg.root)
    before = tree(dest)
    res = run_mirror_cli("--registry", str(reg.root), "--to", sshd.dest(dest), *ssh_args(sshd))
    assert res.returncode == 0
    assert log_lines(reg)[-1]["sent"] == 0 and log_lines(reg)[-1]["verified"] is True
    assert tree(dest) == before


def test_ssh_that_cannot_authenticate_fails_one_line_and_others_still_run(
    tmp_path: Path, sshd: SshServer
) -> None:
    reg = make_origin(tmp_path / "reg")
    remote = tmp_path / "remote"
    assert mirror(reg, [sshd.dest(remote)], ssh_options=sshd.ssh_options).ok
    reg.add("later", name="later")
    before = tree(remote)
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    opts = [
        o if not o.startswith("IdentityFile=") else f"IdentityFile={stranger}"
        for o in sshd.ssh_options
    ]
    local = tmp_path / "local"
    args = ["--registry", str(reg.root), "--to", sshd.dest(remote), "--to", str(local)]
    res = run_mirror_cli(*args, *[a for o in opts for a in ("--ssh-option", o)], "--json")
    assert res.returncode == 6
    report = orjson.loads(res.stdout)
    assert report["failed"] == [sshd.dest(remote)]
    err = res.stderr.decode()
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and sshd.dest(remote) in errors[0]
    assert "Permission denied" in err and sshd.dest(remote) in err
    assert tree(remote) == before  # nothing deleted or sent there
    assert content(local) == content(reg.root)  # the other destination went ahead
    assert [x["result"] for x in log_lines(reg)[-2:]] == ["failed", "ok"] or [
        x["result"] for x in log_lines(reg)[-2:]
    ] == ["ok", "failed"]


def test_ssh_plain_run_hashes_the_worker_and_repairs_an_object_changed_in_place(
    tmp_path: Path, sshd: SshServer
) -> None:
    """#20 case 8 over a real sshd: before, three plain runs printed "verified" over this
    object while the worker's own verify failed. Now the plain run hashes it there, says
    so, sends it again and hashes it again; the worker verifies."""
    reg = make_origin(tmp_path / "reg")
    dest = tmp_path / "remote"
    args = ["--registry", str(reg.root), "--to", sshd.dest(dest), *ssh_args(sshd)]
    assert run_mirror_cli(*args).returncode == 0
    sha = reg.resolve("p3")
    _change_in_place(dest / "objects" / sha[:2] / f"{sha}.txt")
    assert run_cli("verify", "--registry", str(dest)).returncode == 1
    dry = run_mirror_cli(*args, "--dry-run")
    assert dry.returncode == 0 and b"content mismatch" in dry.stderr, dry.stderr
    assert f">fc........ objects/{sha[:2]}/{sha}.txt".encode() in dry.stdout
    res = run_mirror_cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    (d,) = orjson.loads(res.stdout)["destinations"]
    assert (d["sent"], d["changed_in_place"], d["read_back"], d["hashed"]) == (1, 1, 1, 5)
    assert d["content"] == "verified" and d["verified"]
    assert b"verified (5 objects hashed there, 1 changed in place)" in res.stderr, res.stderr
    assert content(dest) == content(reg.root)
    assert run_cli("verify", "--registry", str(dest)).returncode == 0
    for _ in range(2):
        again = run_mirror_cli(*args)
        assert again.returncode == 0 and b"verified (5 objects hashed there)" in again.stderr


def test_a_missing_destination_parent_is_one_clear_line_exit_6(
    tmp_path: Path, sshd: SshServer
) -> None:
    """#24: not rsync's raw exit 11; nothing created, in a dry run too, local or remote."""
    reg = make_origin(tmp_path / "reg", count=1)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for dest in (
        str(tmp_path / "no" / "such" / "m"),
        sshd.dest(tmp_path / "gone" / "m"),
        str(afile / "m"),
    ):
        for extra in ([], ["--dry-run"]):
            res = run_mirror_cli("--registry", str(reg.root), "--to", dest, *ssh_args(sshd), *extra)
            assert res.returncode == 6, res.stderr
            line = one_error_line(res)
            assert "parent directory" in line and "does not exist" in line and dest in line
            assert "exit 11" not in line
    assert not (tmp_path / "no").exists() and not (tmp_path / "gone").exists()
    assert afile.read_text() == "x"


def test_no_sha256sum_at_the_destination_is_one_line_exit_6(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg", count=1)
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("rsync", "sh", "find", "python3"):
        found = shutil.which(tool)
        assert found is not None
        (bindir / tool).symlink_to(found)
    before = tree(dest)
    res = run_mirror_cli("--registry", str(reg.root), "--to", str(dest), env={"PATH": str(bindir)})
    assert res.returncode == 6
    assert "sha256sum is not installed" in one_error_line(res)
    assert tree(dest) == before
    assert log_lines(reg)[-1]["content"] == "unchecked"


def test_a_deeply_nested_frame_record_refuses_the_run_without_a_recursion_error(
    tmp_path: Path,
) -> None:
    """#22 case 3 named the mirror: a self-consistent frame record nested 100k deep."""
    reg = make_origin(tmp_path / "reg", count=1)
    raw = b"[" * 100_000 + b"]" * 100_000
    sha = hashlib.sha256(raw).hexdigest()
    (reg.root / "frames").mkdir(exist_ok=True)
    (reg.root / "frames" / f"{sha}.json").write_bytes(raw)
    (reg.root / "names" / "deep").write_text(f"{sha}\n")
    dest = tmp_path / "m"
    res = run_mirror_cli("--registry", str(reg.root), "--to", str(dest))
    assert res.returncode == 3, res.stderr
    assert sha in one_error_line(res) and b"Recursion" not in res.stderr
    assert not dest.exists()


def test_interrupted_ssh_transfer_is_logged_and_repaired_by_the_next_run(
    tmp_path: Path, sshd: SshServer
) -> None:
    reg = make_origin(tmp_path / "reg", count=40, size=60_000)
    dest = tmp_path / "remote"
    wrapper_dir = tmp_path / "wrap"
    wrapper_dir.mkdir()
    pids = tmp_path / "ssh.pids"
    real_ssh = subprocess.run(["which", "ssh"], capture_output=True, text=True).stdout.strip()
    (wrapper_dir / "ssh").write_text(f'#!/bin/sh\necho $$ >> {pids}\nexec {real_ssh} "$@"\n')
    (wrapper_dir / "ssh").chmod(0o755)
    env = dict(os.environ, PATH=f"{wrapper_dir}:{os.environ['PATH']}")
    args = ["--registry", str(reg.root), "--to", sshd.dest(dest), "--bwlimit", "500"]
    proc = subprocess.Popen(
        [sys.executable, str(BIN), *args, *ssh_args(sshd)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        objects = list((dest / "objects").glob("*/*.txt")) if dest.exists() else []
        if objects:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the transfer finished before it could be interrupted"
    for pid in {int(x) for x in pids.read_text().split()}:
        try:
            os.kill(pid, signal.SIGKILL)  # only the ssh processes this test's run started
        except ProcessLookupError:
            pass
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 6, err
    assert f"error: {sshd.dest(dest)}" in err.decode()
    last = log_lines(reg)[-1]
    assert last["result"] == "failed" and last["verified"] is False and "error" in last
    assert content(dest) != content(reg.root)
    res = run_mirror_cli("--registry", str(reg.root), "--to", sshd.dest(dest), *ssh_args(sshd))
    assert res.returncode == 0, res.stderr
    assert content(dest) == content(reg.root)
    assert log_lines(reg)[-1]["result"] == "ok"


# -- review fixes: locking, concurrent gc, odd sources and destinations ------------------


def test_the_registry_lock_is_not_held_while_the_other_files_travel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Probes, measurements and journals go outside the lock: an agent loop's name move
    during that (slow) pass does not wait for it."""
    reg = make_origin(tmp_path / "reg", count=2)
    (reg.root / "probes").mkdir()
    (reg.root / "probes" / "20260101T000000.000000Z.md").write_bytes(b"probe\n" * 1000)
    loop = Registry(reg.root, lock_timeout=0.5)
    moved: list[object] = []
    real_pass = Session._pass

    def hooked(self: Session, kind: str, paths: Sequence[str]) -> set[str]:
        if kind == "rest":
            moved.append(loop.move_name("p0", loop.resolve("p1")))  # LockTimeoutError if held
        return real_pass(self, kind, paths)

    monkeypatch.setattr(Session, "_pass", hooked)
    report = mirror(reg, [str(tmp_path / "m")], max_rounds=5)
    assert moved and moved[0] is not None
    assert report.ok, report.results[0].error
    assert content(tmp_path / "m") == content(reg.root)


def test_a_gc_between_plan_and_send_is_no_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unnamed object (and its meta) pruned right after the plan: skipped in the
    verification and the reference check, not sent, and the run is ok and logged."""
    from prefixreg.registry.gc import collect_garbage

    reg = make_origin(tmp_path / "reg", count=2)
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    reg.add("unnamed, soon pruned")
    real_prepare = Session.prepare
    pruned: list[int] = []

    def prepare(self: Session) -> None:
        real_prepare(self)
        if not pruned:
            report = collect_garbage(reg, grace_s=0, prune_unnamed=True, min_age_s=0)
            pruned.append(len(report.removed))

    monkeypatch.setattr(Session, "prepare", prepare)
    report = mirror(reg, [str(dest)])
    assert pruned == [2]
    assert report.ok, report.results[0].error
    assert content(dest) == content(reg.root)
    assert log_lines(reg)[-1]["result"] == "ok"


def test_vanished_files_in_the_compare_dry_run_are_no_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rsync exit 24 (a file vanished while it walked the source) from the compare."""
    reg = make_origin(tmp_path / "reg", count=2)
    real_run = rsync.run
    faked: list[bool] = []

    def run(argv: Sequence[str], *, ok_codes: Sequence[int] = (0,)) -> bytes:
        out = real_run(argv, ok_codes=ok_codes)
        if "--dry-run" in argv and not faked:
            faked.append(True)  # rsync exited 24 after printing its plan
            if 24 not in ok_codes:
                raise MirrorError("rsync failed (exit 24): file has vanished", returncode=24)
        return out

    monkeypatch.setattr(rsync, "run", run)
    report = mirror(reg, [str(tmp_path / "m")])
    assert faked and report.ok, report.results[0].error


def test_an_unreadable_source_fails_the_destination_with_a_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = make_origin(tmp_path / "reg", count=2)

    def unreadable(self: Registry, sha: str) -> bytes:
        raise PermissionError(13, "Permission denied", str(self.object_path(sha)))

    monkeypatch.setattr(Registry, "read_verified", unreadable)
    report = mirror(reg, [str(tmp_path / "m")])
    (r,) = report.results
    assert not report.ok and r.result == "failed" and "Permission denied" in (r.error or "")
    assert log_lines(reg)[-1]["result"] == "failed"
    assert not (tmp_path / "m").exists()


def test_a_symlinked_object_is_refused_and_nothing_sent(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg", count=2)
    sha = reg.add("victim", name="victim")
    obj = reg.object_path(sha)
    os.chmod(obj, 0o644)
    obj.unlink()
    (tmp_path / "evil.txt").write_text("not the victim bytes")
    obj.symlink_to(tmp_path / "evil.txt")
    dest = tmp_path / "m"
    with pytest.raises(IntegrityError, match="symlink"):
        mirror(reg, [str(dest)])
    assert not dest.exists()
    assert log_lines(reg)[-1]["result"] == "refused"


def test_duplicate_spellings_of_one_destination_run_once(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg", count=2)
    dest = tmp_path / "m"
    report = mirror(reg, [str(dest), f"{dest}/", f"{tmp_path}/./m", f"{tmp_path}/x/../m"])
    assert [r.destination for r in report.results] == [str(dest)]
    assert report.ok and len(log_lines(reg)) == 1


@pytest.mark.parametrize(
    "pair", [("m", "m/inner"), ("m/inner", "m"), ("h:/srv/m", "h:/srv/m/w"), ("h:a", "h:a/b")]
)
def test_nested_destinations_are_refused(tmp_path: Path, pair: tuple[str, str]) -> None:
    reg = make_origin(tmp_path / "reg", count=1)
    dests = [p if ":" in p else str(tmp_path / p) for p in pair]
    with pytest.raises(MirrorError, match="nested"):
        mirror(reg, dests)
    assert not (tmp_path / "m").exists() and not log_lines(reg)


def test_root_and_a_symlink_to_the_source_are_refused_as_overlapping(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg", count=1)
    link = tmp_path / "link-to-reg"
    link.symlink_to(reg.root)
    before = tree(reg.root)
    for dest in ("/", str(link), f"{link}/", str(tmp_path)):
        with pytest.raises(MirrorError, match="overlaps the source"):
            mirror(reg, [dest])
    res = run_mirror_cli("--registry", str(reg.root), "--to", "/")
    assert res.returncode == 6 and "overlaps" in one_error_line(res)
    assert tree(reg.root) == before


@pytest.mark.parametrize(
    "listing",
    [
        b"",  # nothing at all: no positive answer that the directory is empty
        b"drwxr-xr-x          4,096 2026/11/29 13:52:11 .\nsomething rsync printed\n",
        b"-rw-r--r--              0 2026/11/29 13:52:11 precious\n",  # no "." line
    ],
)
def test_destination_inspection_fails_closed_on_an_unreadable_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listing: bytes
) -> None:
    reg = make_origin(tmp_path / "reg", count=1)
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "precious").write_text("keep")
    real_run = rsync.run

    def run(argv: Sequence[str], *, ok_codes: Sequence[int] = (0,)) -> bytes:
        return listing if "--list-only" in argv else real_run(argv, ok_codes=ok_codes)

    monkeypatch.setattr(rsync, "run", run)
    before = tree(dest)
    (r,) = mirror(reg, [str(dest)]).results
    assert r.result == "failed" and "refusing" in (r.error or "")
    assert tree(dest) == before


def test_rsync_runs_in_the_c_locale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    monkeypatch.setenv("LANG", "de_DE.UTF-8")
    out = rsync.run(["sh", "-c", 'echo "$LC_ALL $LANG"'])
    assert out == b"C C\n"


# -- what travels is checked by type and hash (#12) ------------------------------------------


def _replace_object(reg: Registry, sha: str, kind: str, outside: Path) -> None:
    """Put something that is not the object at the object's path in the source."""
    obj = reg.object_path(sha)
    os.chmod(obj.parent, 0o755)  # noqa: S103 (a test making room for the swap)
    os.chmod(obj, 0o644)
    obj.unlink()
    if kind == "empty-dir":
        obj.mkdir()
    elif kind == "dir-with-file":
        obj.mkdir()
        (obj / "inner").write_text("not the object")
    elif kind == "fifo":
        os.mkfifo(obj)
    elif kind == "symlink":
        outside.write_text("outside bytes")
        obj.symlink_to(outside)
    else:
        raise AssertionError(kind)


def _assert_good_object(dest: Path, sha: str, expected: bytes) -> None:
    obj = dest / "objects" / sha[:2] / f"{sha}.txt"
    assert obj.is_file() and not obj.is_symlink()
    data = obj.read_bytes()
    assert data == expected and hashlib.sha256(data).hexdigest() == sha
    res = run_cli("cat", "--registry", str(dest), sha)
    assert res.returncode == 0, res.stderr
    assert res.stdout == expected


@pytest.mark.parametrize("kind", ["empty-dir", "dir-with-file", "fifo", "symlink"])
def test_a_source_object_replaced_by_a_non_file_is_refused_and_the_worker_keeps_its_object(
    tmp_path: Path, kind: str
) -> None:
    """The issue's row: after a good mirror, a source object becomes a directory (or a
    FIFO, or a symlink); the next run exits non-zero and the worker's object stays."""
    reg = make_origin(tmp_path / "reg", count=3)
    dest = tmp_path / "m"
    assert run_mirror_cli("--registry", str(reg.root), "--to", str(dest)).returncode == 0
    sha = reg.resolve("p1")
    expected = reg.read_verified(sha)
    _replace_object(reg, sha, kind, tmp_path / "outside.txt")
    before = tree(dest)
    res = run_mirror_cli("--registry", str(reg.root), "--to", str(dest))
    assert res.returncode == 3, res.stderr
    assert "refusing" in one_error_line(res)
    assert tree(dest) == before
    _assert_good_object(dest, sha, expected)
    assert log_lines(reg)[-1]["result"] == "refused"


def test_a_source_object_replaced_by_a_directory_is_refused_over_ssh(
    tmp_path: Path, sshd: SshServer
) -> None:
    reg = make_origin(tmp_path / "reg", count=3)
    dest = tmp_path / "remote"
    args = ["--registry", str(reg.root), "--to", sshd.dest(dest), *ssh_args(sshd)]
    assert run_mirror_cli(*args).returncode == 0
    assert log_lines(reg)[-1]["read_back"] == 3  # every object sent was read back over ssh
    sha = reg.resolve("p0")
    expected = reg.read_verified(sha)
    _replace_object(reg, sha, "empty-dir", tmp_path / "unused")
    before = tree(dest)
    res = run_mirror_cli(*args)
    assert res.returncode == 3, res.stderr
    assert tree(dest) == before
    _assert_good_object(dest, sha, expected)


@pytest.mark.parametrize("sub", ["meta", "names", "objects"])
def test_a_symlinked_registry_directory_is_refused_and_nothing_sent(
    tmp_path: Path, sub: str
) -> None:
    reg = make_origin(tmp_path / "reg", count=2)
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    outside = tmp_path / "outside"
    (reg.root / sub).rename(outside)
    (reg.root / sub).symlink_to(outside)
    before = tree(dest)
    res = run_mirror_cli("--registry", str(reg.root), "--to", str(dest))
    assert res.returncode == 3, res.stderr
    assert "symlink" in one_error_line(res)
    assert tree(dest) == before


def test_an_object_that_turns_into_a_directory_after_the_check_never_travels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race after the check: the send passes carry regular files only, so the
    worker's good object is not replaced, and the next round refuses the run."""
    reg = make_origin(tmp_path / "reg", count=3)
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    sha = reg.resolve("p2")
    expected = reg.read_verified(sha)
    os.utime(reg.object_path(sha), (1_000_000, 1_000_000))  # in the next plan
    fresh = reg.add("fresh object", name="fresh")
    real_pass = Session._pass
    swapped: list[str] = []

    def hooked(self: Session, kind: str, paths: Sequence[str]) -> set[str]:
        if kind == "objects" and not swapped:
            for victim in (sha, fresh):
                _replace_object(reg, victim, "empty-dir", tmp_path / "unused")
                swapped.append(victim)
        return real_pass(self, kind, paths)

    monkeypatch.setattr(Session, "_pass", hooked)
    (r,) = mirror(reg, [str(dest)]).results
    assert swapped and r.result == "failed", r
    _assert_good_object(dest, sha, expected)
    assert not (dest / "objects" / fresh[:2] / f"{fresh}.txt").exists()
    assert not (dest / "names" / "fresh").exists()  # its name never points to nothing


def test_an_object_that_arrives_wrong_is_caught_by_the_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each object sent is hashed at the destination right after its pass: a worker copy
    that does not hash to its name fails the destination before its name is sent, and the
    verdict is "mismatch"; the next plain run finds and repairs it."""
    reg = make_origin(tmp_path / "reg", count=2)
    dest = tmp_path / "m"
    assert mirror(reg, [str(dest)]).ok
    fresh = reg.add("arrives damaged", name="fresh")
    real_read_back = Session.read_back

    def damaged_in_transit(self: Session, paths: Sequence[str]) -> None:
        flip_byte(dest / "objects" / fresh[:2] / f"{fresh}.txt")
        real_read_back(self, paths)

    monkeypatch.setattr(Session, "read_back", damaged_in_transit)
    report = mirror(reg, [str(dest)])
    (r,) = report.results
    assert r.result == "failed" and not r.verified and r.content == "mismatch"
    assert "hashes to" in (r.error or "") and fresh in (r.error or "")
    assert not (dest / "names" / "fresh").exists()
    assert log_lines(reg)[-1]["result"] == "failed"
    assert log_lines(reg)[-1]["content"] == "mismatch"
    monkeypatch.undo()
    assert mirror(reg, [str(dest)]).ok  # the next plain run repairs it
    assert content(dest) == content(reg.root)


def test_send_argv_never_carries_symlinks_devices_or_fifos() -> None:
    send = build_rsync_argv("send", "/r/", "/m/", files_from="/l")
    assert {"--no-links", "--no-devices", "--no-specials"} <= set(send)
    assert "--no-dirs" not in send
    assert "--no-dirs" in build_rsync_argv("send", "/r/", "/m/", files_from="/l", regular_only=True)
    assert "--checksum" in send  # a file changed in place keeps its size and mtime


def test_pip_installs_prefix_mirror_with_the_other_two_commands() -> None:
    import importlib
    import tomllib

    scripts = tomllib.loads(Path("pyproject.toml").read_text())["project"]["scripts"]
    for command in ("prefixreg", "prefix-add", "prefix-warm", "prefix-mirror"):
        module, _, attr = scripts[command].partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), command
    lines = Path("README.md").read_text().splitlines()
    install = next(line for line in lines if line.startswith("pip install .  "))
    assert all(c in install for c in ("prefix-add", "prefix-warm", "prefix-mirror"))
