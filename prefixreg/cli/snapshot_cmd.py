"""`prefixreg snapshot save | restore | ls`: KV snapshots of registered prefixes (llama.cpp).

Exit codes: `save` 0 saved, 3 integrity (nothing sent), 4 the slot could not be shown to
hold the prefix (nothing recorded), 2 a server profile without a slot API, 5 worker error.
`restore` 0 only when a fresh-tail check pinned to the restored slot resumed the prefix
(`restored`); 1 when no snapshot fits the worker's build, the server refused the restore,
or it "succeeded" without resuming (each followed by a normal warm unless --no-warm);
3 the snapshot file changed on disk (no restore sent); 4 unverified evidence; 2, 5 as above.
`warm --restore` runs the same restore through `warm_restore_cli`: 0 for `restored`, else the
normal warm that follows decides the exit code as a plain `warm` would.
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

if TYPE_CHECKING:
    from prefixreg.registry.store import Registry
    from prefixreg.server.worker import Worker
    from prefixreg.verbs.snapshot.run import RestoreResult

__all__ = ["register", "restore_exit_code", "snapshot_app", "warm_restore_cli"]

RefArg = Annotated[str, typer.Argument(help="A name, a sha256, or 8+ hex digits of one.")]
SlotDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--slot-dir",
        help="The server's --slot-save-path as seen from here: the snapshot file is hashed "
        "there (save records its sha256; restore re-checks it and sends nothing on a "
        "mismatch). Default for restore: the directory recorded at save.",
        show_default=False,
    ),
]
SlotOpt = Annotated[
    int | None,
    typer.Option(
        "--slot", help="Use this slot id if it is idle (default: the first idle one).", min=0
    ),
]

snapshot_app = typer.Typer(
    name="snapshot",
    help="KV snapshots of registered prefixes on llama.cpp's llama-server: save a slot's "
    "state, restore it after a restart, and prove the restore with the server's own counts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def restore_exit_code(result: RestoreResult) -> int:
    """0 only for a proven `restored`; 4 unverified; 1 for every other answer."""
    if result.verdict == "restored":
        return int(ExitCode.OK)
    if result.verdict == "unverified":
        return int(ExitCode.UNVERIFIED)
    return int(ExitCode.NO)


def warm_exit_code(result: RestoreResult) -> int:
    """`warm --restore`: 0 for a proven `restored`; else the fallback warm decides, as a
    plain `warm` would (without one: `restore_exit_code`)."""
    if result.verdict == "restored" or result.fallback is None:
        return restore_exit_code(result)
    return int(EXIT_BY_OUTCOME[result.fallback.verdict])


def _did_not_resume(result: RestoreResult) -> str:
    if result.verdict == "no_snapshot":
        return "no snapshot was restored"
    if result.verdict == "restore_failed":
        return "the restore was refused: it did not resume the prefix"
    return "the restore did NOT resume the prefix"


def warm_restore_cli(
    reg: Registry, ref: str, worker: Worker, *, slot_dir: Path | None, json_out: bool
) -> int:
    """`prefixreg warm REF --restore`: restore and prove, else warm normally; the exit code.

    The text output says plainly when the restore did not resume, and then shows the
    normal warm's own summary; `--json` adds `outcome` (`restored`, or the warm's verdict)
    and `resumed_by` (`restore`, `warm` or null) to the restore's receipt.
    """
    from prefixreg.verbs.snapshot.run import restore_and_prove

    progress = info if sys.stderr.isatty() and not json_out else None
    result = restore_and_prove(reg, ref, worker, slot_dir=slot_dir, progress=progress)
    code = warm_exit_code(result)
    fb = result.fallback
    if json_out:
        by = "restore" if result.verdict == "restored" else None
        if by is None and fb is not None and code == int(ExitCode.OK):
            by = "warm"
        outcome = result.verdict if fb is None else fb.verdict
        emit_json({**result.to_dict(), "outcome": outcome, "resumed_by": by})
        return code
    sys.stdout.write(_restore_summary(result, with_fallback=False))
    if fb is not None:
        sys.stdout.write(
            f"restore  {_did_not_resume(result)}; a normal warm followed "
            f"({fb.verdict}, exit {code}):\n"
        )
        sys.stdout.write(fb.summary())
    return code


@snapshot_app.command("save")
def save_command(
    ref: RefArg,
    worker: WorkerOpt = None,
    slot_dir: SlotDirOpt = None,
    slot: SlotOpt = None,
    model: ModelOpt = None,
    timeout: TimeoutOpt = 1800.0,
    profile: ProfileOpt = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Warm a prefix (in the slot already holding it, else an idle one), prove with a fresh
    tail pinned to that slot that it holds the prefix, save the slot, and record it.

    The file name is derived from the prefix sha and the server build id. Exit 0 saved,
    3 integrity (nothing sent), 4 not proven (nothing recorded), 2 no slot API, 5 worker.
    """
    from prefixreg.verbs.snapshot.run import save_snapshot

    with cli_errors(debug):
        reg = open_registry_from(registry)
        reg.get(ref)  # verify before opening a connection
        progress = info if sys.stderr.isatty() and not json_out else None
        with open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
            result = save_snapshot(reg, ref, w, slot_dir=slot_dir, slot=slot, progress=progress)
        if json_out:
            emit_json(result.to_dict())
        else:
            rec, t = result.record, result.transfer
            size = "" if rec.file_bytes is None else f", file sha256 {rec.file_sha256}"
            sys.stdout.write(
                f"saved    {rec.sha256[:16]} on build {rec.build_id}: {rec.n_saved:,} tokens, "
                f"{t.n_bytes or 0:,} bytes, {t.server_ms or 0:.1f} ms (slot {rec.slot_id})\n"
                f"file     {rec.file}{size}\nrecord   {result.record_path}\n"
            )


