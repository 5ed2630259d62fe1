"""Server activity counters that tell keepalive how much foreign traffic a prefix has seen.

- `StoresCounter`: Halogen's `/cache` `stores`, entries written since the server started
  (exact: what an LRU of entries evicts by).
- `PromptCounter`: llama.cpp has no `/cache`; it counts prompts from `/slots` (a slot's
  `id_task` changes when it starts a completion; counted once the slot is idle again, as
  llama.cpp's LRU goes by last use) or, with `/slots` off, `/metrics` (a poll window in which
  the prompt-token counters moved is one prompt). Both are lower bounds, exact when polls
  come faster than prompts finish. Raw `id_task` values are no count: one chat uses three
  and every `/slots` or `/metrics` read more (measured). vLLM, SGLang and TensorRT-LLM count
  the same way from their Prometheus token counters (`server.engines`).

`read()` returns the running count and whether the server restarted since the last read (a
counter went backwards: every prefix is gone), or None when the poll gave nothing usable.
"""

from __future__ import annotations

import math
from typing import Final

from prefixreg.core.errors import UsageError, WorkerError
from prefixreg.core.records import CacheCounters, strict_count
from prefixreg.server import engines
from prefixreg.server.engines import metric_total
from prefixreg.server.transport import shown
from prefixreg.server.worker import Worker


def _worker(worker: object) -> Worker:
    if not isinstance(worker, Worker):
        raise UsageError(f"a counter reads a Worker, not {type(worker).__name__}")
    return worker


class StoresCounter:
    """Halogen's `/cache` `stores`: entries written since the server started."""

    source = "/cache"

    def __init__(self, worker: Worker) -> None:
        self.worker = _worker(worker)
        self.total = 0
        self.busy: set[int] = set()
        self.last: CacheCounters | None = None

    def read(self) -> tuple[int, bool] | None:
        counters = self.worker.cache()
        return None if counters is None or counters.stores is None else self.saw(counters)

    def saw(self, counters: CacheCounters) -> tuple[int, bool]:
        """Take a snapshot read elsewhere (a re-warm's closing one) as the latest."""
        if not isinstance(counters, CacheCounters):
            raise UsageError(f"saw() takes CacheCounters, not {type(counters).__name__}")
        stores = counters.stores
        restarted = stores is not None and self.last is not None and stores < self.total
        self.last = counters
        self.total = stores if stores is not None else self.total
        return self.total, restarted


_LLAMACPP: Final = ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total")


def _sources(profile: str) -> tuple[str, ...]:
    """What `profile` counts prompts with: llama.cpp `/slots`, `/metrics`; an engine `METRICS`."""
    if profile == "llamacpp":
        return ("/slots", "/metrics")
    metrics = engines.METRICS.get(profile)
    return () if metrics is None else (metrics.path,)


class PromptCounter:
    """Prompts the server started, from llama.cpp's `/slots` or `/metrics`, or an engine's
    Prometheus token counters (see the module docstring)."""

    def __init__(self, worker: Worker, source: str, profile: str = "llamacpp") -> None:
        if source not in _sources(profile):
            raise UsageError(f"a {profile} prompt counter cannot read {shown(source)}")
        self.worker = _worker(worker)
        self.source = source
        metrics = engines.METRICS.get(profile)
        self._names = _LLAMACPP if metrics is None else (metrics.prompt, metrics.cached)
        self.total = 0
        self.busy: set[int] = set()  # slots processing at the last read
        self.changed: set[int] = set()  # slots counted at the last read
        self._slots: dict[int, int] | None = None
        self._tokens: int | None = None

    @classmethod
    def detect(cls, worker: Worker, profile: str = "llamacpp") -> PromptCounter | None:
        """The best counter this server offers (`/slots`, else `/metrics`), or None."""
        for source in _sources(profile):
            counter = cls(worker, source, profile)
            try:
                if counter.read() is not None:
                    return counter
            except WorkerError:
                continue  # a route that errors is a route we cannot count with
        return None

    def read(self) -> tuple[int, bool] | None:
        return self._read_slots() if self.source == "/slots" else self._read_metrics()

    def _read_slots(self) -> tuple[int, bool] | None:
        raw = self.worker.slots()
        if not raw or any(not isinstance(s.get("is_processing", False), bool) for s in raw):
            return None  # read strictly: `is_processing: "yes"` is no answer, never idle
        last, now = self._slots, {}
        self.busy = set()
        for slot in raw:
            sid, task = strict_count(slot.get("id")), strict_count(slot.get("id_task"))
            busy = slot.get("is_processing") is True
            if sid is not None and busy:
                self.busy.add(sid)
            if sid is None or task is None:
                continue
            # Count a prompt once its slot is done with it (llama.cpp's LRU goes by last use, so
            # a re-warm finishing before a foreign prompt leaves the prefix's slot the older
            # one); the loop's own call in flight does not count before its `touch` arrives.
            now[sid] = last[sid] if busy and last is not None and sid in last else task
        self._slots = now
        if last is None:
            return self.total, False
        if any(task < last[sid] for sid, task in now.items() if sid in last):
            return self.total, True
        # A slot that shows a task it did not show before served at least one prompt.
        self.changed = {sid for sid, task in now.items() if last.get(sid) != task}
        self.total += len(self.changed)
        return self.total, False

    def _read_metrics(self) -> tuple[int, bool] | None:
        samples = self.worker.metrics(self.source)
        done, cached = (None if samples is None else metric_total(samples, n) for n in self._names)
        if done is None or cached is None or not math.isfinite(done + cached):
            return None
        tokens = int(done + cached)
        last, self._tokens = self._tokens, tokens
        if last is None or tokens < last:
            return self.total, last is not None
        self.total += 1 if tokens > last else 0
        return self.total, False


Counter = StoresCounter | PromptCounter
