"""The `prefixreg` Typer app and the per-command console scripts.

Each command module under `prefixreg.cli` exposes `register(app)`; this module only wires
them together. Start-up is kept close to importing typer itself: command modules import
the library inside their functions, and `run()` builds only the command being run (typer
builds a command by inspecting every parameter's annotation, about 2 ms each); for the
top-level `--help` it builds parameterless stand-ins that carry each command's help.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import typer

from prefixreg.cli import (
    audit_cmd,
    demo_cmd,
    keepalive_cmd,
    lifecycle,
    mirror,
    probe_cmd,
    sim,
    snapshot_cmd,
    store_cmds,
    worker_cmds,
)

__all__ = ["app", "run", "run_add", "run_mirror", "run_warm"]

HELP = (
    "A content-addressed registry of LLM prompt prefixes, and the tools that make "
    "an inference server's prompt cache resume them.\n\n"
    "Exit codes: 0 ok, 1 the answer is no, 2 usage, 3 integrity, 4 unverified evidence, "
    "5 worker error, 6 mirror failure, 7 lock timeout."
)
_SETTINGS: dict[str, Any] = {
    "add_completion": False,
    "pretty_exceptions_enable": False,
    "rich_markup_mode": None,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}
MODULES = (
    store_cmds,
    worker_cmds,
    probe_cmd,
    keepalive_cmd,
    audit_cmd,
    mirror,
    lifecycle,
    sim,
    demo_cmd,
    snapshot_cmd,
)


def _new_app() -> typer.Typer:
    new = typer.Typer(name="prefixreg", help=HELP, no_args_is_help=True, **_SETTINGS)

    @new.callback()
    def _main() -> None:
        # A callback keeps this a command group even when it holds a single command.
        pass

    _main.__doc__ = HELP
    return new


app = _new_app()
for _module in MODULES:
    _module.register(app)


def _stand_in(help_text: str | None) -> Callable[[], None]:
    def command() -> None:  # never run: only listed by the top-level --help
        raise typer.Exit(2)

    command.__doc__ = help_text
    return command


def app_for(argv: Sequence[str]) -> typer.Typer:
    """An app holding just what `argv` needs: the one command it names, built in full, or
    (for `--help`, no arguments or an unknown name) stand-ins listing every command."""
    name = next((a for a in argv if not a.startswith("-")), None)
    infos = [info for info in app.registered_commands if info.name == name]
    lean = _new_app()
    # Command groups (`snapshot`) are built only when named or listed by --help.
    groups = [g for g in app.registered_groups if g.name == name]
    lean.registered_groups = groups or list(app.registered_groups)
    if infos or groups:
        lean.registered_commands = infos
        return lean
    for info in app.registered_commands:
        doc = info.callback.__doc__ if info.callback is not None else None
        lean.command(info.name)(_stand_in(doc))
    return lean


def run() -> None:
    """Entry point of `prefixreg`."""
    app_for(sys.argv[1:])(prog_name="prefixreg")


def _single(command: Callable[..., Any], prog_name: str) -> None:
    """Run one command as its own program (`prefix-add` is `prefixreg add`)."""
    single = typer.Typer(**_SETTINGS)
    single.command()(command)
    single(prog_name=prog_name)


def run_add() -> None:
    """Entry point of `prefix-add`."""
    _single(store_cmds.add_command, "prefix-add")


def run_warm() -> None:
    """Entry point of `prefix-warm`."""
    _single(worker_cmds.warm_command, "prefix-warm")


def run_mirror() -> None:
    """Entry point of `prefix-mirror`."""
    _single(mirror.mirror_command, "prefix-mirror")
