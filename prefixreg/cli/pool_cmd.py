"""`prefixreg pool warm | doctor | status`: registered prefixes on a pool of workers.

The pool: `--worker URL` repeated, else `--pool FILE` (TOML or JSON; see
`prefixreg.verbs.pool.spec`), else `$PREFIXREG_WORKERS` (comma-separated); `--router URL` puts
sglang-router (`--policy manual`) in front. Exit codes: 0 every prefix placed and proven
(doctor: and builds agree, no worker overloaded), 1 a prefix refused (the pool is too small)
or not resumed, or builds differ, 2 usage, 3 integrity (nothing sent), 5 worker error.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli._common import (
    DebugOpt,
    ExitCode,
    JsonOpt,
    RegistryOpt,
    cli_errors,
    emit_json,
    info,
    open_registry_from,
)

if TYPE_CHECKING:
    from prefixreg.registry.store import Registry
    from prefixreg.verbs.pool.live import Pool
    from prefixreg.verbs.pool.warm import PoolReport

__all__ = ["register"]

WorkersOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--worker",
        help="A worker's base URL; repeat for each worker (default: --pool, "
        "else $PREFIXREG_WORKERS).",
        show_default=False,
    ),
]
PoolOpt = Annotated[
    Path | None,
    typer.Option(
        "--pool",
        help="A pool file (TOML if it ends in .toml, else JSON): workers, optional "
        "per-worker capacity, optional router.",
        show_default=False,
    ),
]
RouterOpt = Annotated[
    str | None,
    typer.Option(
        "--router",
        help="sglang-router in front of the workers (policy manual; routing key header "
        "x-smg-routing-key).",
        show_default=False,
    ),
]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for a chat reply.", min=0.1)
]

pool_app = typer.Typer(
    name="pool",
    help="Keep registered prefixes resident on a pool of workers, one worker each, "
    "proven per worker.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def _open(
    workers: list[str] | None,
    pool_file: Path | None,
    router: str | None,
    registry: Path | None,
    timeout: float,
) -> tuple[Registry, Pool]:
    from prefixreg.verbs.pool.live import Pool
    from prefixreg.verbs.pool.spec import pool_spec

    reg = open_registry_from(registry)
    spec = pool_spec(workers or (), pool_file=pool_file, router=router)
    return reg, Pool(spec, reg, read_timeout=timeout)


def _names(reg: Registry) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, sha in sorted(reg.names().items()):
        out.setdefault(sha, name)
    return out


def _print_report(report: PoolReport, reg: Registry, *, title: str) -> None:
    names = _names(reg)
    out = sys.stdout
    out.write(
        f"{title}: {len(report.workers)} workers, capacity "
        f"{sum(w.capacity for w in report.workers)}"
        + (f", router {report.router}" if report.router else "")
        + "\n"
    )
    for w in report.workers:
        if w.error is not None:
            out.write(f"  {w.url}  UNREACHABLE: {w.error}\n")
            continue
        surv = "-" if w.survival is None else str(w.survival)
        profile = w.build.profile if w.build else "-"
        out.write(
            f"  {w.url}  {profile} build {w.build_id}  slots {w.slots or '-'} "
            f"({w.slots_source}), survival {surv}, keeps {w.capacity}\n"
        )
        for p in report.held_by(w.url):
            label = names.get(p.sha256, "")
            cached = "-" if p.cached_tokens is None else f"{p.cached_tokens:,}"
            span = "-" if p.span_tokens is None else f"{p.span_tokens:,}"
            out.write(
                f"    {p.sha256[:16]} {label:<16} {p.verdict.upper():<10} "
                f"cached {cached} of span ~{span}  key {p.key[:20]}\n"
            )
    if report.builds_differ:
        out.write("  FLAG: the workers run different builds\n")
    for note in report.notes:
        out.write(f"  note: {note}\n")


@pool_app.command("warm")
def pool_warm_command(
    refs: Annotated[
        list[str], typer.Argument(help="Names or shas of registered prefixes.", metavar="REF...")
    ],
    worker: WorkersOpt = None,
    pool: PoolOpt = None,
    router: RouterOpt = None,
    timeout: TimeoutOpt = 1800.0,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Place each prefix on one worker within its capacity, warm it, prove it there.

    Through a router, a prefix's first call carries its routing key (its sha) and the
    worker that served it is traced; a key the router put on a full worker is re-keyed.
    Each prefix is then proven by a fresh-tail check directly on its worker (a measurement
    bound to that worker's build). A prefix beyond the pool's capacity is refused and
    nothing is sent for it: exit 1.
    """
    from prefixreg.verbs.pool.warm import warm_pool

    with cli_errors(debug):
        reg, live = _open(worker, pool, router, registry, timeout)
        with live:
            for ref in refs:
                reg.get(ref)  # verify every prefix before anything is sent
            progress = info if sys.stderr.isatty() and not json_out else None
            report = warm_pool(live, refs, progress=progress)
        if json_out:
            emit_json(report.to_dict())
        else:
            _print_report(report, reg, title="pool warm")
        raise typer.Exit(int(_exit_code(report)))


