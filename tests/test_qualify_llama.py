"""`prefixreg qualify` against the real llama-server peer (`tests.peer.fixtures.llama_server`):
a token-ID prompt file made with the server's own `/tokenize`, sent as a token prompt on
`/v1/completions`, and `--expected-prompt-tokens` exact. These need the engine: they fail,
never skip, when it cannot start."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import orjson
import pytest

from tests.conftest import run_cli
from tests.peer.llama_peer import PeerServer

pytestmark = pytest.mark.timeout(900)

TEXT = (
    "A field guide to the birds of the northern marshes, written for patient walkers. "
    "It names each bird, the months it stays, the calls it makes and where it nests. "
) * 12


def token_file(server: PeerServer, tmp_path: Path) -> tuple[Path, int]:
    """The model's own token IDs for `TEXT` (`/tokenize`, BOS included), as a JSON array."""
    reply = httpx.post(
        server.url + "/tokenize", json={"content": TEXT, "add_special": True}, timeout=120
    )
    assert reply.status_code == 200, reply.content[:200]
    ids = orjson.loads(reply.content)["tokens"]
    assert ids and all(type(t) is int for t in ids)
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(ids))
    return path, len(ids)


def test_token_prompt_with_exact_expected_count_qualifies(
    llama_server: PeerServer, tmp_path: Path
) -> None:
    ids, n = token_file(llama_server, tmp_path)
    out = tmp_path / "receipt.json"
    args = ["--worker", llama_server.url, "--prompt-file", str(ids), "--output", str(out)]
    args += ["--expected-prompt-tokens", str(n), "--tokens", "8", "--require-reuse"]
    res = run_cli("qualify", *args, "--repeats", "2", "--streams", "2", timeout=600)
    receipt = orjson.loads(out.read_bytes())
    # Greedy replies of one prompt may still differ warm from cold: a real finding, said so.
    differs = [r for r in receipt["rows"][1:] if r["output_vs_first"] == "differ"]
    assert res.returncode == (1 if differs else 0), (res.stderr, receipt["failures"])
    assert receipt["qualified"] is not differs
    assert receipt["server"]["profile"] == "llamacpp"
    assert receipt["prompt"] == {"kind": "tokens", "source": "file"}
    assert all(r["prompt_tokens"] == n for r in receipt["rows"])  # the server's count, exact
    repeated = [r for r in receipt["rows"] if r["phase"] == "repeated"]
    assert all(r["cache_state"] == "reused" and 0 < r["cached_tokens"] <= n for r in repeated)
    assert all(r["output_vs_first"] in ("pass", "differ") for r in receipt["rows"][1:])
    assert all(r["tokens_vs_first"] == "unverified" for r in receipt["rows"][1:])
    assert llama_server.url not in out.read_text()


def test_a_wrong_expected_count_fails_naming_the_reported_one(
    llama_server: PeerServer, tmp_path: Path
) -> None:
    ids, n = token_file(llama_server, tmp_path)
    out = tmp_path / "receipt.json"
    args = ["--worker", llama_server.url, "--prompt-file", str(ids), "--output", str(out)]
    args += ["--expected-prompt-tokens", str(n + 3), "--tokens", "4"]
    res = run_cli("qualify", *args, "--repeats", "1", "--streams", "1", timeout=600)
    assert res.returncode == 1, res.stderr
    receipt = orjson.loads(out.read_bytes())
    assert receipt["qualified"] is False
    assert f"reported {n:,} prompt tokens, expected {n + 3:,}" in receipt["failures"][0]
    assert f"reported {n:,} prompt tokens" in res.stdout.decode()
