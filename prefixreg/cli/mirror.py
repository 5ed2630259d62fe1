"""`prefixreg mirror` / `prefix-mirror`: one-way verified rsync to the workers.

One summary line per destination on stderr as it finishes, its content word the report's
(`judge_copy`'s verdict); `--json` prints the report on stdout. `prefixreg.verbs.mirror` is
imported inside the command so `--help` stays cheap.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli import _common as c

if TYPE_CHECKING:
    from prefixreg.verbs.mirror import DestinationResult


def _summary(r: DestinationResult) -> str:
    """The one stderr line per destination; the content word is the judge's verdict."""
    content = f"{r.content} ({r.hashed} objects hashed there"
    content += f", {r.changed_in_place} changed in place)" if r.changed_in_place else ")"
    if r.result == "dry-run":
        new = " (new mirror)" if r.new else ""
        return f"dry-run {r.destination}: {len(r.changes)} changes{new}, content {content}"
    if not r.ok:
        reason = r.error or r.result
        return (
            f"error: {reason}" if r.destination in reason else f"error: {r.destination}: {reason}"
        )
    rounds = f", {r.rounds} rounds" if r.rounds > 1 else ""
    return (
        f"ok      {r.destination}: sent {r.sent} files ({r.bytes:,} bytes), deleted "
        f"{r.deleted}, {content}{rounds}, {r.seconds:.2f}s"
    )


def mirror_command(
    to: Annotated[
        list[str] | None,
        typer.Option(
            "--to",
            help="Destination PATH or [user@]HOST:PATH (repeatable; default: "
            "$PREFIXREG_MIRROR_TO, space-separated). Its parent directory must exist.",
            show_default=False,
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
        typer.Option(
            "--ssh-option",
            help="An ssh option as Key=Value (repeatable; also $PREFIXREG_SSH_OPTS).",
            show_default=False,
        ),
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
        from prefixreg.core.errors import MirrorError, RegistryLocationError
        from prefixreg.verbs.mirror import ENV_SSH_OPTS, ENV_TO, mirror

        # Space-separated in the environment; flags first (ssh keeps the first value).
        destinations = to or os.environ.get(ENV_TO, "").split()
        options = [*(ssh_option or []), *os.environ.get(ENV_SSH_OPTS, "").split()]
        try:
            reg = c.open_registry_from(registry)
        except RegistryLocationError as exc:
            # An unmarked source is a refused mirror (exit 6), not a usage slip.
            raise MirrorError(f"source is not a registry: {exc}", hint=exc.hint) from None
        report = mirror(
            reg,
            destinations,
            dry_run=dry_run,
            full_verify=full_verify,
            ssh_options=options,
            bwlimit=bwlimit,
            on_result=lambda r: c.info(_summary(r)),
        )
        if json_out:
            c.emit_json(report.to_dict())
        elif dry_run:
            for r in report.results:
                if r.ok:
                    sys.stdout.write(f"# {r.destination}\n")
                    sys.stdout.writelines(f"{change}\n" for change in r.changes)
            sys.stdout.flush()
        if not report.ok:
            # Each failure already has its line on stderr (and is listed in --json).
            raise typer.Exit(int(c.ExitCode.MIRROR))