@pool_app.command("doctor")
def pool_doctor_command(
    worker: WorkersOpt = None,
    pool: PoolOpt = None,
    router: RouterOpt = None,
    no_prove: Annotated[
        bool, typer.Option("--no-prove", help="Do not send the fresh-tail checks.")
    ] = False,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Per worker: build, slots, measured survival, capacity, and which registered
    prefixes it holds, each proven by a fresh-tail check on that worker.

    Exit 0 healthy; 1 when a placed prefix is not resumed, a worker is overloaded or
    unreachable, or the workers' builds differ.
    """
    from prefixreg.verbs.pool.warm import doctor_pool

    with cli_errors(debug):
        reg, live = _open(worker, pool, router, registry, 60.0)
        with live:
            report = doctor_pool(live, prove=not no_prove)
        if json_out:
            emit_json(report.to_dict())
        else:
            _print_report(report, reg, title="pool doctor")
        healthy = report.ok and not report.builds_differ and not report.notes
        raise typer.Exit(int(ExitCode.OK if healthy else ExitCode.NO))


@pool_app.command("status")
def pool_status_command(
    worker: WorkersOpt = None,
    pool: PoolOpt = None,
    router: RouterOpt = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """The pool's workers and the kept placement, without sending any chat call."""
    from prefixreg.verbs.pool.warm import doctor_pool

    with cli_errors(debug):
        reg, live = _open(worker, pool, router, registry, 60.0)
        with live:
            report = doctor_pool(live, prove=False)
            placement = [a.to_dict() for a in live.placement.values()]
        if json_out:
            emit_json({**report.to_dict(), "placement": placement})
        else:
            _print_report(report, reg, title="pool status")
            names = _names(reg)
            for a in sorted(live.placement.values(), key=lambda a: a.worker):
                sys.stdout.write(
                    f"  {a.sha256[:16]} {names.get(a.sha256, ''):<16} -> {a.worker}"
                    f"  key {a.key[:20]}\n"
                )
        raise typer.Exit(int(ExitCode.OK))


def register(app: typer.Typer) -> None:
    """Add the `pool` command group to `app`."""
    app.add_typer(pool_app, name="pool")


def _exit_code(report: PoolReport) -> ExitCode:
    """0 ok; 5 when no worker answered; 4 when only unverified counts stand in the way;
    else 1 (a prefix refused, unplaced or not resumed, a worker down)."""
    if report.ok:
        return ExitCode.OK
    if report.workers and all(w.error is not None for w in report.workers):
        return ExitCode.WORKER
    if report.unverified and not report.refused:
        return ExitCode.UNVERIFIED
    return ExitCode.NO
