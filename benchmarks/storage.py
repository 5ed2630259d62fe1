"""Storage benchmarks: verified get, durable add, CLI start-up, each against a floor.

Every figure is a ratio against a floor measured in the same run on the same files, so
the numbers hold on a noisy machine. Run: `python benchmarks/storage.py [--quick]`.

- get: a verified `Registry.get(sha)` (a no-follow open of every component below the root,
  read, sha256, compare) of a 3 KB and a 256 KB prefix vs open + read + hashlib.sha256 of
  the same file, in CPU time and in alternation (floor, ours, floor, ...) so a busy machine
  slows both alike. Targets <= 1.2x and <= 1.1x.
- add: durable `Registry.add()` of new 3 KB objects vs the durable writes the format needs,
  done by hand (temp write + fsync + rename + directory fsync, for the object and its meta).
  Target <= 1.2x.
- scale: `prefixreg verify` and `prefixreg ls` of a registry of 5,000 and 20,000 3 KB
  objects (each with its meta record, as `add` writes them) vs `find R -type f | xargs
  sha256sum` (every file read and hashed) and `find R -type f | xargs ls -l` (every file
  stat'ed and listed), whole processes in turn, the median of the pair-by-pair ratios of
  wall and of CPU time (user + system, the pipeline's processes summed). Target <= 2x.
- start-up: `prefixreg --help` and `prefix-add FILE` vs `python3 -c "import typer"`, whole
  processes run in turn by the same interpreter; the median of the pair-by-pair ratios of
  wall time and of CPU time (user + system). Targets: the CLI's start (`--help`) <= 1.2x;
  `prefix-add FILE`, which also imports hashlib and orjson and does a verified add of an
  existing object, <= 1.4x.
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prefixreg.core.jsonio import dumps_canonical
from prefixreg.registry import layout
from prefixreg.registry.store import Registry


def best_of(
    fn: Callable[[], object],
    *,
    number: int,
    repeat: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per call: the minimum over `repeat` runs of `number` calls (least noise)."""
    times = []
    for _ in range(repeat):
        start = clock()
        for _ in range(number):
            fn()
        times.append((clock() - start) / number)
    return min(times)


def bench_get(reg: Registry, size: int, number: int) -> tuple[float, float]:
    text = ("x" * 63 + "\n") * (size // 64)
    sha = reg.add(text)
    path = reg.object_path(sha)

    def floor() -> None:
        with open(path, "rb") as fh:
            hashlib.sha256(fh.read()).hexdigest()

    def ours() -> None:
        reg.get(sha)

    floor_s = ours_s = float("inf")
    for _ in range(100):  # alternate, keep each side's best: drift hits both equally
        floor_s = min(floor_s, best_of(floor, number=number, repeat=1, clock=time.process_time))
        ours_s = min(ours_s, best_of(ours, number=number, repeat=1, clock=time.process_time))
    return ours_s, floor_s


def _durable_write(directory: Path, name: str, data: bytes) -> None:
    tmp = directory / f".{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, directory / name)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def bench_add(root: Path, count: int) -> tuple[float, float]:
    payloads = [os.urandom(1536).hex() for _ in range(count * 2)]
    reg = Registry(root / "reg")
    reg.init()
    floor_dir = root / "floor"
    (floor_dir / "objects").mkdir(parents=True)
    (floor_dir / "meta").mkdir()
    ours, floor = [], []
    for i in range(count):
        # Interleave the two so drift in disk speed hits both equally.
        data = payloads[i].encode()
        start = time.perf_counter()
        sha = hashlib.sha256(data).hexdigest()
        fan = floor_dir / "objects" / sha[:2]
        fan.mkdir(exist_ok=True)
        _durable_write(fan, f"{sha}.txt", data)
        _durable_write(floor_dir / "meta", f"{sha}.json", b'{"sha256":"%s"}' % sha.encode())
        floor.append(time.perf_counter() - start)
        start = time.perf_counter()
        reg.add(payloads[count + i])
        ours.append(time.perf_counter() - start)
    return statistics.median(ours), statistics.median(floor)


# What the installed console scripts run (see [project.scripts]), run here by the floor's own
# interpreter: a launcher in front of one side (a pyenv shim is a shell script) would time
# the launcher, and the checkout under test (PYTHONPATH) is what gets imported.
_SCRIPT = "import re, sys\nfrom prefixreg.cli.main import {entry}\nsys.exit({entry}())"


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, cpu) seconds of one whole process; cpu is the child's user + system time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def compile_checkout() -> None:
    """An installed package has byte-code compiled at install time (typer's has, for the
    floor); an editable checkout may not (PYTHONDONTWRITEBYTECODE), so compile it first."""
    import prefixreg

    compileall.compile_dir(Path(prefixreg.__file__).parent, quiet=1)


