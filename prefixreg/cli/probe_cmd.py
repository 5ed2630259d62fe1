"""`prefixreg probe`: legs A1/A2/B/C per size, the six counter checks, Cmax, survival.

Exit codes: 0 every leg verified and no check failed beyond the lag explanation; 1 a check
failed; 2 bad options (sizes over the worker's context included, a --frame's tools counted);
3 a --frame that fails verification (nothing sent); 4 evidence unverified (a leg, a survival
trial, or counter checks that could compare nothing); 5 worker error; 7 another probe holds
the lock.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

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
    read_user_file,
)
from prefixreg.core.errors import UsageError

__all__ = ["probe_command", "register"]


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str, int], None] | None]:
    """A progress bar on stderr when it is a terminal (calls made, current leg)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("probe"),
        BarColumn(),
        TextColumn("{task.completed} calls"),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)

        def step(label: str, n: int) -> None:
            bar.update(task, advance=n, description=label)

        yield step


def probe_command(
    worker: WorkerOpt = None,
    sizes: Annotated[
        str,
        typer.Option("--sizes", help="Prefix sizes in characters, comma-separated (k = 1000)."),
    ] = "4k,16k,32k,64k",
    foreign: Annotated[
        int, typer.Option("--foreign", help="Distinct foreign prompts before leg C.", min=1)
    ] = 9,
    foreign_chars: Annotated[
        int,
        typer.Option(
            "--foreign-chars",
            help="Size of each foreign prompt in characters (raised on aligned servers so "
            "that a foreign prompt stores a snapshot).",
            min=1,
        ),
    ] = 2000,
    corpus: Annotated[
        Path | None,
        typer.Option(
            "--corpus", help="UTF-8 text to slice prefixes from (default: a built-in text)."
        ),
    ] = None,
    survival: Annotated[
        bool,
        typer.Option(
            "--survival", help="Also search the largest number of foreign prompts survived."
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Probe even while the worker reports work in flight.")
    ] = False,
    legs: Annotated[
        str,
        typer.Option(
            "--legs",
            help="all: leg C at every size; report: leg C at the size nearest 16k only "
            "(the report's shape: 22 calls at the four default sizes).",
        ),
    ] = "all",
    frame: Annotated[
        str | None,
        typer.Option(
            "--frame",
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
    --foreign foreign prompts (every size, or with --legs report at 16k only). The verdict
    gives each leg's seconds. Sizes over the worker's context are refused (exit 2).
    Every leg is a registered prefix and a measurement bound to
    the server build; the run is written to probes/<ts>.json and probes/<ts>.md.
    """
    from prefixreg.registry.frames import get_frame
    from prefixreg.verbs.probe.run import ProbeOptions, parse_sizes, run_probe

    with cli_errors(debug):
        if public and not json_out:
            raise UsageError("--public shapes the --json receipt; add --json")
        text = None
        if corpus is not None:
            try:
                text = read_user_file(corpus).decode("utf-8")
            except UnicodeDecodeError:
                raise UsageError(f"{corpus}: the corpus is not UTF-8 text") from None
        parsed = parse_sizes(sizes)  # a usage error before the registry is opened
        if legs not in ("all", "report"):
            raise UsageError(f"--legs {legs!r}: use all or report")
        reg = open_registry_from(registry)
        options = ProbeOptions(
            sizes=parsed,
            foreign=foreign,
            foreign_chars=foreign_chars,
            corpus=text,
            survival=survival,
            force=force,
            legs="report" if legs == "report" else "all",
            frame=None if frame is None else get_frame(reg, frame),  # verified before any call
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
