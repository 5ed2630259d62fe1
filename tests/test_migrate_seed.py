"""migrate --repoint: the seed's hand-built registry (no REGISTRY.json, objects 0644, its own
meta and measurement shapes, bin/ scripts naming the old path, README, mirror.log) adopted at
the XDG location, history byte-identical and read as legacy, README and bin/ repointed, the
worker path left alone; --dry-run prints diffs; bad objects refuse, each named (#24)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from prefixreg.registry.location import default_registry_path, legacy_registry_path
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from tests.conftest import run_cli as run

PREFIXES = ("You are the coding loop.\n" * 40, "Review the diff.\n" * 25)


def _mirror_sh(home: Path) -> str:
    lines = [
        "#!/bin/sh",
        "# prefix-mirror.sh: rsync the registry to every worker, nightly.",
        "#",
        "# Usage: prefix-mirror.sh [HOST...]",
        "# Reads $REG (default ~/prefix-registry), appends one line per run to",
        "# mirror.log, and copies to HOST:$REMOTE_PATH on each worker",
        "# (e.g. worker1:~/prefix-registry).",
        "set -eu",
        "",
        "HOSTS=${HOSTS:-worker1 worker2}",
        "",
        'REG="${REG:-$HOME/prefix-registry}"',  # line 12
        "",
        f'REMOTE_PATH="{home}/prefix-registry"',  # line 14
        "for h in $HOSTS; do",
        '  rsync -a --delete "$REG/objects" "$h:$REMOTE_PATH/"',
        '  echo "{\\"host\\":\\"$h\\",\\"rc\\":$?}" >> "$REG/mirror.log"',
        "done",
    ]
    return "\n".join(lines) + "\n"


def build_seed(home: Path) -> tuple[Path, list[str]]:
    """The seed's registry as the Halogen report describes it; its shas."""
    root = home / "prefix-registry"
    shas = []
    for i, text in enumerate(PREFIXES):
        data = text.encode()
        sha = hashlib.sha256(data).hexdigest()
        shas.append(sha)
        obj = root / "objects" / sha[:2] / f"{sha}.txt"
        obj.parent.mkdir(parents=True, exist_ok=True)
        obj.write_bytes(data)
        obj.chmod(0o644)
        meta = {"sha": sha, "size": len(data), "added": f"2026-09-0{i + 1} 10:00", "tags": ["x"]}
        (root / "meta").mkdir(exist_ok=True)
        (root / "meta" / f"{sha}.json").write_text(json.dumps(meta, indent=2) + "\n")
        (root / "measurements").mkdir(exist_ok=True)
        m = {"prefix": sha, "ts": "2026-09-02T03:00:00", "cold_s": 17.2, "warm_s": 0.41}
        (root / "measurements" / f"{sha}-20260902T030000.json").write_text(json.dumps(m))
    (root / "bin").mkdir()
    (root / "bin" / "prefix-add.py").write_text(
        '#!/usr/bin/env python3\n"""Add a prefix to the registry at ~/prefix-registry.\n\n'
        f"Objects land in {home}/prefix-registry/objects/<aa>/<sha>.txt.\n"
        '"""\nimport os\n\n'
        'REGISTRY = os.environ.get("PREFIX_REGISTRY", os.path.expanduser("~/prefix-registry"))\n'
    )
    (root / "bin" / "prefix-warm.py").write_text(
        '#!/usr/bin/env python3\n"""Warm a prefix on a worker."""\nimport os\n\n'
        'REGISTRY = os.path.expanduser("~/prefix-registry")\n'
        'OTHER = os.path.expanduser("~/prefix-registry-old")\n'
    )
    (root / "bin" / "prefix-mirror.sh").write_text(_mirror_sh(home))
    for script in (root / "bin").iterdir():
        script.chmod(0o755)
    (root / "README.md").write_text(
        "# prefix registry\n\nLayout: `~/prefix-registry/objects/<aa>/<sha>.txt`, "
        "`meta/<sha>.json`, `measurements/<sha>-<ts>.json`.\n"
    )
    (root / "mirror.log").write_text('{"host":"worker1","rc":0}\n{"host":"worker2","rc":0}\n')
    return root, shas


