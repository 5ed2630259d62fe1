"""A registry writer for the lifecycle crash test: add, name moves, measurements and gc.

Usage: python -m tests.lifecycle_writer ROOT SEED COUNT
Each step is one of: add (sometimes naming it), move a shared name, write a measurement,
or gc (strays, and unnamed objects with no grace and a 1.5 s minimum age). Errors a racing
gc may cause in a concurrent move (the object vanished under it: RefNotFoundError) are
expected and counted, never hidden: the crash test then checks that nothing visible is broken.
"""

from __future__ import annotations

import random
import sys

from prefixreg.core.errors import RefNotFoundError
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry.gc import collect_garbage
from prefixreg.registry.store import Registry

_BUILD = ServerBuild(profile="halogen", identity={"model": "m"})


def main() -> None:
    root, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    reg = Registry(root, lock_timeout=60)
    known: list[str] = []
    sys.stdout.write("started\n")  # past start-up: a kill from now on lands mid-work
    sys.stdout.flush()
    for i in range(count):
        op = rng.random()
        try:
            if op < 0.45 or not known:
                text = f"prefix {rng.randrange(40)}\n" * rng.randint(1, 300)
                name = f"n{rng.randrange(4)}" if rng.random() < 0.5 else None
                known.append(reg.add(text, name=name, note=f"seed {seed} step {i}"))
            elif op < 0.7:
                reg.move_name(f"n{rng.randrange(4)}", rng.choice(known))
            elif op < 0.9:
                sha = rng.choice(known)
                body: JSONObject = {"step": i, "verdict": "reused"}
                reg.write_measurement(
                    Measurement(sha256=sha, at="2026", kind="warm", build=_BUILD, body=body)
                )
            else:
                collect_garbage(reg, grace_s=0, prune_unnamed=rng.random() < 0.7, min_age_s=1.5)
        except RefNotFoundError:
            sys.stdout.write("vanished\n")  # a gc removed an unnamed object we were using
            sys.stdout.flush()


if __name__ == "__main__":
    main()
