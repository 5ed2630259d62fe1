"""`audit` on server timings, walls and given rates no server could produce: a timing that is
not finite positive seconds for its tokens, implies more than `MAX_TPS` tokens/s or lasts over
`MAX_CALL_S` is never a cold-rate sample nor a modelled second; it is modelled by rate and
listed as implausible, in text, `--json` and `--html` alike, never a traceback. A given rate
outside [`MIN_TPS`, `MAX_TPS`] is a usage error (exit 2).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.verbs.audit.report import MIN_TPS
from prefixreg.verbs.audit.saving import MAX_CALL_S, MAX_TPS
from tests.conftest import run_cli


def reply(cached: int, prompt_ms: float | None, **extra: Any) -> bytes:
    """A llama.cpp-style reply of a 1,000-token prompt with `cached` tokens reused."""
    body: dict[str, Any] = {
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "x"}}],
        "usage": {
            "prompt_tokens": 1000,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
    if prompt_ms is not None:
        body["timings"] = {"prompt_n": 1000 - cached, "prompt_ms": prompt_ms, "predicted_ms": 1.0}
    return orjson.dumps(body | extra)


def audit(*args: str) -> tuple[dict[str, Any], str]:
    """`audit ARGS` as JSON and as text: both exit 0 with nothing on stderr."""
    js, text = run_cli("audit", *args, "--json"), run_cli("audit", *args)
    for res in (js, text):
        assert res.returncode == 0 and res.stderr == b"", res.stderr
    out: dict[str, Any] = orjson.loads(js.stdout)
    return out, text.stdout.decode()


def finite(value: Any) -> bool:
    """Every number in a JSON value is finite (orjson would have refused it anyway)."""
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, list):
        return all(finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


@pytest.mark.parametrize("prompt_ms", [5e-324, 1e-300, 0.0, 0.0999])
def test_an_implausible_cold_timing_never_sets_the_cold_rate(
    tmp_path: Path, prompt_ms: float
) -> None:
    """5e-324 ms is 0 s once divided (a ZeroDivisionError before); 1e-300 ms set the batch's
    cold rate to 1e303 tok/s; 1,000 tokens in 0.0999 ms is just over `MAX_TPS`."""
    path = tmp_path / "calls.jsonl"
    plausible = reply(0, 500.0)  # 1,000 cold tokens in 0.5 s: 2,000 tok/s
    path.write_bytes(b"\n".join([reply(0, prompt_ms), reply(900, 5.0), plausible]))
    out, text = audit(str(path))
    s = out["saving"]
    assert s["cold_rate"] == {"tokens_per_s": pytest.approx(2000.0), "calls": 1}
    assert s["implausible_prompt_timings"] == 1
    [odd] = out["implausible"]
    assert odd["source"] == f"{path}:1" and odd["reason"].startswith("prompt_ms ")
    assert "not used (modelled by rate)" in odd["reason"]
    # The implausible call is modelled by the given rate, like a call without timings.
    cold = 1000 / 2000 + 1000 / 2000 + 1000 / 1180
    assert s["seconds"]["cold"] == pytest.approx(cold)
    assert s["seconds"]["actual"] == pytest.approx(1000 / 1180 + 0.005 + 0.5)
    assert out["time"]["sources"]["prefill"] == {"timings": 2, "rates": 1, "unknown": 0}
    assert "the server's 2,000 tok/s on cold prefills; server timings not used, implausible: 1" in (
        text
    )
    assert f"implausible (1):\n  {path}:1: prompt_ms " in text
    page = tmp_path / "r.html"
    res = run_cli("audit", str(path), "--html", str(page))
    assert res.returncode == 0 and res.stderr == b"" and page.stat().st_size > 0


def test_a_batch_of_only_implausible_timings_uses_the_given_rate(tmp_path: Path) -> None:
    """The attacker's batch: one cold call in no time, one resumed. No cold rate is claimed;
    nothing is said to have been lost against an absurd cold time."""
    path = tmp_path / "calls.jsonl"
    path.write_bytes(b"\n".join([reply(0, 1e-300), reply(900, 5.0)]))
    out, text = audit(str(path), "--prefill-tps", "1000")
    s = out["saving"]
    assert s["cold_rate"] == {"tokens_per_s": None, "calls": 0}
    assert s["seconds"]["cold"] == pytest.approx(2.0)
    assert s["seconds"]["saved"] == pytest.approx(2.0 - 1.0 - 0.005)
    assert "tok/s on cold prefills" not in text and "more than cold" not in text
    assert "(the rates; server timings not used, implausible: 1)" in text


def test_a_timing_at_the_bound_is_used(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    at_bound = 0.1  # ms for 1,000 tokens: MAX_TPS exactly
    assert 1000 / (at_bound / 1000) == pytest.approx(MAX_TPS)
    path.write_bytes(b"\n".join([reply(0, at_bound), reply(0, 1000.0)]))
    out, _ = audit(str(path))
    assert out["implausible"] == [] and out["saving"]["cold_rate"]["calls"] == 2


def test_absurd_long_timings_and_walls_are_not_used_and_sums_stay_finite(tmp_path: Path) -> None:
    """Each 1.7e308 is finite, but a few of them summed were not: a ValueError writing JSON
    and a NaN share before. Over `MAX_CALL_S` they are not used."""
    walls = tmp_path / "walls.jsonl"
    walls.write_bytes(b"\n".join(reply(0, None, wall_s=1.7e308) for _ in range(2)))
    slow = tmp_path / "slow.jsonl"
    ms = {"prompt_ms": 1.7e308, "predicted_ms": 1.7e308}
    slow.write_bytes(b"\n".join(reply(0, None, timings=ms) for _ in range(1001)))
    out, text = audit(str(walls))
    assert finite(out) and out["time"]["wall_s"] is None and out["time"]["wall_calls"] == 0
    assert len(out["implausible"]) == 2
    assert f"wall 1.7e+308 s: over {MAX_CALL_S:,.0f} s: not used" in text
    out, text = audit(str(slow))
    assert finite(out) and len(out["implausible"]) == 2002
    assert out["time"]["sources"]["prefill"] == {"timings": 0, "rates": 1001, "unknown": 0}
    assert out["saving"]["seconds"]["actual"] == pytest.approx(1001 * 1000 / 1180)
    assert "prefill dominates" in text and "... and 1,992 more (see --json)" in text


@pytest.mark.parametrize("rate", ["5e-324", "1e-300", "0.0009", "2e7", "1e300"])
def test_a_given_rate_no_server_has_is_a_usage_error(tmp_path: Path, rate: str) -> None:
    """5e-324 made every modelled second infinite (a NaN share, a traceback); 1e300 made them
    1e-297 s. Both flags, every mode: exit 2, one line, nothing written."""
    path = tmp_path / "calls.jsonl"
    path.write_bytes(reply(0, None))
    for flag in ("--prefill-tps", "--decode-tps"):
        for mode in ([], ["--json"], ["--html", str(tmp_path / "r.html")]):
            res = run_cli("audit", str(path), flag, rate, *mode)
            assert res.returncode == 2 and b"Traceback" not in res.stderr
            assert f"{flag} must be a positive number" in res.stderr.decode()
            assert res.stdout == b"" and not (tmp_path / "r.html").exists()


def test_the_bounds_of_a_given_rate_are_accepted_and_printed(tmp_path: Path) -> None:
    path = tmp_path / "calls.jsonl"
    path.write_bytes(reply(0, None))
    out, text = audit(str(path), "--prefill-tps", str(MIN_TPS), "--decode-tps", str(MAX_TPS))
    assert out["time"]["prefill_s"] == pytest.approx(1000 / MIN_TPS)
    assert "by rate (0.001 tok/s)" in text and "by rate (10,000,000 tok/s)" in text
