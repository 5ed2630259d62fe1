"""`audit --html FILE`: one self-contained page whose plots (matplotlib, the `report` extra)
render in a real headless browser (Debian's chromium, installed by scripts/test).

The page is parsed first (self-contained, escaped, both figures present); then chromium
loads it from disk with every network path closed and takes a screenshot, whose plot
areas must show the figures' colours. Without a browser the test fails, never skips.

Past `MAX_DRAWN` calls the figures are binned: the page says so, still renders, and its
drawing costs no more CPU or memory for 50,000 calls than for `MAX_DRAWN` (ratios measured
in the same run, of real processes, never absolute times).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import orjson
import pytest
from matplotlib.image import imread

from prefixreg.registry.store import Registry
from prefixreg.verbs.audit.html import BINS, CACHED, DRIFT, MAX_DRAWN, SAVED, UNCACHED, series
from prefixreg.verbs.audit.saving import CallSaving
from tests.conftest import run_cli

SYSTEM = "You are the build bot. Answer with one word and keep the house style.\n" * 40
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]


class Page(HTMLParser):
    """Every tag's attributes, and the text, of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def pair(tail: str, prompt: int, cached: int, tools: list[Any]) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": tail}]
    usage = {"prompt_tokens": prompt, "completion_tokens": 5}
    usage["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[assignment]
    response = {
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "ok"}}],
        "usage": usage,
        "timings": {"prompt_ms": 40.0 + (prompt - cached) / 2, "predicted_ms": 80.0},
    }
    request = {"messages": messages, "tools": tools}
    return orjson.dumps({"request": request, "response": response})


def screenshot(page: Path, out: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "no headless browser: install Debian's chromium (scripts/test does)"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",  # root in a container
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={out.parent / 'chromium-profile'}",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--proxy-server=127.0.0.1:9",  # nothing leaves the machine
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--hide-scrollbars",
            "--window-size=1200,1500",
            f"--screenshot={out}",
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
        env={**os.environ, "HOME": str(out.parent)},
    )


def share(image: Any, colour: str, tolerance: float = 0.03) -> float:
    """The share of the screenshot's pixels that have `colour`."""
    rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    close = (abs(image[:, :, :3] - rgb) <= tolerance).all(axis=2)
    return float(close.mean())


def test_html_report_is_self_contained_and_its_plots_render(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="sys")
    reg.add_frame("sys", tools=orjson.dumps(TOOLS), name="loop")
    drifted = [{"type": "function", "function": {"name": "rm", "parameters": {}}}]
    rows = [(900, 0, TOOLS), (960, 880, TOOLS), (1010, 100, drifted), (1080, 1000, TOOLS)]
    calls = tmp_path / "calls.jsonl"
    calls.write_bytes(b"\n".join(pair(f"turn {i}", *row) for i, row in enumerate(rows)))
    page_path = tmp_path / "report.html"
    args = [str(calls), "--registry", str(reg.root), "--frame", "loop", "--json"]
    res = run_cli("audit", *args, "--html", str(page_path))
    assert res.returncode == 0, res.stderr
    summary = orjson.loads(res.stdout)["summary"]

    page = Page()
    page.feed(page_path.read_text(encoding="utf-8"))
    images = {a["id"]: a["src"] or "" for tag, a in page.tags if tag == "img"}
    assert set(images) == {"tokens", "saved"}
    assert all(src.startswith("data:image/png;base64,") for src in images.values())
    assert not [t for t, a in page.tags if t in ("script", "link", "iframe")]
    assert not [a for _, a in page.tags if "href" in a]
    assert summary in "".join(page.text)
    assert not [a for _, a in page.tags if a.get("id") == "binned"]  # 4 calls: one bar each
    assert "uncached" in page.text and " (tools " in "".join(page.text)  # drift, named

    shot = tmp_path / "shot.png"
    screenshot(page_path, shot)
    image = imread(shot)
    assert image.shape[0] >= 1000 and image.shape[1] >= 1000
    # The plot areas are drawn: bars of both kinds, the drift marker, the savings curve.
    assert share(image, CACHED) > 0.01 and share(image, UNCACHED) > 0.005
    assert share(image, DRIFT) > 0.0001
    assert share(image, SAVED) > 0.001


