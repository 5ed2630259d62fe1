"""`prefixreg sim`: run the Halogen-compatible simulator in the foreground.

The defaults in the help texts are the measured Flash lane (and, where it differs, the dense
profile); `tests/test_sim_cli.py` checks them against `SimConfig`. `prefixreg.sim` is imported
inside the command so `prefixreg --help` does not pay for the HTTP server modules.
"""

from __future__ import annotations

import os
import threading
from typing import Annotated

import typer

from prefixreg.cli._common import DebugOpt, cli_errors, info

__all__ = ["register", "sim_command"]

_ENV_KEY = "PREFIXREG_SIM_API_KEY"
_HELP = (
    "Run a Halogen-compatible worker simulator in the foreground until Ctrl-C.\n\n"
    "It serves /health, /cache, /metrics, /v1/models, /v1/chat/completions and "
    "/v1/completions on 127.0.0.1 and models the prompt cache measured on the Halogen Flash "
    "lane (API 0.7.0). A peer for demos and tests, not a measurement of Halogen.\n\n"
    "Tokens: calibrated so the probe corpus's 4k/16k/32k/64k-character slices give the "
    "lane's 2,593/11,374/21,337/43,538 prompt tokens (about 1.5 characters a token).\n\n"
    "Time model (fitted to the lane's probe; every duration divided by --speed): the u "
    "uncached tokens of an n-token prompt prefill in min(u x step(n), prefill-setup-s + "
    "u / prefill-tps) seconds, step(n) = step-ms + n/1000 x step-ms-per-kctx milliseconds; "
    "decode takes tokens / decode-tps. Defaults give cold 3.38/9.79/17.06/33.26 s at the four "
    "sizes, an identical repeat 0.16-0.19 s and a fresh tail 0.41-0.47 s (measured: "
    "3.38/9.81/17.16/33.26, 0.12-0.19, 0.4-0.69).\n\n"
    "Wall: a snapshot of t tokens needs t x token-bytes of its slab (cap-mb MiB when set, "
    "else entry-bytes); one the slab cannot take is refused (/cache refused)."
)


