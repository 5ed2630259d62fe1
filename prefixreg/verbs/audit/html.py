"""`audit --html FILE`: the report as one self-contained page, its plots drawn by matplotlib
(the optional extra `prefixreg[report]`).

Invariants: the page loads nothing (plots are PNG `data:` images, styles inline, a CSP that
allows nothing else); every text from the inputs (a call's source, a reason) is HTML-escaped;
the figures come from the report's own numbers (`AuditReport.saved`), per call in call order:
cached, uncached and (of those) the lost session prefix's tokens stacked, a marker on each
call whose request drifted from the frame, and the seconds caching saved, cumulative. Over
`MAX_DRAWN` calls, the calls are drawn in at most `BINS` bins of consecutive calls (`series`):
a bar is its bin's mean per call, a marker a bin holding a drifted call, the curve sampled at
each bin's last call; the page says so above the figures. So the drawing's time and memory
are bounded whatever the batch's size.
matplotlib is drawn through its object API (`Figure`), never pyplot's global state; a missing
extra is a `UsageError`.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from prefixreg.core.errors import UsageError
from prefixreg.verbs.audit.report import AuditReport
from prefixreg.verbs.audit.saving import CallSaving

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CACHED, UNCACHED, DRIFT, SAVED = "#2a7ab9", "#f28e2b", "#c0392b", "#2e8b57"
SESSION = "#8e6bb8"
_ROWS = ("calls", "cached share", "wall time", "if cold", "caching saved", "uncached", "modelled")
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
_STYLE = (
    "body{font:15px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}"
    "table{border-collapse:collapse}td{padding:2px 14px 2px 0}td:first-child{color:#666}"
    "figure{margin:1.5em 0}img{max-width:100%}#binned{color:#555;font-size:13px}"
)
# matplotlib draws a bar (two, stacked) per call: its time and memory grow with each; past this
# many calls they are drawn in bins, so a batch of any size draws at most `BINS` of each.
MAX_DRAWN: Final = 2000
BINS: Final = 500


@dataclass(frozen=True, slots=True)
class Series:
    """What the figures draw: per bar (a call, or a bin of `size` consecutive calls) its centre,
    width, mean cached and uncached tokens per call (and of the uncached, the session's),
    whether a call in it drifted; the cumulative seconds saved at its last call (`end`)."""

    size: int
    x: list[float]
    width: list[float]
    cached: list[float]
    uncached: list[float]
    drifted: list[bool]
    end: list[int]
    saved: list[float]
    session: list[float]

    @property
    def bins(self) -> int:
        return len(self.x)

    def note(self, calls: int) -> str | None:
        """What the page says of the binning, or None: one bar per call."""
        if self.size == 1:
            return None
        return (
            f"{calls:,} calls, over {MAX_DRAWN:,}, are drawn in {self.bins:,} bins of "
            f"{self.size:,} consecutive calls (the last may hold fewer): a bar is its bin's "
            "mean tokens per call, a marker a bin holding a call that drifted from the frame, "
            "and the curve the cumulative seconds saved at each bin's last call."
        )


def series(calls: Sequence[CallSaving]) -> Series:
    """The bars and the curve of `calls`: one per call up to `MAX_DRAWN`, else binned."""
    size = 1 if len(calls) <= MAX_DRAWN else -(-len(calls) // BINS)  # ceil: at most BINS bins
    out = Series(size, [], [], [], [], [], [], [], [])
    total = 0.0
    for i in range(0, len(calls), size):
        chunk = calls[i : i + size]
        n = len(chunk)
        out.x.append(i + 1 + (n - 1) / 2)  # the centre of calls i+1 .. i+n
        out.width.append(0.85 * n)
        out.cached.append(sum(c.cached for c in chunk) / n)
        out.uncached.append(sum(c.prompt - c.cached - c.session for c in chunk) / n)
        out.session.append(sum(c.session for c in chunk) / n)
        out.drifted.append(any(c.drifted for c in chunk))
        total += sum(c.cold_s - c.actual_s for c in chunk)
        out.end.append(i + n)
        out.saved.append(total)
    return out


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plots(report: AuditReport) -> tuple[str, str, str | None]:
    """The two figures as base64 PNG: tokens per call (drift marked), seconds saved; and what
    the page says of their binning (None: not binned). Raises `UsageError`: matplotlib (the
    `report` extra) is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise UsageError(
            "--html draws its plots with matplotlib", hint="pip install 'prefixreg[report]'"
        ) from None
    calls = report.saved().calls
    s = series(calls)
    binned = f" (mean per call, bins of {s.size:,} calls)" if s.size > 1 else ""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(s.x, s.cached, color=CACHED, label="cached tokens", width=s.width)
    ax.bar(s.x, s.uncached, bottom=s.cached, color=UNCACHED, width=s.width, label="uncached tokens")
    below = [k + u for k, u in zip(s.cached, s.uncached, strict=True)]
    if any(s.session):
        label = "uncached: the session's previous prompt"
        ax.bar(s.x, s.session, bottom=below, color=SESSION, width=s.width, label=label)
    heights = [b + x for b, x in zip(below, s.session, strict=True)]
    top = max(heights, default=0)
    drifted = [(x, h + 0.04 * top) for x, h, d in zip(s.x, heights, s.drifted, strict=True) if d]
    if drifted:
        xs, ys = zip(*drifted, strict=True)
        ax.scatter(xs, ys, marker="v", s=140, color=DRIFT, zorder=3, label="drifted from the frame")
        ax.set_ylim(0, top * 1.12)
    ax.set(xlabel="call", ylabel="prompt tokens", title=f"Prompt tokens per call{binned}")
    ax.legend(loc="upper left")
    fig2 = Figure(figsize=(11, 3.4), layout="constrained")
    ax2 = fig2.add_subplot()
    dot = "o" if s.size == 1 else ""  # a dot is a call: none for a bin
    ax2.plot(s.end, s.saved, color=SAVED, linewidth=2.5, marker=dot, markersize=3)
    ax2.fill_between(s.end, s.saved, color=SAVED, alpha=0.25)
    title = "Prefill seconds caching saved, cumulative" + (" (at each bin's end)" if binned else "")
    ax2.set(xlabel="call", ylabel="seconds", title=title)
    for axis in (ax.xaxis, ax2.xaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    return _png(fig), _png(fig2), s.note(len(calls))


def render_html(report: AuditReport) -> bytes:
    """The page (UTF-8). Raises `UsageError` without matplotlib."""
    tokens, bars, note = plots(report)
    e = html.escape
    binned = "" if note is None else f"<p id=binned>{e(note)}</p>"
    lines = [(line[:15].strip(), line[15:].strip()) for line in report.to_text().splitlines()]
    table = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in lines if k in _ROWS)
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
        f"<title>prefixreg audit</title><style>{_STYLE}</style></head><body>"
        f"<h1>What caching saved</h1><p id=summary>{e(report.summary())}</p>"
        f"<table>{table}</table>{binned}"
        f'<figure><img id=tokens alt="cached and uncached prompt tokens per call" '
        f'src="data:image/png;base64,{tokens}"></figure>'
        f'<figure><img id=saved alt="cumulative prefill seconds saved" '
        f'src="data:image/png;base64,{bars}"></figure>'
        "</body></html>\n"
    ).encode()
