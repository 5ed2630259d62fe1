"""`prefixreg qualify`: parse, call the verb (`verbs.qualify.run.qualify`), render, exit.

Exit codes come from the one table (`_common`): 0 qualified, 1 not qualified (the receipt is
written either way), 2 bad arguments (nothing sent), 5 `/health` or the first request failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from typer import Option as Flag

from prefixreg.cli import _common as c


def qualify_command(
    output: Annotated[
        Path,
        Flag(
            help="Write the receipt here (JSON, replaced atomically, also on failure). It holds "
            "hashes, counters, timings, phases and settings only: no endpoint, model, path, "
            "prompt or output text."
        ),
    ],
    worker: c.WorkerOpt = None,
    model: c.ModelOpt = None,
    tokens: Annotated[int, Flag(help="Reply limit (max_tokens) of every request.", min=1)] = 64,
    repeats: Annotated[
        int, Flag(help="Identical requests sent one after another after the first.", min=1)
    ] = 2,
    streams: Annotated[
        int, Flag(help="Identical requests then sent at once (overlapping).", min=1, max=64)
    ] = 4,
    require_cold: Annotated[
        bool,
        Flag(
            "--require-cold",
            help="The first request must be cold: a complete reply and an explicit, valid zero "
            "cached count (a missing count is not zero).",
        ),
    ] = False,
    require_reuse: Annotated[
        bool,
        Flag(
            "--require-reuse",
            help="Every repeated request must report 0 < cached <= prompt tokens.",
        ),
    ] = False,
    prompt_file: Annotated[
        Path | None,
        Flag(
            help="The prompt: a UTF-8 text file, or a JSON array of token IDs from the model's "
            "own tokenizer (a file starting with '['), sent as a token prompt (Halogen dense "
            "and Ollama take only text: exit 2; an engine that refuses it: exit 5). Default: "
            "a built-in public text fixture whose token length depends on the tokenizer."
        ),
    ] = None,
    expected_prompt_tokens: Annotated[
        int | None,
        Flag(help="Every request's server-reported prompt count must be exactly this.", min=1),
    ] = None,
    seed: Annotated[
        int, Flag(help="The seed every request sends (greedy: temperature 0).", min=0)
    ] = 1234,
    timeout: c.TimeoutOpt = 1800.0,
    profile: c.ProfileOpt = None,
    registry: Annotated[
        Path | None,
        Flag(help="Also record one measurement per phase, bound to the build, in this registry."),
    ] = None,
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Qualify a server's prompt cache: a first request, --repeats identical ones in sequence,
    then --streams at once, each judged by the strict evidence rules.

    Per request: prompt, cached and completion tokens as the server counts them, the cache
    state (cold: a complete reply with an explicit valid zero; reused: 0 < cached <= prompt;
    else unverified, with why), the token fingerprint when reported, the output fingerprint,
    time to first token and decode rate. Each later reply's fingerprints are compared with
    the first's: pass, differ or unverified (a token hash missing on either side is
    unverified, never a pass; equal text is not equal tokens). No warm-up; nothing is cleared
    or restarted. `qualified` means every request completed with output, every assertion
    asked held, and no fingerprint differed: not a model certification, not a RAM sizing.
    Exit 0 qualified, 1 not (receipt written), 2 bad arguments, 5 worker error.
    """
    from prefixreg.verbs.qualify.run import qualify

    with c.cli_errors(debug):
        reg = None if registry is None else c.open_registry_from(registry)
        with c.open_worker(worker, model=model, timeout=timeout, profile=profile) as w:
            result = qualify(
                w,
                tokens=tokens,
                repeats=repeats,
                streams=streams,
                require_cold=require_cold,
                require_reuse=require_reuse,
                prompt_file=prompt_file,
                seed=seed,
                output=output,
                expected_prompt_tokens=expected_prompt_tokens,
                registry=reg,
                progress=c.progress_for(json_out),
            )
        c.finish(json_out, result)
