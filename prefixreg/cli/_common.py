"""What every command shares: the error-to-exit-code table, stderr messages, `--json` output,
the options several commands take.

This is the one place that maps errors to exit codes (DESIGN §5). Commands run their body
inside `cli_errors(debug)`: a `PrefixregError` becomes `error: <message>` (and a hint line)
on stderr and the mapped exit code; no traceback unless `--debug`. Data goes to stdout,
messages to stderr. Only `prefixreg.cli` imports typer.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Protocol

import typer

from prefixreg.core import errors

if TYPE_CHECKING:
    from prefixreg.registry.store import Registry
    from prefixreg.server.worker import Worker
    from prefixreg.verbs.measure.metrics import Metrics


class ExitCode(IntEnum):
    """The exit-code table of DESIGN §5."""

    OK = 0
    NO = 1
    USAGE = 2
    INTEGRITY = 3
    UNVERIFIED = 4
    WORKER = 5
    MIRROR = 6
    LOCK_TIMEOUT = 7
    INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 + the signal's number, as a shell reports it


# Most specific first: IntegrityError must win over any broader class it may share.
EXIT_CODES: tuple[tuple[type[errors.PrefixregError], ExitCode], ...] = (
    (errors.IntegrityError, ExitCode.INTEGRITY),
    (errors.UsageError, ExitCode.USAGE),
    (errors.EvidenceUnverifiedError, ExitCode.UNVERIFIED),
    (errors.WorkerError, ExitCode.WORKER),
    (errors.MirrorError, ExitCode.MIRROR),
    (errors.LockTimeoutError, ExitCode.LOCK_TIMEOUT),
)
# Outcomes the verbs report (a typed result's `outcome`), mapped here with the errors': the
# one table a command's exit code comes from (`exit_with`).
EXIT_BY_OUTCOME: dict[str, ExitCode] = {
    **dict.fromkeys(
        ("resumed", "warmed", "ok", "healthy", "qualified", "restored", "done"), ExitCode.OK
    ),
    **dict.fromkeys(
        ("partial", "cold", "check_failed", "unhealthy", "not_qualified", "failed"), ExitCode.NO
    ),
    "unverified": ExitCode.UNVERIFIED,
    "worker_error": ExitCode.WORKER,
    "mirror_failed": ExitCode.MIRROR,
    # clif: `snapshot ship` where a destination's build has no snapshot of the head.
    "no_snapshot": ExitCode.NO,
    # clis: `verify` found a problem (warnings alone are "ok")
    "problems": ExitCode.NO,
    # cliw: a restore not proven (`snapshot restore`), a keeper stopped by something else
    **dict.fromkeys(("not_restored", "stopped"), ExitCode.NO),
}
# The settings of every Typer app and command group the CLI builds.
APP_SETTINGS: dict[str, Any] = {
    "add_completion": False,
    "pretty_exceptions_enable": False,
    "rich_markup_mode": None,
    "context_settings": {"help_option_names": ["-h", "--help"]},
}

# An option's flag is its parameter's name: `registry: RegistryOpt` is `--registry`.
RefArg = Annotated[str, typer.Argument(help="A name, a sha256, or 8+ hex digits of one.")]


def _note_registry(value: Path | None) -> Path | None:
    """`--registry` as parsed, remembered before the command runs: no output it names may
    land inside that registry (`userfiles.check_output_file`), made yet or not."""
    if value is not None:
        from prefixreg.registry.userfiles import note_registry

        note_registry(value.expanduser())
    return value


RegistryOpt = Annotated[
    Path | None,
    typer.Option(
        help="Registry directory (default: $PREFIXREG_HOME, else XDG state directory).",
        callback=_note_registry,
    ),
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
WorkerOpt = Annotated[
    str | None, typer.Option(help="Worker base URL (default: $PREFIXREG_WORKER).")
]
ModelOpt = Annotated[
    str | None,
    typer.Option(help="Model id to send (default: the server's; generic: first id of /v1/models)."),
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        help="Seconds to await a chat reply (a large cold prefill takes minutes).", min=0.1
    ),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option(
        help="Force the server profile: halogen, llamacpp, vllm, sglang, trtllm, ollama or "
        "generic (default: detected from what the server answers, never from its port)."
    ),
]
SlotDirOpt = Annotated[
    Path | None,
    typer.Option(
        help="The server's --slot-save-path as seen from here, where the snapshot file is "
        "hashed (snapshot save: required; a restore, also warm --restore: re-checked, nothing "
        "sent on a mismatch; default the directory recorded at save)."
    ),
]
MetricsOpt = Annotated[
    Path | None,
    typer.Option(
        help="Also write Prometheus metrics to this file (node_exporter textfile format, "
        "replaced atomically), e.g. /var/lib/node_exporter/textfile/prefixreg.prom."
    ),
]


def info(message: str) -> None:
    """A message for the person at the shell: stderr, never stdout."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def write_metrics_file(path: Path | None, metrics: Metrics) -> None:
    """Write `--metrics-file` (None: not asked). One that cannot be written (a full disk) is a
    warning naming it: the command's outcome decides its exit code, not the file."""
    if path is None:
        return
    from prefixreg.verbs.measure.metrics import write_metrics

    try:
        write_metrics(path, metrics)
    except OSError as exc:
        info(f"warning: --metrics-file {path} not written: {exc.strerror or exc}")


