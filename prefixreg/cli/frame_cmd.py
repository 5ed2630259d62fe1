"""`prefixreg frame`: register a frame (system prefix + tools + prompt settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prefixreg.cli import _common as c
from prefixreg.core.errors import UsageError


def _settings(pairs: list[str]) -> dict[str, object]:
    """`--set KEY=JSON` pairs: a bare word is a string; a value is never empty, never a
    non-finite number, and a key is given once."""
    from prefixreg.core.errors import CorruptRecordError
    from prefixreg.core.jsonio import loads  # lazily: `--help` lists every command

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value.strip():
            raise UsageError(f"--set {pair!r}: use KEY=JSON (e.g. tool_choice='\"auto\"')")
        if key in out:
            raise UsageError(f"--set {key} is given twice; a setting has one value")
        try:
            out[key] = loads(value, exact=True)
        except CorruptRecordError as exc:
            if value.strip()[:1] in set('[{"-0123456789') or value in ("NaN", "Infinity"):
                raise UsageError(f"--set {key}: {exc}") from None
            out[key] = value  # a bare word is a string: tool_choice=auto
    return out


def frame_command(
    system: Annotated[str, typer.Argument(help="The system prefix: a name or sha.")],
    tools: Annotated[
        Path | None,
        typer.Option("--tools", help="A JSON file with the tools list, stored as exact bytes."),
    ] = None,
    settings: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="A prompt setting KEY=JSON (tool_choice, enable_thinking, reasoning_effort, "
            "chat_template_kwargs, parallel_tool_calls, preserve_thinking); repeatable.",
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Point this name at the frame.")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Move --name even when it now points at a bare prefix.")
    ] = False,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Register a frame: the head a loop sends (system prefix, tools, prompt settings).

    Prints the frame's sha256 (of its record, `frames/<sha>.json`). Exit 0 ok; 2 usage (bad
    tools JSON, unknown setting, bad name or reference); 3 integrity (a part fails
    verification: nothing written, nothing sent).
    """
    from prefixreg.registry.fsutil import read_user_file

    with c.cli_errors(debug):
        reg = c.open_registry_from(registry)
        data = None if tools is None else read_user_file(tools)
        sha = reg.add_frame(
            system, tools=data, settings=_settings(settings or []), name=name, force=force
        )
        c.emit(json_out, {"frame": sha, "name": name}, f"{sha}\n")
