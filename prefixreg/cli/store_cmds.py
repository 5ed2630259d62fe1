"""Registry commands: add, cat, show, ls, name, names, verify.

Each command parses its options, calls one `Registry` method and renders the result.
The library is imported inside the functions so `--help` stays cheap.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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
    read_user_file,
)

if TYPE_CHECKING:
    from prefixreg.core.records import Measurement
    from prefixreg.registry.store import Registry

__all__ = ["add_command", "register"]


def add_command(
    file: Annotated[str, typer.Argument(help="File to add, or - for standard input.")],
    name: Annotated[
        str | None, typer.Option("--name", "-n", help="Point this name at the prefix.")
    ] = None,
    note: Annotated[
        str | None, typer.Option("--note", help="A note kept in the meta record.")
    ] = None,
    registry: RegistryOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Add a prefix (exact bytes, valid UTF-8) and print its sha256. Idempotent."""
    with cli_errors(debug):
        from prefixreg.registry.store import check_text

        if note is not None:
            check_text(note, "--note")  # before reading anything: nothing is written
        if file == "-":
            data, source = sys.stdin.buffer.read(), "stdin"
        else:
            data, source = read_user_file(Path(file)), _label(Path(file).name)
        reg = open_registry_from(registry)
        sha = reg.add(data, name=name, note=note, source=source)
        sys.stdout.write(sha + "\n")


def _label(filename: str) -> str:
    """A file name as a source label that is always valid text: bytes that are not UTF-8
    (kept by the OS as surrogate escapes) are shown as \\xNN escapes."""
    return os.fsencode(filename).decode("utf-8", errors="backslashreplace")


def _safe(text: str) -> str:
    """`text` with control characters (ANSI escapes, newlines, ...) shown as escapes, so
    a note, source or name can never move the cursor, recolour or forge a line."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )


def cat_command(
    ref: Annotated[str, typer.Argument(help="A name, a sha256, or 8+ hex digits of one.")],
    registry: RegistryOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Write the verified bytes of a prefix to stdout, byte for byte."""
    with cli_errors(debug):
        data = open_registry_from(registry).get_bytes(ref)
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def _measurement_line(m: Measurement, current_build: str | None) -> str:
    body = m.body
    verdict = body.get("verdict", "?")
    cached, prompt = body.get("cached_tokens"), body.get("prompt_tokens")
    mark = "" if current_build is None or m.build.build_id == current_build else " (older build)"
    if body.get("interleaved") is True:
        mark += " (interleaved: not a clean measurement)"
    return (
        f"  {m.at}  {m.kind:<8} {verdict!s:<10} cached {cached}/{prompt}"
        f"  build {m.build.build_id}{mark}"
    )


