"""`prefixreg probe`: legs A1/A2/B/C per size, the six counter checks, Cmax, survival.

Exit codes: 0 every leg verified and no check failed beyond the lag explanation; 1 a check
failed; 2 bad options (sizes over the worker's context, a --frame's tools counted; a
--corpus that is not a regular file or is too large; a --frame that names a prefix); 3 a
--frame that fails verification (nothing sent); 4 evidence unverified (a leg, a survival
trial, or counter checks that could compare nothing); 5 worker error; 7 another probe holds
the lock.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, cast

import typer

from prefixreg.cli._common import (
    EXIT_BY_OUTCOME,
    DebugOpt,
    JsonOpt,
    ModelOpt,
    ProfileOpt,
    RegistryOpt,
    TimeoutOpt,
    WorkerOpt,
    cli_errors,
    emit_json,
    open_registry_from,
    open_worker,
)
from prefixreg.core.errors import UsageError


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str, int], None] | None]:
    """A progress bar on stderr when it is a terminal (calls made, current leg)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("probe"), BarColumn(), TextColumn("{task.completed} calls"))
    with Progress(
        *columns,
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)
        yield lambda label, n: bar.update(task, advance=n, description=label)


def probe_command(
    worker: WorkerOpt = None,
    sizes: Annotated[
        str, typer.Option(help="Prefix sizes in characters, comma-separated (k = 1000).")
    ] = "4k,16k,32k,64k",
    foreign: Annotated[int, typer.Option(help="Distinct foreign prompts before leg C.")] = 9,
    foreign_chars: Annotated[
        int,
        typer.Option(help="Characters of each foreign prompt (raised on aligned servers)."),
    ] = 2000,
    corpus: Annotated[
        Path | None,
        typer.Option(help="A regular UTF-8 text file to slice prefixes from (up to 64 MiB)."),
    ] = None,
    survival: Annotated[
        bool,
        typer.Option("--survival", help="Also search the most foreign prompts a prefix survives."),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Probe even while the worker reports work in flight.")
    ] = False,
    legs: Annotated[
        str,
        typer.Option(help="all: leg C at every size; report: at the size nearest 16k only."),
    ] = "all",
    frame: Annotated[
        str | None,
        typer.Option(
            help="A frame (name or sha): send its tools and settings with each size's prefix "
            "and judge legs against that whole head (verified first: exit 3, nothing sent).",
        ),
    ] = None,
    model: ModelOpt = None,
    timeout: TimeoutOpt = 1800.0,
    profile: ProfileOpt = None,
    public: Annotated[
        bool,
        typer.Option(
            "--public",
            help="With --json: drop the worker address, paths, model id and host-identifying"
            " build fields (refused without --json).",
        ),
    ] = False,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Measure a worker's prompt cache: Cmax, LRU survival, and whether /cache can be trusted.

    Per size: A1 cold baseline, A2 identical repeat, B same prefix with a fresh tail, C after
    --foreign foreign prompts. Each leg is a registered probe slice and a measurement bound to
    the server build, judged by the one rule of the README's "Evidence" section; the run is
    written to probes/<ts>.json and probes/<ts>.md.
    """
    from prefixreg.core.frame import Frame
    from prefixreg.verbs.probe.corpus import read_corpus
    from prefixreg.verbs.probe.run import Legs, parse_sizes
    from prefixreg.verbs.probe.run import ProbeOptions, run_probe

    with cli_errors(debug):
        if public and not json_out:
            raise UsageError("--public shapes the --json receipt; add --json")
        parsed = parse_sizes(sizes)  # a usage error before the registry is opened
        text = None if corpus is None else read_corpus(corpus)
        reg = open_registry_from(registry)
        head = None if frame is None else reg.head(frame)  # verified once, before any call
        if head is not None and not isinstance(head, Frame):
            raise UsageError(f"--frame {frame}: names a prefix, not a frame (no tools to send)")
        options = ProbeOptions(
            sizes=parsed,
            foreign=foreign,
            foreign_chars=foreign_chars,
            corpus=text,
            survival=survival,
            force=force,
            legs=cast(Legs, legs),  # checked by ProbeOptions
            frame=head,
        )
        with (
            open_worker(worker, model=model, timeout=timeout, profile=profile) as w,
            _progress(sys.stderr.isatty()) as step,
        ):
            report = run_probe(reg, w, options, progress=step)
        if json_out:
            emit_json(report.to_dict(public=public))
        else:
            sys.stdout.write(report.to_markdown())
            sys.stdout.write(f"\nreceipt: {report.json_path}\nverdict: {report.md_path}\n")
        raise typer.Exit(int(EXIT_BY_OUTCOME[report.outcome]))


def register(app: typer.Typer) -> None:
    """Add `probe` to `app`."""
    app.command("probe")(probe_command)
