"""Fuzzing with Hypothesis: the SSE parser, the evidence functions, record loading and
reference parsing take random and mutated inputs and raise only prefixreg's own errors:
no other exception escapes, and reading never writes (the registry tree is unchanged).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core import digest, jsonio
from prefixreg.core.errors import PrefixregError
from prefixreg.core.records import (
    CacheCounters,
    CallEvidence,
    Measurement,
    Meta,
    NameMove,
    ServerBuild,
)
from prefixreg.registry.store import Registry, validate_name
from prefixreg.registry.verify import verify_registry
from prefixreg.server import counters, evidence, sse
from tests.hypothesis_profile import bounded

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=25,
)

_BUILD = ServerBuild(profile="halogen", identity={"model": "m", "prompt_cache": {"cap_mb": 110}})
_SHA = "ab" * 32
VALID_RECORDS: dict[str, Any] = {
    "meta": {
        "sha256": _SHA,
        "bytes": 5,
        "created": "2026-01-01T00:00:00Z",
        "source": "f",
        "note": None,
    },
    "names.log": {"at": "2026", "name": "n", "from": None, "to": _SHA},
    "measurement": Measurement(
        sha256=_SHA, at="2026", kind="warm", build=_BUILD, body={"verdict": "reused"}
    ).to_dict(),
    "evidence": CallEvidence(
        prompt_tokens=10,
        cached_tokens=8,
        completion_tokens=1,
        cached_source="timings.cache_n",
        cache_state="reused",
        complete=True,
    ).to_dict(),
    "counters": CacheCounters(entries=1, hits=2).to_dict(),
}
LOADERS: dict[str, Callable[[object], object]] = {
    "meta": Meta.from_dict,
    "names.log": NameMove.from_dict,
    "measurement": Measurement.from_dict,
    "evidence": CallEvidence.from_dict,
    "counters": CacheCounters.from_dict,
    "build": ServerBuild.from_dict,
}

SSE_PIECES = st.lists(
    st.sampled_from(
        [
            b"data: ",
            b"[DONE]",
            b"\n",
            b"\n\n",
            b": keepalive\n\n",
            b'{"choices":[{"delta":{"content":"hi"}}]}',
            b'{"usage":{"prompt_tokens":5,"prompt_tokens_details":{"cached_tokens":4}}}',
            b'{"error":{"message":"boom"}}',
            b'{"timings":{"cache_n":"3"}}',
            b"\xff\xfe",
            b"event: x\n",
            b"data: {",
        ]
    )
    | st.binary(max_size=30),
    max_size=30,
)


@contextmanager
def only_our_errors() -> Iterator[None]:
    try:
        yield
    except PrefixregError:
        pass


def _mutate(value: Any, path: list[Any], replacement: Any) -> Any:
    """`value` with the element at `path` (indices wrap) replaced, or deleted if `...`."""
    if not path or not isinstance(value, dict | list) or not value:
        return replacement
    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    key = keys[path[0] % len(keys)] if isinstance(path[0], int) else path[0]
    out = dict(value) if isinstance(value, dict) else list(value)
    if len(path) == 1 and replacement is ... and isinstance(out, dict):
        out.pop(key, None)
        return out
    child = out[key] if isinstance(out, list) or key in out else None
    out[key] = _mutate(child, path[1:], None if replacement is ... else replacement)
    return out


# ------------------------------------------------------------------------ SSE and evidence


@bounded(300)
@given(pieces=SSE_PIECES, split=st.integers(min_value=1, max_value=7))
def test_sse_parser_and_evidence_never_crash(pieces: list[bytes], split: int) -> None:
    body = b"".join(pieces)
    whole = sse.parse_sse(body)
    # The same bytes cut anywhere decode to the same frames.
    parser = sse.SSEParser()
    for i in range(0, len(body), split):
        parser.feed(body[i : i + split])
    assert parser.finish() == whole
    ev = evidence.evidence_from_response(body, wall_s=0.1)
    assert ev.cache_state in ("cold", "reused", "unverified")
    if not whole.done or whole.malformed:
        assert ev.cache_state == "unverified" and ev.output_sha256 is None
    CallEvidence.from_dict(ev.to_dict())  # what we produce, we can read back
    assert evidence.evidence_from_response(whole, wall_s=0.1) == ev


@bounded(300)
@given(resp=JSON, done=st.none() | st.booleans())
def test_evidence_from_random_json(resp: Any, done: bool | None) -> None:
    with only_our_errors():
        ev = evidence.evidence_from_response(resp, done=done)
        assert ev.cache_state in ("cold", "reused", "unverified")
        CallEvidence.from_dict(ev.to_dict())
    with only_our_errors():
        chunks = resp if isinstance(resp, list) else [resp]
        evidence.evidence_from_response(chunks, done=bool(done))


@bounded(200)
@given(
    usage=st.dictionaries(
        st.sampled_from(["prompt_tokens", "completion_tokens", "prompt_tokens_details"]), JSON
    ),
    timings=JSON,
)
def test_evidence_from_mutated_usage(usage: dict[str, Any], timings: Any) -> None:
    resp = {"choices": [{"message": {"content": "ok"}}], "usage": usage, "timings": timings}
    ev = evidence.evidence_from_response(resp)
    if ev.cache_state != "unverified":
        assert type(ev.prompt_tokens) is int and type(ev.cached_tokens) is int
        assert 0 <= ev.cached_tokens <= ev.prompt_tokens


COUNTER_REPLY = st.dictionaries(st.sampled_from(["hits", "misses", "entries", "stores", "x"]), JSON)


@bounded(100)
@given(before=COUNTER_REPLY, after=COUNTER_REPLY, calls=st.integers(0, 5))
def test_counter_functions_take_any_server_reply(
    before: dict[str, Any], after: dict[str, Any], calls: int
) -> None:
    b, a = CacheCounters.from_server(before), CacheCounters.from_server(after)
    counters.counter_deltas(b, a)
    counters.is_interleaved(b, a, calls)


# ------------------------------------------------------------------------ records


@bounded(300)
@given(kind=st.sampled_from(sorted(LOADERS)), value=JSON)
def test_record_loaders_take_random_json(kind: str, value: Any) -> None:
    with only_our_errors():
        LOADERS[kind](value)


@bounded(400)
@given(
    kind=st.sampled_from(sorted(VALID_RECORDS)),
    path=st.lists(st.integers(0, 20), min_size=1, max_size=4),
    replacement=JSON | st.just(...),
)
def test_record_loaders_take_mutated_records(kind: str, path: list[int], replacement: Any) -> None:
    mutated = _mutate(VALID_RECORDS[kind], path, replacement)
    with only_our_errors():
        LOADERS[kind](mutated)


@bounded(300)
@given(data=st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_json_loading_takes_random_bytes(data: bytes) -> None:
    with only_our_errors():
        jsonio.loads_object(data)


# ------------------------------------------------------------------------ references


REFS = st.text(max_size=70) | st.text(alphabet="0123456789abcdefABCDEF", max_size=70)


@bounded(300)
@given(ref=REFS)
def test_reference_parsing_takes_any_text(ref: str) -> None:
    for fn in (digest.parse_abbrev, validate_name):
        with only_our_errors():
            fn(ref)


# ------------------------------------------------------------------------ registry files


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and ".locks" not in p.parts
    }


class _Fixture:
    """One populated registry reused across examples; each example restores its file."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="prefixreg-fuzz-"))
        self.reg = Registry(self.tmp / "reg")
        self.sha = self.reg.add("the prefix\n", name="main", note="n")
        self.reg.add("another prefix\n", name="other")
        self.reg.write_measurement(
            Measurement(sha256=self.sha, at="2026", kind="warm", build=_BUILD, body={})
        )
        self.measurement = next((self.reg.root / "measurements").iterdir())

    def files(self) -> dict[str, Path]:
        root = self.reg.root
        return {
            "meta": root / "meta" / f"{self.sha}.json",
            "name": root / "names" / "main",
            "names.log": root / "names.log",
            "measurement": self.measurement,
            "marker": root / "REGISTRY.json",
        }