def test_html_without_matplotlib_is_a_usage_error(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed')\n")
    calls = tmp_path / "calls.jsonl"
    calls.write_bytes(pair("x", 900, 0, TOOLS))
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    res = run_cli("audit", str(calls), "--html", str(tmp_path / "r.html"), env={"PYTHONPATH": path})
    assert res.returncode == 2 and b"prefixreg[report]" in res.stderr
    assert not (tmp_path / "r.html").exists()
    res = run_cli("audit", str(calls), "--html", str(tmp_path / "no" / "r.html"))
    assert res.returncode == 2 and b"does not exist" in res.stderr


def binned_note(page_path: Path) -> str:
    page = Page()
    page.feed(page_path.read_text(encoding="utf-8"))
    assert [a for t, a in page.tags if t == "p" and a.get("id") == "binned"]
    return "".join(page.text)


def test_series_bins_past_max_drawn_and_keeps_the_totals() -> None:
    for n in (1, MAX_DRAWN, MAX_DRAWN + 1, 2_500, 50_000, 100_003):
        calls = [CallSaving(f"c{i}", 100 + i % 7, i % 5, 0.5, 0.25 * (i % 3)) for i in range(n)]
        calls[n // 2].drifted = "tools"
        s = series(calls)
        assert s.size == (1 if n <= MAX_DRAWN else -(-n // BINS))
        assert s.bins <= (MAX_DRAWN if n <= MAX_DRAWN else BINS)
        sizes = [round(w / 0.85) for w in s.width]  # a bar's width is 0.85 per call in it
        assert sum(sizes) == n and s.end[-1] == n and sum(s.drifted) == 1
        assert sum(k * m for k, m in zip(s.cached, sizes, strict=True)) == pytest.approx(
            sum(c.cached for c in calls)
        )
        assert sum(u * m for u, m in zip(s.uncached, sizes, strict=True)) == pytest.approx(
            sum(c.prompt - c.cached for c in calls)
        )
        net = s.saved[-1] - s.lost[-1]
        assert net == pytest.approx(sum(c.cold_s - c.actual_s for c in calls))
        assert s.saved == sorted(s.saved) and s.lost == sorted(s.lost)  # cumulative: rising
        assert (s.note(n) is None) == (n <= MAX_DRAWN)


def test_a_binned_page_says_so_and_its_plots_render(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="sys")
    reg.add_frame("sys", tools=orjson.dumps(TOOLS), name="loop")
    drifted = [{"type": "function", "function": {"name": "rm", "parameters": {}}}]
    n = MAX_DRAWN + 500
    rows = [(900 + i % 9, 0 if i % 10 == 0 else 880, TOOLS) for i in range(n)]
    rows[n // 2] = (1010, 100, drifted)
    calls = tmp_path / "calls.jsonl"
    calls.write_bytes(b"\n".join(pair(f"turn {i}", *row) for i, row in enumerate(rows)))
    page_path = tmp_path / "report.html"
    args = [str(calls), "--registry", str(reg.root), "--frame", "loop", "--html", str(page_path)]
    res = run_cli(*["audit", *args], timeout=300)
    assert res.returncode == 0, res.stderr
    size = -(-n // BINS)
    text = binned_note(page_path)
    bins = -(-n // size)
    assert f"{n:,} calls, over {MAX_DRAWN:,}, are drawn in {bins:,} bins of {size:,}" in text
    assert "mean tokens per call" in text and "at each bin's last call" in text
    shot = tmp_path / "shot.png"
    screenshot(page_path, shot)
    image = imread(shot)
    assert share(image, CACHED) > 0.01 and share(image, UNCACHED) > 0.002
    assert share(image, DRIFT) > 0.0001 and share(image, SAVED) > 0.001


# Runs the command after it and prints its peak RSS (KiB) and CPU seconds: its own, alone.
MEASURE = (
    "import resource, subprocess, sys\n"
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
    "r = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print(r.ru_maxrss, r.ru_utime + r.ru_stime)\n"
)


def cost(*args: str) -> tuple[int, float]:
    """(peak RSS KiB, CPU s) of `prefixreg audit ARGS` run alone in a measuring process."""
    cmd = [sys.executable, "-c", MEASURE, sys.executable, "-m", "prefixreg", "audit", *args]
    res = subprocess.run(cmd, capture_output=True, timeout=900, check=False)
    assert res.returncode == 0, res.stderr
    rss, cpu = res.stdout.split()
    return int(rss), float(cpu)


def reply(i: int) -> bytes:
    """A response alone (no request: the batch's reading stays cheap), with server timings."""
    cached = 0 if i % 10 == 0 else 880
    usage = {"prompt_tokens": 900 + i % 9, "completion_tokens": 5}
    return orjson.dumps(
        {
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "ok"}}],
            "usage": usage | {"prompt_tokens_details": {"cached_tokens": cached}},
            "timings": {"prompt_ms": 40.0 + (900 - cached) / 2, "predicted_ms": 80.0},
        }
    )


@pytest.mark.timeout(600)  # four real audits, two of 50,000 calls, on a shared machine
def test_html_cost_is_bounded_whatever_the_batch_size(tmp_path: Path) -> None:
    """The page's extra cost (with --html less without) for 50,000 calls is within twice
    that of `MAX_DRAWN` calls, the most drawn one bar each. Per-call bars cost ~25x here."""
    extra = {}
    for n in (MAX_DRAWN, 50_000):
        calls = tmp_path / f"calls-{n}.jsonl"
        calls.write_bytes(b"\n".join(reply(i) for i in range(n)))
        page = tmp_path / f"report-{n}.html"
        (rss, cpu), (rss_plain, cpu_plain) = cost(str(calls), "--html", str(page)), cost(str(calls))
        extra[n] = (rss - rss_plain, cpu - cpu_plain)
    (rss_small, cpu_small), (rss_large, cpu_large) = extra[MAX_DRAWN], extra[50_000]
    assert rss_large < 2 * rss_small, extra
    assert cpu_large < 2 * cpu_small, extra
    assert "50,000 calls, over 2,000, are drawn in 500 bins of 100" in binned_note(page)