def bench_startup(tmp: Path, runs: int) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per command: {"wall"|"cpu": (median seconds, median floor seconds, median ratio)}.

    The floor and each command run in turn (floor, A, B, floor, A, B, ...) and the ratio is
    taken pair by pair, so drift in the machine's speed during the run cancels out.
    """
    compile_checkout()
    small = tmp / "small.txt"
    small.write_text("a small prefix\n")
    env = dict(os.environ, PREFIXREG_HOME=str(tmp / "cli-reg"))
    py = sys.executable
    floor_argv = [py, "-c", "import typer"]
    commands: dict[str, list[str]] = {
        "prefixreg --help": [py, "-c", _SCRIPT.format(entry="run"), "--help"],
        "prefix-add FILE": [py, "-c", _SCRIPT.format(entry="run_add"), str(small)],
    }
    for argv in (floor_argv, *commands.values()):  # warm the page cache and byte-code
        _timed(argv, env)
    floors: list[tuple[float, float]] = []
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in commands}
    for _ in range(runs):
        floor = _timed(floor_argv, env)
        floors.append(floor)
        for key, argv in commands.items():
            samples[key].append(_timed(argv, env))
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for key, got in samples.items():
        out[key] = {}
        for i, kind in enumerate(("wall", "cpu")):
            ratios = [g[i] / f[i] for g, f in zip(got, floors, strict=True) if f[i] > 0]
            out[key][kind] = (
                statistics.median(g[i] for g in got),
                statistics.median(f[i] for f in floors),
                statistics.median(ratios),
            )
    return out


def build_registry(root: Path, count: int) -> None:
    """A registry of `count` distinct 3 KB objects and their meta records, written as `add`
    writes them but without its fsyncs (a benchmark's set-up, not what is timed)."""
    reg = Registry(root)
    reg.init()
    created = layout.iso_utc(layout.utc_now())
    for i in range(count):
        data = f"prefix {i:06d} ".encode() + os.urandom(1500).hex().encode()
        sha = hashlib.sha256(data).hexdigest()
        fan = root / layout.OBJECTS / sha[:2]
        fan.mkdir(exist_ok=True)
        record = {"sha256": sha, "bytes": len(data), "source": "bench", "note": None}
        for path, raw in (
            (fan / f"{sha}.txt", data),
            (root / layout.META / f"{sha}.json", dumps_canonical(record | {"created": created})),
        ):
            path.write_bytes(raw if path.suffix == ".txt" else raw + b"\n")
            path.chmod(0o444)


def _timed_quiet(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """`_timed`, the output thrown away by the child itself (as the floors' `>/dev/null`)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def bench_scale(
    tmp: Path, count: int, runs: int
) -> dict[str, dict[str, tuple[float, float, float]]]:
    """Per command at `count` objects: as `bench_startup`, each against its own floor."""
    compile_checkout()
    root = tmp / f"scale-{count}"
    build_registry(root, count)
    env = dict(os.environ, PREFIXREG_HOME=str(root))
    py = sys.executable
    pairs = {
        f"verify {count // 1000}k": (
            [py, "-c", _SCRIPT.format(entry="run"), "verify"],
            ["sh", "-c", f"find '{root}' -type f -print0 | xargs -0 sha256sum >/dev/null"],
        ),
        f"ls {count // 1000}k": (
            [py, "-c", _SCRIPT.format(entry="run"), "ls"],
            ["sh", "-c", f"find '{root}' -type f -print0 | xargs -0 ls -l >/dev/null"],
        ),
    }
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    for label, (ours_argv, floor_argv) in pairs.items():
        _timed_quiet(ours_argv, env)  # warm the page cache and the dentries for both
        _timed_quiet(floor_argv, env)
        ours, floors = [], []
        for _ in range(runs):
            floors.append(_timed_quiet(floor_argv, env))
            ours.append(_timed_quiet(ours_argv, env))
        out[label] = {}
        for i, kind in enumerate(("wall", "cpu")):
            ratios = [o[i] / f[i] for o, f in zip(ours, floors, strict=True) if f[i] > 0]
            out[label][kind] = (
                statistics.median(o[i] for o in ours),
                statistics.median(f[i] for f in floors),
                statistics.median(ratios),
            )
    return out


def report(
    label: str, ours: float, floor: float, target: float, ratio: float | None = None
) -> bool:
    ratio = ours / floor if ratio is None else ratio
    ok = ratio <= target
    print(
        f"{label:<28} {ours * 1e6:>10.1f} us  floor {floor * 1e6:>10.1f} us  "
        f"ratio {ratio:5.2f}x  target <= {target}x  {'ok' if ok else 'MISSED'}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--startup-only", action="store_true", help="only the CLI start-up")
    parser.add_argument("--scale-only", action="store_true", help="only verify and ls at scale")
    parser.add_argument("--no-scale", action="store_true", help="all but verify and ls at scale")
    args = parser.parse_args()
    scale = 1 if args.quick else 5
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for count in () if args.startup_only or args.no_scale else (5_000, 20_000):
            for label, kinds in bench_scale(tmp, count, 2 * scale + 1).items():
                for kind, (ours, floor, ratio) in kinds.items():
                    results.append(report(f"{label} {kind}", ours, floor, 2.0, ratio))
        if args.scale_only:
            print("all targets met" if all(results) else "some targets missed")
            return 0 if all(results) else 1
        for label, kinds in bench_startup(tmp, 6 * scale).items():
            target = 1.2 if label.endswith("--help") else 1.4
            for kind, (ours, floor, ratio) in kinds.items():
                results.append(report(f"start-up {kind}: {label}", ours, floor, target, ratio))
        if args.startup_only:
            print("all targets met" if all(results) else "some targets missed")
            return 0 if all(results) else 1
        reg = Registry(tmp / "get-reg")
        ours, floor = bench_get(reg, 3 * 1024, 100 * scale)
        results.append(report("get 3 KB", ours, floor, 1.2))
        ours, floor = bench_get(reg, 256 * 1024, 10 * scale)
        results.append(report("get 256 KB", ours, floor, 1.1))
        ours, floor = bench_add(tmp, 40 * scale)
        results.append(report("durable add 3 KB", ours, floor, 1.2))
    print("all targets met" if all(results) else "some targets missed")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
