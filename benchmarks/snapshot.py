"""snapshot benchmark: a proven restore after a restart, against a cold warm and the bare engine.

Against the real llama-server peer (`tests.peer`; Gemma 3 270M, `-c 8192 -np 1 --swa-full
--cache-ram 0 --slot-save-path DIR`), at ~2k, ~4k and ~6k-token prefixes: on server A,
`warm` (its cold call's wall time is "cold") and `save_snapshot`; A stopped and B started
on the same flags and DIR (a restart); on B, interleaved, `reps` times each, prefixreg's
`restore_and_prove` (record and file verified, the slot erased as the baseline, restore,
pinned fresh-tail check, build re-read, measurement) and the bare engine by hand (POST
restore, one pinned chat with a fresh tail, its cached count).

Printed per size: cold, ours, bare (medians), the speed-ups cold/ours and cold/bare, their
ratio (target >= 0.9x), and "ours-only": prefixreg's own time around the restore and the
check (the erase included).
Run: `python benchmarks/snapshot.py` (`--reps N`, `--sizes 2000,4000,6000`); minutes on a
busy 2-core machine, where the cold prefills dominate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefixreg.core.prefix import fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.warm import warm
from prefixreg.verbs.snapshot.run import restore_and_prove, save_snapshot
from tests.peer.llama_peer import install, start
from tests.test_llama_server import prose

FLAGS = (
    *("-c", "8192", "-np", "1", "-t", "2", "-tb", "2"),
    *("--swa-full", "--cache-ram", "0"),
)
WORDS_PER_TOKEN = 0.9  # measured: about 1.1 tokens a word for `prose` on Gemma's tokenizer


def bare_restore_and_check(url: str, filename: str, text: str) -> tuple[float, int]:
    """The engine by hand: restore into slot 0, one pinned fresh-tail chat; (wall, cached)."""
    body = {
        "messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": fresh_tail()},
        ],
        "max_tokens": 1,
        "temperature": 0,
        "id_slot": 0,
    }
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=url, trust_env=False, timeout=600) as client:
        began = time.perf_counter()
        r = client.post(
            "/slots/0?action=restore", content=orjson.dumps({"filename": filename}), headers=headers
        )
        r.raise_for_status()
        r = client.post("/v1/chat/completions", content=orjson.dumps(body), headers=headers)
        r.raise_for_status()
        cached = int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        return time.perf_counter() - began, cached


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="2000,4000,6000")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    paths = install(quiet=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        slots = root / "slots"
        slots.mkdir()
        reg = Registry(root / "reg")
        refs = {}
        for i, size in enumerate(sizes):
            refs[size] = f"p{size}"
            reg.add(prose(500 + i, int(size * WORDS_PER_TOKEN)), name=refs[size])
        flags = (*FLAGS, "--slot-save-path", str(slots))
        cold: dict[int, float] = {}
        tokens: dict[int, int] = {}
        files: dict[int, str] = {}
        server = start(flags, paths=paths, log_dir=root)
        try:
            with Worker(server.url) as w:
                for size in sizes:
                    res = warm(reg, reg.head(refs[size]), w)
                    ev = res.calls[0].evidence
                    # A cold call may share the template's first tokens (DESIGN §4).
                    assert (ev.cached_tokens or 0) < 50 and ev.wall_s is not None, ev
                    cold[size], tokens[size] = ev.wall_s, ev.prompt_tokens or 0
                    record, _ = save_snapshot(reg, reg.head(refs[size]), w, slot_dir=slots)
                    files[size] = record.file
                    print(f"{size}: cold {cold[size]:.2f} s ({tokens[size]} tokens), saved")
        finally:
            server.stop()
        server = start(flags, paths=paths, log_dir=root)  # the restart
        rows = []
        try:
            with Worker(server.url) as w:
                for size in sizes:
                    text = reg.get(refs[size]).text
                    ours, bare, extra = [], [], []
                    for rep in range(args.reps):
                        order = ("ours", "bare") if rep % 2 == 0 else ("bare", "ours")
                        for side in order:
                            if side == "ours":
                                began = time.perf_counter()
                                r = restore_and_prove(
                                    reg, reg.head(refs[size]), w, fallback_warm=False
                                )
                                ours.append(time.perf_counter() - began)
                                assert r.verdict == "restored", r.reason
                                assert r.transfer is not None and r.check is not None
                                served = r.transfer.wall_s + (r.check.evidence.wall_s or 0.0)
                                extra.append(ours[-1] - served)
                            else:
                                wall, cached = bare_restore_and_check(server.url, files[size], text)
                                assert cached > 0.9 * tokens[size] - 40, cached
                                bare.append(wall)
                    rows.append((size, statistics.median(ours), statistics.median(bare), extra))
        finally:
            server.stop()
    print(f"\n{'tokens':>7} {'cold s':>8} {'ours s':>8} {'bare s':>8} {'ours x':>8} "
          f"{'bare x':>8} {'ratio':>6} {'ours-only ms':>13}")  # fmt: skip
    worst = float("inf")
    for size, ours_s, bare_s, extra in rows:
        c = cold[size]
        ratio = (c / ours_s) / (c / bare_s)
        worst = min(worst, ratio)
        print(
            f"{tokens[size]:>7,} {c:>8.2f} {ours_s:>8.3f} {bare_s:>8.3f} {c / ours_s:>7.1f}x "
            f"{c / bare_s:>7.1f}x {ratio:>5.2f}x {1000 * statistics.median(extra):>13.1f}"
        )
    ok = worst >= 0.9
    print(f"\nprefixreg's speed-up / the bare engine's: worst {worst:.2f}x (target >= 0.9x)")
    print(f"cpus {os.cpu_count()}; medians of {args.reps}; {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
