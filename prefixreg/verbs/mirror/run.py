"""The mirror use case: guard, plan every destination, check what travels, transfer, log.

Invariants:
- The source is an origin registry holding objects; destinations are de-duplicated (local
  paths resolved first), never nested, and no local one is, holds or lies inside the source.
- Nothing is written anywhere before every destination's plan passed the source checks
  (`plan`: entry types, objects re-hashed, all of them with `full_verify`, records' objects
  present); one failure refuses the run (`IntegrityError`, exit 3).
- One destination failing (exit 6) never stops the others; each gets its `mirror.log` line.
- Apply and compare repeat until the compare lists nothing; `content` is `judge_copy`'s
  verdict: "verified" only when every object there was hashed there and matched its name
  (the sweep of what stayed, the read-back of what was sent) and the last compare, records
  by content, listed nothing.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath
from typing import Final

from prefixreg.core import errors
from prefixreg.core.errors import IntegrityError, MirrorError
from prefixreg.core.jsonio import dumps_canonical
from prefixreg.core.judge import judge_copy
from prefixreg.registry.layout import MARKER, object_relpath
from prefixreg.registry.store import Registry
from prefixreg.verbs.mirror import plan
from prefixreg.verbs.mirror.rsync import Destination, parse_destination, parse_ssh_options
from prefixreg.verbs.mirror.session import DestinationResult, PassRecord, Session

ENV_TO: Final = "PREFIXREG_MIRROR_TO"
ENV_SSH_OPTS: Final = "PREFIXREG_SSH_OPTS"
Say = Callable[[str], None]


@dataclass(slots=True)
class MirrorReport:
    """The whole run: `objects_verified` counts source objects re-hashed before sending."""

    source: str
    dry_run: bool
    full_verify: bool
    objects_verified: int
    results: list[DestinationResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def outcome(self) -> str:
        """`ok` when every destination is, else `mirror_failed` (each failure has its line)."""
        return "ok" if self.ok else "mirror_failed"

    def to_dict(self) -> dict[str, object]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "results"}
        results = [r.to_dict() for r in self.results]
        failed = [r.destination for r in self.results if not r.ok]
        return {**out, "ok": self.ok, "failed": failed, "destinations": results}


def mirror_targets(
    to: Sequence[str] | None, ssh_options: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """The destinations (`to`, else `$PREFIXREG_MIRROR_TO`) and the ssh options (`ssh_options`,
    then `$PREFIXREG_SSH_OPTS`: flags first, ssh keeps the first value); the environment's
    are space-separated."""
    destinations = list(to or os.environ.get(ENV_TO, "").split())
    return destinations, [*(ssh_options or []), *os.environ.get(ENV_SSH_OPTS, "").split()]


def check_source(reg: Registry) -> None:
    """Refuse a source that is not an origin registry holding objects (`MirrorError`)."""
    try:
        role = reg.role
    except (errors.RegistryLocationError, IntegrityError) as exc:
        raise MirrorError(f"source {reg.root} is not a usable registry: {exc}") from None
    if role != "origin":
        what = f"not a registry (no {MARKER})" if role is None else f"a {role}, not an origin"
        hint = "mirrors flow one way: run it on the coordinator, --registry at the origin"
        raise MirrorError(f"source {reg.root} is {what}; refusing", hint=hint)
    if next(reg.iter_shas(), None) is None:
        raise MirrorError(f"source {reg.root} holds no objects; refusing to mirror (--delete)")


def _guard_destinations(source: Path, parsed: Sequence[Destination]) -> list[Destination]:
    """Drop repeated destinations (two rsyncs into one directory); refuse nested ones (the outer
    `--delete` would delete the inner) and a local one that is, holds or lies in the source."""
    out: dict[tuple[str | None, PurePosixPath], Destination] = {}
    for dest in parsed:
        path = PurePosixPath(posixpath.normpath(dest.path))
        if (dest.host, path) in out:
            continue
        for (host, other), seen in out.items():
            if host == dest.host and (path.is_relative_to(other) or other.is_relative_to(path)):
                text = f"mirror destinations {seen.raw} and {dest.raw} are nested; refusing"
                raise MirrorError(text, hint="give each worker its own directory")
        out[dest.host, path] = dest
    for dest in out.values():
        src, dst = source.resolve(), Path(dest.path).resolve()
        if dest.host is None and (src.is_relative_to(dst) or dst.is_relative_to(src)):
            raise MirrorError(f"destination {dest.raw} overlaps the source {source}; refusing")
    return list(out.values())


def mirror(
    reg: Registry,
    destinations: Sequence[str],
    *,
    dry_run: bool = False,
    full_verify: bool = False,
    ssh_options: Sequence[str] = (),
    bwlimit: int | None = None,
    max_rounds: int = 3,
    on_result: Callable[[DestinationResult], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> MirrorReport:
    """Mirror the origin registry `reg` to `destinations` (`PATH` or `[user@]host:PATH`),
    in parallel; a failed destination has `ok` False in the report, the others still ran.
    `dry_run` compares and hashes only (`changes` says what would change); `full_verify`
    also re-hashes every source object first, not only those about to travel. `max_rounds`
    bounds the apply + confirm rounds a changing origin may take; `on_result` gets each
    result as it finishes; `progress` each step of a long run, in words.

    Raises:
        UsageError: no destination, or a malformed ssh option.
        MirrorError: a refused source or destination, or a malformed destination.
        IntegrityError: a source entry of the wrong type for its place, or a bad object or frame.
        LockTimeoutError: another mirror runs.
    """
    parsed = _guard_destinations(reg.root, [parse_destination(text) for text in destinations])
    if not parsed:
        hint = f"pass --to HOST:PATH or PATH, or set {ENV_TO}"
        raise errors.UsageError("no mirror destination", hint=hint)
    options = parse_ssh_options(ssh_options)
    if shutil.which("rsync") is None:
        raise MirrorError("rsync is not installed (not found on PATH)", hint="install rsync")
    check_source(reg)
    log_lock = threading.Lock()
    verifier = plan.SourceVerifier(reg)
    say = progress or (lambda _msg: None)

    def log(result: DestinationResult, *, announce: bool = True) -> None:
        if not dry_run:
            with log_lock:
                reg.append_mirror_log(dumps_canonical(result.to_dict(log=len(verifier.done))))
        if announce and on_result is not None:
            on_result(result)

    with reg.lock("mirror"), contextlib.ExitStack() as stack:
        sessions = [Session(reg, dest, ssh_options=options, bwlimit=bwlimit) for dest in parsed]
        for session in sessions:
            stack.callback(session.close)
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=len(sessions)))

        # 1. Inspect, compare and hash every destination; read-only everywhere.
        def prepare(session: Session) -> bool:
            say(f"{session.dest.raw}: comparing, hashing the objects there")
            try:
                session.prepare()
            except (MirrorError, OSError) as exc:
                session.finish("failed", str(exc))
                return False
            return True

        live = [s for s, ok in zip(sessions, pool.map(prepare, sessions), strict=True) if ok]
        failed = [s.result for s in sessions if s not in live]

        # 2. Check what is about to travel, for all destinations, before touching any.
        try:
            for s in live:
                plan.check_shapes(reg.root, s.plan)
            if full_verify:
                say("re-hashing every object at the origin (--full-verify)")
                verifier(map(object_relpath, reg.iter_shas()))
            travel = plan.objects_to_verify(c for s in live for c in s.plan)
            say(f"re-hashing the {len(travel)} objects that travel, at the origin")
            verifier(travel)
            for s in live:
                plan.referenced_objects(reg, s.plan, verifier)
        except IntegrityError as exc:
            for s in live:
                s.finish("refused", str(exc))
            for s in sessions:
                # Recorded, not announced: the raised error is the one line the user sees.
                log(s.result, announce=False)
            raise
        except OSError as exc:
            # An unreadable source file fails every destination (exit 6), with a log line.
            failed += [s.finish("failed", f"cannot read the source: {exc}") for s in live]
            live = []
        for failed_result in failed:
            log(failed_result)

        def transfer(session: Session) -> None:
            try:
                _transfer(session, verifier, max_rounds, dry_run=dry_run, say=say)
            except (errors.PrefixregError, OSError) as exc:
                # One destination failing never stops the others; the log says why.
                log(session.finish("failed", str(exc)))
                return
            log(session.finish("dry-run" if dry_run else "ok"))

        list(pool.map(transfer, live))
    results = [s.result for s in sessions]
    return MirrorReport(str(reg.root), dry_run, full_verify, len(verifier.done), results)


def _transfer(
    session: Session, verify: plan.SourceVerifier, max_rounds: int, *, dry_run: bool, say: Say
) -> None:
    """Apply and confirm, round after round (each plan type-checked), until nothing differs."""
    changes = session.plan
    if dry_run:
        session.result.changes = list(changes)
        session.result.content = judge_copy(session.swept, not changes)
        return
    if changes and session.result.new:
        session.write_marker()
    while changes:
        if session.result.rounds >= max_rounds:
            text = f"{session.dest.raw} still differs from the source after {max_rounds} rounds "
            text += f"({len(changes)} changes, e.g. {changes[0]}); is the origin being written to?"
            raise MirrorError(text)
        session.result.rounds += 1
        say(f"{session.dest.raw}: sending {len(changes)} changes (round {session.result.rounds})")
        plan.check_shapes(session.reg.root, changes)
        session.apply(changes, verify)
        changes = session.compare()
        session.result.passes.append(PassRecord("confirm", changes))
    # Every object that stayed was hashed by the sweep (a new destination had none), every
    # object sent by its read-back; the last compare found no difference.
    session.result.content = judge_copy(session.swept or session.result.new, True)
