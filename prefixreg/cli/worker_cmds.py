"""Worker commands: `warm` (and `prefix-warm`) and `doctor`.

Exit codes of `warm`: 0 resumed (server evidence), 1 cold or partial, 4 unverified,
5 worker error, 3 integrity failure (nothing was sent). `warm --restore` (llama.cpp):
0 for a proven `restored`; otherwise the normal warm that follows decides, as above;
3 when the snapshot file changed (no restore sent); 2 a server without a slot API.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli._common import (
    EXIT_BY_OUTCOME,
    DebugOpt,
    ExitCode,
    JsonOpt,
    RegistryOpt,
    WorkerOpt,
    cli_errors,
    emit_json,
    info,
    open_registry_from,
    worker_url,
)
from prefixreg.core.errors import UsageError

if TYPE_CHECKING:
    from prefixreg.server.worker import Worker
    from prefixreg.verbs.measure.warm import WarmResult

__all__ = ["register", "summary_text", "warm_command"]

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Model id to send (default: the server's; generic servers: "
        "the first id of /v1/models).",
    ),
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds to wait for a reply to a chat call (a cold prefill "
        "of a large prefix takes minutes).",
        min=0.1,
    ),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        help="Force the server profile: halogen, llamacpp, vllm or generic "
        "(default: detected from what the server answers: /health, /props, /version).",
    ),
]


def open_worker(
    url: str | None, *, model: str | None, timeout: float, profile: str | None
) -> Worker:
    """A `Worker` for `--worker`/`$PREFIXREG_WORKER` (key from `$PREFIXREG_API_KEY`)."""
    from prefixreg.server.worker import Worker

    return Worker(worker_url(url), model=model, read_timeout=timeout, profile=profile)


def _fmt(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _summary(result: WarmResult) -> str:
    p, frame = result.prefix, result.frame
    ident = result.build.identity
    version = ident.get("version")
    api = version.get("api") if isinstance(version, dict) else None
    lines = (
        [f"frame    {frame.name + ' ' if frame.name else ''}{frame.sha256[:16]}"] if frame else []
    )
    lines += [
        f"prefix   {p.name + ' ' if p.name else ''}{p.sha256[:16]} ({p.size:,} bytes)",
        f"worker   {result.worker_url}  {result.build.profile} build {result.build.build_id}"
        + (f" (api {api})" if api else ""),
    ]
    for call in result.calls:
        ev = call.evidence
        wall = "-" if ev.wall_s is None else f"{ev.wall_s:.3f} s"
        src = f" from {ev.cached_source}" if ev.cached_source else ""
        lines.append(
            f"{call.phase:<8} prompt {_fmt(ev.prompt_tokens)}, cached {_fmt(ev.cached_tokens)}"
            f"{src} ({ev.cache_state}), {wall}"
        )
    span = "" if result.span_tokens is None else f"; prefix span ~{result.span_tokens:,} tokens"
    cov = "" if result.coverage is None else f", coverage {result.coverage:.1%}"
    lines.append(f"verdict  {result.headline}: {result.reason}{span}{cov}")
    lines.append(f"record   {result.record_path}")
    if result.diagnosis:
        lines.append(f"why      {result.diagnosis}")
    return "\n".join(lines) + "\n"


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
        reg = open_registry_from(registry)
        head = reg.head(ref)  # resolved and verified once, before a connection is opened
        if restore:
            if head.kind == "frame":
                raise UsageError("--restore takes a prefix; a frame has no snapshot")
            from prefixreg.cli.snapshot_cmd import warm_restore_cli

            with open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
                raise typer.Exit(
                    warm_restore_cli(reg, ref, w, slot_dir=slot_dir, json_out=json_out)
                )
        progress = info if sys.stderr.isatty() and not json_out else None
        with open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
            result = warm(
                reg, head, w, check=not no_check, send_warm=not check_only, progress=progress
            )
        if json_out:
            emit_json(result.receipt(public=public))
        else:
            sys.stdout.write(_summary(result))
        raise typer.Exit(int(EXIT_BY_OUTCOME[result.verdict]))


def doctor_command(
    worker: WorkerOpt = None,
    profile: ProfileOpt = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Say what a worker's /health and /cache tell about its prompt cache, and what to change.

    With the registry (--registry, else the default one) it also compares Cmax from the latest
    probe of this build with the registered prefixes' token spans; Cmax under 4,000 tokens is
    urgent. Exit 0 when nothing needs changing, 1 when a finding says what to change, 5 worker
    error.
    """
    from prefixreg.verbs.doctor.run import doctor

    with cli_errors(debug):
        reg = open_registry_from(registry)
        with open_worker(worker, model=None, timeout=30.0, profile=profile) as w:
            diagnosis = doctor(w, reg)
            url = w.url
        if json_out:
            emit_json({"worker": url, **diagnosis.to_dict()})
        else:
            sys.stdout.write(f"worker {url} ({diagnosis.profile})\n")
            for f in diagnosis.findings:
                sys.stdout.write(f"  [{f.level}] {f.text}\n")
        raise typer.Exit(int(ExitCode.OK if diagnosis.healthy else ExitCode.NO))


def register(app: typer.Typer) -> None:
    """Add the worker commands to `app`."""
    app.command("warm")(warm_command)
    app.command("doctor")(doctor_command)


summary_text = _summary
