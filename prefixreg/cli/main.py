"""The `prefixreg` Typer app and the per-command console scripts.

Each command module under `prefixreg.cli` names a command `<name>_command` (a group
`<name>_app`). Start-up stays close to importing typer itself: running a command (`prefixreg
add`, `prefix-add`) imports only the module `COMMAND_MODULES` names and builds only that
command (typer inspects every parameter's annotation, about 2 ms each), no verb; the
top-level `--help` (or no arguments, or an unknown name) builds parameterless stand-ins
carrying each command's help. Command modules import the library inside their functions.

Standard streams: a closed stdout is a usage error (exit 2, one line on stderr) before
anything runs, since a command's data would be lost; a closed stdin is an error only for a
command that reads it (exit 2, one line); a closed stderr only silences messages (exit codes
still tell). Descriptors 0-2 are held on /dev/null meanwhile, so no file opened later can
take their place.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Final

import typer

from prefixreg.cli._common import APP_SETTINGS, ExitCode
from prefixreg.core.errors import UsageError

HELP = (
    "A content-addressed registry of LLM prompt prefixes, and the tools that make "
    "an inference server's prompt cache resume them.\n\n"
    "Exit codes: 0 ok, 1 the answer is no, 2 usage (also: stdout closed), "
    "3 integrity, 4 unverified evidence, 5 worker error, 6 mirror failure, 7 lock timeout."
)
# Command -> the module under prefixreg.cli that registers it, in the order `--help` lists
# them. tests/test_cli_main.py checks it against what the modules define.
COMMAND_MODULES: Final[dict[str, str]] = {
    **dict.fromkeys(("add", "cat", "show", "ls", "name", "names", "verify"), "store_cmds"),
    "frame": "loop_cmds",
    **dict.fromkeys(("warm", "doctor", "probe", "keepalive"), "worker_cmds"),
    "audit": "loop_cmds",
    "pool": "fleet_cmds",
    "snapshot": "snapshot_cmd",
    "mirror": "fleet_cmds",
    **dict.fromkeys(("migrate", "gc"), "lifecycle"),
    **dict.fromkeys(("sim", "demo"), "sim"),
    "gateway": "gateway_cmd",
}


# Every command that prints a verdict points to the one rule behind it.
JUDGE_NOTE: Final = (
    "Verdicts come from one judge, from the server's own numbers: see the README's "
    "'Evidence: the one judge' (prefixreg.judge)."
)
_JUDGED: Final = {
    *("warm", "doctor", "probe", "keepalive", "audit", "pool", "snapshot", "mirror", "gateway"),
}


def _found(name: str) -> tuple[Any, typer.Typer | None]:
    """Command `name` in its module: `<name>_command`, or `<name>_app` for a command group."""
    found = vars(importlib.import_module(f"prefixreg.cli.{COMMAND_MODULES[name]}"))
    return found.get(f"{name}_command"), found.get(f"{name}_app")


def _register(app: typer.Typer, name: str) -> None:
    """Add command `name` to `app`, with the judge's note if it judges."""
    command, group = _found(name)
    epilog = JUDGE_NOTE if name in _JUDGED else None
    if group is None:
        app.command(name, epilog=epilog)(command)
        return
    app.add_typer(group, name=name)
    for sub in group.registered_commands:
        sub.epilog = sub.epilog or epilog


def _print_version(value: bool) -> None:
    if value:
        from prefixreg.core.version import package_version

        sys.stdout.write(f"prefixreg {package_version()}\n")
        raise typer.Exit(0)


def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", is_eager=True, callback=_print_version
        ),
    ] = False,
) -> None:
    """The app's callback: it keeps the app a command group even with a single command."""


def _stand_in() -> None:
    """Never run: a command's stand-in, only listed by the top-level --help."""
    raise typer.Exit(ExitCode.USAGE)


def app_for(argv: Sequence[str]) -> typer.Typer:
    """An app holding just what `argv` needs: the one command it names, built in full, or
    (for `--help`, no arguments or an unknown name) stand-ins listing every command."""
    name = next((a for a in argv if not a.startswith("-")), None)
    app = typer.Typer(name="prefixreg", help=HELP, no_args_is_help=True, **APP_SETTINGS)
    app.callback()(_main)
    if name in COMMAND_MODULES:
        _register(app, name)
        return app
    for each in COMMAND_MODULES:  # every command module imported, for its help
        command, group = _found(each)
        doc = command.__doc__ if group is None else str(group.info.help)
        app.command(each, help=doc)(_stand_in)
    return app


class _ClosedInput(io.RawIOBase):
    """Standard input when descriptor 0 was closed: reading it is a usage error."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise UsageError("standard input is closed", hint="give a FILE, or redirect stdin")


def guard_stdio() -> None:
    """Hold closed descriptors 0-2 on /dev/null, then guard each stream as the module says."""
    closed = []
    for fd, stream in ((0, "input"), (1, "output"), (2, "error")):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(stream)
            # The lowest free descriptor is this one: a later open() can no longer land
            # on it and have our output written into, say, an object's temp file.
            os.open(os.devnull, os.O_RDWR)
    if "error" in closed:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 -- /dev/null, for the process
    if "output" in closed:
        sys.stderr.write("error: standard output is closed\n")
        sys.stderr.flush()
        raise SystemExit(ExitCode.USAGE)
    if "input" in closed:
        sys.stdin = io.TextIOWrapper(io.BufferedReader(_ClosedInput()))


def run() -> None:
    """Entry point of `prefixreg`."""
    guard_stdio()
    app_for(sys.argv[1:])(prog_name="prefixreg")


def _single(name: str) -> None:
    """Run one command as its own program (`prefix-add` is `prefixreg add`)."""
    guard_stdio()
    single = typer.Typer(**APP_SETTINGS)
    _register(single, name)
    single(prog_name=f"prefix-{name}")


# The console scripts `prefix-add`, `prefix-warm` and `prefix-mirror` (pyproject.toml).
run_add = functools.partial(_single, "add")
run_warm = functools.partial(_single, "warm")
run_mirror = functools.partial(_single, "mirror")
