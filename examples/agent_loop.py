"""An agent loop with tools and a growing history, warmed as the frame it sends, on a worker.

Run it against the built-in simulator (`prefixreg sim`, started here) or any worker:

    python examples/agent_loop.py                      # starts `prefixreg sim` on a free port
    PREFIXREG_WORKER=http://127.0.0.1:8731 python examples/agent_loop.py

It imports only `prefixreg`: the front door holds everything a loop needs.

The loop registers a frame (system prompt + tools + the prompt settings it sends), warms that
frame, then runs its turns: each call sends the frame's verified head and the loop's own
history (assistant tool calls, tool results, user turns). Between calls another tenant sends
two prompts of its own. Each line says what the server reported and how that reads against
the frame (`resumed` covers the frame's warmed span; `drift` names the part that changed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import prefixreg

HERE = Path(__file__).resolve().parent
TURNS = 6
FOREIGN_BETWEEN_CALLS = 2
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": text,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for name, text in (
        ("read_file", "Read a file of the working tree."),
        ("run_tests", "Run the test suite, or one file of it."),
    )
]


@contextmanager
def simulator() -> Iterator[str]:
    """`prefixreg sim` on a free loopback port, for as long as the loop runs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-m", "prefixreg", "sim", "--port", str(port), "--speed", "50", "-q"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    with ExitStack() as stack:
        url = os.environ.get("PREFIXREG_WORKER") or stack.enter_context(simulator())
        reg = prefixreg.Registry(Path(tempfile.mkdtemp(prefix="agent-loop-")) / "registry")
        reg.add((HERE / "system-prompt.txt").read_bytes(), name="coding-system")
        reg.add_frame(
            "coding-system",
            tools=json.dumps(TOOLS),
            settings={"tool_choice": "auto"},
            name="coding-loop",
        )
        head = reg.head("coding-loop")  # verified once; the same head goes out on each call
        loop = stack.enter_context(prefixreg.Worker(url))
        tenant = stack.enter_context(prefixreg.Worker(url))
        print(f"warm:      {prefixreg.warm(reg, head, loop).headline}")
        judge = prefixreg.LoopJudge.for_worker(reg, head, loop)
        history: list[dict[str, Any]] = [{"role": "user", "content": "Make the tests pass."}]
        for i in range(TURNS):
            for j in range(FOREIGN_BETWEEN_CALLS):
                tenant.chat(f"Another team's job {i}.{j}: summarise the logs. " * 40, "go")
            reply, ev = loop.chat(head, history=history, max_tokens=16)
            verdict, why = judge.observe(ev, head.body(history))
            print(f"call {i}: {verdict:<14} {why}, {ev.wall_s or 0:.3f} s")
            # The loop's own turns: a tool call, its result, the next instruction.
            call = {
                "id": f"c{i}",
                "type": "function",
                "function": {"name": "run_tests", "arguments": "{}"},
            }
            history.append(
                {"role": "assistant", "content": reply.get("content") or None, "tool_calls": [call]}
            )
            history.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"{i} failing"})
            history.append({"role": "user", "content": f"Step {i}: fix the first failure."})
        print(f"loop:      {judge.stats}")
        print(f"records:   {reg.root / 'measurements'}")


if __name__ == "__main__":
    main()
