"""The commands over many workers: `pool warm | doctor | status` keeps registered heads on a
pool of workers (`--worker` repeated, else `--pool FILE`, else `$PREFIXREG_WORKERS`; see
`prefixreg.verbs.pool.spec`); `mirror` (also `prefix-mirror`) copies the registry to them,
one-way verified rsync, one stderr line per destination whose content word is `judge_copy`'s
verdict. Each command's help gives its exit codes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from prefixreg.cli import _common as c
from prefixreg.core.errors import MirrorError, RegistryLocationError

if TYPE_CHECKING:
    from prefixreg.registry.store import Registry
    from prefixreg.verbs.mirror import DestinationResult, MirrorReport
    from prefixreg.verbs.pool.live import Pool
    from prefixreg.verbs.pool.warm import PoolReport

WorkersOpt = Annotated[
    list[str] | None,
    typer.Option(help="A worker base URL, repeatable (default: --pool, else $PREFIXREG_WORKERS)."),
]
PoolOpt = Annotated[
    Path | None,
    typer.Option(
        help="A pool file (TOML if it ends in .toml, else JSON): workers, optional "
        "per-worker capacity, optional router."
    ),
]
RouterOpt = Annotated[
    str | None,
    typer.Option(
        help="sglang-router in front of the workers (policy manual; routing key header "
        "x-smg-routing-key)."
    ),
]
pool_app = typer.Typer(
    name="pool",
    help="Keep registered heads resident on a pool of workers, one worker each, proven per "
    "worker (a proof stands only if nothing prefilled on its worker after it).",
    no_args_is_help=True,
    **c.APP_SETTINGS,
)


def _open(
    workers: list[str] | None,
    pool_file: Path | None,
    router: str | None,
    registry: Path | None,
    timeout: float = 60.0,
) -> tuple[Registry, Pool]:
    from prefixreg.verbs.pool.live import Pool
    from prefixreg.verbs.pool.spec import pool_spec

    reg = c.open_registry_from(registry)
    spec = pool_spec(workers or (), pool_file=pool_file, router=router)
    return reg, Pool(spec, reg, read_timeout=timeout)


def _show(report: PoolReport, reg: Registry, json_out: bool, title: str, **extra: Any) -> None:
    """Warnings (and for status, the workers down) on stderr; the report as JSON (with
    `extra`) or as text on stdout."""
    for warning in report.warnings:
        c.info(f"warning: {warning}")
    if report.verb == "status" and report.down:
        down = f"{len(report.down)} of {len(report.workers)} workers did not answer: "
        c.info(f"error: {down}" + ", ".join(report.down))
    if json_out:
        c.emit_json({**report.to_dict(), **extra})
        return
    # Each sha shown with its first name in order: the later ones are overwritten.
    names = {sha: name for name, sha in sorted(reg.names().items(), reverse=True)}
    capacity = sum(w.capacity for w in report.workers)
    router = f", router {report.router}" if report.router else ""
    lines = [f"{title}: {len(report.workers)} workers, capacity {capacity}{router}"]
    for w in report.workers:
        if w.error is not None:
            lines.append(f"  {w.url}  UNREACHABLE: {w.error}")
            continue
        lines.append(
            f"  {w.url}  {w.build.profile if w.build else '-'} build {w.build_id}  slots "
            f"{w.slots or '-'} ({w.slots_source}), survival "
            f"{'-' if w.survival is None else w.survival}, keeps {w.capacity}"
        )
        for p in report.held_by(w.url):
            label = "RESIDENT" if p.resident else f"UNPROVEN ({p.verdict})"
            lines.append(
                f"    {p.sha256[:16]} {names.get(p.sha256, ''):<16} {label:<10} cached "
                f"{_n(p.cached_tokens)} of span ~{_n(p.span_tokens)}  key {p.key[:20]}"
            )
            lines += [] if p.resident else [f"      {p.reason}"]
    lines += ["  FLAG: the workers run different builds"] if report.builds_differ else []
    lines += [f"  note: {note}" for note in report.notes]
    for a in extra.get("placement", []):
        lines.append(f"  {a['sha256'][:16]} {names.get(a['sha256'], ''):<16} -> {a['worker']}")
    sys.stdout.write("\n".join(lines) + "\n")


def _n(count: int | None) -> str:
    return "-" if count is None else f"{count:,}"


@pool_app.command("warm")
def pool_warm_command(
    refs: Annotated[
        list[str], typer.Argument(help="Names or shas of prefixes or frames.", metavar="REF...")
    ],
    worker: WorkersOpt = None,
    pool: PoolOpt = None,
    router: RouterOpt = None,
    timeout: c.TimeoutOpt = 1800.0,
    metrics_file: c.MetricsOpt = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Place each head on one worker within its capacity, warm it, prove it there.

    Through a router, a head's first call carries its routing key (its sha) and the worker
    that served it is traced; a key the router put on a full worker is re-keyed. Each head
    is then proven by fresh-tail checks directly on its worker, repeated until a round
    prefills nothing. A head beyond the pool's capacity is refused and nothing is sent for it.

    Exit 0 every head placed and proven resident; 1 a head refused (the pool is too small),
    unplaced, not resumed or unproven, or a worker down; 2 usage; 3 integrity (nothing
    sent); 4 only unverified counts stand in the way; 5 no worker answered.
    """
    from prefixreg.verbs.measure.metrics import check_metrics_path
    from prefixreg.verbs.pool.warm import warm_pool

    with c.cli_errors(debug):
        check_metrics_path(metrics_file)
        reg, live = _open(worker, pool, router, registry, timeout)
        with live:
            heads = [reg.head(ref) for ref in refs]  # verified once, before anything is sent
            report = warm_pool(live, heads, progress=c.progress_for(json_out))
        c.write_metrics_file(metrics_file, report.metrics("pool warm"))
        _show(report, reg, json_out, "pool warm")
        c.exit_with(report.outcome)


