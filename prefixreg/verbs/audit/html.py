"""`audit --html FILE`: the report as one self-contained page, its plots drawn by matplotlib
(the optional extra `prefixreg[report]`).

Invariants: the page loads nothing (plots are PNG `data:` images, styles inline, a CSP that
allows nothing else); every text from the inputs (a call's source, a reason) is HTML-escaped;
the figures come from the report's own numbers (`AuditReport.saved`), per call in call order:
cached and uncached tokens stacked, a marker on each call whose request drifted from the
frame, and the seconds caching saved, cumulative. matplotlib is drawn through its object API
(`Figure`), never pyplot's global state; a missing extra is a `UsageError`.
"""

from __future__ import annotations

import base64
import html
import io
from itertools import accumulate
from typing import TYPE_CHECKING

from prefixreg.core.errors import UsageError
from prefixreg.verbs.audit.report import AuditReport

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CACHED, UNCACHED, DRIFT, SAVED = "#2a7ab9", "#f28e2b", "#c0392b", "#2e8b57"
_ROWS = ("calls", "cached share", "wall time", "if cold", "caching saved", "uncached", "modelled")
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
_STYLE = (
    "body{font:15px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}"
    "table{border-collapse:collapse}td{padding:2px 14px 2px 0}td:first-child{color:#666}"
    "figure{margin:1.5em 0}img{max-width:100%}"
)


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plots(report: AuditReport) -> tuple[str, str]:
    """The two figures as base64 PNG: tokens per call (drift marked), seconds saved. Raises
    `UsageError`: matplotlib (the `report` extra) is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise UsageError(
            "--html draws its plots with matplotlib", hint="pip install 'prefixreg[report]'"
        ) from None
    calls = report.saved().calls
    x = list(range(1, len(calls) + 1))
    cached = [c.cached for c in calls]
    uncached = [c.prompt - c.cached for c in calls]
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(x, cached, color=CACHED, label="cached tokens", width=0.85)
    ax.bar(x, uncached, bottom=cached, color=UNCACHED, width=0.85, label="uncached tokens")
    top = max((c.prompt for c in calls), default=0)
    drifted = [(i, c.prompt + 0.04 * top) for i, c in zip(x, calls, strict=True) if c.drifted]
    if drifted:
        xs, ys = zip(*drifted, strict=True)
        ax.scatter(xs, ys, marker="v", s=140, color=DRIFT, zorder=3, label="drifted from the frame")
        ax.set_ylim(0, top * 1.12)
    ax.set(xlabel="call", ylabel="prompt tokens", title="Prompt tokens per call")
    ax.legend(loc="upper left")
    saved = list(accumulate(c.cold_s - c.actual_s for c in calls))
    fig2 = Figure(figsize=(11, 3.4), layout="constrained")
    ax2 = fig2.add_subplot()
    ax2.plot(x, saved, color=SAVED, linewidth=2.5, marker="o", markersize=3)
    ax2.fill_between(x, saved, color=SAVED, alpha=0.25)
    ax2.set(xlabel="call", ylabel="seconds", title="Prefill seconds caching saved, cumulative")
    for axis in (ax.xaxis, ax2.xaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    return _png(fig), _png(fig2)


def render_html(report: AuditReport) -> bytes:
    """The page (UTF-8). Raises `UsageError` without matplotlib."""
    tokens, bars = plots(report)
    e = html.escape
    lines = [(line[:15].strip(), line[15:].strip()) for line in report.to_text().splitlines()]
    table = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in lines if k in _ROWS)
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>prefixreg audit</title><style>{_STYLE}</style></head><body>"
        f"<h1>What caching saved</h1><p id=summary>{e(report.summary())}</p>"
        f"<table>{table}</table>"
        f'<figure><img id=tokens alt="cached and uncached prompt tokens per call" '
        f'src="data:image/png;base64,{tokens}"></figure>'
        f'<figure><img id=saved alt="cumulative prefill seconds saved" '
        f'src="data:image/png;base64,{bars}"></figure>'
        "</body></html>\n"
    ).encode()
