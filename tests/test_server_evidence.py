"""Evidence says exactly what the server proved: disk-tier restores, final responses only,
and public receipts without the model or host-identifying fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from prefixreg.core.errors import CorruptRecordError
from prefixreg.core.records import CallEvidence, Measurement, ServerBuild, public_identity
from prefixreg.registry.store import Registry
from prefixreg.server.engines import generic_identity, llamacpp_identity, vllm_identity
from prefixreg.server.evidence import (
    SOURCE_DISK,
    SOURCE_TIMINGS,
    SOURCE_USAGE,
    evidence_from_response,
)
from prefixreg.server.worker import Worker
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, sse_frames
from tests.test_worker import HALOGEN_CACHE, HALOGEN_HEALTH, LLAMA_PROPS

CHAT = "/v1/chat/completions"


def final(usage: dict[str, Any] | None, timings: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "ok"}}],
    }
    if usage is not None:
        out["usage"] = usage
    if timings is not None:
        out["timings"] = timings
    return out


def use(cached: int | None = None, prompt: int = 4000) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": 1}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


# ------------------------------------------------------------------ disk tier


def test_disk_restore_alone_is_resumed_with_its_source() -> None:
    """Halogen omits the usage count; cache_n 0 but 3,000 tokens came back from disk."""
    ev = evidence_from_response(
        final(use(), {"cache_n": 0, "disk_restore_n": 3000, "disk_restore_ms": 41.5})
    )
    assert (ev.cache_state, ev.cached_tokens, ev.cached_source) == ("reused", 3000, SOURCE_DISK)
    assert (ev.disk_restore_tokens, ev.disk_restore_ms) == (3000, 41.5)


def test_disk_restore_without_any_other_count_is_not_lost() -> None:
    ev = evidence_from_response(final(use(), {"disk_restore_n": 64}))
    assert (ev.cache_state, ev.cached_tokens, ev.cached_source) == ("reused", 64, SOURCE_DISK)


def test_disk_restore_inside_the_cached_count_is_not_double_counted() -> None:
    ev = evidence_from_response(final(use(3500), {"cache_n": 3500, "disk_restore_n": 3000}))
    assert (ev.cached_tokens, ev.cached_source, ev.disk_restore_tokens) == (
        3500,
        SOURCE_USAGE,
        3000,
    )
    ev = evidence_from_response(final(use(), {"cache_n": 3500, "disk_restore_n": 3000}))
    assert (ev.cached_tokens, ev.cached_source) == (3500, SOURCE_TIMINGS)


def test_zero_disk_restore_proves_nothing_about_a_missing_count() -> None:
    ev = evidence_from_response(final(use(), {"disk_restore_n": 0}))
    assert ev.cache_state == "unverified" and ev.disk_restore_tokens == 0


@pytest.mark.parametrize("bad", [1.0, "3", True, -1, [3]])
def test_malformed_disk_restore_count_is_unverified(bad: Any) -> None:
    ev = evidence_from_response(final(use(100), {"disk_restore_n": bad}))
    assert ev.cache_state == "unverified" and "disk_restore_n" in (ev.reason or "")


def test_disk_restore_over_the_prompt_is_unverified() -> None:
    ev = evidence_from_response(final(use(prompt=10), {"disk_restore_n": 11}))
    assert ev.cache_state == "unverified"


def test_disk_restore_fields_round_trip_and_old_records_still_load() -> None:
    ev = evidence_from_response(final(use(), {"disk_restore_n": 64, "disk_restore_ms": 2}))
    assert CallEvidence.from_dict(ev.to_dict()) == ev
    old = ev.to_dict()
    del old["disk_restore_tokens"], old["disk_restore_ms"]
    assert CallEvidence.from_dict(old).disk_restore_tokens is None
    with pytest.raises(CorruptRecordError):
        CallEvidence.from_dict({**ev.to_dict(), "disk_restore_tokens": -1})


def test_disk_restore_reaches_the_worker_evidence_over_a_stream() -> None:
    frames: list[Any] = [
        {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": use(), "timings": {"cache_n": 0, "disk_restore_n": 2048}},
    ]
    with FakeServer() as srv:
        srv.route("POST", CHAT, Reply(sse=sse_frames(frames)))
        with Worker(srv.url) as w:
            _, ev = w.chat("system", "tail")
    assert (ev.cache_state, ev.cached_tokens, ev.cached_source) == ("reused", 2048, SOURCE_DISK)


# ------------------------------------------------------------------ final responses only


@pytest.mark.parametrize(
    "resp",
    [
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "message": {}, "finish_reason": "stop"}],
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": None}]},
        {"choices": []},
    ],
)
def test_only_a_final_response_is_complete(resp: dict[str, Any]) -> None:
    ev = evidence_from_response({**resp, "usage": use(0)})
    assert (ev.cache_state, ev.complete, ev.output_sha256) == ("unverified", False, None)


# ------------------------------------------------------------------ public receipts


def test_public_halogen_identity_drops_the_model_and_unknown_fields() -> None:
    health = {**HALOGEN_HEALTH, "prompt_cache": {**HALOGEN_HEALTH["prompt_cache"], "host": "gpu7"}}
    build = ServerBuild(profile="halogen", identity={**_halogen(health), "hostname": "gpu7"})
    public: Any = build.to_dict(public=True)
    text = json.dumps(public)
    assert "flash" not in text and "gpu7" not in text and "hostname" not in text
    assert public["public"] is True and public["build_id"] == build.build_id
    assert public["identity"]["prompt_cache"]["snapshot_align"] == 64
    assert public["identity"]["version"] == HALOGEN_HEALTH["version"]
    assert build.identity["model"] == "flash"  # the record keeps it


def _halogen(health: dict[str, Any]) -> dict[str, Any]:
    from prefixreg.server.engines import halogen_identity

    return dict(halogen_identity(health))


@pytest.mark.parametrize(
    ("identity", "secret"),
    [
        (llamacpp_identity(LLAMA_PROPS), "gemma-3-270m"),
        (generic_identity({"data": [{"id": "acme-private-70b"}]}), "acme-private-70b"),
        (
            vllm_identity({"version": "0.9"}, {"data": [{"id": "acme-7b", "max_model_len": 8}]}),
            "acme-7b",
        ),
    ],
)
def test_public_identity_of_every_profile_drops_model_ids_and_paths(
    identity: dict[str, Any], secret: str
) -> None:
    assert secret in json.dumps(identity)
    assert secret not in json.dumps(public_identity(identity))


def test_public_measurement_receipt_drops_worker_model_and_build_model() -> None:
    build = ServerBuild(profile="halogen", identity=_halogen(HALOGEN_HEALTH))
    m = Measurement(
        sha256="a" * 64, at="2025-01-01T00:00:00Z", kind="warm", build=build, body={},
        worker="http://10.1.2.3:8731", model="flash",
    )  # fmt: skip
    text = json.dumps(m.to_dict(public=True))
    assert "flash" not in text and "10.1.2.3" not in text
    assert Measurement.from_dict(m.to_dict()) == m  # the stored form is unchanged


def test_warm_json_public_prints_no_model_or_worker(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    Registry(reg).add("You are a careful assistant. " * 20, name="loop")
    frames: list[Any] = [
        {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": use(), "timings": {"cache_n": 0}},
    ]
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, Reply(sse=sse_frames(frames)))
        res = run_cli(
            "warm", "loop", "--worker", srv.url, "--registry", str(reg), "--json", "--public"
        )
        url = srv.url
    assert res.returncode in (0, 1), res.stderr
    assert b'"flash"' not in res.stdout and url.encode() not in res.stdout
    assert json.loads(res.stdout)["build"]["public"] is True
