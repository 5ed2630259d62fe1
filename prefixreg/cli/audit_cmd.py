"""`prefixreg audit PATH...`: token and time accounting over call outputs, each call judged
against the head it sends, and the byte identity of each request's system prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli import _common as c

if TYPE_CHECKING:
    from prefixreg.registry.store import Registry


def audit_command(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Files (.json: a document or a list; .jsonl/.ndjson: one per line) or "
            "directories of them (recursive; symlinks and non-regular files skipped).",
            metavar="PATH...",
            show_default=False,
        ),
    ],
    prefill_tps: Annotated[
        float | None,
        typer.Option(help="Prefill tok/s for calls without server timings [default: 1180]."),
    ] = None,
    decode_tps: Annotated[
        float | None,
        typer.Option(help="Decode tok/s for calls without server timings [default: 60]."),
    ] = None,
    frame: Annotated[
        str | None,
        typer.Option(
            help="A frame or prefix (name or sha): judge in-line calls against it; name "
            "each request's drift from it and the cold calls after."
        ),
    ] = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Count prompt, cached and completion tokens over a batch of call outputs, model its
    prefill and decode time (default rates: the measured Halogen Flash lane), and say which
    dominates and which registered head the batch shares.

    Reads chat responses (bare, or under `response`/`body`, a `wall_s` beside them), request
    bodies, `{"request", "response"}` pairs and measurement records; a line or .json
    document over 16 MiB is skipped. Each call is reused, partial, cold or unverified:
    reused only when its cached count covers the span of the head it sends (its request's
    bytes, its record's head, or for a response read alone the batch's head). The batch's
    head is named by byte identity (each request's `messages[0].content` hashed and looked
    up), else by the measured span most calls cover.

    Exit 0 at least one call or request was read (malformed inputs, skipped files and lines,
    unverified calls are listed, not fatal); 2 nothing readable, bad rates, or a --frame
    that names nothing; 3 a registry record, object or the --frame (or one of its parts)
    fails verification (the store fails closed).
    """
    with c.cli_errors(debug):
        from prefixreg.core.errors import RegistryLocationError, UsageError
        from prefixreg.verbs.audit.run import run_audit

        try:
            reg: Registry | None = c.open_registry_from(registry)
        except RegistryLocationError:
            if registry is not None:
                raise
            reg = None  # the default registry only adds names and spans
        if reg is not None and not reg.exists:
            if registry is not None:
                raise UsageError(f"{registry}: not a registry")
            reg = None
        if frame is not None and reg is None:
            raise UsageError("--frame needs a registry that holds the frame")
        head = None if frame is None or reg is None else reg.head(frame)  # resolved once
        report = run_audit(
            paths, registry=reg, prefill_tps=prefill_tps, decode_tps=decode_tps, frame=head
        )
        if not report.calls and report.identity is None:
            for m in (*report.malformed, *report.skipped)[:10]:
                c.info(f"{m.source}: {m.reason}")
            raise UsageError(
                "no call outputs or requests read",
                hint="give response or request JSON, JSON lines, a directory of them, "
                "or measurement records",
            )
        c.emit(json_out, report.to_dict(), report.to_text())
