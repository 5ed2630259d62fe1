"""`audit`'s session part: a loop call sends the previous call's whole prompt first, so what it
did not resume of that prompt is a lost session prefix (cacheable: `keepalive --session` keeps
it), not new history. The batches are real loops on the simulator, a tenant's prompts between
turns evicting the loop's history; the expected split is computed here from the server's counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.judge import judge_lever
from prefixreg.core.prefix import fresh_tail
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.audit.read import read_outputs
from prefixreg.verbs.audit.run import audit_calls
from prefixreg.verbs.audit.sessions import session_prefixes
from tests.conftest import run_cli
from tests.hypothesis_profile import bounded

SYSTEM = "You are a careful coding agent. Follow the repository's conventions.\n" * 60
TURNS = 8


def tenant(http: httpx.Client, turn: int) -> None:
    """Another tenant's prompts, then a keeper re-warming the head alone (as `keepalive`
    without `--session` does): the loop's history is evicted, its head kept."""
    for k in range(3):
        system = f"tenant {turn} {k} " * 200
        body = {"messages": [{"role": "system", "content": system}], "max_tokens": 1}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": fresh_tail()}]
    assert http.post("/v1/chat/completions", json={"messages": head, "max_tokens": 1}).is_success


def run_loop(out: Path, *, sessions: bool) -> list[tuple[int, int]]:
    """`TURNS` calls, each with a new user message: one growing conversation (`sessions`), or
    a fresh conversation each call (history that really is new). Writes {request, response}
    pairs; returns each call's (prompt, cached)."""
    config = SimConfig.for_profile("flash", speed=1000.0, max_entries=4)
    lines, counts = [], []
    history: list[dict[str, Any]] = []
    with SimServer(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        for turn in range(TURNS):
            message = {"role": "user", "content": f"turn {turn}: change file {turn}.py " * 40}
            history = [*history, message] if sessions else [message]
            body = {"messages": [{"role": "system", "content": SYSTEM}, *history], "max_tokens": 8}
            reply = http.post("/v1/chat/completions", json=body).json()
            usage = reply["usage"]
            counts.append(
                (
                    usage["prompt_tokens"],
                    usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                )
            )
            lines.append(orjson.dumps({"request": body, "response": reply}))
            history.append(
                {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
            )
            tenant(http, turn)
    out.write_bytes(b"\n".join(lines) + b"\n")
    return counts


def test_a_loop_whose_history_a_tenant_evicted_is_told_to_keep_its_session_warm(
    tmp_path: Path,
) -> None:
    path = tmp_path / "loop.jsonl"
    counts = run_loop(path, sessions=True)
    # The head survived (the keeper), the history did not: every later call resumed the head only.
    assert all(0 < k < prev for (_, k), (prev, _) in zip(counts[1:], counts, strict=False))
    report = audit_calls(read_outputs([path]))
    calls = report.saved().calls
    for i in range(1, TURNS):
        (prev, _), (p, k) = counts[i - 1], counts[i]
        # The previous call's prompt is this call's first `prev` tokens: what of it was not
        # cached is the head's miss or the lost session; only what this call appended is new.
        assert calls[i].session + calls[i].miss == prev - k
        assert calls[i].new_history == p - prev
        assert calls[i].session > 0
    assert calls[0].session == 0  # the first call continues nothing
    s = orjson.loads(run_cli("audit", str(path), "--json").stdout)["saving"]
    u = s["uncached"]
    assert u["session"] == sum(c.session for c in calls) and u["session"] > u["new_history"]
    assert sum(u.values()) == sum(p - k for p, k in counts)
    assert s["session_estimated_calls"] == 0  # every previous prompt has its server count
    assert s["lever"]["verdict"] == "lever"
    assert "keepalive --session" in s["lever"]["reason"]
    text = run_cli("audit", str(path)).stdout.decode()
    assert f"session {u['session']:,}" in text and "keeping each session warm" in text
    assert "prompt caching is the lever" in text


def test_a_batch_whose_history_is_really_new_is_not_told_caching_is_the_lever(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fresh.jsonl"
    counts = run_loop(path, sessions=False)
    s = orjson.loads(run_cli("audit", str(path), "--json").stdout)["saving"]
    u = s["uncached"]
    assert u["session"] == 0 and sum(u.values()) == sum(p - k for p, k in counts)
    assert u["new_history"] > u["miss"] + u["drift"]
    assert s["lever"]["verdict"] == "not_lever"
    assert "newly appended" in s["lever"]["reason"]


def test_a_previous_call_without_counts_gives_an_estimated_session_prefix(tmp_path: Path) -> None:
    first = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a" * 400}]
    }
    second = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "b" * 400},
            {"role": "user", "content": "c" * 400},
        ]
    }
    ok = {"object": "chat.completion", "choices": [{"message": {"content": "x"}}]}
    counted = ok | {
        "usage": {
            "prompt_tokens": 2000,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 100},
        }
    }
    path = tmp_path / "pairs.jsonl"
    pairs = [{"request": first, "response": ok}, {"request": second, "response": counted}]
    path.write_bytes(b"\n".join(orjson.dumps(p) for p in pairs) + b"\n")
    data = read_outputs([path])
    prev = session_prefixes(data.calls)
    assert prev[0] is None and prev[1] is not None
    # The bytes a template renders: every string of the messages after the system prompt
    # (their roles too), and the system prompt's own.
    sent = len(SYSTEM) + len("user") + 400
    now = sent + len("assistant") + 400 + len("user") + 400
    assert (prev[1].of, prev[1].source) == (f"{path}:1", "estimated")
    assert prev[1].tokens == 2000 * sent // now
    s = orjson.loads(run_cli("audit", str(path), "--json").stdout)["saving"]
    assert s["session_estimated_calls"] == 1
    assert "estimated by bytes for 1 calls" in run_cli("audit", str(path)).stdout.decode()


def test_a_changed_message_or_tool_set_breaks_the_session() -> None:
    from prefixreg.server.calllog import message_chain

    head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "u"}]
    longer = {"messages": [*head, {"role": "assistant", "content": "a"}]}
    assert message_chain({"messages": head}) == message_chain(longer)[:2]
    edited = {"messages": [head[0], {"role": "user", "content": "v"}]}
    assert message_chain(edited)[1] != message_chain(longer)[1]
    tools = {"messages": head, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert message_chain(tools)[0] != message_chain({"messages": head})[0]


counts = st.integers(min_value=0, max_value=10**9)


@bounded(300)
@given(counts, counts, counts, counts, counts, counts)
def test_the_session_part_is_held_like_the_head(
    cached: int, history: int, session: int, drift: int, miss: int, unknown: int
) -> None:
    verdict, why = judge_lever(
        cached=cached, new_history=history, drift=drift, miss=miss, unknown=unknown, session=session
    )
    moved, _ = judge_lever(
        cached=cached, new_history=history, drift=drift, miss=miss + session, unknown=unknown
    )
    assert verdict == moved  # what a cache could have held, the head's or the session's
    if verdict == "lever" and session > drift + miss:
        assert "keepalive --session" in why


def test_html_page_shows_the_session_part(tmp_path: Path) -> None:
    path = tmp_path / "loop.jsonl"
    run_loop(path, sessions=True)
    session = orjson.loads(run_cli("audit", str(path), "--json").stdout)["saving"]["uncached"]
    page = tmp_path / "page.html"
    assert run_cli("audit", str(path), "--html", str(page)).returncode == 0
    assert f"session {session['session']:,}".encode() in page.read_bytes()