def progress_for(json_out: bool) -> Callable[[str], None] | None:
    """Where long work reports its steps: stderr when it is a terminal and no JSON is asked."""
    return info if sys.stderr.isatty() and not json_out else None


@contextmanager
def cli_errors(debug: bool) -> Iterator[None]:
    """Turn an error into `error: <message>` (and a `hint:` line) on stderr and its exit code:
    a prefixreg error's from `EXIT_CODES`, 1 for one not listed there and for an OSError."""
    try:
        yield
    except KeyboardInterrupt:
        info("interrupted")
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    except BrokenPipeError:
        # stdout closed early (`prefixreg cat x | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(int(ExitCode.OK)) from None
    except (errors.PrefixregError, OSError) as exc:
        if debug:
            traceback.print_exc()
        if isinstance(exc, errors.PrefixregError):
            code = next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), ExitCode.NO)
            message, hint = str(exc), exc.hint
        else:
            code, hint = ExitCode.NO, None
            message = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
        info(f"error: {message}")
        if hint:
            info(f"hint: {hint}")
        raise typer.Exit(int(code)) from None


def exit_with(outcome: str) -> NoReturn:
    """End the command with the exit code `EXIT_BY_OUTCOME` maps `outcome` to."""
    raise typer.Exit(int(EXIT_BY_OUTCOME[outcome]))


def emit_json(value: Any) -> None:
    """Write `value` as indented JSON on stdout."""
    from prefixreg.core.jsonio import dumps_pretty

    sys.stdout.buffer.write(dumps_pretty(value))
    sys.stdout.flush()


def emit(json_out: bool, value: Any, text: str) -> None:
    """The data on stdout: `value` as indented JSON with `--json`, else `text`."""
    if json_out:
        emit_json(value)
    else:
        sys.stdout.write(text)


def open_registry_from(flag: Path | None) -> Registry:
    """Open the registry named by `--registry`, `$PREFIXREG_HOME` or the XDG default."""
    from prefixreg.registry.location import migration_hint, resolve_registry_path
    from prefixreg.registry.store import Registry

    path = resolve_registry_path(flag)
    hint = migration_hint(path)  # an empty default location while ~/prefix-registry exists
    if hint is not None:
        info(f"hint: {hint}")
    return Registry(path)


def resolve_worker_url(flag: str | None) -> str:
    """The worker URL from `--worker` or `$PREFIXREG_WORKER`, or a usage error."""
    url = flag or os.environ.get("PREFIXREG_WORKER")
    if not url:
        raise errors.UsageError("no worker given", hint="pass --worker URL or set PREFIXREG_WORKER")
    return url


def open_worker(
    url: str | None, *, model: str | None, timeout: float, profile: str | None
) -> Worker:
    """A `Worker` for `--worker`/`$PREFIXREG_WORKER` (key from `$PREFIXREG_API_KEY`)."""
    from prefixreg.server.worker import Worker

    return Worker(resolve_worker_url(url), model=model, read_timeout=timeout, profile=profile)


# -- clif --


@contextmanager
def open_workers(urls: list[str], *, timeout: float, profile: str | None) -> Iterator[list[Worker]]:
    """A `Worker` for each of `urls` (in order, model the server's), all closed on the way out."""
    from contextlib import ExitStack  # here: this block leaves the module's imports alone

    with ExitStack() as stack:
        yield [
            stack.enter_context(open_worker(u, model=None, timeout=timeout, profile=profile))
            for u in urls
        ]


# -- cliw --
class Rendered(Protocol):
    """A verb's typed result as a command ends with it: JSON, text, and its outcome."""

    @property
    def outcome(self) -> str: ...

    def to_dict(self) -> Any: ...

    def text(self, exit_code: int) -> str: ...


def finish(json_out: bool, result: Rendered, *, note: str | None = None) -> NoReturn:
    """Print `result` (`--json`: its dict; else its text, told the exit code), then `note`
    (why it failed) on stderr, and end the command with the exit code its outcome maps to."""
    code = int(EXIT_BY_OUTCOME[result.outcome])
    emit(json_out, result.to_dict(), result.text(code))
    if note:
        info(note)
    raise typer.Exit(code)
