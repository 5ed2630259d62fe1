"""An agent loop that shares one large prefix across calls, with keepalive, against a worker.

Run it against the built-in simulator (started in-process) or any worker:

    python examples/agent_loop.py                      # in-process simulator
    PREFIXREG_WORKER=http://127.0.0.1:8731 python examples/agent_loop.py

Between the loop's calls another tenant sends its own prompts (five each time: more than a
prefix survives in the measured 8-entry LRU). Each line shows what the server said about the
loop's call; the summary is `LoopStats` and the keeper's own accounting.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

import prefixreg
from prefixreg.cli.demo import sample_prompt
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.keepalive import KeepAlive
from prefixreg.verbs.loopstats import LoopStats

CALLS = 8
FOREIGN_BETWEEN_CALLS = 5


def main() -> None:
    with ExitStack() as stack:
        url = os.environ.get("PREFIXREG_WORKER")
        if not url:
            url = stack.enter_context(SimServer(SimConfig(speed=50))).url
        reg = prefixreg.Registry(Path(tempfile.mkdtemp(prefix="agent-loop-")) / "registry")
        reg.add(sample_prompt(), name="coding-loop")
        prefix = reg.get("coding-loop")  # verified once; the same bytes go out on every call
        loop = stack.enter_context(prefixreg.Worker(url))
        tenant = stack.enter_context(prefixreg.Worker(url))
        poller = stack.enter_context(prefixreg.Worker(url, timeout=2.0))  # short poll timeout
        keeper = stack.enter_context(KeepAlive(poller, [prefix], registry=reg, poll_s=0.01))
        stats = LoopStats()
        for i in range(CALLS):
            for j in range(FOREIGN_BETWEEN_CALLS):
                tenant.chat(f"Another team's job {i}.{j}: summarise the logs. " * 40, "go")
            _, ev = loop.chat(
                prefix, f"Step {i}: run the tests and fix the first failure.", max_tokens=16
            )
            keeper.touch(prefix.sha256)
            stats.add(ev)
            print(
                f"call {i}: {ev.cache_state:<10} cached {ev.cached_tokens}/{ev.prompt_tokens}"
                f" ({ev.cached_source}), {ev.wall_s or 0:.3f} s"
            )
        summary = keeper.stop()
        print(f"loop:      {stats}")
        print(f"keepalive: {summary}")
        print(f"records:   {reg.root / 'measurements'}")


if __name__ == "__main__":
    main()
