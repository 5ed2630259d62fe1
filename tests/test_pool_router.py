"""A pool behind the real router: sglang-router 0.3.2 (`manual` policy, routing keys in
`x-smg-routing-key`) in front of two real llama-servers (`-np 2 --swa-full --cache-ram 0`).

After `warm_pool` of three registered prefixes, a fresh-tail call *through the router* for
each prefix reports cached tokens covering its span; a fourth prefix beyond the pool's
capacity is refused before anything is sent, and the three stay resident.

The router hides its workers' slots, drops `cache_prompt`/`id_slot` and proxies no
`/slots`: placement is traced on the workers directly, and residency is proven there.
Prefixes are ~1,000 tokens, so each cold prefill is a few seconds on two cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from prefixreg.core.judge import judge
from prefixreg.core.prefix import fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.verbs.pool.live import Pool
from prefixreg.verbs.pool.spec import ROUTING_KEY_HEADER, parse_pool_file
from prefixreg.verbs.pool.warm import doctor_pool, warm_pool
from tests.peer.fixtures import serve
from tests.peer.llama_peer import SMALL_CACHE_FLAGS, PeerServer
from tests.peer.router_peer import RouterServer, start_router
from tests.test_llama_server import prose

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RouterServer, list[str]]]:
    logs = tmp_path_factory.mktemp("pool-fleet")
    with serve(SMALL_CACHE_FLAGS, logs) as one, serve(SMALL_CACHE_FLAGS, logs) as two:
        workers: list[PeerServer] = [one, two]
        router = start_router([w.url for w in workers], policy="manual", log_dir=logs)
        try:
            yield router, [w.url for w in workers]
        finally:
            router.stop()


def _pool_file(tmp_path: Path, router: str, workers: list[str]) -> Path:
    # The second worker keeps one prefix (a cap below its two slots): capacity 2 + 1 = 3.
    path = tmp_path / "pool.json"
    body = {"router": router, "workers": [workers[0], {"url": workers[1], "capacity": 1}]}
    path.write_bytes(orjson.dumps(body))
    return path


def test_three_prefixes_resume_through_the_router_and_a_fourth_is_refused(
    fleet: tuple[RouterServer, list[str]], tmp_path: Path
) -> None:
    router, workers = fleet
    reg = Registry(tmp_path / "reg")
    shas = [reg.add(prose(100 + i, 900, title=f"Team {i} brief")) for i in range(4)]
    spec = parse_pool_file(_pool_file(tmp_path, router.url, workers))
    with Pool(spec, reg, timeout=30.0) as pool:
        report = warm_pool(pool, [reg.head(s) for s in shas[:3]])
        assert report.ok, report.to_dict()
        assert [w.capacity for w in report.workers] == [2, 1]
        held = {url: len(report.held_by(url)) for url in workers}
        assert held[workers[1]] <= 1 and sum(held.values()) == 3, report.to_dict()

        def through_router(sha: str) -> None:
            tail = fresh_tail()
            _, ev = pool.chat(sha, tail, max_tokens=1, temperature=0, stream=False)
            j = judge(ev, head_bytes=reg.meta(sha).bytes, rest_bytes=len(tail.encode()))
            verdict, reason, span = j.verdict, j.reason, j.span
            assert verdict == "resumed", (sha[:12], reason, ev.cached_tokens, span)
            assert span is not None and ev.cached_tokens is not None
            assert ev.cached_tokens >= span - 32

        for sha in shas[:3]:
            assert pool.headers_for(sha)[ROUTING_KEY_HEADER].startswith(sha)
            through_router(sha)

        # The fourth does not fit: refused, nothing sent, the three stay where they are.
        fourth = warm_pool(pool, [reg.head(shas[3])])
        assert fourth.refused == [shas[3]] and not fourth.ok
        assert "refused" in " ".join(fourth.notes)
        assert shas[3] not in pool.placement
        for sha in shas[:3]:
            through_router(sha)

    # The kept placement is read back by a new Pool (another process, another loop).
    with Pool(spec, reg) as again:
        assert set(again.placement) == set(shas[:3])
        doc = doctor_pool(again)
        assert doc.ok and not doc.builds_differ, doc.to_dict()
        assert sorted(p.sha256 for p in doc.proofs) == sorted(shas[:3])
