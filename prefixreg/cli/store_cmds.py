"""Registry commands: add, cat, show, ls, name, names, verify.

Each resolves a reference once (`Registry.head`: a verified prefix or frame; whatever takes a
prefix takes a frame), calls one library function (the registry; `verbs.show` for what `show`
and `ls` present; `registry.verify.check_registry`) and renders its typed result; `verify`'s
exit code comes from `EXIT_BY_OUTCOME`. The helpers here only render. Files the user names
are read by `userfiles.read_user_file` (regular files only, size-capped). The library is
imported inside the functions so `--help` stays cheap.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli import _common as c

if TYPE_CHECKING:
    from prefixreg.core.records import Measurement
    from prefixreg.registry.objects import ObjectInfo
    from prefixreg.registry.verify import VerifyReport
    from prefixreg.verbs.show import ShowView

SHOWN = 10  # measurements `show` lists as text, newest; --json lists every one

RefArg = Annotated[
    str, typer.Argument(help="A prefix or frame: a name, a sha256, or 8+ hex digits of one.")
]


def _safe(text: str) -> str:
    """`text`, control characters escaped: it cannot move the cursor, recolour or forge a line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def add_command(
    file: Annotated[str, typer.Argument(help="File to add, or - for standard input.")],
    name: Annotated[str | None, typer.Option("--name", "-n", help="Point this name at it.")] = None,
    note: Annotated[str | None, typer.Option("--note", help="A note for its meta record.")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Move --name even when it now points at a frame.")
    ] = False,
    registry: c.RegistryOpt = None,
    debug: c.DebugOpt = False,
) -> None:
    """Add a prefix (exact bytes, valid UTF-8) and print its sha256. Idempotent.

    A --name that points at a frame is refused (exit 2, nothing written) unless --force.
    """
    with c.cli_errors(debug):
        from prefixreg.registry.objects import check_text
        from prefixreg.registry.userfiles import read_user_file

        if note is not None:
            check_text(note, "--note")  # before reading anything: nothing is written
        data = read_user_file(file)  # a regular file (or stdin), size-capped
        # A file name as a label that is always valid text: bytes that are not UTF-8 (kept by
        # the OS as surrogate escapes) are shown as \xNN escapes.
        label = os.fsencode(Path(file).name).decode("utf-8", errors="backslashreplace")
        reg = c.open_registry_from(registry)
        source = "stdin" if file == "-" else label
        sha = reg.add(data, name=name, note=note, source=source, force=force)
        sys.stdout.write(sha + "\n")


def cat_command(ref: RefArg, registry: c.RegistryOpt = None, debug: c.DebugOpt = False) -> None:
    """Write a prefix's verified bytes to stdout, byte for byte; a frame's head as JSON
    (its system text, tools in their own key order, and settings)."""
    with c.cli_errors(debug):
        from prefixreg.core.frame import Frame
        from prefixreg.core.jsonio import dumps_ordered

        head = c.open_registry_from(registry).head(ref)
        data = head.system.data
        if isinstance(head, Frame):
            parts = {"system": head.system.text, "tools": head.tools, "settings": head.settings}
            if head.lead:
                parts["messages"] = head.lead
            data = (dumps_ordered(parts) + "\n").encode()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def _measurement_line(m: Measurement, current_build: str | None) -> str:
    out = m.outcome
    # "other", never "older": a build measured on another worker may be newer than this one.
    mark = "" if current_build is None or m.build.build_id == current_build else " (other build)"
    if out.interleaved:
        mark += " (interleaved: not a clean measurement)"
    hits = f"cached {out.cached_tokens}/{out.prompt_tokens}"
    return f"  {m.at}  {m.kind:<8} {out.verdict or '?':<10} {hits}  build {m.build.build_id}{mark}"


