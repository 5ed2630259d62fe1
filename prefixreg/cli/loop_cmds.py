"""The commands around an agent loop's head: `frame` registers it (system prefix, tools,
prompt settings); `audit PATH...` accounts tokens and time over the loop's call outputs, judges
each call against the head it sends, and names each request's system prefix by byte identity.
Each command's help gives its exit codes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prefixreg.cli import _common as c
from prefixreg.core.errors import CorruptRecordError, UsageError


def _settings(pairs: list[str]) -> dict[str, object]:
    """`--set KEY=JSON` pairs: a bare word is a string; a value is never empty, never a
    non-finite number, and a key is given once."""
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
        Path | None, typer.Option(help="A JSON file with the tools list, stored as exact bytes.")
    ] = None,
    settings: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="A prompt setting KEY=JSON (tool_choice, enable_thinking, reasoning_effort, "
            "chat_template_kwargs, parallel_tool_calls, preserve_thinking); repeatable.",
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Point this name at the frame.")] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Move --name even when it now points at a bare prefix.")
    ] = False,
    messages: Annotated[
        Path | None,
        typer.Option(
            help="A JSON file with the leading messages every call sends after the system one "
            "(few-shot examples, a static first user message), stored as exact bytes: part "
            "of the head (`GET /prefixreg/heads` on a gateway proposes them)."
        ),
    ] = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Register a frame: the head a loop sends (system prefix, tools, prompt settings, and
    the leading messages it sends identically on every call).

    Prints the frame's sha256 (of its record, `frames/<sha>.json`). Exit 0 ok; 2 usage (bad
    tools JSON, unknown setting, bad name or reference, a --name that points at a bare
    prefix without --force: nothing written); 3 integrity (a part fails verification:
    nothing written, nothing sent).
    """
    from prefixreg.registry.userfiles import read_user_file

    with c.cli_errors(debug):
        reg = c.open_registry_from(registry)
        data = None if tools is None else read_user_file(tools)
        lead = None if messages is None else read_user_file(messages)
        sha = reg.add_frame(
            system,
            tools=data,
            settings=_settings(settings or []),
            name=name,
            force=force,
            messages=lead,
        )
        c.emit(json_out, {"frame": sha, "name": name}, f"{sha}\n")


def audit_command(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Files (.json: a document or a list; .jsonl/.ndjson: one per line) or "
            "directories of them (recursive; symlinks and non-regular files skipped).",
            metavar="PATH...",
            show_default=False,
        ),
    ],
    prefill_tps: Annotated[
        float | None,
        typer.Option(
            help="Prefill tok/s (0.001 to 10,000,000) for calls without server timings "
            "[default: 1180]."
        ),
    ] = None,
    decode_tps: Annotated[
        float | None,
        typer.Option(
            help="Decode tok/s (0.001 to 10,000,000) for calls without server timings "
            "[default: 60]."
        ),
    ] = None,
    frame: Annotated[
        str | None,
        typer.Option(
            help="A frame or prefix (name or sha): judge in-line calls against it; name "
            "each request's drift from it and the cold calls after."
        ),
    ] = None,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Also write the report as one self-contained HTML page with plots (needs "
            "the report extra: pip install 'prefixreg[report]').",
            metavar="FILE",
        ),
    ] = None,
    registry: c.RegistryOpt = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Count prompt, cached and completion tokens over a batch of call outputs, model its
    prefill and decode time (default rates: the measured Halogen Flash lane), say what
    caching saved (tokens and seconds against a cold run: the server's timings where given,
    else the rates), where the uncached tokens went (new history, the previous call's prompt
    of the same session not resumed, drift from --frame, misses of the head) and so whether
    caching is the lever, and which registered head it shares.

    Reads chat responses (bare, or under `response`/`body`, a `wall_s` beside them), request
    bodies, `{"request", "response"}` pairs, call-log lines (`prefixreg-call`, what
    `Session(call_log=)` writes), measurement records and aiperf's per-request
    exports (`profile_export.jsonl`, `profile_export_raw.jsonl`: wall time is then the
    batch's span, with its concurrency); a line or .json document over 16 MiB is skipped.
    Each call is reused, partial, cold or unverified: reused only when its cached count
    covers the span of the head it sends (its request's bytes, its record's head, or for a
    response read alone the batch's head). The batch's head is named by byte identity (each
    request's `messages[0].content` hashed and looked up), else by the measured span most
    calls cover.

    Exit 0 at least one call or request was read (malformed inputs, skipped files and lines,
    unverified calls are listed, not fatal); 2 nothing readable, bad rates, or a --frame
    that names nothing; 3 a registry record, object or the --frame (or one of its parts)
    fails verification (the store fails closed).
    """
    with c.cli_errors(debug):
        from prefixreg.verbs.audit.run import audit_paths

        report = audit_paths(
            paths,
            registry=registry,
            frame=frame,
            html=html,
            prefill_tps=prefill_tps,
            decode_tps=decode_tps,
            say=c.info,
        )
        c.emit(json_out, report.to_dict(), report.to_text())
