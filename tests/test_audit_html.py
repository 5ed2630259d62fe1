"""`audit --html FILE`: one self-contained page whose plots (matplotlib, the `report` extra)
render in a real headless browser (Debian's chromium, installed by scripts/test).

The page is parsed first (self-contained, escaped, both figures present); then chromium
loads it from disk with every network path closed and takes a screenshot, whose plot
areas must show the figures' colours. Without a browser the test fails, never skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import orjson
from matplotlib.image import imread

from prefixreg.registry.store import Registry
from prefixreg.verbs.audit.html import CACHED, DRIFT, SAVED, UNCACHED
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
