"""The full-disk journal case (#22 case 2), run inside a private mount namespace.

Usage: unshare -rm python -m tests.enospc_writer DIR CASE
Mounts a small tmpfs on DIR, makes a registry there, moves a name until the next
`names.log` line would (CASE `torn`) straddle the journal's last page or (CASE `fits`) fit in
it, fills the disk to the last page, then runs the real CLI: `name n1` on the full disk,
`name n2`, `verify` and `names --log` once space is back. Prints one JSON object of what
happened (exit codes and journal sizes) for the test to judge.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from prefixreg.registry.store import Registry

PAGE = 4096


def cli(*args: str) -> int:
    run = [sys.executable, "-m", "prefixreg", *args]
    return subprocess.run(run, capture_output=True, check=False, timeout=60).returncode


def main() -> None:
    mount, case = Path(sys.argv[1]), sys.argv[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    root = mount / "reg"
    reg = Registry(root)
    a, b = reg.add("a\n", name="n0"), reg.add("b\n", name="n0")
    log = root / "names.log"
    line = len(log.read_bytes().splitlines()[-1]) + 1  # a move of a short name: all alike
    for i in range(200):  # move a name back and forth until the next line lands as asked
        free = PAGE - log.stat().st_size % PAGE
        if (case == "torn" and 8 < free < line - 8) or (case == "fits" and free > line + 8):
            break
        reg.move_name("n0", a if i % 2 else b)
    filler = mount / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
    with contextlib.suppress(OSError):  # every free page (tmpfs allocates whole pages)
        while os.write(fd, b"\0" * PAGE):
            pass
    os.close(fd)
    before = log.read_bytes()
    full = os.statvfs(mount).f_bavail == 0
    result: dict[str, object] = {"full": full, "free": PAGE - len(before) % PAGE}
    result["line"] = line
    result["n1"] = cli("name", "n1", a, "--registry", str(root))
    result["log_unchanged"] = log.read_bytes() == before
    filler.unlink()
    result["n2"] = cli("name", "n2", b, "--registry", str(root))
    result["verify"] = cli("verify", "--registry", str(root))
    result["names_log"] = cli("names", "--log", "--registry", str(root))
    result["names"] = sorted(Registry(root).names())
    subprocess.run(["umount", str(mount)], check=False)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
