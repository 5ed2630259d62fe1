"""`prefixreg sim`: the Halogen-compatible simulator in the foreground; `prefixreg demo`: the main
job run on it in-process, reported in the simulated server's own numbers. `sim` has one option per
`SimConfig` field, from its metadata (`prefixreg.sim.config.knob`): named after it, typed by its
default, with its help; None (the profile's default) unless the field names a ``cli_default``;
``env`` names a fallback variable. Typer builds them with the command, and the library is imported
inside the functions, so registering it (`prefixreg --help`) imports no simulator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from prefixreg.cli import _common as c

if TYPE_CHECKING:
    from prefixreg.sim import SimConfig
    from prefixreg.verbs.measure.warm import WarmResult
    from prefixreg.verbs.probe.run import ProbeReport

_KW = inspect.Parameter.KEYWORD_ONLY
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Do not print a line per request.")]


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def option_help(f: dataclasses.Field[Any]) -> str:
    """A field's help text, ending with its default: ``Default: 8 (measured; dense: 3).``"""
    notes = [f.metadata["note"]] if f.metadata["note"] else []
    if "dense" in f.metadata:
        notes.append(f"dense: {_shown(f.metadata['dense'])}")
    shown = f.metadata.get("shown") or _shown(f.metadata.get("cli_default", f.default))
    tail = f" ({'; '.join(notes)})" if notes else ""
    return f"{f.metadata['help']} Default: {shown}{tail}."


def _option(f: dataclasses.Field[Any]) -> inspect.Parameter:
    from prefixreg.sim.config import kind_of

    kind, name = kind_of(f.default), f.name.replace("_", "-")
    decls = f"--{name}/--no-{name}" if kind is bool else f"--{name}"
    option = typer.Option(decls, help=option_help(f), show_default=False)
    hint: Any = Annotated[kind | None, option]
    return inspect.Parameter(f.name, _KW, default=f.metadata.get("cli_default"), annotation=hint)


class _SimCommand:
    """Run a Halogen-compatible worker simulator in the foreground until Ctrl-C.

    It serves /health, /cache, /metrics, /v1/models, /v1/chat/completions and /v1/completions on
    127.0.0.1 and models the prompt cache measured on the Halogen Flash lane (API 0.7.0). A peer for
    demos and tests, not a measurement of Halogen. --engine vllm|sglang|trtllm|ollama answers as
    that engine over the same cache model (no /cache; see --engine, --cache-report).

    Tokens: calibrated so the probe corpus's 4k/16k/32k/64k-character slices give the lane's
    2,593/11,374/21,337/43,538 prompt tokens (about 1.5 characters a token).

    Time model (fitted to the lane's probe; every duration divided by --speed): the u uncached
    tokens of an n-token prompt prefill in min(u x step(n), prefill-setup-s + u / prefill-tps)
    seconds, step(n) = step-ms + n/1000 x step-ms-per-kctx milliseconds; decode takes tokens /
    decode-tps. Defaults give cold 3.38/9.79/17.06/33.26 s at the four sizes, an identical repeat
    0.16-0.19 s and a fresh tail 0.41-0.47 s (measured: 3.38/9.81/17.16/33.26, 0.12-0.19, 0.4-0.69).

    Wall: a snapshot of t tokens needs t x token-bytes of its slab (cap-mb MiB when set, else
    entry-bytes); one the slab cannot take is refused (/cache refused).
    """

    # The `sim` callback (its docstring is the command's help). Typer reads its signature when
    # it builds the command: made from `SimConfig` then, not when the command is registered.

    def __init__(self) -> None:
        self.__annotations__: dict[str, Any] = {}  # typer's hints are in the signature

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        from prefixreg.sim.config import SimConfig

        own = [("quiet", QuietOpt), ("debug", c.DebugOpt)]  # not simulator fields
        params = [inspect.Parameter(name, _KW, default=False, annotation=a) for name, a in own]
        return inspect.Signature([*map(_option, dataclasses.fields(SimConfig)), *params])

    def __call__(self, *, quiet: bool, debug: bool, **options: Any) -> None:
        with c.cli_errors(debug):
            from prefixreg.sim import SimConfig, SimServer

            config = SimConfig.from_options(**options)
            server = SimServer.listening(config, log=None if quiet else c.info)
            c.info(_banner(config, server.url))
            server.serve_forever(say=c.info)


