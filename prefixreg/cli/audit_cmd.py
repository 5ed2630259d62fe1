"""`prefixreg audit PATH...`: token and time accounting over call outputs, and the byte
identity of each request's system prefix against the registry.

Exit codes: 0 at least one call or request was read (malformed files, skipped non-regular
files and unverified calls are listed, not fatal); 2 nothing readable (no path exists, or no
call or request among them) or bad rates; 3 a registry measurement record or object is
corrupt (the store fails closed), or the `--frame` or one of its parts fails verification.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli._common import (
    DebugOpt,
    JsonOpt,
    RegistryOpt,
    cli_errors,
    emit_json,
    info,
    open_registry_from,
)

if TYPE_CHECKING:
    from prefixreg.registry.store import Registry

__all__ = ["audit_command", "register"]


def audit_command(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Files (.json: one document or a list; .jsonl/.ndjson: one per line) or "
            "directories of them (recursive; symlinks and non-regular files skipped).",
            metavar="PATH...",
            show_default=False,
        ),
    ],
    prefill_tps: Annotated[
        float | None,
        typer.Option(
            "--prefill-tps",
            help="Prefill rate (tok/s) for calls without server timings "
            "[default: 1180, the measured Halogen Flash lane].",
            show_default=False,
        ),
    ] = None,
    decode_tps: Annotated[
        float | None,
        typer.Option(
            "--decode-tps",
            help="Decode rate (tok/s) for calls without server timings [default: 60].",
            show_default=False,
        ),
    ] = None,
    frame: Annotated[
        str | None,
        typer.Option(
            "--frame",
            help="A frame (name or sha): name, per request, the part of its head that "
            "drifted from the frame (tools, tool_choice, a setting), with the cold calls after.",
            show_default=False,
        ),
    ] = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Count prompt, cached and completion tokens over a batch of call outputs, model its
    prefill and decode time, and say which dominates and which registered prefix it shares.

    Documents read: a chat response (bare, or under `response`/`body` as in OpenAI batch
    output; a `wall_s` beside it is its wall time); a chat request body (`{"messages": [...]}`,
    bare or as OpenAI batch input under `body`); a request+response pair
    (`{"request": {...}, "response": {...}, "wall_s": 1.2}`); a prefixreg measurement record.

    For every request, `messages[0].content` is hashed (sha256 of its UTF-8 bytes) and looked
    up in the registry: the report names the registered prefix the batch's requests are
    byte-identical to (name and sha), and lists the calls whose system prefix drifted.
    With `--frame`, each request's head (system, tools, prompt settings) is compared with
    the frame's, and each change is named with the cold calls that follow it.
    """
    with cli_errors(debug):
        from prefixreg.core.errors import RegistryLocationError, UsageError
        from prefixreg.verbs.audit import run_audit

        reg: Registry | None
        if registry is not None:
            reg = open_registry_from(registry)
            if not reg.exists:
                raise UsageError(f"{registry}: not a registry")
        else:
            # The default registry only adds names and spans: its absence (or a location
            # that is not one) must not stop an audit of files.
            try:
                reg = open_registry_from(None)
            except RegistryLocationError:
                reg = None
        head = None
        if frame is not None:
            from prefixreg.registry.frames import get_frame

            if reg is None or not reg.exists:
                raise UsageError("--frame needs a registry that holds the frame")
            head = get_frame(reg, frame)  # verified: a tampered part fails closed (exit 3)
        report = run_audit(
            paths,
            registry=reg if reg is not None and reg.exists else None,
            prefill_tps=prefill_tps,
            decode_tps=decode_tps,
            frame=head,
        )
        if not report.calls and report.identity is None:
            for m in (*report.malformed, *report.skipped)[:10]:
                info(f"{m.source}: {m.reason}")
            raise UsageError(
                "no call outputs or requests read",
                hint="give response or request JSON, JSON lines, a directory of them, "
                "or measurement records",
            )
        if json_out:
            emit_json(report.to_dict())
        else:
            sys.stdout.write(report.to_text())


def register(app: typer.Typer) -> None:
    """Add the `audit` command to `app`."""
    app.command("audit")(audit_command)