def _tree(root: Path, top: tuple[str, ...]) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] in top
    }


HISTORY = ("meta", "measurements", "mirror.log", "objects")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home whose XDG state directory lies inside it (`~/.local/state`, as on Linux)."""
    home = tmp_path / "home"
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    return home


def test_the_seeds_registry_is_adopted_and_repointed(home: Path) -> None:
    seed, shas = build_seed(home)
    assert seed == legacy_registry_path()
    history = _tree(seed, HISTORY)
    mirror_sh = (seed / "bin" / "prefix-mirror.sh").read_text().splitlines()

    before = run("verify", "--registry", str(seed))
    assert before.returncode == 2 and b"REGISTRY.json" in before.stderr
    refused = run("migrate", str(seed))  # without --repoint: one line, the way out
    assert refused.returncode == 2
    assert b"--repoint" in refused.stderr and b"On-disk format" in refused.stderr

    done = run("migrate", "~/prefix-registry".replace("~", str(home)), "--repoint")
    assert done.returncode == 0, done.stderr
    new = default_registry_path()
    assert new == home / ".local" / "state" / "prefix-registry"
    assert not seed.exists()
    assert b"2 legacy" not in done.stderr and b"4 legacy records" in done.stderr
    assert b"kept as yours: bin" in done.stderr

    # History byte-identical; objects read-only and verified.
    assert _tree(new, HISTORY) == history
    for sha in shas:
        obj = new / "objects" / sha[:2] / f"{sha}.txt"
        assert stat.S_IMODE(obj.stat().st_mode) == 0o444
    verified = run("verify", "--registry", str(new), "--json")
    assert verified.returncode == 0, verified.stdout
    findings = json.loads(verified.stdout)["findings"]
    assert [f["kind"] for f in findings] == ["legacy"]  # warned once, never a problem
    cat = run("cat", shas[0], "--registry", str(new))
    assert (cat.returncode, cat.stdout) == (0, PREFIXES[0].encode())
    assert run("ls", "--registry", str(new)).returncode == 0
    assert Registry(new).measurements() == []  # history, bound to no build

    # README and bin/ repointed in the spelling they used; the worker path left alone.
    state = "~/.local/state/prefix-registry"
    assert f"`{state}/objects/" in (new / "README.md").read_text()
    add = (new / "bin" / "prefix-add.py").read_text()
    assert f"registry at {state}." in add
    assert f"{new}/objects/" in add and f'expanduser("{state}")' in add
    warm = (new / "bin" / "prefix-warm.py").read_text()
    assert f'expanduser("{state}")' in warm and "~/prefix-registry-old" in warm
    after = (new / "bin" / "prefix-mirror.sh").read_text().splitlines()
    assert after[11] == 'REG="${REG:-$HOME/.local/state/prefix-registry}"'
    assert after[13] == mirror_sh[13] == f'REMOTE_PATH="{home}/prefix-registry"'
    assert "(e.g. worker1:~/prefix-registry)" in after[6]  # a host:path
    assert [i for i, (a, b) in enumerate(zip(mirror_sh, after, strict=True)) if a != b] == [4, 11]
    assert os.access(new / "bin" / "prefix-mirror.sh", os.X_OK)
    log = json.loads((new / "migrations.log").read_text().splitlines()[-1])
    assert (log["method"], log["objects"], log["from"]) == ("adopt", 2, str(seed))


def test_dry_run_prints_each_change_as_a_diff_and_changes_nothing(home: Path) -> None:
    seed, _shas = build_seed(home)
    everything = _tree(seed, (*HISTORY, "bin", "README.md"))
    dry = run("migrate", str(seed), "--repoint", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    out = dry.stdout.decode()
    new = default_registry_path()
    for rel in ("README.md", "bin/prefix-add.py", "bin/prefix-warm.py", "bin/prefix-mirror.sh"):
        assert f"--- {seed}/{rel}\n+++ {new}/{rel}\n" in out
    assert '-REG="${REG:-$HOME/prefix-registry}"' in out
    assert '+REG="${REG:-$HOME/.local/state/prefix-registry}"' in out
    changed = [line for line in out.splitlines() if line[:1] in "+-"]
    assert not [line for line in changed if "REMOTE_PATH" in line or "mirror.log" in line]
    assert not [line for line in changed if "worker1:" in line]
    assert b"would move" in dry.stderr
    assert _tree(seed, (*HISTORY, "bin", "README.md")) == everything
    assert not new.exists()


def test_bad_objects_refuse_the_adoption_each_named(home: Path) -> None:
    seed, shas = build_seed(home)
    for sha in shas:
        (seed / "objects" / sha[:2] / f"{sha}.txt").write_bytes(b"edited by hand\n")
    everything = _tree(seed, (*HISTORY, "bin", "README.md"))
    result = run("migrate", str(seed), "--repoint")
    assert result.returncode == 3
    err = result.stderr.decode()
    assert "2 objects do not verify" in err and all(sha in err for sha in shas)
    assert "On-disk format" in err and "DESIGN" not in err
    assert _tree(seed, (*HISTORY, "bin", "README.md")) == everything
    assert not default_registry_path().exists()
    assert not list(default_registry_path().parent.glob(".*adopting*"))


def test_a_legacy_record_changed_after_adoption_is_a_problem(home: Path) -> None:
    seed, shas = build_seed(home)
    assert run("migrate", str(seed), "--repoint").returncode == 0
    reg = Registry(default_registry_path())
    meta = reg.root / "meta" / f"{shas[0]}.json"
    meta.write_text(meta.read_text().replace("10:00", "11:00"))
    kinds = {(f.kind, f.path) for f in verify_registry(reg).findings}
    assert ("bad_record", f"meta/{shas[0]}.json") in kinds
    # Something new outside the format is still unexpected, and says where the format is.
    (reg.root / "notes").mkdir()
    found = [f for f in verify_registry(reg).findings if f.path == "notes"]
    assert found and "On-disk format" in found[0].message and "DESIGN" not in found[0].message


def test_a_note_never_rewrites_a_legacy_meta_record(home: Path, tmp_path: Path) -> None:
    seed, shas = build_seed(home)
    assert run("migrate", str(seed), "--repoint").returncode == 0
    reg = Registry(default_registry_path())
    meta = reg.root / "meta" / f"{shas[0]}.json"
    before = meta.read_bytes()
    src = tmp_path / "p.txt"
    src.write_text(PREFIXES[0])
    noted = run("add", str(src), "--note", "mine", "--registry", str(reg.root))
    assert noted.returncode == 2 and b"legacy record" in noted.stderr
    assert meta.read_bytes() == before
    plain = run("add", str(src), "--registry", str(reg.root))  # the same bytes again: a no-op
    assert plain.returncode == 0 and plain.stdout.decode().strip() == shas[0]
    assert meta.read_bytes() == before
    assert run("verify", "--registry", str(reg.root)).returncode == 0


def test_the_hint_for_the_seeds_registry_names_repoint(home: Path) -> None:
    build_seed(home)
    hints = [line for line in run("ls").stderr.decode().splitlines() if line.startswith("hint:")]
    assert hints == [
        "hint: found a registry at ~/prefix-registry; "
        "run prefixreg migrate ~/prefix-registry --repoint"
    ]


def test_what_cannot_be_adopted_is_refused_with_nothing_written(home: Path) -> None:
    seed, _shas = build_seed(home)
    (seed / "bin" / "link").symlink_to("/etc/passwd")
    linked = run("migrate", str(seed), "--repoint")
    assert linked.returncode == 3 and b"symlink" in linked.stderr
    (seed / "bin" / "link").unlink()
    new = default_registry_path()
    Registry(new).add("another registry\n")
    taken = run("migrate", str(seed), "--repoint")
    assert taken.returncode == 2 and b"holds a registry" in taken.stderr
    empty = home / "not-a-registry"
    (empty / "docs").mkdir(parents=True)
    plain = run("migrate", str(empty), "--repoint", "--to", str(home / "x"))
    assert plain.returncode == 2 and b"no objects/ directory" in plain.stderr
    assert seed.is_dir() and not (seed / "REGISTRY.json").exists()


@pytest.mark.parametrize("junk", ["meta/junk", "frames/x.json"])
def test_junk_in_meta_or_frames_refuses_the_adoption_alike(home: Path, junk: str) -> None:
    seed, _shas = build_seed(home)
    (seed / junk).parent.mkdir(exist_ok=True)
    (seed / junk).write_bytes(b"{")
    everything = _tree(seed, (*HISTORY, "bin", "README.md", "frames"))
    result = run("migrate", str(seed), "--repoint")
    assert result.returncode == 3
    assert f"first: unexpected {junk}: not a ".encode() in result.stderr
    assert _tree(seed, (*HISTORY, "bin", "README.md", "frames")) == everything
    assert not default_registry_path().exists()
    assert not list(default_registry_path().parent.glob(".*adopting*"))


def test_a_corrupt_legacy_manifest_is_a_problem(home: Path) -> None:
    seed, _shas = build_seed(home)
    assert run("migrate", str(seed), "--repoint").returncode == 0
    reg = Registry(default_registry_path())
    manifest = reg.root / "legacy.json"
    manifest.chmod(0o644)
    manifest.write_text('{"format": "prefix-registry-legacy", "records": [], "kept": []}\n')
    kinds = {f.kind for f in verify_registry(Registry(reg.root)).findings}
    assert "bad_record" in kinds and "legacy" not in kinds


@pytest.mark.parametrize(
    ("line", "repointed"),
    [
        ('remote_path = "~/prefix-registry"', False),  # a worker path, any case
        ("export REMOTE_DIR=$HOME/prefix-registry", False),
        ("rsync -a objects/ user@w1:~/prefix-registry/objects/", False),  # host:path
        ('dest = "w2.lan:/HOME/prefix-registry"', False),
        ("PATH=/usr/bin:$HOME/prefix-registry/bin", True),  # a PATH list, not a host
        ('REG="${REG:-~/prefix-registry}"', True),  # a shell default
        ("see ~/prefix-registry-old and ~/prefix-registry.bak", False),  # other paths
        ("see ~/prefix-registry/README.md", True),
        ('for h in $HOSTS; do rsync -a "$REG/" "$h:~/prefix-registry/"; done', False),
        ('rsync -a "$REG/" worker2:"$HOME/prefix-registry/"', False),  # a quoted host:path
        ("rsync -a objects ${WORKER}:~/prefix-registry/", False),
        ('REMOTE_PATH: str = os.path.expanduser("~/prefix-registry")', False),  # annotated
        ('REMOTE_DIR = os.environ.get(\n    "REMOTE_DIR", "~/prefix-registry"\n)', False),
        ('REMOTE_DIR = get(\n    "x"\n)\nREG = "~/prefix-registry"', True),  # after it ends
        ("export REMOTE=w1 \\\n  DIR=~/prefix-registry", False),  # a continued line
    ],
)
def test_repoint_rules(tmp_path: Path, home: Path, line: str, repointed: bool) -> None:
    from prefixreg.registry.repointing import repoint

    root = tmp_path / "tree"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "script").write_text(line.replace("/HOME", str(home)) + "\n")
    changes = repoint(root, home / "prefix-registry", home / "new-reg", write=True)
    after = (root / "bin" / "script").read_text()
    assert bool(changes) == repointed == ("new-reg" in after)


def test_an_adoption_that_fails_at_the_end_leaves_the_source_the_one_copy(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source that kept changing while the adoption retired it (a fault injected where the
    real catch-up gives up): nothing adopted, the source as it was, and a re-run adopts it."""
    from prefixreg.core.errors import PrefixregError
    from prefixreg.registry import migrate, treecopy

    seed, _ = build_seed(home)
    before = _tree(seed, ("objects", "meta", "measurements", "bin", "README.md", "mirror.log"))

    def never_quiet(source: Path, target: Path, _before: object) -> object:
        raise PrefixregError(f"{source} kept changing during the move")

    with monkeypatch.context() as patched, pytest.raises(PrefixregError, match="nothing") as err:
        patched.setattr(treecopy, "retire_source", never_quiet)  # only here: the home stays
        migrate.migrate_registry(seed, repoint=True)
    assert "--repoint again" in (err.value.hint or "")
    assert not default_registry_path().exists() and seed.exists()
    assert _tree(seed, ("objects", "meta", "measurements", "bin", "README.md", "mirror.log")) == (
        before
    )
    assert os.environ["XDG_STATE_HOME"].startswith(str(home))  # never the real home's
    again = run("migrate", str(seed), "--repoint")
    assert again.returncode == 0, again.stderr
    assert run("verify", "--registry", str(default_registry_path())).returncode == 0


