"""`prefixreg keepalive REF...`: keep heads (prefixes or frames) resumable on a worker.

Ctrl-C (or `--duration`) stops it and prints the summary. Exit 0 when stopped normally after
at least one re-warm whose counts the judge could read; 5 when repeated worker errors stopped
it, or none succeeded and worker errors were why; 4 when none succeeded and the server never
reported the counts; 1 when something else stopped it (a measurement that could not be
written); 2 for a bad argument (an interval that is not finite seconds above 0, ...).
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli._common import (
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
    from prefixreg.verbs.keepalive.rewarm import Rewarm

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """`90`, `30s`, `10m`, `2h`, `1d` -> seconds (above 0)."""
    match = _DURATION.fullmatch(text.strip().lower())
    seconds = 0.0 if match is None else float(match.group(1)) * _UNITS[match.group(2)]
    if seconds <= 0:
        raise UsageError(f"bad duration {text!r}: seconds above 0, or a number with s, m, h, d")
    return seconds


def _say(rewarm: Rewarm) -> None:
    ev = rewarm.record.evidence
    since = "first warm" if rewarm.since is None else f"after {rewarm.since:g} {rewarm.unit}"
    what = rewarm.sha256[:12] if rewarm.frame is None else f"frame {rewarm.frame[:12]}"
    kept = "kept" if rewarm.verdict == "resumed" else "not kept"
    info(
        f"re-warmed {what} ({since}): {rewarm.verdict} ({kept}), cached {ev.cached_tokens}/"
        f"{ev.prompt_tokens}"
    )


def keepalive_command(
    refs: Annotated[list[str], typer.Argument(help="Prefixes or frames (names or shas).")],
    worker: WorkerOpt = None,
    interval: Annotated[
        float | None,
        typer.Option("--interval", help="Seconds between re-warms without /cache (default 60)."),
    ] = None,
    budget: Annotated[
        int | None,
        typer.Option(
            "--budget",
            help="Stores (llama.cpp: prompts) a just-used head survives (default: the latest "
            "probe --survival for this build, else max_entries less the entries per request; "
            "llama.cpp: 1, a re-warm after every foreign prompt).",
            min=1,
        ),
    ] = None,
    duration: Annotated[
        str | None,
        typer.Option("--duration", help="Stop after this long (30s, 10m, 2h); default: Ctrl-C."),
    ] = None,
    poll: Annotated[float, typer.Option("--poll", help="Seconds between counter polls.")] = 0.5,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Keep heads resumable under foreign traffic, using the server's own counters.

    It polls /cache (llama.cpp: /slots, else /metrics), counts stores (prompts) since each
    head was last used, and re-warms a head before one more foreign prompt could evict it;
    servers with neither are re-warmed on a time interval. A frame keeps its whole head
    warm. A re-warm is kept only when the judge says resumed; one that comes back partial
    or cold tightens the budget. Every re-warm is recorded as a measurement.
    """
    from prefixreg.server.worker import Worker
    from prefixreg.verbs.keepalive.run import KeepAlive

    with cli_errors(debug):
        seconds = None if duration is None else parse_duration(duration)
        reg = open_registry_from(registry)
        heads = [reg.head(ref) for ref in refs]  # resolved and verified once, before sending
        with Worker(worker_url(worker), timeout=5.0) as w:
            keeper = KeepAlive(
                w,
                heads,
                registry=reg,
                budget=budget,
                interval_s=interval,
                poll_s=poll,
                on_rewarm=None if json_out else _say,
            )
            b = keeper.budget
            if not json_out:
                info(f"keeping {len(heads)} heads on {w.url}; budget {b.describe()} ({b.source})")
            try:
                summary = keeper.run(seconds)
            except KeyboardInterrupt:
                summary = keeper.summary
        if json_out:
            emit_json({"budget": b.to_dict(), **summary.to_dict()})
        else:
            lines = [str(summary), *(f"  {change}" for change in summary.budget_changes)]
            sys.stdout.write("\n".join(lines) + "\n")
        if summary.stopped_because:
            info(f"stopped: {summary.stopped_because}")
            raise typer.Exit(int(ExitCode.WORKER if summary.stopped_by_worker else ExitCode.NO))
        if summary.succeeded == 0:
            # The keeper's claim is "these heads were kept warm": a run in which not one
            # re-warm came back with counts the judge could read proved nothing of the kind.
            why = f"{summary.errors} worker errors" if summary.errors else "no verified counts"
            info(f"no re-warm succeeded in this run ({why})")
            raise typer.Exit(int(ExitCode.WORKER if summary.errors else ExitCode.UNVERIFIED))


def register(app: typer.Typer) -> None:
    """Add `keepalive` to `app`."""
    app.command("keepalive")(keepalive_command)
