"""The `prefixreg` Typer app and the per-command console scripts.

Each command module under `prefixreg.cli` exposes `register(app)`; this module only wires
them together. Start-up is kept close to importing typer itself:

- `COMMAND_MODULES` maps each command to the module that registers it, so running a
  command (`prefixreg add`, `prefix-add`) imports that one module and builds only that
  command (typer builds a command by inspecting every parameter's annotation, about 2 ms
  each); no other command module, and no verb, is imported;
- the top-level `--help` (or no arguments, or an unknown name) builds parameterless
  stand-ins that carry each command's help;
- command modules import the library inside their functions.

Standard streams: a closed stdout (`prefixreg ls >&-`) is a usage error (exit 2, one line on
stderr) before anything runs, since a command's data would be lost; a closed stdin is an
error only for a command that reads it (`prefixreg add - <&-`: exit 2, one line); a closed
stderr only silences messages (exit codes still tell). File descriptors 0-2 are held on
/dev/null meanwhile, so no file opened later can take their place.
"""

from __future__ import annotations

import importlib
import io
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Annotated, Any, Final

import typer

HELP = (
    "A content-addressed registry of LLM prompt prefixes, and the tools that make "
    "an inference server's prompt cache resume them.\n\n"
    "Exit codes: 0 ok, 1 the answer is no, 2 usage (also: stdout closed), "
    "3 integrity, 4 unverified evidence, 5 worker error, 6 mirror failure, 7 lock timeout."
)
_SETTINGS: dict[str, Any] = {
    "add_completion": False,
    "pretty_exceptions_enable": False,
    "rich_markup_mode": None,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}
# Command -> the module under prefixreg.cli that registers it, in the order `--help` lists
# them. tests/test_cli_startup.py checks it against what the modules register.
COMMAND_MODULES: Final[dict[str, str]] = {
    "add": "store_cmds",
    "cat": "store_cmds",
    "show": "store_cmds",
    "ls": "store_cmds",
    "name": "store_cmds",
    "names": "store_cmds",
    "verify": "store_cmds",
    "frame": "frame_cmd",
    "warm": "warm_cmd",
    "doctor": "doctor_cmd",
    "probe": "probe_cmd",
    "keepalive": "keepalive_cmd",
    "audit": "audit_cmd",
    "pool": "pool_cmd",
    "snapshot": "snapshot_cmd",
    "mirror": "mirror",
    "migrate": "lifecycle",
    "gc": "lifecycle",
    "sim": "sim",
    "demo": "demo_cmd",
}
EXIT_USAGE: Final = 2


# Every command that prints a verdict points to the one rule behind it.
JUDGE_NOTE: Final = (
    "Verdicts come from one judge, from the server's own numbers: see the README's "
    "'Evidence: the one judge' (prefixreg.judge)."
)
_JUDGED: Final = frozenset(
    {"warm", "doctor", "probe", "keepalive", "audit", "pool", "snapshot", "mirror"}
)


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"prefixreg.cli.{name}")


def _register(module: str, app: typer.Typer) -> None:
    """Register a command module's commands on `app`, the judge's note on those that judge."""
    _module(module).register(app)
    for info in app.registered_commands:
        if info.name in _JUDGED and info.epilog is None:
            info.epilog = JUDGE_NOTE
    for group in app.registered_groups:
        if group.name in _JUDGED and group.typer_instance is not None:
            for sub in group.typer_instance.registered_commands:
                sub.epilog = sub.epilog or JUDGE_NOTE


def _print_version(value: bool) -> None:
    if value:
        from prefixreg.core.version import package_version

        sys.stdout.write(f"prefixreg {package_version()}\n")
        raise typer.Exit(0)


def _new_app() -> typer.Typer:
    new = typer.Typer(name="prefixreg", help=HELP, no_args_is_help=True, **_SETTINGS)

    @new.callback()
    def _main(
        version: Annotated[
            bool,
            typer.Option(
                "--version",
                help="Print the version and exit.",
                is_eager=True,
                callback=_print_version,
            ),
        ] = False,
    ) -> None:
        # A callback keeps this a command group even when it holds a single command.
        pass

    _main.__doc__ = HELP
    return new


def full_app() -> typer.Typer:
    """The app with every command registered and built in full (imports every module)."""
    new = _new_app()
    for module in dict.fromkeys(COMMAND_MODULES.values()):
        _register(module, new)
    return new


def _stand_in(help_text: str | None) -> Callable[[], None]:
    def command() -> None:  # never run: only listed by the top-level --help
        raise typer.Exit(EXIT_USAGE)

    command.__doc__ = help_text
    return command


def app_for(argv: Sequence[str]) -> typer.Typer:
    """An app holding just what `argv` needs: the one command it names, built in full, or
    (for `--help`, no arguments or an unknown name) stand-ins listing every command."""
    name = next((a for a in argv if not a.startswith("-")), None)
    lean = _new_app()
    if name in COMMAND_MODULES:
        scratch = typer.Typer()
        _register(COMMAND_MODULES[name], scratch)
        lean.registered_commands = [i for i in scratch.registered_commands if i.name == name]
        lean.registered_groups = [g for g in scratch.registered_groups if g.name == name]
        return lean
    full = full_app()
    for info in full.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback is not None else None)
        lean.command(info.name)(_stand_in(doc))
    for group in full.registered_groups:  # `pool`: a command with subcommands
        sub = group.typer_instance
        lean.command(group.name)(_stand_in(None if sub is None else str(sub.info.help)))
    order = list(COMMAND_MODULES)
    lean.registered_commands.sort(key=lambda i: order.index(i.name) if i.name in order else 0)
    return lean


class _ClosedInput(io.RawIOBase):
    """Standard input when descriptor 0 was closed: reading it is a usage error."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        from prefixreg.core.errors import UsageError

        raise UsageError("standard input is closed", hint="give a FILE, or redirect stdin")


def guard_stdio() -> None:
    """Hold closed descriptors 0-2 on /dev/null, then refuse to run without stdout
    (exit 2), make a read of a closed stdin a usage error, and drop messages to a closed
    stderr."""
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
        raise SystemExit(EXIT_USAGE)
    if "input" in closed:
        sys.stdin = io.TextIOWrapper(io.BufferedReader(_ClosedInput()))


def run() -> None:
    """Entry point of `prefixreg`."""
    guard_stdio()
    app_for(sys.argv[1:])(prog_name="prefixreg")


def _single(module: str, command: str, prog_name: str) -> None:
    """Run one command as its own program (`prefix-add` is `prefixreg add`)."""
    guard_stdio()
    single = typer.Typer(**_SETTINGS)
    single.command(epilog=JUDGE_NOTE if command != "add_command" else None)(
        getattr(_module(module), command)
    )
    single(prog_name=prog_name)


def run_add() -> None:
    """Entry point of `prefix-add`."""
    _single("store_cmds", "add_command", "prefix-add")


def run_warm() -> None:
    """Entry point of `prefix-warm`."""
    _single("warm_cmd", "warm_command", "prefix-warm")


def run_mirror() -> None:
    """Entry point of `prefix-mirror`."""
    _single("mirror", "mirror_command", "prefix-mirror")


def __getattr__(name: str) -> Any:
    # `prefixreg.cli.main.app`, the full app, built on first use only (start-up cost).
    if name == "app":
        return full_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
