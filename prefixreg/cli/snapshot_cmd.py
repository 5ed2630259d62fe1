"""`prefixreg snapshot save | restore | ship | ls`: KV snapshots of registered heads (llama.cpp).

Each reference is resolved once (`Registry.head`: a prefix or a frame) and verified before
a connection is opened; each command's help gives its exit codes. `warm --restore` runs the
same restore (`verbs.snapshot.warmrestore`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli import _common as c

if TYPE_CHECKING:
    from prefixreg.core.frame import Head
    from prefixreg.core.snapshots import SnapshotRecord
    from prefixreg.verbs.mirror.snapshots import ShipReport

SlotOpt = Annotated[
    int | None,
    typer.Option(help="Use this slot id if it is idle (default: the first idle).", min=0),
]

snapshot_app = typer.Typer(
    name="snapshot",
    help="KV snapshots of registered heads on llama.cpp's llama-server: save a slot's state, "
    "restore it after a restart, and prove the restore with the server's own counts (the "
    "judge's rule: README, evidence).",
    no_args_is_help=True,
    **c.APP_SETTINGS,
)


@snapshot_app.command("save")
def save_command(
    ref: c.RefArg,
    worker: c.WorkerOpt = None,
    slot_dir: c.SlotDirOpt = None,
    slot: SlotOpt = None,
    model: c.ModelOpt = None,
    timeout: c.TimeoutOpt = 1800.0,
    profile: c.ProfileOpt = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Warm a head (in the slot already holding it, else an idle one), prove with a fresh
    tail pinned to that slot that it holds the head, save the slot as a file named by the
    head's sha and the build id, hash it in --slot-dir (required), and record it.

    Exit 0 saved, 3 integrity (nothing sent), 4 not proven (nothing recorded), 2 no slot
    API or no --slot-dir, 5 worker.
    """
    from prefixreg.verbs.snapshot.run import require_slot_dir, save_snapshot

    with c.cli_errors(debug):
        where = require_slot_dir(slot_dir)
        reg = c.open_registry_from(registry)
        head = reg.head(ref)  # resolved and verified once, before a connection is opened
        progress = c.progress_for(json_out)
        with c.open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
            rec, receipt = save_snapshot(reg, head, w, slot_dir=where, slot=slot, progress=progress)
        c.emit(json_out, receipt, _saved_text(head, rec, str(receipt["record"])))


def _saved_text(head: Head, rec: SnapshotRecord, record: str) -> str:
    """`snapshot save`'s text: what was saved, its file and hash, where the record is."""
    return (
        f"saved    {head.kind} {rec.sha256[:16]} on build {rec.build_id}: {rec.n_saved:,} "
        f"tokens, {rec.file_bytes:,} bytes, {rec.save_ms or 0:.1f} ms (slot {rec.slot_id})\n"
        f"file     {rec.file}, sha256 {rec.file_sha256}\nrecord   {record}\n"
    )


@snapshot_app.command("restore")
def restore_command(
    ref: c.RefArg,
    worker: c.WorkerOpt = None,
    slot_dir: c.SlotDirOpt = None,
    slot: SlotOpt = None,
    no_warm: Annotated[
        bool, typer.Option("--no-warm", help="Do not fall back to a normal warm when not restored.")
    ] = False,
    model: c.ModelOpt = None,
    timeout: c.TimeoutOpt = 1800.0,
    profile: c.ProfileOpt = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Restore a head's snapshot for the worker's current build, and prove it.

    `restored` only when the slot was erased first, the server restored tokens, and a
    fresh-tail check pinned to the slot reports cached tokens covering the head (n_restored
    alone is never evidence). Exit 0 restored, 1 not used / not restored / refused (then a
    normal warm unless --no-warm), 3 the record or the snapshot file does not verify (no
    restore sent), 4 unverified, 2 no slot API or a bad --slot-dir, 5 worker.
    """
    from prefixreg.verbs.snapshot.warmrestore import warm_restore

    with c.cli_errors(debug):
        reg = c.open_registry_from(registry)
        head = reg.head(ref)
        with c.open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
            done = warm_restore(
                reg,
                head,
                w,
                slot_dir=slot_dir,
                slot=slot,
                fallback=not no_warm,
                as_warm=False,
                progress=c.progress_for(json_out),
            )
        c.finish(json_out, done)


@snapshot_app.command("ship")
def ship_command(
    ref: c.RefArg,
    to: Annotated[
        list[str],
        typer.Option(
            help="A destination worker's slot directory, PATH or [user@]HOST:PATH (repeatable, "
            "each with its --worker, in order)."
        ),
    ],
    workers: Annotated[
        list[str],
        typer.Option(
            "--worker", help="The worker serving that directory: its build picks the file."
        ),
    ],
    source: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="The slot directory the snapshot was saved in, PATH or [user@]HOST:PATH "
            "(default: the directory recorded at save).",
        ),
    ] = None,
    ssh_option: Annotated[
        list[str] | None, typer.Option(help="An ssh option as Key=Value (repeatable).")
    ] = None,
    timeout: c.TimeoutOpt = 60.0,
    profile: c.ProfileOpt = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Ship a head's proven snapshot to the workers of the same build: from the saving
    worker's slot directory to this host (hashed against the record on arrival), then to
    each destination's slot directory (hashed there). A worker of another build gets
    nothing. Then `warm --restore` on each destination proves the restore.

    Exit 0 every destination shipped and verified there, 1 a worker's build has no snapshot
    of the head, 3 the record or the file as fetched does not verify (nothing sent), 6 a
    destination failed (ssh, rsync, a wrong hash there), 5 a worker did not answer (and no
    destination failed otherwise), 2 --to and --worker do not pair.
    """
    from prefixreg.verbs.mirror.snapshots import ShipReport, check_ship_targets, ship_snapshot

    with c.cli_errors(debug):
        check_ship_targets(to, workers)  # before a worker is asked
        reg = c.open_registry_from(registry)
        head = reg.head(ref)
        progress = c.progress_for(json_out)
        with c.open_workers(workers, timeout=timeout, profile=profile) as ws:
            pairs = list(zip(to, ws, strict=True))
            results = ship_snapshot(
                reg, head, pairs, source=source, ssh_options=ssh_option or (), progress=progress
            )
        report = ShipReport(results)
        c.emit(json_out, report.to_list(), _shipped_text(report))
        c.exit_with(report.outcome)


def _shipped_text(report: ShipReport) -> str:
    """`snapshot ship`'s text: one line per destination, shipped or why not."""
    lines = [
        f"shipped  {r.destination}: {r.file}, {r.bytes:,} bytes, {r.content} there, "
        f"{r.seconds:.2f}s"
        if r.result == "shipped"
        else f"{r.result:<8} {r.destination}: {r.error}"
        for r in report.results
    ]
    return "\n".join(lines) + "\n"


@snapshot_app.command("ls")
def ls_command(
    ref: Annotated[str | None, typer.Argument(help="Only this head's snapshots.")] = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """List snapshot records: head, build id, tokens saved, file and its sha256."""
    from prefixreg.registry.snapshots import list_snapshots

    with c.cli_errors(debug):
        reg = c.open_registry_from(registry)
        records = list_snapshots(reg, None if ref is None else reg.head(ref).sha256)
        rows = (
            f"{r.sha256[:16]}  {r.build_id}  {r.n_saved:>7,} tokens  {r.created}  "
            f"{r.file}  {r.file_sha256[:16]}\n"
            for r in records
        )
        c.emit(json_out, [r.to_dict() for r in records], "".join(rows))