def show_command(
    ref: Annotated[str, typer.Argument(help="A name, a sha256, or 8+ hex digits of one.")],
    worker: Annotated[
        str | None,
        typer.Option(
            "--worker",
            help="Read the worker's current build from /health and mark measurements taken "
            "on other builds (default: the newest measured build counts as current).",
        ),
    ] = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show a prefix's metadata, names and measurements (after verifying its bytes)."""
    with cli_errors(debug):
        reg = open_registry_from(registry)
        prefix = reg.get(ref)
        meta = reg.meta(prefix.sha256)
        names = sorted(n for n, s in reg.names().items() if s == prefix.sha256)
        measurements = reg.measurements(prefix.sha256)
        latest_build = measurements[-1].build.build_id if measurements else None
        if worker is not None:
            from prefixreg.server.worker import Worker

            with Worker(worker) as w:
                latest_build = w.server_build().build_id
        if json_out:
            emit_json(
                {
                    "sha256": prefix.sha256,
                    "path": str(reg.object_path(prefix.sha256)),
                    "meta": meta.to_dict(),
                    "names": names,
                    "current_build": latest_build,
                    "measurements": [m.to_dict() for m in measurements],
                }
            )
            return
        out = [
            f"sha256   {prefix.sha256}",
            f"bytes    {meta.bytes}",
            f"created  {meta.created}",
            f"source   {_safe(meta.source)}",
            f"names    {_safe(', '.join(names)) if names else '-'}",
            f"path     {reg.object_path(prefix.sha256)}",
        ]
        if meta.note:
            out.append(f"note     {_safe(meta.note)}")
        if measurements:
            current = [m for m in measurements if m.build.build_id == latest_build]
            source = "from the worker" if worker is not None else "newest measured"
            out.append(f"current build {latest_build} ({source})")
            # A measurement foreign calls interleaved with proves little: prefer a clean one.
            clean = [m for m in current if m.body.get("interleaved") is not True]
            if clean:
                out.append("latest on the current build:")
                out.append(_measurement_line(clean[-1], latest_build))
            elif current:
                out.append("latest on the current build (no clean measurement):")
                out.append(_measurement_line(current[-1], latest_build))
            else:
                out.append("no measurement on the current build; older builds' figures:")
            out.append(f"measurements ({len(measurements)}, newest last):")
            out.extend(_measurement_line(m, latest_build) for m in measurements[-10:])
        sys.stdout.write("\n".join(out) + "\n")


def ls_command(
    show_all: Annotated[
        bool, typer.Option("--all", "-a", help="Also list probe slices (marked 'probe').")
    ] = False,
    probe: Annotated[bool, typer.Option("--probe", help="List only probe slices.")] = False,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """List prefixes: sha, size, creation time, names, note.

    The slices a probe registered are hidden (a named one is shown: its name makes it
    yours); the count hidden goes to stderr. --all lists them too, --probe only them.
    """
    with cli_errors(debug):
        reg = open_registry_from(registry)
        everything = reg.list_objects()
        if probe:
            objects = [o for o in everything if o.probe_slice]
        elif show_all:
            objects = everything
        else:
            objects = [o for o in everything if not o.probe_slice or o.names]
        hidden = len(everything) - len(objects)
        if json_out:
            emit_json(
                [
                    {
                        "sha256": o.sha256,
                        "bytes": o.bytes,
                        "created": o.created,
                        "names": list(o.names),
                        "note": o.note,
                        "probe_slice": o.probe_slice,
                    }
                    for o in objects
                ]
            )
        else:
            for o in objects:
                size = "?" if o.bytes is None else str(o.bytes)
                names = _safe(",".join(o.names)) or "-"
                note = f"  {_safe(o.note)}" if o.note else ""
                mark = "  [probe]" if o.probe_slice else ""
                sys.stdout.write(
                    f"{o.sha256[:12]}  {size:>9}  {(o.created or '?')[:19]}  {names}{mark}{note}\n"
                )
        if hidden and not probe:
            what = "probe slice" if hidden == 1 else "probe slices"
            info(f"{hidden} {what} hidden (ls --all lists them, ls --probe only them)")


def name_command(
    name: Annotated[str, typer.Argument(help="The name to set or move.")],
    ref: Annotated[str, typer.Argument(help="The prefix it should point to.")],
    expect: Annotated[
        str | None,
        typer.Option(
            "--expect",
            help="Only move if the name now points to this sha (or 'none'): compare-and-swap.",
        ),
    ] = None,
    registry: RegistryOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Point NAME at a prefix (journalled in names.log)."""
    with cli_errors(debug):
        reg = open_registry_from(registry)
        kwargs: dict[str, Any] = {}
        if expect is not None:
            kwargs["expect"] = None if expect.lower() == "none" else reg.resolve(expect)
        move = reg.move_name(name, ref, **kwargs)
        if move is None:
            info(f"{name} already points to {reg.resolve(ref)}")
        else:
            info(f"{name}: {move.from_sha or '(new)'} -> {move.to_sha}")


def names_command(
    log: Annotated[bool, typer.Option("--log", help="Show the journal of name moves.")] = False,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """List names and the sha each points to (or the move journal with --log)."""
    with cli_errors(debug):
        reg = open_registry_from(registry)
        if log:
            moves = reg.name_log()
            if json_out:
                emit_json([m.to_dict() for m in moves])
                return
            for m in moves:
                sys.stdout.write(f"{m.at}  {_safe(m.name)}  {m.from_sha or '-'} -> {m.to_sha}\n")
            return
        names = reg.names()
        if json_out:
            emit_json(names)
            return
        for n, sha in names.items():
            sys.stdout.write(f"{sha}  {_safe(n)}\n")


def verify_command(
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="First make every name agree with names.log: complete an interrupted move "
            "(its object verifies) or journal the name's current value.",
        ),
    ] = False,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check every object, meta record, name, measurement and stray temp file.

    Exits 1 when a problem is found; stray temp files and objects without meta (left by
    interrupted writes) are reported as warnings.
    """
    with cli_errors(debug):
        from prefixreg.registry.verify import repair_registry, verify_registry

        reg: Registry = open_registry_from(registry)
        report = repair_registry(reg) if repair else verify_registry(reg)
        if json_out:
            emit_json(report.to_dict())
        else:
            for done in report.repaired:
                sys.stdout.write(f"repaired {_safe(done)}\n")
            for f in report.findings:
                line = f"{f.severity:<8} {f.kind:<12} {f.path}: {f.message}"
                sys.stdout.write(_safe(line) + "\n")
            info(
                f"{'ok' if report.ok else 'PROBLEMS FOUND'}: {report.objects} objects, "
                f"{report.meta} meta, {report.names} names, {report.measurements} measurements"
                f"; {sum(f.severity == 'problem' for f in report.findings)} problems, "
                f"{sum(f.severity == 'warning' for f in report.findings)} warnings"
            )
        if not report.ok:
            raise typer.Exit(int(ExitCode.NO))


def register(app: typer.Typer) -> None:
    """Add the registry commands to `app`."""
    app.command("add")(add_command)
    app.command("cat")(cat_command)
    app.command("show")(show_command)
    app.command("ls")(ls_command)
    app.command("name")(name_command)
    app.command("names")(names_command)
    app.command("verify")(verify_command)
