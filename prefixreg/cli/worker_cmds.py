"""The commands that talk to one worker: `warm` (also `prefix-warm`), `doctor`, `probe` and
`keepalive`. A reference is resolved once (`Registry.head`: a prefix or a frame) and verified
before a connection is opened; each command's help gives its exit codes. A command only
maps: it parses, calls one verb (option rules included), renders the verb's typed result and
ends with the exit code `_common.EXIT_BY_OUTCOME` gives its outcome.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli import _common as c

if TYPE_CHECKING:
    from prefixreg.core.frame import Head
    from prefixreg.registry.store import Registry

Flag = typer.Option


def warm_command(
    ref: c.RefArg,
    worker: c.WorkerOpt = None,
    no_check: Annotated[
        bool, Flag("--no-check", help="Send the warm call only; skip the resume check.")
    ] = False,
    check_only: Annotated[
        bool, Flag("--check-only", help="Only the resume check: is the prefix still resumable?")
    ] = False,
    model: c.ModelOpt = None,
    timeout: c.TimeoutOpt = 1800.0,
    profile: c.ProfileOpt = None,
    restore: Annotated[
        bool,
        Flag(
            "--restore",
            help="llama.cpp: restore the prefix's KV snapshot for the worker's current build"
            " and prove it with a fresh tail pinned to that slot; when there is none, or it"
            " does not resume, a normal warm follows (see `prefixreg snapshot`).",
        ),
    ] = False,
    slot_dir: c.SlotDirOpt = None,
    public: Annotated[
        bool,
        Flag(
            "--public",
            help="With --json: drop the worker address, model id and host-identifying build"
            " fields (refused without --json).",
        ),
    ] = False,
    metrics_file: c.MetricsOpt = None,
    copies: Annotated[
        int,
        Flag(
            help="llama.cpp: also warm and prove a copy in this many slots, one per "
            "concurrent loop call (exit 1 when one is not resumed).",
            min=1,
        ),
    ] = 1,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Warm a prefix on a worker, then prove with a fresh tail that the worker resumes it.

    The prefix's bytes are verified first; on a mismatch nothing is sent (exit 3). One
    measurement record is written, bound to the server build read from /health. Exit 0
    resumed, 1 cold or partial, 4 unverified evidence, 5 worker error. With --restore: exit
    0 when the snapshot is proven `restored`, else the normal warm that follows decides;
    3 when the snapshot file changed (no restore sent); 2 a server without a slot API.
    """
    from prefixreg.verbs.measure.metrics import check_metrics_path
    from prefixreg.verbs.measure.slots import warm_with_copies
    from prefixreg.verbs.measure.warm import check_warm_options
    from prefixreg.verbs.snapshot.warmrestore import warm_restore

    with c.cli_errors(debug):
        check_warm_options(
            public=public,
            json_out=json_out,
            no_check=no_check,
            check_only=check_only,
            restore=restore,
            slot_dir=slot_dir,
        )
        check_metrics_path(metrics_file)
        reg = c.open_registry_from(registry)
        head = reg.head(ref)  # resolved and verified once, before a connection is opened
        progress = c.progress_for(json_out)
        with c.open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
            if restore:
                c.finish(json_out, warm_restore(reg, head, w, slot_dir=slot_dir, progress=progress))
            result = warm_with_copies(
                reg,
                head,
                w,
                check=not no_check,
                send_warm=not check_only,
                copies=copies,
                public=public,
                progress=progress,
            )
        c.write_metrics_file(metrics_file, result.warm.metrics())
        c.finish(json_out, result)


def doctor_command(
    worker: c.WorkerOpt = None,
    profile: c.ProfileOpt = None,
    loops: Annotated[
        int, Flag(help="llama.cpp: concurrent loop calls the slots must hold.", min=1)
    ] = 1,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Say what a worker's /health and /cache tell about its prompt cache, and what to change.

    With the registry it also weighs Cmax, the best that this build's probe receipts prove,
    against the registered prefixes' token spans; Cmax under 4,000 tokens is urgent. On
    llama.cpp it weighs the slots against --loops and names --cache-ram. Exit 0
    when nothing needs changing, 1 when a finding says what to change, 5 worker error.
    """
    from prefixreg.verbs.doctor.run import doctor

    with c.cli_errors(debug):
        reg = c.open_registry_from(registry)
        with c.open_worker(worker, model=None, timeout=30.0, profile=profile) as w:
            diagnosis = doctor(w, reg, loops=loops)
        c.emit(json_out, diagnosis.receipt(w.url), diagnosis.text(w.url))
        c.exit_with(diagnosis.outcome)


@contextmanager
def _progress_bar(
    enabled: bool,
) -> Iterator[tuple[Callable[[str, int], None] | None, Callable[[str], None] | None]]:
    """On a terminal's stderr: a progress bar (the leg being measured) and a way to print a
    line above it (a leg's result, the estimate); neither elsewhere."""
    if not enabled:
        yield None, None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True, highlight=False), transient=True) as bar:
        task = bar.add_task("probe", total=None)

        def step(label: str, n: int) -> None:
            bar.update(task, advance=n, description=f"probe: {label}")

        def say(line: str) -> None:
            bar.console.print(line, markup=False, soft_wrap=True)

        yield step, say


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
    bisect: Annotated[
        bool,
        Flag(
            "--bisect",
            help="Then narrow Cmax between the largest size that resumed and the next that "
            "did not (two calls a step, to within 2%).",
        ),
    ] = False,
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
    --foreign foreign prompts. Cmax is a bracket: at least the largest count a fresh tail
    resumed, below the first larger size that did not; --bisect narrows it with sizes in
    between. Each leg is a registered probe slice and a measurement bound to
    the server build; the run is written to probes/<ts>.json and probes/<ts>.md.

    Exit 0 every leg verified and no check failed beyond the lag explanation; 1 a check
    failed; 2 bad options (sizes over the worker's context, a --frame's tools counted; a
    --corpus that is not a regular file or is too large; a --frame that names a prefix); 3 a
    --frame that fails verification (nothing sent); 4 evidence unverified (a leg, a survival
    trial, or counter checks that could compare nothing); 5 worker error; 7 another probe
    holds the lock.
    """
    from prefixreg.verbs.probe.run import probe_inputs, probe_options, run_probe

    with c.cli_errors(debug):
        parsed, text = probe_inputs(sizes, corpus, public=public, json_out=json_out)
        reg = c.open_registry_from(registry)
        options = probe_options(
            reg,
            parsed,
            text,
            frame=frame,
            legs=legs,
            foreign=foreign,
            foreign_chars=foreign_chars,
            survival=survival,
            force=force,
            bisect=bisect,
        )
        with (
            c.open_worker(worker, model=model, timeout=timeout, profile=profile) as w,
            _progress_bar(sys.stderr.isatty()) as (step, say),
        ):
            report = run_probe(reg, w, options, progress=step, say=say)
        c.emit(json_out, report.to_dict(public=public), report.text())
        c.exit_with(report.outcome)


def _placed(reg: Registry, heads: list[Head], pool: Path) -> dict[str, list[Head]]:
    """The heads by the pool worker that holds each (its placement; UsageError: unplaced):
    the pool verb's answer, asked here because one verb never imports another."""
    from prefixreg.verbs.pool.live import Pool
    from prefixreg.verbs.pool.spec import pool_spec

    groups: dict[str, list[Head]] = {}
    with Pool(pool_spec((), pool_file=pool), reg) as live:
        for head in heads:
            groups.setdefault(live.assignment(head).worker, []).append(head)
    return groups


