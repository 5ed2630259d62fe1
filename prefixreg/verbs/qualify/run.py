"""`qualify`: a first request, identical repeats in sequence, then a concurrent group, each
judged by the strict evidence rules (DESIGN §4; halogen-api.md §3, the benchmark client's).

Sequence: check the arguments and `--output` (nothing sent on a refusal), read the build
(its zero rule is how a missing count is read), send `first`, `repeats` x `repeated`, then
`streams` x `concurrent` released together (one thread each, behind a barrier, over the one
thread-safe client: they overlap on the wire), re-read the build, write the receipt, then
(with a registry) one measurement per phase bound to the build. No warm-up; nothing is
cleared or restarted. Every request is the same body: the prompt (`/v1/completions`,
streamed with usage), `max_tokens`, temperature 0, the seed.

Invariants:
- A call is measured in one place (`verbs.measure.calls.measured_completion`); its evidence
  is `server.evidence`'s; every verdict is the judge's (`core.judge`: `compare_tokens`,
  `compare_output`, `judge_qualified`). The phase is the order; the cache state observed is
  judged on its own.
- A call that raises is a row (`error`: the exception's class, never its text). A failure
  of `/health` or of the first request ends the run: the receipt is written, then the
  `WorkerError` is raised (exit 5). The receipt is written atomically whenever it is asked
  for and the run started, also on failure; it holds only what `receipt.py` allows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prefixreg.core.errors import (
    ArgumentTypeError,
    ArgumentValueError,
    UsageError,
    WorkerError,
    WorkerHTTPError,
)
from prefixreg.core.judge import (
    Assertions,
    compare_output,
    compare_tokens,
    judge_qualified,
    judge_same_build,
)
from prefixreg.core.qualification import decode_rate
from prefixreg.core.records import CallEvidence, ServerBuild
from prefixreg.registry.fsutil import replace_atomic
from prefixreg.registry.store import Registry
from prefixreg.registry.userfiles import check_output_file
from prefixreg.server.engines import string_prompt_only
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import CallRecord, measured_completion, record_measurement
from prefixreg.verbs.qualify.prompts import QualifyPrompt, builtin_prompt, load_prompt
from prefixreg.verbs.qualify.receipt import QualifyRow, Settings, render, rows_for, summary_lines

MAX_STREAMS: Final = 64  # under the client's pool of 100 connections: all really overlap
BARRIER_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class QualifyResult:
    """What `qualify` found: each request's row in request order, the judge's decision and
    each failure in words, the build, the receipt (allowlisted) and where it went."""

    qualified: bool
    failures: tuple[str, ...]
    rows: tuple[QualifyRow, ...]
    settings: Settings
    prompt: QualifyPrompt
    build: ServerBuild | None
    receipt: dict[str, Any]
    output: Path | None = None
    measurements: tuple[str, ...] = ()

    def summary(self) -> str:
        """The text a person reads (no endpoint, model or prompt: as fit to share as the
        receipt)."""
        return "\n".join(summary_lines(self.receipt)) + "\n"

    @property
    def outcome(self) -> str:
        return "qualified" if self.qualified else "not_qualified"

    def to_dict(self) -> dict[str, Any]:
        """The `--json` output: the receipt as written."""
        return self.receipt

    def text(self, _exit_code: int = 0) -> str:
        return self.summary()


def _whole(name: str, value: object, low: int, high: int | None = None) -> int:
    if type(value) is not int:
        raise ArgumentTypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ArgumentValueError(f"{name} must be {bound}, not {value}")
    return value


def _check(**given: Any) -> Settings:
    for flag in ("require_cold", "require_reuse"):
        if not isinstance(given[flag], bool):
            got = type(given[flag]).__name__
            raise ArgumentTypeError(f"{flag} must be True or False, not {got}")
    expected = given["expected_prompt_tokens"]
    return Settings(
        tokens=_whole("tokens", given["tokens"], 1, 1 << 20),
        repeats=_whole("repeats", given["repeats"], 1, 1000),
        streams=_whole("streams", given["streams"], 1, MAX_STREAMS),
        seed=_whole("seed", given["seed"], 0, (1 << 63) - 1),
        assertions=Assertions(
            require_cold=given["require_cold"],
            require_reuse=given["require_reuse"],
            expected_prompt_tokens=None
            if expected is None
            else _whole("expected_prompt_tokens", expected, 1),
        ),
    )


def qualify(
    worker: Worker,
    *,
    tokens: int = 64,
    repeats: int = 2,
    streams: int = 4,
    require_cold: bool = False,
    require_reuse: bool = False,
    prompt_file: Path | str | None = None,
    expected_prompt_tokens: int | None = None,
    seed: int = 1234,
    output: Path | str | None = None,
    registry: Registry | None = None,
    progress: Callable[[str], None] | None = None,
) -> QualifyResult:
    """Qualify `worker`'s cache behaviour (module docstring): `tokens` the reply limit,
    `repeats` identical requests after the first, `streams` concurrent ones; the assertions
    asked; `prompt_file` (text, or a JSON array of token IDs), else the built-in fixture;
    `output`, the receipt's file; `registry`, where one measurement per phase is recorded.

    Raises:
        UsageError (also TypeError / ValueError): a bad argument, an `output` refused, a
        prompt file refused, a token prompt on an engine that takes none; nothing is sent.
        WorkerError: `/health` or the first request failed (the receipt written first).
    """
    if not isinstance(worker, Worker):
        raise ArgumentTypeError(f"worker must be a Worker, not {type(worker).__name__}")
    settings = _check(
        tokens=tokens,
        repeats=repeats,
        streams=streams,
        seed=seed,
        require_cold=require_cold,
        require_reuse=require_reuse,
        expected_prompt_tokens=expected_prompt_tokens,
    )
    for name, value in (("prompt_file", prompt_file), ("output", output)):
        if value is not None and not isinstance(value, Path | str):
            raise ArgumentTypeError(f"{name} must be a path, not {type(value).__name__}")
    if registry is not None and not isinstance(registry, Registry):
        raise ArgumentTypeError(f"registry must be a Registry, not {type(registry).__name__}")
    out = None if output is None else check_output_file(Path(output), "--output")
    prompt = builtin_prompt() if prompt_file is None else load_prompt(prompt_file)
    if registry is not None:
        registry.refuse_on_mirror("record measurements")
    say = progress or (lambda _msg: None)
    run = _Run(worker, settings, prompt, say)
    try:
        run.start()
        run.sequence()
        run.concurrent()
        run.finish()
    except BaseException as exc:  # the evidence so far is written, whatever stopped the run
        if out is not None and not isinstance(exc, UsageError):
            replace_atomic(out, render(run.receipt(error=type(exc).__name__)))
        raise
    receipt = run.receipt(error=None)
    if out is not None:
        replace_atomic(out, render(receipt))
    paths = () if registry is None or run.build is None else run.record(registry, receipt)
    qualified, failures = receipt["qualified"], tuple(receipt["failures"])
    rows = tuple(run.rows())
    return QualifyResult(
        qualified, failures, rows, settings, prompt, run.build, receipt, out, paths
    )


class _Run:
    """One run's state: the build, and each request's record (or failure) in request order."""

    def __init__(
        self, worker: Worker, settings: Settings, prompt: QualifyPrompt, say: Callable[[str], None]
    ) -> None:
        self.worker, self.settings, self.prompt, self.say = worker, settings, prompt, say
        self.build: ServerBuild | None = None
        self.changed: str | None = None  # the judge's words when the build changed mid-run
        self.with_cache = False
        self.calls: list[tuple[str, CallRecord | CallEvidence]] = []
        self.params: dict[str, Any] = {}

    def start(self) -> None:
        self.build = self.worker.server_build()
        refused = string_prompt_only(self.build.profile, self.build.identity)
        if self.prompt.kind == "tokens" and refused:
            raise UsageError(
                f"{refused}: a token-ID prompt cannot be sent",
                hint="give a text --prompt-file, or leave it out for the built-in fixture",
            )
        model = self.worker.model or self.worker.default_model()
        s = self.settings
        self.params = {"max_tokens": s.tokens, "temperature": 0, "seed": s.seed}
        self.params |= {} if model is None else {"model": model}
        self.with_cache = self.build.profile == "halogen"

    def _one(self, phase: str, *, witness: bool = True) -> CallRecord | CallEvidence:
        assert self.build is not None  # noqa: S101 -- `start` read it before any call
        before = None
        last = self.calls[-1][1] if self.calls else None
        if isinstance(last, CallRecord) and witness:
            before = last.after
        try:
            return measured_completion(
                self.worker,
                self.prompt.sent,
                build=self.build,
                phase=phase,
                prompt_sha256=self.prompt.fixture_sha256,
                with_cache=self.with_cache and witness,
                before=before,
                witness=witness,
                **self.params,
            )
        except WorkerError as exc:
            if not self.calls:  # the first request: nothing to qualify on this worker
                self.calls.append((phase, failed(exc)))
                refused = isinstance(exc, WorkerHTTPError) and 400 <= exc.status_code < 500
                if refused and self.prompt.kind == "tokens" and exc.hint is None:
                    exc.hint = "this engine may not take a token-ID prompt; try a text one"
                raise
            return failed(exc)

    def sequence(self) -> None:
        self.say("first request")
        self.calls.append(("first", self._one("first")))
        for i in range(self.settings.repeats):
            self.say(f"repeated request {i + 1} of {self.settings.repeats}")
            self.calls.append(("repeated", self._one("repeated")))

    def concurrent(self) -> None:
        n = self.settings.streams
        self.say(f"{n} concurrent requests")
        results: list[CallRecord | CallEvidence | None] = [None] * n
        barrier = threading.Barrier(n)

        def one(index: int) -> None:
            try:
                barrier.wait(BARRIER_S)
            except threading.BrokenBarrierError:
                results[index] = failed(threading.BrokenBarrierError())
                return
            try:
                results[index] = self._one("concurrent", witness=False)
            except Exception as exc:  # a row, never a lost thread  # noqa: BLE001
                results[index] = failed(exc)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.calls += [("concurrent", r if r is not None else failed(None)) for r in results]

    def finish(self) -> None:
        if self.build is not None:
            try:
                after = self.worker.server_build().build_id
            except WorkerError:
                return  # the calls' own evidence stands
            moved = judge_same_build(self.build.build_id, after)
            self.changed = None if moved is None else moved.reason

    def evidence(self) -> list[tuple[str, CallEvidence]]:
        return [(p, c.evidence if isinstance(c, CallRecord) else c) for p, c in self.calls]

    def rows(self) -> list[QualifyRow]:
        first = self.evidence()[0][1] if self.calls else None
        out = []
        for index, (phase, call) in enumerate(self.calls):
            record = call if isinstance(call, CallRecord) else None
            ev = call.evidence if isinstance(call, CallRecord) else call
            tokens = None if first is None or index == 0 else compare_tokens(first, ev)
            output = None if first is None or index == 0 else compare_output(first, ev)
            out.append(QualifyRow(phase, index, ev, record, tokens, output, decode_rate(ev)))
        return out

    def receipt(self, *, error: str | None) -> dict[str, Any]:
        qualified, failures = judge_qualified(self.evidence(), self.settings.assertions)
        failures += (self.changed,) if self.changed else ()
        if error is not None:
            failures += (f"the run stopped: {error}",)
        return rows_for(
            self.rows(),
            settings=self.settings,
            prompt=self.prompt,
            build=self.build,
            qualified=qualified and self.changed is None and error is None,
            failures=failures,
            error=error,
        )

    def record(self, registry: Registry, receipt: dict[str, Any]) -> tuple[str, ...]:
        """One measurement per phase, bound to the build (as `warm` records its calls)."""
        if self.build is None:
            return ()
        paths = []
        for phase in ("first", "repeated", "concurrent"):
            calls = [r for r in receipt["rows"] if r["phase"] == phase]
            body = {k: v for k, v in receipt.items() if k != "rows"} | {"phase": phase}
            body |= {"verdict": "qualified" if receipt["qualified"] else "not_qualified"}
            body |= {"calls": calls}
            sha = self.prompt.fixture_sha256
            path = record_measurement(registry, self.worker, self.build, sha, "qualify", body)[1]
            paths.append(str(path))
        return tuple(paths)


def failed(exc: BaseException | None) -> CallEvidence:
    """A request that raised: a row of unverified evidence naming the exception's class."""
    name = "not_run" if exc is None else type(exc).__name__
    return CallEvidence(
        prompt_tokens=None,
        cached_tokens=None,
        completion_tokens=None,
        cached_source=None,
        cache_state="unverified",
        complete=False,
        error=name,
        reason="the request failed before a reply was read",
    )
