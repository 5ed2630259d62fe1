"""Lifecycle commands: `migrate` (move a registry, verified) and `gc` (remove debris).

Data goes to stdout (`--json` for machines): stale references as `file:line: text`, one line
per removed file; the summary goes to stderr. Exit codes (DESIGN §5): a refused target 2, a
registry that does not verify 3, a held lock 7.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from prefixreg.cli import _common as c

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
        from prefixreg.registry.location import display_path
        from prefixreg.registry.migrate import migrate_registry

        progress = c.progress_for(json_out)
        report = migrate_registry(
            old, to, scan=scan or (), dry_run=dry_run, repoint=repoint, progress=progress
        )
        if json_out:
            c.emit_json(report.to_dict())
        for change in [] if json_out else report.repointed:
            if dry_run:
                sys.stdout.write(change.diff)
            else:
                c.info(f"repointed {display_path(Path(change.path))} ({change.lines} lines)")
        for ref in [] if json_out else report.stale:
            sys.stdout.write(f"{ref.path}:{ref.line}: {ref.text}\n")
        for warning in report.warnings:
            c.info(f"warning: {warning}")
        source, target = display_path(Path(report.source)), display_path(Path(report.target))
        verb, checked = ("would move", "") if dry_run else ("moved", " verified")
        if report.method != "none":
            moved = f"{verb} {source} -> {target} by {report.method}: {report.objects} objects"
            legacy = f", {report.legacy} legacy records kept as they are" if report.legacy else ""
            kept = f", kept as yours: {', '.join(report.kept)}" if report.kept else ""
            c.info(f"{moved}{checked}, {report.files} files{legacy}{kept}")
        if scan:
            where = ", ".join(map(str, scan))
            todo = "; repoint them to the new location" if report.stale else ""
            c.info(f"{len(report.stale)} references to {source} left under {where}{todo}")


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

        grace_s = parse_grace(grace)
        report = collect_garbage(
            c.open_registry_from(registry),
            grace_s=grace_s,
            prune_unnamed=prune_unnamed,
            prune_snapshots=prune_snapshots,
            dry_run=dry_run,
        )
        if json_out:
            c.emit_json(report.to_dict())
        done = "would remove" if dry_run else "removed"
        for item in [] if json_out else report.removed:
            sys.stdout.write(f"{done} {item.kind:<6} {item.path}\n")
        kinds = ("stray", "frame", "object", "meta", "snapshot")
        count = {k: sum(i.kind == k for i in report.removed) for k in kinds}
        removed = "dry run: would remove" if dry_run else "removed"
        files = f"{count['stray']} stray temp files, {count['frame']} unnamed frames"
        files += f", {count['object']} unnamed objects"
        snaps = f", {count['snapshot']} snapshot records" if prune_snapshots else ""
        kept = "" if prune_unnamed else "; unnamed objects are kept without --prune-unnamed"
        c.info(f"{removed} {files}, {count['meta']} meta records{snaps} (grace {grace}){kept}")


def register(app: typer.Typer) -> None:
    """Add the lifecycle commands to `app`."""
    app.command("migrate")(migrate_command)
    app.command("gc")(gc_command)
