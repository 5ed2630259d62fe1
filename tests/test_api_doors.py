"""The API's doors: a wrong argument to a public function is refused at the door with an error
that is a `PrefixregError` and a `TypeError` (wrong type) or a `ValueError` (wrong value),
naming the argument; never a raw TypeError/AttributeError/ValueError from deep inside, and
never accepted leniently. Nothing is sent: the worker's URL has no listener."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import prefixreg
from prefixreg.core.errors import ArgumentTypeError, ArgumentValueError, EvidenceUnverifiedError
from tests.fakeserver import FakeServer, Reply
from tests.test_snapshots import _llama

DEAD = "http://127.0.0.1:9"
TEXT = "You are a careful coding agent. Keep the house style.\n" * 30


class Ctx:
    def __init__(self, root: Path) -> None:
        self.reg = prefixreg.open_registry(root)
        self.reg.add(TEXT, name="loop")
        settings = {"chat_template_kwargs": {"enable_thinking": False}}
        self.reg.add_frame("loop", settings=settings, name="framed")
        self.head = self.reg.head("loop")
        self.frame = self.reg.head("framed")
        self.worker = prefixreg.Worker(DEAD)
        self.reg_any: Any = self.reg
        self.frame_any: Any = self.frame


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[Ctx]:
    c = Ctx(tmp_path / "reg")
    with c.worker:
        yield c


Case = tuple[str, Callable[[Ctx], Any], type[Exception], str]
P: Any = prefixreg  # the calls below pass what the types forbid, on purpose
NOW = "2026-12-02T00:00:00.000000Z"
CASES: list[Case] = [
    ("open_registry(5)", lambda c: P.open_registry(5), TypeError, "path"),
    ("warm(None)", lambda c: P.warm(None, c.head, c.worker), TypeError, "registry"),
    ("warm(url)", lambda c: P.warm(c.reg, c.head, DEAD), TypeError, "Worker(url)"),
    (
        "warm(progress=5)",
        lambda c: P.warm(c.reg, c.head, c.worker, progress=5),
        TypeError,
        "progress",
    ),
    (
        "warm(check='no')",
        lambda c: P.warm(c.reg, c.head, c.worker, check="no"),
        TypeError,
        "check",
    ),
    (
        "for_worker(None)",
        lambda c: P.LoopJudge.for_worker(None, c.head, c.worker),
        TypeError,
        "registry",
    ),
    (
        "for_worker(worker=url)",
        lambda c: P.LoopJudge.for_worker(c.reg, c.head, DEAD),
        TypeError,
        "worker",
    ),
    (
        "save_snapshot(slot_dir=5)",
        lambda c: P.save_snapshot(c.reg, c.head, c.worker, slot_dir=5),
        TypeError,
        "slot_dir",
    ),
    (
        "save_snapshot(slot_dir NUL)",
        lambda c: P.save_snapshot(c.reg, c.head, c.worker, slot_dir="a\0b"),
        ValueError,
        "slot_dir",
    ),
    ("ship(targets=5)", lambda c: P.ship_snapshot(c.reg, c.head, 5), TypeError, "targets"),
    (
        "ship(targets=[5])",
        lambda c: P.ship_snapshot(c.reg, c.head, [5]),
        TypeError,
        "targets[0]",
    ),
    (
        "ship(targets=[(1, 2)])",
        lambda c: P.ship_snapshot(c.reg, c.head, [(1, 2)]),
        TypeError,
        "targets[0][0]",
    ),
    (
        "ship(targets=[(dir, url)])",
        lambda c: P.ship_snapshot(c.reg, c.head, [("/tmp/x", DEAD)]),
        TypeError,
        "targets[0][1]",
    ),
    (
        "ship(targets=[(dir,)])",
        lambda c: P.ship_snapshot(c.reg, c.head, [("/tmp/x",)]),
        ValueError,
        "targets[0]",
    ),
    (
        "add_frame(settings={1: 2})",
        lambda c: c.reg_any.add_frame("loop", settings={1: 2}),
        TypeError,
        "settings",
    ),
    (
        "KeepAlive(session=NUL)",
        lambda c: P.KeepAlive(c.worker, [c.head], session="a\0b"),
        ValueError,
        "session",
    ),
    (
        "openai_kwargs(extra_body='x')",
        lambda c: c.frame_any.openai_kwargs([], extra_body="x"),
        TypeError,
        "extra_body",
    ),
    ("fresh_tail(5)", lambda c: P.fresh_tail(5), TypeError, "nonce"),
    (
        "rest_bytes(messages=[1, 2])",
        lambda c: P.rest_bytes({"messages": [1, 2]}),
        TypeError,
        "messages'][0]",
    ),
    (
        "Prefix.body(max_tokens=nan)",
        lambda c: c.head.body([], max_tokens=math.nan),
        ValueError,
        "max_tokens",
    ),
    (
        "Frame.body(temperature=inf)",
        lambda c: c.frame.body([], extra={"t": [math.inf]}),
        ValueError,
        "extra",
    ),
    (
        "Meta(bytes=-1)",
        lambda c: P.Meta(sha256="a" * 64, bytes=-1, created=NOW, source="x"),
        ValueError,
        "bytes",
    ),
    (
        "Meta(bytes='1')",
        lambda c: P.Meta(sha256="a" * 64, bytes="1", created=NOW, source="x"),
        TypeError,
        "bytes",
    ),
    ("Registry(NUL)", lambda c: P.Registry("a\0b"), ValueError, "root"),
    ("Registry(5)", lambda c: P.Registry(5), TypeError, "root"),
    ("Worker(5)", lambda c: P.Worker(5), TypeError, "worker URL"),
    ("Session(head=5)", lambda c: P.Session(5), TypeError, "Session"),
    ("Session(calls='x')", lambda c: P.Session(c.head, calls="x"), TypeError, "calls"),
    ("Session(calls=-1)", lambda c: P.Session(c.head, calls=-1), ValueError, "calls"),
    ("Session(log=5)", lambda c: P.Session(c.head, log=5), TypeError, "log"),
    (
        "judge_fit('a')",
        lambda c: _levers().judge_fit("a", 1, lower_bound=False),
        TypeError,
        "judge_fit",
    ),
    (
        "Assertions(require_cold=1)",
        lambda c: _qualification().Assertions(require_cold=1),
        TypeError,
        "require_cold",
    ),
    (
        "Assertions(expected_prompt_tokens=0)",
        lambda c: _qualification().Assertions(expected_prompt_tokens=0),
        ValueError,
        "expected_prompt_tokens",
    ),
]


def _levers() -> Any:
    from prefixreg.core import levers

    return levers


def _qualification() -> Any:
    from prefixreg.core import qualification

    return qualification


@pytest.mark.parametrize(("label", "call", "kind", "names"), CASES, ids=[c[0] for c in CASES])
def test_a_wrong_argument_is_refused_at_the_door(
    ctx: Ctx, label: str, call: Callable[[Ctx], Any], kind: type[Exception], names: str
) -> None:
    with pytest.raises(prefixreg.PrefixregError) as info:
        call(ctx)
    assert isinstance(info.value, kind), (label, type(info.value).__mro__)
    assert isinstance(info.value, prefixreg.UsageError)
    expected = ArgumentTypeError if kind is TypeError else ArgumentValueError
    assert isinstance(info.value, expected)
    assert names in str(info.value), (label, str(info.value))
    assert ctx.reg.measurements() == []  # nothing ran


def test_save_snapshot_takes_a_str_slot_dir(ctx: Ctx, tmp_path: Path) -> None:
    """A str path is the obvious call: it reaches the work (here: the slot is not shown to
    hold the head, so nothing is saved), where it used to raise AttributeError."""
    with FakeServer() as srv:
        _llama(srv, restore=Reply(status=500), cached=0)  # every call is served cold
        with prefixreg.Worker(srv.url) as w, pytest.raises(EvidenceUnverifiedError):
            prefixreg.save_snapshot(ctx.reg, ctx.head, w, slot_dir=str(tmp_path))
    with prefixreg.Worker(DEAD) as w, pytest.raises(prefixreg.UsageError, match="readable"):
        prefixreg.save_snapshot(ctx.reg, ctx.head, w, slot_dir=str(tmp_path / "none"))


def test_the_front_door_builds_a_pool_spec(ctx: Ctx) -> None:
    spec = prefixreg.pool_spec([DEAD])
    assert type(spec) is prefixreg.PoolSpec
    assert [w.url for w in spec.workers] == [DEAD]
    with prefixreg.Pool(spec, ctx.reg) as pool:
        assert pool.spec is spec
