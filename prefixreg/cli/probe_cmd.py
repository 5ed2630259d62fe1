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

from prefixreg.cli import _common as c
from prefixreg.core.errors import UsageError


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str, int], None] | None]:
    """A progress bar on stderr when it is a terminal (the leg being measured)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("probe", total=None)
        yield lambda label, n: bar.update(task, advance=n, description=f"probe: {label}")


Flag = typer.Option


def probe_command(
    worker: c.WorkerOpt = None,
    sizes: Annotated[str, Flag(help="Prefix sizes in characters (k = 1000).")] = "4k,16k,32k,64k",
    foreign: Annotated[int, Flag(help="Distinct foreign prompts before leg C.")] = 9,
    foreign_chars: Annotated[int, Flag(help="Characters of each foreign prompt.")] = 2000,
    corpus: Annotated[Path | None, Flag(help="UTF-8 text to slice (a file, - for stdin).")] = None,
    survival: Annotated[
        bool, Flag("--survival", help="Also find how many foreign prompts a prefix survives.")
    ] = False,
    force: Annotated[bool, Flag("--force", help="Probe even a worker that is busy.")] = False,
    legs: Annotated[str, Flag(help="all: leg C at every size; report: nearest 16k only.")] = "all",
    frame: Annotated[
        str | None,
        Flag(help="A frame whose tools and settings go with each prefix (verified first)."),
    ] = None,
    model: c.ModelOpt = None,
    timeout: c.TimeoutOpt = 1800.0,
    profile: c.ProfileOpt = None,
    public: Annotated[
        bool, Flag("--public", help="With --json: drop what identifies the worker and host.")
    ] = False,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Measure a worker's prompt cache: Cmax, LRU survival, and whether /cache can be trusted.

    Per size: A1 cold baseline, A2 identical repeat, B same prefix with a fresh tail, C after
    --foreign foreign prompts. Each leg is a registered probe slice and a measurement bound to
    the server build; the run is written to probes/<ts>.json and probes/<ts>.md.
    """
    from prefixreg.core.frame import Frame
    from prefixreg.verbs.probe.options import Legs, ProbeOptions
    from prefixreg.verbs.probe.run import parse_sizes, run_probe

    with c.cli_errors(debug):
        if public and not json_out:
            raise UsageError("--public shapes the --json receipt; add --json")
        parsed = parse_sizes(sizes)  # a usage error before the registry is opened
        text = None if corpus is None else _text(c.read_user_file(corpus), corpus)
        reg = c.open_registry_from(registry)
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
            c.open_worker(worker, model=model, timeout=timeout, profile=profile) as w,
            _progress(sys.stderr.isatty()) as step,
        ):
            report = run_probe(reg, w, options, progress=step)
        if json_out:
            c.emit_json(report.to_dict(public=public))
        else:
            sys.stdout.write(report.to_markdown())
            sys.stdout.write(f"\nreceipt: {report.json_path}\nverdict: {report.md_path}\n")
        raise typer.Exit(int(c.EXIT_BY_OUTCOME[report.outcome]))


def _text(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: the corpus is not UTF-8 text") from None


def register(app: typer.Typer) -> None:
    """Add `probe` to `app`."""
    app.command("probe")(probe_command)
