"""The simulator's time model: modelled seconds of a call, before `speed`. Pure.

Fitted to the measured Flash lane's probe (prefixreg's legs A1 cold, A2 identical repeat, B
fresh tail; ``max_tokens`` 1) at 2,593 / 11,374 / 21,337 / 43,538 prompt tokens:

- **Prefill.** ``u`` uncached tokens after ``n`` prompt tokens of context are processed the
  cheaper of two ways (the engine batches a long pass, and steps through a short one):

  - token by token: ``u * step(n)``, with ``step(n) = step_ms + n / 1000 * step_ms_per_kctx``
    (20.28 ms + 0.0855 ms per 1,000 tokens of context: a short pass is latency-bound like
    decode, and slows as the context grows);
  - batched: ``prefill_setup_s + u / prefill_tps`` (1.4706 s + u / 1,370 tok/s).

  The two cross near 75 tokens.
- **Decode.** ``completion / decode_tps`` (60 tok/s).
- **Disk restore** (disk tier only): ``restored_bytes / (disk_read_mbps * 10^6)``.

With the defaults: cold A1 3.38 / 9.79 / 17.06 / 33.26 s (measured 3.38 / 9.81 / 17.16 /
33.26); A2 (7 tokens) 0.160 / 0.165 / 0.172 / 0.185 s (measured 0.12-0.19); B (19 tokens)
0.406 / 0.420 / 0.438 / 0.473 s (measured 0.4-0.69). The measured B/A2 ratio (3.3-3.6) is more
than 19/7, which no model linear in the uncached tokens reaches, so A2 sits in the upper part
of its range and B in the lower part of its own.
"""

from __future__ import annotations

from prefixreg.sim.config import SimConfig

__all__ = ["decode_s", "disk_restore_s", "prefill_s", "step_s"]


def step_s(config: SimConfig, context: int) -> float:
    """Seconds to process one token on its own after `context` tokens."""
    return (config.step_ms + context / 1000 * config.step_ms_per_kctx) / 1000


def prefill_s(config: SimConfig, *, prompt: int, cached: int) -> float:
    """Modelled seconds to prefill the `prompt - cached` uncached tokens (0 if none)."""
    uncached = prompt - cached
    if uncached <= 0:
        return 0.0
    stepped = uncached * step_s(config, prompt)
    batched = config.prefill_setup_s + uncached / config.prefill_tps
    return min(stepped, batched)


def decode_s(config: SimConfig, completion: int) -> float:
    """Modelled seconds to decode `completion` tokens."""
    return completion / config.decode_tps


def disk_restore_s(config: SimConfig, restored_bytes: int) -> float:
    """Modelled seconds to read a disk-tier record of `restored_bytes`."""
    return restored_bytes / (config.disk_read_mbps * 1e6)