def sim_command(
    profile: Annotated[
        str,
        typer.Option(
            "--profile",
            help="flash (the measured Halogen Flash lane, API 0.7.0) or dense (Halogen dense: "
            "2048-aligned snapshots, no timings). Default: flash.",
            show_default=False,
        ),
    ] = "flash",
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Address to bind. Default: 127.0.0.1 (loopback only).",
            show_default=False,
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(
            "--port",
            help="Port to bind; 0 picks a free one. Default: 8731 (Halogen's API port).",
            show_default=False,
        ),
    ] = 8731,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            help=f"Require 'Authorization: Bearer KEY' (401 otherwise; /health stays open). "
            f"Default: ${_ENV_KEY}, else no key.",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="Model id reported. Default: prefixreg-sim-<profile>.",
            show_default=False,
        ),
    ] = None,
    max_entries: Annotated[
        int | None,
        typer.Option(
            "--max-entries",
            help="LRU capacity in snapshots. Default: 8 (measured; dense: 3).",
            show_default=False,
        ),
    ] = None,
    entries_per_request: Annotated[
        int | None,
        typer.Option(
            "--entries-per-request",
            help="Snapshots stored per request (flash: system end, history end, then last "
            "message start, prompt end). Default: 2 (measured; dense: 1).",
            show_default=False,
        ),
    ] = None,
    snapshot_align: Annotated[
        int | None,
        typer.Option(
            "--snapshot-align",
            help="Snapshot places are rounded down to this many tokens; 0 = exact. "
            "Default: 0 (measured; dense: 2048).",
            show_default=False,
        ),
    ] = None,
    entry_bytes: Annotated[
        int | None,
        typer.Option(
            "--entry-bytes",
            help="Size of one entry (slab) in bytes. Default: 116389652 (measured; dense: "
            "18400000000).",
            show_default=False,
        ),
    ] = None,
    cap_mb: Annotated[
        int | None,
        typer.Option(
            "--cap-mb",
            help="The cache-size option (cacheMb -> HALOGEN_CACHE_MB), in MiB. Flash: the size "
            "of one entry's slab (0 = --entry-bytes); dense: the whole budget, cut into whole "
            "entries. Default: 0 (dense: 61440).",
            show_default=False,
        ),
    ] = None,
    token_bytes: Annotated[
        int | None,
        typer.Option(
            "--token-bytes",
            help="Bytes of its slab a snapshot needs per token; a snapshot over the slab is "
            "refused. 0 = no per-token wall. Default: 2048 (not measured: the lane stored "
            "43,531 tokens in a 111 MiB slab; dense: 0).",
            show_default=False,
        ),
    ] = None,
    counter_lag: Annotated[
        int | None,
        typer.Option(
            "--counter-lag",
            help="Requests before a call's hits/misses/prompt_tokens_saved show in /cache; "
            "0 = immediate. Default: 1 (measured on Flash; dense: 0).",
            show_default=False,
        ),
    ] = None,
    dedupe_snapshots: Annotated[
        bool | None,
        typer.Option(
            "--dedupe-snapshots/--no-dedupe-snapshots",
            help="Refresh an identical snapshot instead of storing it again. Default: False "
            "(measured on Flash 0.7.0: snapshot every request; dense: True).",
            show_default=False,
        ),
    ] = None,
    prefill_tps: Annotated[
        float | None,
        typer.Option(
            "--prefill-tps",
            help="Batched prefill throughput, tokens/s. Default: 1370 (fitted).",
            show_default=False,
        ),
    ] = None,
    prefill_setup_s: Annotated[
        float | None,
        typer.Option(
            "--prefill-setup-s",
            help="Fixed seconds of a batched prefill pass. Default: 1.4706 (fitted).",
            show_default=False,
        ),
    ] = None,
    step_ms: Annotated[
        float | None,
        typer.Option(
            "--step-ms",
            help="Milliseconds to process one token on its own (short passes). "
            "Default: 20.28 (fitted).",
            show_default=False,
        ),
    ] = None,
    step_ms_per_kctx: Annotated[
        float | None,
        typer.Option(
            "--step-ms-per-kctx",
            help="Extra milliseconds per stepped token per 1,000 tokens of context. "
            "Default: 0.0855 (fitted).",
            show_default=False,
        ),
    ] = None,
    decode_tps: Annotated[
        float | None,
        typer.Option(
            "--decode-tps",
            help="Decode speed, tokens/s. Default: 60 (measured).",
            show_default=False,
        ),
    ] = None,
    slots: Annotated[
        int | None,
        typer.Option(
            "--slots",
            help="Requests served at once; more wait in the queue. Default: 4 (measured; "
            "dense: 1).",
            show_default=False,
        ),
    ] = None,
    slot_ctx: Annotated[
        int | None,
        typer.Option(
            "--slot-ctx",
            help="Tokens per slot; a longer prompt is a 400. Default: 262144 (measured).",
            show_default=False,
        ),
    ] = None,
    max_tokens_cap: Annotated[
        int | None,
        typer.Option(
            "--max-tokens-cap",
            help="Largest max_tokens accepted; more is a 400. Default: 65536.",
            show_default=False,
        ),
    ] = None,
    queue_timeout: Annotated[
        float | None,
        typer.Option(
            "--queue-timeout",
            help="Seconds a request may wait for a slot before 503 engine_busy (divided by "
            "--speed). Default: 3600 (dense: 7200).",
            show_default=False,
        ),
    ] = None,
    keepalive: Annotated[
        float | None,
        typer.Option(
            "--keepalive",
            help="Seconds of streaming silence before a ': keepalive' line (divided by "
            "--speed); 0 disables. Default: 10.",
            show_default=False,
        ),
    ] = None,
    answer_tokens: Annotated[
        int | None,
        typer.Option(
            "--answer-tokens",
            help="Length of the deterministic answer in tokens (less if max_tokens is "
            "smaller). Default: 24.",
            show_default=False,
        ),
    ] = None,
    cache_dir: Annotated[
        str | None,
        typer.Option(
            "--cache-dir",
            help="Flash disk tier (HALOGEN_CACHE_DIR): snapshots persist here across restarts "
            "and are restored from it (/cache disk, timings.disk_restore_n/ms). "
            "Default: None (no disk tier).",
            show_default=False,
        ),
    ] = None,
    disk_gib: Annotated[
        float | None,
        typer.Option(
            "--disk-gib",
            help="Disk tier budget in GiB (HALOGEN_CACHE_DISK_GIB). Default: 64.",
            show_default=False,
        ),
    ] = None,
    disk_token_bytes: Annotated[
        int | None,
        typer.Option(
            "--disk-token-bytes",
            help="Modelled bytes of a disk record per token. Default: 27648 (~27 KiB).",
            show_default=False,
        ),
    ] = None,
    disk_read_mbps: Annotated[
        float | None,
        typer.Option(
            "--disk-read-mbps",
            help="Modelled disk read speed for restores, MB/s. Default: 2000.",
            show_default=False,
        ),
    ] = None,
    speed: Annotated[
        float | None,
        typer.Option(
            "--speed",
            help="Time compression: every modelled duration is divided by this. Default: 1.",
            show_default=False,
        ),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Do not print a line per request.")
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Run a Halogen-compatible worker simulator in the foreground until Ctrl-C (see _HELP)."""
    with cli_errors(debug):
        from prefixreg.sim import SimConfig, SimServer

        config = SimConfig.for_profile(
            profile,
            host=host,
            port=port,
            api_key=api_key or os.environ.get(_ENV_KEY) or None,
            model=model,
            max_entries=max_entries,
            entries_per_request=entries_per_request,
            snapshot_align=snapshot_align,
            entry_bytes=entry_bytes,
            cap_mb=cap_mb,
            token_bytes=token_bytes,
            counter_lag=counter_lag,
            dedupe_snapshots=dedupe_snapshots,
            prefill_tps=prefill_tps,
            prefill_setup_s=prefill_setup_s,
            step_ms=step_ms,
            step_ms_per_kctx=step_ms_per_kctx,
            decode_tps=decode_tps,
            slots=slots,
            slot_ctx=slot_ctx,
            max_tokens_cap=max_tokens_cap,
            queue_timeout=queue_timeout,
            keepalive=keepalive,
            answer_tokens=answer_tokens,
            cache_dir=cache_dir,
            disk_gib=disk_gib,
            disk_token_bytes=disk_token_bytes,
            disk_read_mbps=disk_read_mbps,
            speed=speed,
        )
        server = SimServer(config, log=None if quiet else info).bind()
        auth = ", API key required" if config.api_key else ""
        info(
            f"prefixreg sim ({config.profile}, speed {config.speed:g}{auth}) listening on "
            f"{server.url}  (Ctrl-C to stop)"
        )
        stopper = threading.Event()
        try:
            server.start()
            stopper.wait()  # until Ctrl-C
        except KeyboardInterrupt:
            info("stopping")
        finally:
            server.stop()


def register(app: typer.Typer) -> None:
    """Add the `sim` command to `app`."""
    app.command("sim", help=_HELP)(sim_command)