def show_command(
    ref: RefArg,
    worker: Annotated[
        str | None,
        typer.Option(
            "--worker",
            help="Read the worker's current build from /health and mark measurements taken "
            "on other builds (default: $PREFIXREG_WORKER; with neither, no build is called "
            "current: the newest measured one is shown as that).",
        ),
    ] = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Show a prefix's or a frame's metadata, names and measurements (after verifying it)."""
    with c.cli_errors(debug):
        from prefixreg.verbs.show import show_view

        env_worker = os.environ.get("PREFIXREG_WORKER")
        view = show_view(c.open_registry_from(registry), ref, worker=worker, env_worker=env_worker)
        if view.note is not None:
            c.info(f"note: {view.note}")
        if json_out:
            c.emit_json(view.to_dict())
        else:
            sys.stdout.write(_show_text(view))


def _show_text(view: ShowView) -> str:
    """`show`'s text: its rows, the judged build and measurements, then legacy records."""
    out = [f"{key:<8} {_safe(value)}" for key, value in view.rows.items()]
    if view.measurements:
        if view.from_worker:
            out.append(f"current build {view.build} (from the worker)")
            build = "the current build"
        else:
            why = "no worker asked: --worker or PREFIXREG_WORKER says which build is current"
            out.append(f"newest measured build {view.build} ({why})")
            build = "the newest measured build"
        if view.latest is not None:
            what = "" if view.latest_clean else " (no clean measurement)"
            out.append(f"latest on {build}{what}:")
            out.append(_measurement_line(view.latest, view.build))
        else:
            out.append(f"no measurement on {build}; other builds' figures:")
        out.append(f"measurements ({len(view.measurements)}, newest last):")
        if len(view.measurements) > SHOWN:
            hidden = len(view.measurements) - SHOWN
            out.append(f"  ({hidden} older not shown; show --json lists every one)")
        out.extend(_measurement_line(m, view.build) for m in view.measurements[-SHOWN:])
    if view.legacy:  # the person's own records from before the adoption, as they wrote them
        out.append(f"legacy records ({len(view.legacy)}, byte-identical, listed in legacy.json):")
        out.extend(f"  {_safe(_legacy_line(rel, raw))}" for rel, raw in view.legacy)
    return "\n".join(out) + "\n"


def _legacy_line(rel: str, raw: bytes) -> str:
    """`path: key value, ...` of a legacy JSON object (nested values as compact JSON), else
    the path and its first line."""
    from prefixreg.core.jsonio import dumps_ordered
    from prefixreg.verbs.show import legacy_dict

    record = legacy_dict(rel, raw).get("record")
    if isinstance(record, dict):
        pairs = (f"{k} {v if isinstance(v, str) else dumps_ordered(v)}" for k, v in record.items())
        return f"{rel}: {', '.join(pairs)}"
    first = raw.decode("utf-8", "replace").splitlines()[:1]
    return f"{rel}: {first[0][:200] if first else ''}"


def ls_command(
    show_all: Annotated[bool, typer.Option("--all", "-a", help="Also list probe slices.")] = False,
    probe: Annotated[bool, typer.Option("--probe", help="List only probe slices.")] = False,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """List prefixes and frames: sha, kind, size, creation time, names, note.

    A frame's tools object is kind `tools`, its note naming the frame that holds it (gc
    --prune-unnamed removes it only with that frame).

    The slices a probe registered are hidden (a named one is shown: its name makes it
    yours); the count hidden goes to stderr. --all lists them too, --probe only them.
    """
    with c.cli_errors(debug):
        from prefixreg.verbs.show import list_view

        view = list_view(c.open_registry_from(registry), show_all=show_all, probe=probe)
        if json_out:
            c.emit_json(view.to_dict())
        else:  # one write: a large registry lists at its disk's pace
            sys.stdout.write("".join(map(_ls_line, view.rows)))
        if view.hidden:
            what = "probe slice" if view.hidden == 1 else "probe slices"
            c.info(f"{view.hidden} {what} hidden (ls --all lists them, ls --probe only them)")


def _ls_line(o: ObjectInfo) -> str:
    """One row of `ls`: sha, kind, size, creation time, names, probe mark, note."""
    size = "-" if o.bytes is None else str(o.bytes)
    names = _safe(",".join(o.names)) or "-"
    note = f"  {_safe(o.note)}" if o.note else ""
    mark = "  [probe]" if o.probe_slice else ""
    created = (o.created or "?")[:19]
    return f"{o.sha256[:12]}  {o.kind:<6}  {size:>9}  {created}  {names}{mark}{note}\n"


def name_command(
    name: Annotated[str, typer.Argument(help="The name to set or move.")],
    ref: Annotated[str, typer.Argument(help="The prefix or frame it should point to.")],
    expect: Annotated[
        str | None, typer.Option("--expect", help="Move only if it holds this sha (or 'none').")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Move a name from a prefix to a frame, or back.")
    ] = False,
    registry: c.RegistryOpt = None,
    debug: c.DebugOpt = False,
) -> None:
    """Point NAME at a prefix or a frame (journalled in names.log)."""
    with c.cli_errors(debug):
        from prefixreg.registry.names import UNSET

        reg = c.open_registry_from(registry)
        was: object = UNSET
        if expect is not None:
            was = None if expect.lower() == "none" else reg.resolve(expect)
        if (move := reg.move_name(name, ref, expect=was, force=force)) is None:
            c.info(f"{name} already points to {reg.resolve(ref)}")
        else:
            c.info(f"{name}: {move.from_sha or '(new)'} -> {move.to_sha}")


def names_command(
    log: Annotated[bool, typer.Option("--log", help="Show the journal of name moves.")] = False,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """List names and the sha each points to (or the move journal with --log)."""
    with c.cli_errors(debug):
        reg = c.open_registry_from(registry)
        if log:
            moves = reg.name_log()
            if json_out:
                c.emit_json([m.to_dict() for m in moves])
            for m in [] if json_out else moves:
                sys.stdout.write(f"{m.at}  {_safe(m.name)}  {m.from_sha or '-'} -> {m.to_sha}\n")
            return
        names = reg.names()
        if json_out:
            c.emit_json(names)
        for n, sha in [] if json_out else names.items():
            sys.stdout.write(f"{sha}  {_safe(n)}\n")


def verify_command(
    repair: Annotated[
        bool, typer.Option("--repair", help="First cut torn journal tails, settle name moves.")
    ] = False,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Check every object, meta record, name, frame, measurement and stray temp file.

    Exits 1 when a problem is found, 2 when there is no registry at the path (a typo must
    not pass as an empty registry); stray temp files and objects without meta (left by
    interrupted writes) are reported as warnings. Repairs (--repair): cut a torn journal
    tail; complete an interrupted name move whose target verifies, else journal the name's
    current value.
    """
    with c.cli_errors(debug):
        from prefixreg.registry.verify import check_registry

        report = check_registry(c.open_registry_from(registry), repair=repair)
        if json_out:
            c.emit_json(report.to_dict())
        else:
            sys.stdout.write(_verify_text(report))
            c.info(_verify_summary(report))
        c.exit_with(report.outcome)


def _verify_text(report: VerifyReport) -> str:
    """`verify`'s findings on stdout: each repair, then each finding, one a line."""
    lines = [f"repaired {_safe(done)}\n" for done in report.repaired]
    for f in report.findings:
        lines.append(_safe(f"{f.severity:<8} {f.kind:<12} {f.path}: {f.message}") + "\n")
    return "".join(lines)


def _verify_summary(report: VerifyReport) -> str:
    """`verify`'s verdict line for stderr: what was checked, problems and warnings."""
    problems = sum(f.severity == "problem" for f in report.findings)
    counts = f"{report.objects} objects, {report.meta} meta, {report.names} names"
    found = f"{problems} problems, {len(report.findings) - problems} warnings"
    verdict = "ok" if report.ok else "PROBLEMS FOUND"
    return f"{verdict}: {counts}, {report.measurements} measurements; {found}"


def register(app: typer.Typer) -> None:
    """Add the registry commands to `app`."""
    commands = (add_command, cat_command, show_command, ls_command, name_command, names_command)
    for command in (*commands, verify_command):
        app.command(command.__name__.removesuffix("_command"))(command)
