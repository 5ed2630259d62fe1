"""An agent loop with tools and a growing history, warmed as the frame it sends, on a worker.

Run it against the built-in simulator (started in-process) or any worker:

    python examples/agent_loop.py                      # in-process simulator
    PREFIXREG_WORKER=http://127.0.0.1:8731 python examples/agent_loop.py

The loop registers a frame (system prompt + tools + the prompt settings it sends), warms that
frame, then runs its turns: each call sends the frame's verified head and the loop's own
history (assistant tool calls, tool results, user turns). Between calls another tenant sends
two prompts of its own. Each line says what the server reported and how that reads against
the frame (`resumed` covers the frame's warmed span; `drift` names the part that changed).
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import prefixreg
from prefixreg.cli.demo import sample_prompt
from prefixreg.registry.frames import get_frame, write_frame
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.loop import LoopJudge, LoopStats
from prefixreg.verbs.measure.warm import warm

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


def main() -> None:
    with ExitStack() as stack:
        url = os.environ.get("PREFIXREG_WORKER")
        if not url:
            url = stack.enter_context(SimServer(SimConfig(speed=50))).url
        reg = prefixreg.Registry(Path(tempfile.mkdtemp(prefix="agent-loop-")) / "registry")
        reg.add(sample_prompt(), name="coding-system")
        write_frame(
            reg,
            "coding-system",
            tools=json.dumps(TOOLS),
            settings={"tool_choice": "auto"},
            name="coding-loop",
        )
        frame = get_frame(reg, "coding-loop")  # verified once; the same head goes out each call
        loop = stack.enter_context(prefixreg.Worker(url))
        tenant = stack.enter_context(prefixreg.Worker(url))
        print(f"warm:      {warm(reg, reg.head('coding-loop'), loop).headline}")
        judge = LoopJudge.for_worker(reg, frame, loop)
        stats = LoopStats()
        history: list[dict[str, Any]] = [{"role": "user", "content": "Make the tests pass."}]
        for i in range(TURNS):
            for j in range(FOREIGN_BETWEEN_CALLS):
                tenant.chat(f"Another team's job {i}.{j}: summarise the logs. " * 40, "go")
            reply, ev = loop.chat(frame, history=history, max_tokens=16)
            verdict, why = judge.observe(ev, frame.body(history))
            stats.add(ev)
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
        print(f"loop:      {stats}")
        print(f"records:   {reg.root / 'measurements'}")


if __name__ == "__main__":
    main()
