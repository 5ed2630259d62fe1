"""Mirror benchmark: a no-change mirror and a +10-object mirror of a 10,000-object registry.

Every figure is measured against a floor in the same run on the same trees:

- no-change: `mirror()` with its content check (every object hashed at the destination,
  there; every other file compared by content), so "verified" means hashed, vs bare
  `rsync -a --delete` of the same source to an up-to-date copy. Target <= 2x (#20). Also
  the whole command as a process (`bin/prefix-mirror`), start-up included.
- +10: the time of a mirror after adding 10 objects, next to the no-change time: the
  extra should be the second (confirming) compare, the read-back of the 10 objects sent
  and the other work for the 10, not work that grows with the 10,000.

Run: `python benchmarks/mirror.py [--objects N] [--ssh]` (`--ssh` also measures both over a
throwaway sshd on 127.0.0.1, using `tests/sshd.py`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prefixreg.registry.store import Registry  # noqa: E402
from prefixreg.verbs.mirror import mirror  # noqa: E402


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """Seconds for one call: the minimum over `repeat` calls (least noise)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def build(root: Path, count: int) -> Registry:
    reg = Registry(root)
    for i in range(count):
        reg.add(f"prefix {i}\n" + os.urandom(700).hex(), name=f"n{i}" if i % 10 == 0 else None)
    return reg


def bench(reg: Registry, dest: str, bare_dest: str, ssh: list[str], repeat: int) -> None:
    rsh = ["-e", " ".join(["ssh", "-o", "BatchMode=yes"] + [f"-o {o}" for o in ssh])] if ssh else []
    bare = ["rsync", *rsh, "-a", "--delete", f"{reg.root}/", f"{bare_dest}/"]
    subprocess.run(bare, check=True)
    report = mirror(reg, [dest], ssh_options=ssh)
    assert report.ok, report.results[0].error

    def no_change() -> None:
        (result,) = mirror(reg, [dest], ssh_options=ssh).results
        # The content check ran: every object hashed there and matched, nothing sent.
        assert result.verified and result.hashed == objects and result.sent == 0, result

    objects = sum(1 for _ in reg.iter_shas())
    floor = best_of(lambda: subprocess.run(bare, check=True), repeat)
    ours = best_of(no_change, repeat)
    cli_args = [sys.executable, str(ROOT / "bin" / "prefix-mirror"), "--registry", str(reg.root)]
    cli_args += ["--to", dest, *[a for o in ssh for a in ("--ssh-option", o)]]
    cli = best_of(lambda: subprocess.run(cli_args, check=True, capture_output=True), repeat)
    print(f"  no-change: bare rsync -a --delete {floor * 1000:7.1f} ms")
    print(
        f"             mirror(), {objects} objects hashed there {ours * 1000:7.1f} ms  "
        f"ratio {ours / floor:.2f}x (target <= 2x)"
    )
    print(f"             prefix-mirror process  {cli * 1000:7.1f} ms  ratio {cli / floor:.2f}x")

    plus = []
    for round_ in range(repeat):
        for j in range(10):
            reg.add(f"added {round_}-{j}\n" + os.urandom(700).hex())
        start = time.perf_counter()
        result = mirror(reg, [dest], ssh_options=ssh).results[0]
        plus.append(time.perf_counter() - start)
        assert result.ok and result.sent >= 10, result
    plus_s = min(plus)
    print(
        f"  +10 objects: mirror() {plus_s * 1000:7.1f} ms = no-change + "
        f"{(plus_s - ours) * 1000:.1f} ms ({plus_s / ours:.2f}x no-change; "
        f"{plus_s / floor:.2f}x bare rsync)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ssh", action="store_true", help="also measure over a local sshd")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefixreg-bench-") as tmp:
        base = Path(tmp)
        t0 = time.perf_counter()
        reg = build(base / "reg", args.objects)
        files = sum(len(files) for _, _, files in os.walk(reg.root))
        print(f"registry: {args.objects} objects, {files} files ({time.perf_counter() - t0:.1f}s)")
        print("local destination:")
        bench(reg, str(base / "m"), str(base / "bare"), [], args.repeat)
        if args.ssh:
            from tests.sshd import SshServer

            server = SshServer.start(base / "sshd")
            try:
                print("ssh destination (127.0.0.1):")
                bench(
                    reg,
                    server.dest(base / "ms"),
                    server.dest(base / "bare-ssh"),
                    server.ssh_options,
                    args.repeat,
                )
            finally:
                server.stop()


if __name__ == "__main__":
    main()
