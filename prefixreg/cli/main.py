"""The `prefixreg` Typer app and the per-command console scripts.

Each command module under `prefixreg.cli` exposes `register(app)`; this module only wires
them together. Command modules import the library lazily inside their functions so that
`prefixreg --help` costs little more than importing typer itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from prefixreg.cli import (
    audit_cmd,
    demo_cmd,
    keepalive_cmd,
    probe_cmd,
    sim,
    store_cmds,
    worker_cmds,
)

__all__ = ["app", "run", "run_add", "run_warm"]

app = typer.Typer(
    name="prefixreg",
    help=(
        "A content-addressed registry of LLM prompt prefixes, and the tools that make "
        "an inference server's prompt cache resume them.\n\n"
        "Exit codes: 0 ok, 1 the answer is no, 2 usage, 3 integrity, 4 unverified evidence, "
        "5 worker error, 6 mirror failure, 7 lock timeout."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

for _module in (store_cmds, worker_cmds, probe_cmd, keepalive_cmd, audit_cmd, sim, demo_cmd):
    _module.register(app)


def run() -> None:
    """Entry point of `prefixreg`."""
    app()


def _single(command: Callable[..., Any], prog_name: str) -> None:
    """Run one command as its own program (`prefix-add` is `prefixreg add`)."""
    single = typer.Typer(
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    single.command()(command)
    single(prog_name=prog_name)


def run_add() -> None:
    """Entry point of `prefix-add`."""
    _single(store_cmds.add_command, "prefix-add")


def run_warm() -> None:
    """Entry point of `prefix-warm`."""
    _single(worker_cmds.warm_command, "prefix-warm")