@pytest.mark.parametrize("brk", ["\n", "\r", "\u2028"], ids=["LF", "CR", "U+2028"])
def test_a_repoint_target_holding_a_line_break_is_refused_up_front(home: Path, brk: str) -> None:
    seed, _shas = build_seed(home)
    before = _tree(seed, (*HISTORY, "README.md", "bin"))
    target = home / f"new{brk}registry"
    res = run("migrate", str(seed), "--repoint", "--to", str(target))
    assert res.returncode == 2, res.stderr
    assert b"Traceback" not in res.stderr and b"holds a line break" in res.stderr
    assert res.stderr.count(b"\n") == 1  # one clear line
    assert not os.path.lexists(target) and _tree(seed, (*HISTORY, "README.md", "bin")) == before


def test_a_hand_built_tree_with_names_and_no_journal_is_adopted_with_one(home: Path) -> None:
    # Before (issue 33): exit 3, "names.log has no move of it", and no hint.
    seed, shas = build_seed(home)
    (seed / "names").mkdir()
    for name, sha in (("loop", shas[0]), ("other", shas[1])):
        (seed / "names" / name).write_text(sha + "\n")
    done = run("migrate", str(seed), "--repoint")
    assert done.returncode == 0, done.stderr
    assert b"had names/ (2) but no names.log: wrote one" in done.stderr
    new = default_registry_path()
    moves = [json.loads(line) for line in (new / "names.log").read_text().splitlines()]
    assert [(m["name"], m["from"], m["to"]) for m in moves] == [
        ("loop", None, shas[0]),
        ("other", None, shas[1]),
    ]
    assert run("verify", "--registry", str(new)).returncode == 0
    cat = run("cat", "loop", "--registry", str(new))
    assert (cat.returncode, cat.stdout) == (0, PREFIXES[0].encode())
    assert Registry(new).move_name("loop", shas[1]) is not None  # the journal goes on


def test_a_script_others_can_write_is_adopted_at_the_mode_verify_accepts(home: Path) -> None:
    # Before (issue 33): adopted at 0777, then `verify` called it a problem.
    seed, _ = build_seed(home)
    script = seed / "bin" / "prefix-warm.py"
    script.chmod(0o777)
    (seed / "bin").chmod(0o777)
    done = run("migrate", str(seed), "--repoint")
    assert done.returncode == 0, done.stderr
    new = default_registry_path()
    for rel in ("bin/prefix-warm.py", "bin"):
        assert stat.S_IMODE((new / rel).stat().st_mode) & stat.S_IWOTH == 0, rel
        assert f"{rel}: was writable by every user (mode 0777)".encode() in done.stderr
    assert os.access(new / "bin" / "prefix-warm.py", os.X_OK)
    verified = run("verify", "--registry", str(new), "--json")
    assert verified.returncode == 0, verified.stdout
    kinds = [f["kind"] for f in json.loads(verified.stdout)["findings"]]
    assert "insecure_mode" not in kinds, kinds
