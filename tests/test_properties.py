"""A Hypothesis state machine over add / name / move / get / verify / gc against a plain
in-memory model: after every step the registry and the model agree and verify is clean.

Bounded by the shared deterministic profile (`tests.hypothesis_profile`): example and step
counts, not wall time.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from prefixreg.core.digest import sha256_hex
from prefixreg.core.errors import InvalidContentError, RefNotFoundError
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry.gc import collect_garbage
from prefixreg.registry.store import NameConflictError, Registry
from prefixreg.registry.verify import verify_registry
from tests.hypothesis_profile import bounded

NAMES = st.sampled_from(["main", "coding-loop", "a.b_c-1", "X9"])
# Small alphabets so the machine keeps re-adding the same content and moving names back.
CONTENT = st.one_of(
    st.sampled_from(["sys prompt\n", "é ü 漢字\n", "x", "\r\n\t trailing space "]),
    st.text(alphabet="ab\n€", min_size=0, max_size=40),
)
_BUILD = ServerBuild(profile="halogen", identity={"model": "m"})


class RegistryMachine(RuleBasedStateMachine):
    shas = Bundle("shas")

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="prefixreg-prop-"))
        self.reg = Registry(self.tmp / "reg", lock_timeout=5)
        self.objects: dict[str, bytes] = {}
        self.names: dict[str, str] = {}
        self.journal = 0

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    @rule(target=shas, text=CONTENT, name=st.none() | NAMES)
    def add(self, text: str, name: str | None) -> str:
        data = text.encode()
        if not data:
            try:
                self.reg.add(text, name=name)
            except InvalidContentError:
                return sha256_hex(b"")  # refused; the bundle may hold an absent sha
            raise AssertionError("empty content was accepted")
        sha = self.reg.add(text, name=name)
        assert sha == sha256_hex(data)
        self.objects[sha] = data
        if name is not None and self.names.get(name) != sha:
            self.names[name] = sha
            self.journal += 1
        return sha

    @rule(name=NAMES, sha=shas)
    def move(self, name: str, sha: str) -> None:
        if sha not in self.objects:
            try:
                self.reg.move_name(name, sha)
            except RefNotFoundError:
                return
            raise AssertionError("a name was pointed at a missing object")
        moved = self.reg.move_name(name, sha)
        assert (moved is None) == (self.names.get(name) == sha)
        if moved is not None:
            assert moved.from_sha == self.names.get(name)
            self.names[name] = sha
            self.journal += 1

    @rule(name=NAMES, sha=shas, stale=st.booleans())
    def compare_and_swap(self, name: str, sha: str, stale: bool) -> None:
        current = self.names.get(name)
        expect = "0" * 64 if stale else current
        if sha not in self.objects:
            return
        try:
            moved = self.reg.move_name(name, sha, expect=expect)
        except NameConflictError:
            assert stale and current != expect
            return
        assert not stale or current == expect
        if moved is not None:
            self.names[name] = sha
            self.journal += 1

    @rule(sha=shas, how=st.sampled_from(["sha", "abbrev", "name"]))
    def get(self, sha: str, how: str) -> None:
        if how == "name":
            for name, target in self.names.items():
                assert self.reg.get(name).data == self.objects[target]
            return
        ref = sha if how == "sha" else sha[:12]
        if sha in self.objects:
            assert self.reg.get(ref).data == self.objects[sha]
            assert self.reg.get(ref).data == self.objects[sha]
        else:
            try:
                self.reg.get(ref)
            except RefNotFoundError:
                return
            raise AssertionError("a removed or refused prefix was returned")

    @rule(sha=shas)
    def measure(self, sha: str) -> None:
        if sha in self.objects:
            m = Measurement(
                sha256=sha, at="2026-01-01T00:00:00Z", kind="warm", build=_BUILD, body={}
            )
            self.reg.write_measurement(m)

    @rule(prune=st.booleans())
    def gc_within_grace(self, prune: bool) -> None:
        # Everything is younger than an hour: nothing may go.
        report = collect_garbage(self.reg, grace_s=3600, prune_unnamed=prune)
        assert report.removed == []

    @precondition(lambda self: bool(self.objects))
    @rule()
    def gc_prune_everything_old(self) -> None:
        # A clock an hour ahead with no grace: every unnamed object is old, and so is every
        # measurement, so only names protect.
        report = collect_garbage(self.reg, grace_s=0, prune_unnamed=True, now=time.time() + 3600)
        gone = {item.path for item in report.removed if item.kind == "object"}
        named = set(self.names.values())
        expected = {f"objects/{s[:2]}/{s}.txt" for s in self.objects if s not in named}
        assert gone == expected
        self.objects = {s: d for s, d in self.objects.items() if s in named}

    @rule(sha=consumes(shas))
    def forget(self, sha: str) -> None:
        """Drop a sha from the bundle (keeps bundles small; the registry is unchanged)."""

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert self.reg.names() == self.names
        assert set(self.reg.iter_shas()) == set(self.objects)
        assert len(self.reg.name_log()) == self.journal
        for sha, data in self.objects.items():
            assert self.reg.get(sha).data == data
            assert self.reg.meta(sha).bytes == len(data)

    @invariant()
    def verify_is_clean(self) -> None:
        report = verify_registry(self.reg)
        assert report.findings == [], report.findings
        assert report.objects == len(self.objects)


RegistryMachine.TestCase.settings = bounded(60, stateful_step_count=30)
TestRegistryMachine = RegistryMachine.TestCase
