"""Lifecycle commands: `migrate` (move a registry, verified) and `gc` (remove debris).

Data goes to stdout (`--json` for machines): stale references as `file:line: text`, one line
per removed file; the summary goes to stderr. Exit codes (DESIGN §5): a refused target 2, a
registry that does not verify 3, a held lock 7.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli import _common as c

if TYPE_CHECKING:
    from prefixreg.registry.gc import GcReport
    from prefixreg.registry.migrate import MigrationReport

DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Say what would happen; change nothing.")
]


def migrate_command(
    old: Annotated[Path, typer.Argument(help="The registry to move, e.g. ~/prefix-registry.")],
    to: Annotated[
        Path | None,
        typer.Option(
            "--to", help="Where to (default: the XDG state directory).", show_default=False
        ),
    ] = None,
    scan: Annotated[
        list[Path] | None,
        typer.Option("--scan", help="List file:line under DIR still naming OLD (repeatable)."),
    ] = None,
    repoint: Annotated[
        bool,
        typer.Option(
            "--repoint",
            help="Adopt a hand-built registry (no REGISTRY.json) and repoint its README and "
            "bin/ to the new path (never a REMOTE variable or host:path).",
        ),
    ] = False,
    dry_run: DryRunOpt = False,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Move a registry to a new path (default: the standard location), verified.

    Refuses a target that holds a different registry. Every object is verified at the
    target before the old tree is removed; measurements and logs arrive byte-identical;
    the move is journalled in migrations.log at the new root. With --dry-run, each file
    --repoint would change is printed as a diff.
    """
    with c.cli_errors(debug):
        from prefixreg.registry.migrate import migrate_registry

        progress = c.progress_for(json_out)
        report = migrate_registry(
            old, to, scan=scan or (), dry_run=dry_run, repoint=repoint, progress=progress
        )
        if json_out:
            c.emit_json(report.to_dict())
        else:
            _migration_text(report)
        for line in _migration_notes(report, scan or []):
            c.info(line)


def _migration_text(report: MigrationReport) -> None:
    """What `migrate` prints without `--json`: each repointed file (a dry run's diff on
    stdout, else a line on stderr), then each stale reference as `file:line: text`."""
    from prefixreg.registry.location import display_path

    for change in report.repointed:
        if report.dry_run:
            sys.stdout.write(change.diff)
        else:
            c.info(f"repointed {display_path(Path(change.path))} ({change.lines} lines)")
    sys.stdout.write("".join(f"{ref.path}:{ref.line}: {ref.text}\n" for ref in report.stale))


def _migration_notes(report: MigrationReport, scan: list[Path]) -> list[str]:
    """`migrate`'s lines for stderr: its warnings, what moved (or would), what `--scan` left."""
    from prefixreg.registry.location import display_path

    notes = [f"warning: {warning}" for warning in report.warnings]
    source, target = display_path(Path(report.source)), display_path(Path(report.target))
    verb, checked = ("would move", "") if report.dry_run else ("moved", " verified")
    if report.method != "none":
        moved = f"{verb} {source} -> {target} by {report.method}: {report.objects} objects"
        legacy = f", {report.legacy} legacy records kept as they are" if report.legacy else ""
        kept = f", kept as yours: {', '.join(report.kept)}" if report.kept else ""
        notes.append(f"{moved}{checked}, {report.files} files{legacy}{kept}")
    if scan:
        where = ", ".join(map(str, scan))
        todo = "; repoint them to the new location" if report.stale else ""
        notes.append(f"{len(report.stale)} references to {source} left under {where}{todo}")
    return notes


def gc_command(
    dry_run: DryRunOpt = False,
    grace: Annotated[
        str,
        typer.Option("--grace", help="Only touch files older than this: 14d, 12h, 30m, 45s, 0."),
    ] = "14d",
    prune_unnamed: Annotated[
        bool,
        typer.Option(
            "--prune-unnamed",
            help="Also remove old frames, then objects, nothing refers to (--json lists "
            "each one kept, with why).",
        ),
    ] = False,
    prune_snapshots: Annotated[
        bool,
        typer.Option(
            "--prune-snapshots",
            help="Also remove snapshot records whose prefix is gone (not the snapshot files).",
        ),
    ] = False,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Remove stray temp files older than the grace period; unnamed objects only if asked.

    Takes the registry's exclusive lock. Never removes a named object or frame, one a
    snapshot record, a kept frame or a recent measurement points to, a measurement, a
    journal or anything younger than the grace period;
    snapshot records only with --prune-snapshots (and only when their prefix is gone).
    """
    with c.cli_errors(debug):
        from prefixreg.registry.gc import collect_garbage, parse_grace

        grace_s = parse_grace(grace)  # a bad --grace is refused before the registry is opened
        report = collect_garbage(
            c.open_registry_from(registry),
            grace_s=grace_s,
            prune_unnamed=prune_unnamed,
            prune_snapshots=prune_snapshots,
            dry_run=dry_run,
        )
        if json_out:
            c.emit_json(report.to_dict())
        else:
            sys.stdout.write("".join(_gc_lines(report)))
        c.info(_gc_summary(report, grace))


def _gc_lines(report: GcReport) -> list[str]:
    """One stdout line per file gc removed (or, in a dry run, would remove)."""
    done = "would remove" if report.dry_run else "removed"
    return [f"{done} {item.kind:<6} {item.path}\n" for item in report.removed]


def _gc_summary(report: GcReport, grace: str) -> str:
    """gc's summary line for stderr: how many of each kind, the grace period as given."""
    kinds = ("stray", "frame", "object", "meta", "snapshot")
    count = {k: sum(i.kind == k for i in report.removed) for k in kinds}
    removed = "dry run: would remove" if report.dry_run else "removed"
    files = f"{count['stray']} stray temp files, {count['frame']} unnamed frames"
    files += f", {count['object']} unnamed objects"
    snaps = f", {count['snapshot']} snapshot records" if report.prune_snapshots else ""
    kept = "" if report.prune_unnamed else "; unnamed objects are kept without --prune-unnamed"
    return f"{removed} {files}, {count['meta']} meta records{snaps} (grace {grace}){kept}"


def register(app: typer.Typer) -> None:
    """Add the lifecycle commands to `app`."""
    app.command("migrate")(migrate_command)
    app.command("gc")(gc_command)