def _banner(config: SimConfig, url: str) -> str:
    """The line `sim` prints once it listens: the profile or engine, speed, key, address."""
    auth = ", API key required" if config.api_key else ""
    shown = config.profile if config.engine is None else config.engine
    shown += ", cache report off" if config.engine and not config.cache_report else ""
    head = f"prefixreg sim ({shown}, speed {config.speed:g}{auth})"
    return f"{head} listening on {url}  (Ctrl-C to stop)"


sim_command = _SimCommand()
SAMPLE_NAME = "coding-agent"
SAMPLE_SOURCE = "examples/system-prompt.txt"


def sample_prompt() -> bytes:
    """`examples/system-prompt.txt` from a checkout, or its copy packaged in a wheel."""
    checkout = Path(__file__).resolve().parents[2] / "examples" / "system-prompt.txt"
    if checkout.is_file():
        return checkout.read_bytes()
    return (resources.files("prefixreg") / "_examples" / "system-prompt.txt").read_bytes()


def text_report(root: Path, warm: WarmResult, probe: ProbeReport) -> str:
    """What each step did, in the simulated server's own numbers."""
    lines = [
        "prefixreg demo: add -> warm -> probe on the built-in Halogen simulator",
        "",
        f"1. add    {warm.prefix.name} {warm.prefix.sha256[:16]} ({warm.prefix.size:,} bytes)",
    ]
    cold = next((call.evidence for call in warm.calls if call.phase == "warm"), None)
    if cold is not None and warm.check is not None:
        check = warm.check.evidence
        speedup = (
            f", {cold.wall_s / check.wall_s:.0f}x faster" if cold.wall_s and check.wall_s else ""
        )
        lines += [
            f"2. warm   cold call: {cold.prompt_tokens:,} prompt tokens, "
            f"{cold.cached_tokens} cached, {cold.wall_s or 0:.3f} s",
            f"         resume check with a fresh tail: {check.cached_tokens:,} of "
            f"{check.prompt_tokens:,} tokens cached ({check.cached_source}), "
            f"{check.wall_s or 0:.3f} s{speedup}",
            f"         verdict: {warm.verdict.upper()} ({warm.reason})",
        ]
    status = ", ".join(
        f"{k.number} {k.per_call if k.per_call == k.windowed else k.windowed + f' (lag {k.lag})'}"
        for k in probe.checks
    )
    lines += [
        f"3. probe  Cmax {'at least ' if probe.cmax_floor else ''}{probe.cmax:,} tokens; "
        f"a prefix survives {probe.survival} foreign prompts",
        f"         counter checks: {status}",
        *(f"         - {line}" for line in probe.follows()),
        "",
        f"registry {root}",
        f"records  {root / 'measurements'} and {probe.md_path}",
        f"next     prefixreg show {warm.prefix.name} --registry {root}",
    ]
    return "\n".join(lines) + "\n"


def demo_command(
    registry: Annotated[
        Path | None,
        typer.Option("--registry", help="Registry to use (default: a fresh temporary directory)."),
    ] = None,
    speed: Annotated[
        float,
        typer.Option(
            "--speed", help="Simulator time compression (1 = the measured lane).", min=0.01
        ),
    ] = 100.0,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Show the main job in a minute: start a simulated Halogen worker in-process, add the
    sample system prompt, warm it, prove it resumes, run a short probe, and stop."""
    from prefixreg.verbs.probe.run import run_demo

    say = c.info if not json_out else _silent
    with c.cli_errors(debug):
        start = functools.partial(_simulated, speed, say)
        demo = run_demo(
            registry, sample_prompt(), start, name=SAMPLE_NAME, source=SAMPLE_SOURCE, say=say
        )
        c.emit(json_out, demo.receipt(), text_report(demo.root, demo.warm, demo.probe))
        c.exit_with(demo.outcome)


def _silent(message: str) -> None:
    """`--json`: the steps are not reported."""


@contextlib.contextmanager
def _simulated(speed: float, say: Callable[[str], None]) -> Iterator[str]:
    """A simulated Halogen worker in-process (Flash lane defaults): its URL while it runs."""
    from prefixreg.sim import SimConfig, SimServer

    with SimServer(SimConfig(speed=speed)) as sim:
        say(f"started the simulated Halogen worker at {sim.url} (Flash lane defaults, x{speed:g})")
        yield sim.url
