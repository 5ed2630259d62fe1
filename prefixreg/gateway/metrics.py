"""The gateway's counters and their Prometheus text (`/metrics`). Not thread-safe but for
`add`, which the keeper's thread also calls (one lock).

Series (all `prefixreg_gateway_*`): `calls_total{api,head,worker,verdict}`,
`prompt_tokens_total` / `resumed_tokens_total` / `uncached_tokens_total{head,worker}` (the
server's own counts: resumed = cached, uncached = prompt - cached), `misses_total{head,
worker,reason}`, `drift_total{head,part}`, `refused_total{head}`, `strips_total{head}`,
`rewarms_total{head,worker,outcome}`, `snapshots_total{action,worker,outcome}`,
`restored_tokens_total{worker}`, `failures_total{where}` (registry, judge, keeper, log),
`added_seconds` (a histogram of the time the gateway's own work added to a call),
`upstream_inflight`, `cancelled_total`, `sessions`.

Invariants: label values are escaped by the exposition rules (backslash, quote, newline);
a head label is a 12-digit sha or a registry name, a worker label a URL without user info;
at most `MAX_SERIES` series per name (past it, labels read `other`): bounded memory.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Final

MAX_SERIES: Final = 2000
BUCKETS: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
_HELP: Final = {
    "calls_total": "Calls proxied, by the judge's verdict",
    "prompt_tokens_total": "Prompt tokens the server counted",
    "resumed_tokens_total": "Prompt tokens the server reported served from its cache",
    "uncached_tokens_total": "Prompt tokens the server prefilled (prompt - cached)",
    "misses_total": "Calls not resumed, by the reason the gateway names",
    "drift_total": "Calls whose head differs from the one their session sent before",
    "dynamic_first_total": "Sessions whose first user message puts dynamic text before static",
    "not_placed_total": "New heads served where every worker was at its capacity",
    "session_misses_total": "Calls that resumed the head but not the session's previous prompt",
    "refused_total": "Calls refused by --on-drift refuse (nothing forwarded)",
    "strips_total": "Matches of --strip rules removed from heads before forwarding",
    "rewarms_total": "Re-warms the keeper sent for live sessions (never counted as calls)",
    "snapshots_total": "Slot saves and restores that keep sessions whole (llama.cpp)",
    "restored_tokens_total": "Tokens of session state restored into slots a foreign prompt took",
    "failures_total": "Failures of prefixreg's own parts; the calls went on",
    "cancelled_total": "Upstream calls closed because their client went away",
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Counters by (name, labels), a latency histogram, and gauges given at render time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._hist = [0] * (len(BUCKETS) + 1)
        self._hist_sum = 0.0

    def add(self, name: str, value: float = 1.0, /, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters.setdefault(name, {})
            if key not in series and len(series) >= MAX_SERIES:
                key = tuple((k, "other") for k, _ in key)
            series[key] = series.get(key, 0.0) + value

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            series = self._counters.get(name, {})
            if not labels:
                return sum(series.values())
            want = set(labels.items())
            return sum(v for k, v in series.items() if want <= set(k))

    def observe_added(self, seconds: float) -> None:
        with self._lock:
            self._hist_sum += seconds
            i = next((i for i, b in enumerate(BUCKETS) if seconds <= b), len(BUCKETS))
            self._hist[i] += 1

    def render(self, gauges: Mapping[str, float]) -> str:
        lines: list[str] = []
        with self._lock:
            counters = {n: dict(s) for n, s in self._counters.items()}
            hist, total = list(self._hist), self._hist_sum
        for name in sorted(set(counters) | set(_HELP)):
            full = f"prefixreg_gateway_{name}"
            lines.append(f"# HELP {full} {_HELP.get(name, name)}")
            lines.append(f"# TYPE {full} counter")
            for key, value in sorted(counters.get(name, {}).items()):
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in key)
                lines.append(f"{full}{{{labels}}} {value:g}" if labels else f"{full} {value:g}")
        full = "prefixreg_gateway_added_seconds"
        lines.append(f"# HELP {full} Time the gateway's own work added to a call")
        lines.append(f"# TYPE {full} histogram")
        running = 0
        for bound, count in zip((*BUCKETS, float("inf")), hist, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            lines.append(f'{full}_bucket{{le="{le}"}} {running}')
        lines.append(f"{full}_sum {total:.6f}")
        lines.append(f"{full}_count {running}")
        for name, value in sorted(gauges.items()):
            full = f"prefixreg_gateway_{name}"
            lines.append(f"# TYPE {full} gauge")
            lines.append(f"{full} {value:g}")
        return "\n".join(lines) + "\n"
