"""A registry writer process for crash and concurrency tests.

Usage: python -m tests.writer ROOT SEED COUNT [moves]
Adds COUNT prefixes (half shared between seeds) and moves a few shared names, printing one
line per journalled move ("moved") so the parent can count them, after a first line "started"
once its imports are done (a kill timed from it lands mid-work on a loaded machine too). With
`moves`, it adds a handful of prefixes and then mostly moves names among them (so a kill lands
mid-move).
"""

from __future__ import annotations

import random
import sys

from prefixreg.registry.store import Registry


def main() -> None:
    root, seed, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    moves_mode = len(sys.argv) > 4 and sys.argv[4] == "moves"
    rng = random.Random(seed)
    reg = Registry(root)
    shas: list[str] = []
    sys.stdout.write("started\n")  # past start-up: a kill from now on lands mid-work
    sys.stdout.flush()
    for i in range(count):
        if moves_mode and len(shas) >= 4:
            sha = rng.choice(shas)
        else:
            shared = rng.random() < 0.5
            text = (
                f"shared prefix {i % 7}\n" * 50
                if shared
                else f"own {seed}-{i}\n" * rng.randint(1, 400)
            )
            sha = reg.add(text, note=f"seed {seed}")
            shas.append(sha)
        if reg.move_name(f"n{i % 3}", sha) is not None:
            sys.stdout.write("moved\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
