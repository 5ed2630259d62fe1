"""`prefixreg warm` (and `prefix-warm`): warm a head on a worker and prove it resumes.

Exit codes of `warm`: 0 resumed (server evidence), 1 cold or partial, 4 unverified,
5 worker error, 3 integrity failure (nothing was sent). `warm --restore` (llama.cpp):
0 for a proven `restored`; otherwise the normal warm that follows decides, as above;
3 when the snapshot file changed (no restore sent); 2 a server without a slot API.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from prefixreg.cli._common import (
    EXIT_BY_OUTCOME,
    DebugOpt,
    JsonOpt,
    MetricsOpt,
    ModelOpt,
    ProfileOpt,
    RegistryOpt,
    TimeoutOpt,
    WorkerOpt,
    cli_errors,
    emit_json,
    info,
    open_registry_from,
    open_worker,
)
from prefixreg.core.errors import UsageError


def warm_command(
    ref: Annotated[str, typer.Argument(help="A name, a sha256, or 8+ hex digits of one.")],
    worker: WorkerOpt = None,
    no_check: Annotated[
        bool, typer.Option("--no-check", help="Send the warm call only; skip the resume check.")
    ] = False,
    check_only: Annotated[
        bool,
        typer.Option(
            "--check-only", help="Send the resume check only: is the prefix still resumable?"
        ),
    ] = False,
    model: ModelOpt = None,
    timeout: TimeoutOpt = 1800.0,
    profile: ProfileOpt = None,
    restore: Annotated[
        bool,
        typer.Option(
            "--restore",
            help="llama.cpp: restore the prefix's KV snapshot for the worker's current build"
            " and prove it with a fresh tail pinned to that slot; when there is none, or it"
            " does not resume, a normal warm follows (see `prefixreg snapshot`).",
        ),
    ] = False,
    slot_dir: Annotated[
        Path | None,
        typer.Option(
            "--slot-dir",
            help="With --restore: the server's --slot-save-path as seen from here, where the"
            " snapshot file is re-hashed (default: the directory recorded at save).",
            show_default=False,
        ),
    ] = None,
    public: Annotated[
        bool,
        typer.Option(
            "--public",
            help="With --json: drop the worker address, model id and host-identifying build"
            " fields (refused without --json).",
        ),
    ] = False,
    metrics_file: MetricsOpt = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Warm a prefix on a worker, then prove with a fresh tail that the worker resumes it.

    The prefix's bytes are verified first; on a mismatch nothing is sent (exit 3). One
    measurement record is written, bound to the server build read from /health. Exit 0
    resumed, 1 cold or partial, 4 unverified evidence, 5 worker error. With --restore: exit
    0 when the snapshot is proven `restored`, else the normal warm that follows decides;
    3 when the snapshot file changed (no restore sent); 2 a server without a slot API.
    """
    from prefixreg.verbs.measure.warm import warm

    with cli_errors(debug):
        if public and not json_out:
            raise UsageError("--public shapes the --json receipt; add --json")
        if no_check and check_only:
            raise typer.BadParameter("--no-check and --check-only exclude each other")
        if slot_dir is not None and not restore:
            raise UsageError("--slot-dir is for --restore; add --restore")
        if restore and (no_check or check_only or public):
            raise UsageError(
                "--restore always proves with a check; drop --no-check/--check-only/--public"
            )
        from prefixreg.verbs.measure.metrics import check_metrics_path, write_metrics

        check_metrics_path(metrics_file)
        reg = open_registry_from(registry)
        head = reg.head(ref)  # resolved and verified once, before a connection is opened
        if restore:
            from prefixreg.cli.snapshot_cmd import warm_restore_cli

            with open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
                raise typer.Exit(
                    warm_restore_cli(reg, head, w, slot_dir=slot_dir, json_out=json_out)
                )
        progress = info if sys.stderr.isatty() and not json_out else None
        with open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
            result = warm(
                reg, head, w, check=not no_check, send_warm=not check_only, progress=progress
            )
        if metrics_file is not None:
            write_metrics(metrics_file, result.metrics())
        if json_out:
            emit_json(result.receipt(public=public))
        else:
            sys.stdout.write(result.summary())
        raise typer.Exit(int(EXIT_BY_OUTCOME[result.verdict]))


def register(app: typer.Typer) -> None:
    """Add `warm` to `app`."""
    app.command("warm")(warm_command)