@pool_app.command("doctor")
def pool_doctor_command(
    worker: WorkersOpt = None,
    pool: PoolOpt = None,
    router: RouterOpt = None,
    no_prove: Annotated[
        bool, typer.Option("--no-prove", help="Do not send the fresh-tail checks.")
    ] = False,
    metrics_file: c.MetricsOpt = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Per worker: build, slots, measured survival, capacity, and which registered heads
    it holds, each proven by a fresh-tail check on that worker.

    Exit 0 healthy; 1 when a placed head is not resident, a worker is overloaded or
    unreachable, or the workers' builds differ.
    """
    from prefixreg.verbs.measure.metrics import check_metrics_path
    from prefixreg.verbs.pool.warm import doctor_pool

    with c.cli_errors(debug):
        check_metrics_path(metrics_file)
        reg, live = _open(worker, pool, router, registry)
        with live:
            report = doctor_pool(live, prove=not no_prove)
        c.write_metrics_file(metrics_file, report.metrics("pool doctor"))
        _show(report, reg, json_out, "pool doctor")
        c.exit_with(report.outcome)


@pool_app.command("status")
def pool_status_command(
    worker: WorkersOpt = None,
    pool: PoolOpt = None,
    router: RouterOpt = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """The pool's workers and the kept placement, without sending any chat call.

    Exit 0 every worker answered; 5 a worker did not (the report is printed all the same).
    """
    from prefixreg.verbs.pool.warm import status_pool

    with c.cli_errors(debug):
        reg, live = _open(worker, pool, router, registry)
        with live:
            report = status_pool(live)
        placement = sorted(live.placement.values(), key=lambda a: a.worker)
        _show(report, reg, json_out, "pool status", placement=[a.to_dict() for a in placement])
        c.exit_with(report.outcome)


def _summary(r: DestinationResult) -> str:
    """The one stderr line per destination; the content word is the judge's verdict."""
    content = f"{r.content} ({r.hashed} objects hashed there"
    content += f", {r.changed_in_place} changed in place)" if r.changed_in_place else ")"
    if r.result == "dry-run":
        new = " (new mirror)" if r.new else ""
        return f"dry-run {r.destination}: {len(r.changes)} changes{new}, content {content}"
    if not r.ok:
        reason = r.error or r.result
        where = "" if r.destination in reason else f"{r.destination}: "
        return f"error: {where}{reason}"
    rounds = f", {r.rounds} rounds" if r.rounds > 1 else ""
    return (
        f"ok      {r.destination}: sent {r.sent} files ({r.bytes:,} bytes), deleted "
        f"{r.deleted}, {content}{rounds}, {r.seconds:.2f}s"
    )


def _source(registry: Path | None) -> Registry:
    """The registry to mirror; an unmarked one is a refused mirror (exit 6), not a usage slip."""
    try:
        return c.open_registry_from(registry)
    except RegistryLocationError as exc:
        raise MirrorError(f"source is not a registry: {exc}", hint=exc.hint) from None


def _show_mirror(report: MirrorReport, json_out: bool) -> None:
    """The report as JSON; else with --dry-run, each destination's changes (itemized). Each
    failure already has its line on stderr (and is listed in --json)."""
    if json_out:
        c.emit_json(report.to_dict())
    elif report.dry_run:
        for r in report.results:
            if r.ok:
                sys.stdout.write(f"# {r.destination}\n")
                sys.stdout.writelines(f"{change}\n" for change in r.changes)
        sys.stdout.flush()


def mirror_command(
    to: Annotated[
        list[str] | None,
        typer.Option(
            help="Destination PATH or [user@]HOST:PATH (repeatable; default: "
            "$PREFIXREG_MIRROR_TO, space-separated). Its parent directory must exist."
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would change (itemized); change nothing.")
    ] = False,
    full_verify: Annotated[
        bool,
        typer.Option(
            "--full-verify",
            help="Also re-hash every object at the origin (without it, only the objects "
            "about to be sent). Run it weekly: examples/prefix-mirror-full.timer.",
        ),
    ] = False,
    ssh_option: Annotated[
        list[str] | None,
        typer.Option(help="An ssh option as Key=Value (repeatable; also $PREFIXREG_SSH_OPTS)."),
    ] = None,
    bwlimit: Annotated[
        int | None, typer.Option("--bwlimit", min=1, help="Limit each transfer to this many KiB/s.")
    ] = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Mirror the origin registry to workers: rsync -a --delete, one way, verified.

    Objects travel before the records that point to them, deletions last. Every run hashes
    every object at each destination, there (sha256sum, over ssh for a remote one), and
    compares every other file by content: a file changed in place is sent again. "verified"
    means every object there hashed to its name and every other file matched (the judge's
    rule for a copy, see the README's evidence section); else "mismatch" or "unchecked".

    Exit codes: 0 every destination ok; 6 a destination failed or was refused, named on its
    line (ssh, rsync, a missing parent directory, an object that hashes wrong after
    sending); 3 a source entry about to travel is not what the layout says (a bad hash, a
    symlink, FIFO or device, a directory where a file belongs): nothing sent anywhere; 2 no
    destination; 7 another mirror holds the lock. Each run and destination: a mirror.log line.
    """
    with c.cli_errors(debug):
        from prefixreg.verbs.mirror import mirror, mirror_targets

        destinations, options = mirror_targets(to, ssh_option)
        report = mirror(
            _source(registry),
            destinations,
            dry_run=dry_run,
            full_verify=full_verify,
            ssh_options=options,
            bwlimit=bwlimit,
            on_result=lambda r: c.info(_summary(r)),
            progress=c.progress_for(json_out),
        )
        _show_mirror(report, json_out)
        c.exit_with(report.outcome)
