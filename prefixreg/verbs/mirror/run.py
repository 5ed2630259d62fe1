"""The mirror use case: guard, plan every destination, verify what travels, transfer, log.

Role: drive one `Session` per destination (in parallel) through the phases of a run and
write one `mirror.log` line per destination (through `Registry.append_mirror_log`).

Invariants:
- Nothing is written at any destination before every destination's plan has passed the
  source checks: each entry's type fits its place in the layout (`plan.check_shapes`),
  every object about to travel (every object, with `full_verify`) re-hashes to its name,
  and every name and meta record about to travel points to an object present at the
  source. One failure refuses the whole run (`IntegrityError`, exit 3, "refused" lines).
- One destination failing (exit 6) never stops the others; each gets its log line.
- A destination is "verified" only when the final compare dry run lists nothing, and
  every object sent was read back from it and hashed.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

from prefixreg.core.errors import IntegrityError, MirrorError, PrefixregError, UsageError
from prefixreg.core.jsonio import dumps_canonical
from prefixreg.registry.layout import object_relpath
from prefixreg.registry.store import Registry
from prefixreg.verbs.mirror.guards import check_overlap, check_source, dedupe
from prefixreg.verbs.mirror.plan import check_shapes, objects_to_verify, referenced_objects
from prefixreg.verbs.mirror.report import DestinationResult, MirrorReport, PassRecord
from prefixreg.verbs.mirror.rsync import parse_destination, parse_ssh_options
from prefixreg.verbs.mirror.session import Session
from prefixreg.verbs.mirror.verifier import SourceVerifier

__all__ = ["ENV_SSH_OPTS", "ENV_TO", "destinations_from_env", "mirror", "ssh_options_from_env"]

ENV_TO: Final = "PREFIXREG_MIRROR_TO"
ENV_SSH_OPTS: Final = "PREFIXREG_SSH_OPTS"


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
) -> MirrorReport:
    """Mirror the origin registry `reg` to every destination (in parallel).

    Args:
        destinations: `PATH` or `[user@]host:PATH` strings (duplicates, after resolving
            local paths, are dropped; nested destinations are refused).
        dry_run: compare only; the report's `changes` say what would change.
        full_verify: re-hash every source object first, and compare with `--checksum`.
            Without it a destination is "verified" when an itemized dry run finds no
            size or mtime difference (the objects sent are still re-hashed first, and
            read back from the destination and hashed after).
        ssh_options: `Key=Value` ssh options for remote destinations.
        bwlimit: rsync `--bwlimit` (KiB/s) for the transfer passes.
        max_rounds: how many apply + confirm rounds a changing origin may take.
        on_result: called with each destination's result as it finishes (progress lines).

    Returns:
        The report; a destination that failed has `ok` False (the others still ran).

    Raises:
        UsageError: no destination. MirrorError: a refused source or a malformed
        destination or option (nothing touched). IntegrityError: a source entry about to
        be sent is not a regular file or directory where the layout wants one, or an
        object fails verification (nothing sent). LockTimeoutError: another mirror runs.
    """
    parsed = dedupe([parse_destination(text) for text in destinations])
    if not parsed:
        raise UsageError(
            "no mirror destination", hint=f"pass --to HOST:PATH or PATH, or set {ENV_TO}"
        )
    options = parse_ssh_options(ssh_options)
    if shutil.which("rsync") is None:
        raise MirrorError("rsync is not installed (not found on PATH)", hint="install rsync")
    check_source(reg)
    for dest in parsed:
        check_overlap(reg.root, dest)
    report = MirrorReport(source=str(reg.root), dry_run=dry_run, full_verify=full_verify)
    log_lock = threading.Lock()
    verifier = SourceVerifier(reg)

    def log(result: DestinationResult, *, announce: bool = True) -> None:
        if not dry_run:
            with log_lock:
                line = dumps_canonical(result.log_record(verifier.count))
                reg.append_mirror_log(line)
        if announce and on_result is not None:
            on_result(result)

    with reg.lock("mirror"), contextlib.ExitStack() as stack:
        sessions = []
        for dest in parsed:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="prxm-")))
            session = Session(
                reg,
                dest,
                ssh_options=options,
                full_verify=full_verify,
                bwlimit=bwlimit,
                workdir=workdir,
            )
            stack.callback(session.close)
            sessions.append(session)
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=len(sessions)))

        # 1. Inspect and plan every destination; read-only everywhere.
        def plan(session: Session) -> DestinationResult | None:
            try:
                session.open()
                session.inspect()
                session.plan = session.compare()
            except (MirrorError, OSError) as exc:
                return session.finish("failed", str(exc))
            return None

        planned = list(pool.map(plan, sessions))
        live = [s for s, failed in zip(sessions, planned, strict=True) if failed is None]

        # 2. Check what is about to travel, for all destinations, before touching any.
        failed = [r for r in planned if r is not None]
        try:
            for s in live:
                check_shapes(reg.root, s.plan)
            if full_verify:
                verifier(map(object_relpath, reg.iter_shas()))
            else:
                verifier(objects_to_verify(c for s in live for c in s.plan))
            for s in live:
                referenced_objects(reg, s.plan, verifier)
        except IntegrityError as exc:
            report.objects_verified = verifier.count
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
        report.objects_verified = verifier.count
        for failed_result in failed:
            log(failed_result)

        if dry_run:
            for s in live:
                s.result.changes = list(s.plan)
                s.result.verified = not s.plan
                log(s.finish("dry-run"))
        else:

            def transfer(session: Session) -> None:
                try:
                    _transfer(session, verifier, max_rounds)
                except (PrefixregError, OSError) as exc:
                    # One destination failing never stops the others; the log says why.
                    log(session.finish("failed", str(exc)))
                    return
                log(session.finish("ok"))

            list(pool.map(transfer, live))
            report.objects_verified = verifier.count
        report.results = [s.result for s in sessions]
    return report


def _transfer(session: Session, verify: SourceVerifier, max_rounds: int) -> None:
    """Apply the plan and confirm, round after round, until the destination equals the source.

    Each later round's plan passes the same type checks as the first one's.
    """
    plan = session.plan
    if plan and session.result.new:
        session.write_marker()
    while plan:
        if session.result.rounds >= max_rounds:
            raise MirrorError(
                f"{session.dest.raw} still differs from the source after {max_rounds} rounds "
                f"({len(plan)} changes, e.g. {plan[0]}); is the origin being written to?"
            )
        session.result.rounds += 1
        check_shapes(session.reg.root, plan)
        session.apply(plan, verify)
        plan = session.compare()
        session.result.passes.append(PassRecord("confirm", plan))
    session.result.verified = True


def destinations_from_env(value: str | None) -> list[str]:
    """Destinations from `PREFIXREG_MIRROR_TO` (space-separated)."""
    return value.split() if value else []


def ssh_options_from_env(value: str | None) -> list[str]:
    """ssh options from `PREFIXREG_SSH_OPTS` (space-separated `Key=Value`)."""
    return value.split() if value else []