@snapshot_app.command("restore")
def restore_command(
    ref: RefArg,
    worker: WorkerOpt = None,
    slot_dir: SlotDirOpt = None,
    slot: SlotOpt = None,
    no_warm: Annotated[
        bool,
        typer.Option("--no-warm", help="Do not fall back to a normal warm when not restored."),
    ] = False,
    model: ModelOpt = None,
    timeout: TimeoutOpt = 1800.0,
    profile: ProfileOpt = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Restore a prefix's snapshot for the worker's current build, and prove it resumes.

    The verdict is `restored` only when a fresh-tail check pinned to the restored slot
    reports cached tokens covering the prefix (n_restored alone is never evidence).
    Exit 0 restored, 1 not used / not resumed / refused (then a normal warm unless
    --no-warm), 3 snapshot file changed (no restore sent), 4 unverified, 2 no slot API.
    """
    from prefixreg.verbs.snapshot.run import restore_and_prove

    with cli_errors(debug):
        reg = open_registry_from(registry)
        reg.get(ref)
        progress = info if sys.stderr.isatty() and not json_out else None
        with open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
            result = restore_and_prove(
                reg,
                ref,
                w,
                slot_dir=slot_dir,
                slot=slot,
                fallback_warm=not no_warm,
                progress=progress,
            )
        if json_out:
            emit_json(result.to_dict())
        else:
            sys.stdout.write(_restore_summary(result))
        raise typer.Exit(restore_exit_code(result))


def _restore_summary(result: RestoreResult, *, with_fallback: bool = True) -> str:
    lines = [f"prefix   {result.prefix.sha256[:16]} on build {result.build.build_id}"]
    if result.snapshot is not None:
        lines.append(f"file     {result.snapshot.file} ({result.file_check})")
    t = result.transfer
    if t is not None:
        lines.append(
            f"restore  slot {t.slot_id}: server says {t.n_tokens} tokens, "
            f"{t.server_ms or 0:.1f} ms (not evidence by itself)"
        )
    if result.check is not None:
        ev = result.check.evidence
        lines.append(
            f"check    prompt {ev.prompt_tokens}, cached {ev.cached_tokens} ({ev.cache_state})"
            + ("" if ev.wall_s is None else f", {ev.wall_s:.3f} s")
        )
    lines.append(f"verdict  {result.verdict.upper()}: {result.reason}")
    if result.record_path:
        lines.append(f"record   {result.record_path}")
    if result.fallback is not None and with_fallback:
        fb = result.fallback
        lines.append(f"warm     {fb.verdict.upper()}: {fb.reason} ({fb.record_path})")
    return "\n".join(lines) + "\n"


@snapshot_app.command("ls")
def ls_command(
    ref: Annotated[str | None, typer.Argument(help="Only this prefix's snapshots.")] = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """List snapshot records: prefix, build id, tokens saved, file and its sha256."""
    from prefixreg.registry.snapshots import list_snapshots

    with cli_errors(debug):
        reg = open_registry_from(registry)
        sha = reg.resolve(ref) if ref is not None else None
        records = list_snapshots(reg, sha)
        if json_out:
            emit_json([r.to_dict() for r in records])
            return
        for r in records:
            digest = (r.file_sha256 or "-")[:16]
            sys.stdout.write(
                f"{r.sha256[:16]}  {r.build_id}  {r.n_saved:>7,} tokens  {r.created}  "
                f"{r.file}  {digest}\n"
            )


def register(app: typer.Typer) -> None:
    """Add `snapshot` as a command group to `app`."""
    app.add_typer(snapshot_app, name="snapshot")