def keepalive_command(
    refs: Annotated[list[str], typer.Argument(help="Prefixes or frames (names or shas).")],
    worker: c.WorkerOpt = None,
    interval: Annotated[
        float | None, Flag(help="Seconds between re-warms without /cache (default 60).")
    ] = None,
    budget: Annotated[
        int | None,
        Flag(
            help="Stores (llama.cpp: prompts) a just-used head survives (default: the latest "
            "probe --survival for this build, else max_entries less the entries per request; "
            "llama.cpp: 1, a re-warm after every foreign prompt).",
            min=1,
        ),
    ] = None,
    duration: Annotated[
        str | None, Flag(help="Stop after this long (30s, 10m, 2h); default: Ctrl-C.")
    ] = None,
    poll: Annotated[float, Flag(help="Seconds between counter polls.")] = 0.5,
    metrics_file: c.MetricsOpt = None,
    session: Annotated[
        Path | None,
        Flag(
            help="A file the loop appends each request body to (one JSON line per call, "
            "after it returns): keep the loop's latest request warm, not only its head."
        ),
    ] = None,
    pool: Annotated[
        Path | None,
        Flag(
            help="A pool file: keep each head on the worker that holds it (its placement "
            "from `pool warm`), one keeper per worker."
        ),
    ] = None,
    copies: Annotated[
        int,
        Flag(
            help="llama.cpp: keep each head in this many slots, one per concurrent loop call.",
            min=1,
        ),
    ] = 1,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Keep heads resumable under foreign traffic, using the server's own counters.

    It polls /cache (llama.cpp: /slots, else /metrics), counts stores (prompts) since each
    head was last used, and re-warms a head before one more foreign prompt could evict it;
    servers with neither are re-warmed on a time interval. A frame keeps its whole head
    warm. A re-warm is kept only when the judge says resumed; one that comes back partial
    or cold tightens the budget. Every re-warm is recorded as a measurement. With --session
    it re-touches the loop's latest request (head and history) instead. When re-warms
    spend more prefill than they keep warm, it backs off and says why. On llama.cpp a call
    that resumed a head in its slot is a use, an evicted head is restored from its snapshot
    (else left to the loop, never re-prefilled), and more heads than slots are refused.

    Ctrl-C, SIGTERM (a systemd stop) or --duration stops it and prints the summary;
    --metrics-file gets its counters after every re-warm and at the end. Exit 0 when
    stopped normally after at least one re-warm whose counts the judge could read; 5 when
    repeated worker errors stopped it, or none succeeded and worker errors were why; 4 when
    none succeeded and the server never reported the counts; 1 when something else stopped
    it (a measurement that could not be written); 2 a bad argument (an interval that is not
    finite seconds above 0, a --session that is a FIFO, ...).
    """
    from functools import partial

    from prefixreg.verbs.keepalive.keepers import keep_heads, parse_duration
    from prefixreg.verbs.measure.metrics import check_metrics_path

    with c.cli_errors(debug):
        seconds = None if duration is None else parse_duration(duration)
        check_metrics_path(metrics_file)
        reg = c.open_registry_from(registry)
        heads = [reg.head(ref) for ref in refs]  # resolved and verified once, before sending
        groups = _placed(reg, heads, pool) if pool else {c.resolve_worker_url(worker): heads}
        run = keep_heads(
            reg,
            groups,
            duration_s=seconds,
            say=c.info,
            progress=None if json_out else c.info,
            metrics=partial(c.write_metrics_file, metrics_file),
            pooled=pool is not None,
            budget=budget,
            interval_s=interval,
            poll_s=poll,
            session=session,
            copies=copies,
        )
        c.finish(json_out, run, note=run.note)