_FIXTURE: _Fixture | None = None


def _fixture() -> _Fixture:
    global _FIXTURE
    if _FIXTURE is None:
        _FIXTURE = _Fixture()
    return _FIXTURE


def teardown_module() -> None:
    if _FIXTURE is not None:
        shutil.rmtree(_FIXTURE.tmp, ignore_errors=True)


@bounded(250)
@given(
    which=st.sampled_from(["meta", "name", "names.log", "measurement", "marker"]),
    data=st.binary(max_size=120)
    | JSON.map(lambda v: json.dumps(v).encode())
    | st.tuples(st.integers(0, 400), st.binary(min_size=1, max_size=3)),
    ref=st.sampled_from(["main", "other", "ab" * 4, "zz", "ab" * 32]),
)
def test_corrupted_records_on_disk_raise_only_our_errors_and_change_nothing(
    which: str, data: bytes | tuple[int, bytes], ref: str
) -> None:
    fx = _fixture()
    path = fx.files()[which]
    original = path.read_bytes()
    if isinstance(data, tuple):  # a byte-level mutation of the real record
        at, patch = data
        at %= len(original)
        data = original[:at] + patch + original[at + len(patch) :]
    path.chmod(0o644)
    path.write_bytes(data)
    try:
        before = _tree(fx.reg.root)
        with only_our_errors():
            reg = Registry(fx.reg.root)  # the marker is read here
            report = verify_registry(reg)
            json.dumps(report.to_dict())
            for fn in (
                lambda: reg.get(ref),
                reg.names,
                reg.name_log,
                reg.measurements,
                lambda: reg.meta(fx.sha),
                reg.list_objects,
            ):
                with only_our_errors():
                    fn()
        assert _tree(fx.reg.root) == before  # reading never writes
    finally:
        path.write_bytes(original)
        path.chmod(0o444 if which in ("meta", "measurement") else 0o644)


@pytest.mark.parametrize("bad", [2**70, float("nan")])
def test_server_build_from_dict_with_unencodable_identity(bad: object) -> None:
    with only_our_errors():
        ServerBuild.from_dict({"profile": "p", "identity": {"x": bad}, "build_id": "x"})
