"""The door: what the gateway knows of a call before it goes upstream and after it comes back.

`admit` reads the head, strips what the user declared volatile, finds the session, names a
drift (and refuses with `--on-drift refuse`), names the head from the registry, chooses the
target; `settle` / `settle_stream` judge the reply, name a miss, write the call log and the
metrics, and move the session on. Everything runs on the event loop, in memory; the
registry's writes and the keeper run on their own threads.

Invariants:
- Never the loop's failure: any exception in `admit` or `settle` is logged (its type only)
  and counted under `failures_total{where}`; the call is then forwarded as it came and its
  reply sent unchanged. Only a refuse policy answers a call itself.
- The body is re-serialised only when a strip matched or a slot is pinned; otherwise the
  client's bytes are forwarded as they came.
- Proof headers are ASCII and single-line (`apis.clean_message`); none carries prompt text
  but the drift excerpt, which holds only the current request's own bytes (never the
  session's earlier head: another caller may have sent it).
- `--on-drift refuse` refuses only a drift the session's own caller made: one session
  header, or one credential behind a shared `prompt_cache_key` (never another tenant's).
- Bounded: the latest `MAX_SEEN_HEADS` heads' workers, the latest `MAX_CALLS_KEPT` proofs.
- The latest `MAX_CALLS_KEPT` proofs are kept for `GET /prefixreg/calls/{id}`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import orjson

from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import judge
from prefixreg.core.prefix import text_bytes
from prefixreg.core.records import CallEvidence
from prefixreg.gateway import calllog
from prefixreg.gateway import head as heads
from prefixreg.gateway.admission import Admission, header_value
from prefixreg.gateway.apis import Api
from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.keeper import Keeper
from prefixreg.gateway.known import KnownHeads
from prefixreg.gateway.leads import Leads
from prefixreg.gateway.metrics import Metrics
from prefixreg.gateway.proof import Proof, Tally, evidence_of, prove
from prefixreg.gateway.sessions import Session, Sessions, owner_of
from prefixreg.gateway.slots import Pins
from prefixreg.gateway.upstream import ROUTING_KEY_HEADER, Router
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.transport import display_url

log = logging.getLogger("prefixreg.gateway")
MAX_CALLS_KEPT: Final = 4096
MAX_SEEN_HEADS: Final = 10_000  # heads whose workers are remembered (least recent go first)
MAX_PROOF_BYTES: Final = 8 * 1024 * 1024  # a stream's bytes the proof reads


class Door:
    """The gateway's knowledge of heads, sessions and calls (see the module docstring)."""

    def __init__(self, config: GatewayConfig, router: Router) -> None:
        self.config = config
        self.router = router
        self.rules = heads.compile_rules(config.strip)
        self.sessions = Sessions(max_sessions=config.max_sessions, idle_s=config.session_idle_s)
        self.known = KnownHeads(config.registry_root, register=config.register)
        self.metrics = Metrics()
        self.log = calllog.CallLog(config.call_log)
        self.calls: OrderedDict[str, JSONObject] = OrderedDict()
        # head sha -> worker -> calls there; an LRU: a per-request nonce makes a head a call
        self.seen_on: OrderedDict[str, dict[str, int]] = OrderedDict()
        self.leads = Leads()
        self.pins = Pins(config, self.metrics)
        self.keeper = (
            Keeper(self.metrics, idle_s=config.session_idle_s, api_key=config.upstream_key)
            if config.keep_warm
            else None
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """What the door reads before serving (the registry's heads, the workers' slots)."""
        self.known.load()
        self.pins.start()
        if self.keeper is not None:
            self.keeper.start()

    def stop(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
        self.pins.stop()
        self.known.close()

    def failure(self, where: str, exc: BaseException) -> None:
        self.metrics.add("failures_total", where=where)
        log.warning("%s failed (%s); the call went on", where, type(exc).__name__)

    # -- before ------------------------------------------------------------------------------
    def admit(
        self, api: Api, body: dict[str, Any], content: bytes, headers: Mapping[str, str]
    ) -> Admission:
        t0 = time.perf_counter()
        adm = Admission(os.urandom(8).hex(), api, t0, self.router.targets[0], content, body)
        adm.headers["x-prefixreg-call"] = adm.call_id
        try:
            self._admit(adm, body, headers)
        except Exception as exc:  # noqa: BLE001 -- never the loop's failure
            self.failure("door", exc)
            adm.content, adm.refuse, adm.upstream_headers = content, None, []
            adm.target = self.router.targets[0]
        adm.headers["x-prefixreg-worker"] = header_value(display_url(adm.target))
        adm.door_s = time.perf_counter() - t0
        return adm

    def admit_unread(self, api: Api, content: bytes, why: str) -> Admission:
        """A call whose body is forwarded unread (valid JSON the gateway's parser refuses):
        no head, no session, the first target; its proof says `why`."""
        started, target = time.perf_counter(), self.router.targets[0]
        adm = Admission(os.urandom(8).hex(), api, started, target, content, miss=why)
        adm.headers["x-prefixreg-call"] = adm.call_id
        adm.headers["x-prefixreg-head"] = "none"
        adm.headers["x-prefixreg-worker"] = header_value(display_url(adm.target))
        return adm

    def _admit(self, adm: Admission, body: dict[str, Any], headers: Mapping[str, str]) -> None:
        api = adm.api
        adm.strips = heads.strip(api, body, self.rules)
        head, why = heads.head_of(api, body)
        adm.history = heads.history(api, body)
        if head is not None:  # a registered frame's leading messages are part of the head
            head = self.known.extend(head, adm.history)
        adm.head = head
        adm.rest_bytes = heads.rest_bytes(api, body) - (head.lead_bytes if head else 0)
        sha = head.sha256 if head is not None else None
        session, adm.chain = self.sessions.find(body, headers, adm.history, sha)
        adm.owner = owner_of(headers)
        # A shared key may join two callers: their drift is named, never refused for them.
        own = session.source == "header" or (adm.owner is not None and adm.owner == session.owner)
        adm.session = session
        adm.extends = session.extends(adm.chain)
        adm.headers["x-prefixreg-session"] = session.id
        if head is None:
            adm.headers["x-prefixreg-head"] = "none"
            adm.miss = why
        else:
            registered, name = self.known.name_of(head)
            adm.head_label = name or head.sha256[:12]
            adm.headers["x-prefixreg-head"] = head.sha256
            known = "registered" if registered else "unregistered"
            adm.headers["x-prefixreg-head-known"] = known
            if name is not None:
                adm.headers["x-prefixreg-head-name"] = header_value(name)
            if registered is None:
                self.known.remember_tools(head, body.get("tools"))
                self.known.maybe_register(head, api.name)
        if adm.strips:
            self.metrics.add("strips_total", adm.strips, head=adm.head_label)
            adm.headers["x-prefixreg-stripped"] = str(adm.strips)
        if head is not None and session.head is not None:
            adm.drift = heads.drift_of(session.head, head)
        if head is not None and session.calls == 0 and self.leads.observe(head.sha256, adm.history):
            self.metrics.add("dynamic_first_total", head=adm.head_label)
            adm.headers["x-prefixreg-note"] = (
                "the first user message puts dynamic text before static text"
            )
        if adm.drift is not None:
            self.metrics.add("drift_total", head=adm.head_label, part=adm.drift.part)
            adm.headers["x-prefixreg-drift"] = header_value(adm.drift.header())
            # The first differing bytes, escaped, to the client that sent them (never logged).
            adm.headers["x-prefixreg-drift-bytes"] = header_value(adm.drift.excerpt)
            if self.config.on_drift == "refuse" and own:
                self.metrics.add("refused_total", head=adm.head_label)
                adm.refuse = (
                    f"prefixreg gateway: the head changed since this session's last call "
                    f"({adm.drift.header()}: {adm.drift.excerpt}); refused by --on-drift refuse"
                )
                return
        key = head.sha256 if head is not None else None
        adm.target, placement = self.router.choose(key=key, session_worker=session.worker)
        if placement is not None:
            adm.headers["x-prefixreg-placement"] = placement
            self.metrics.add("not_placed_total", head=adm.head_label)
        if key is not None and self.router.behind_router:
            routing = self.router.routing_key(key).encode("ascii")
            adm.upstream_headers.append((ROUTING_KEY_HEADER.encode(), routing))
        adm.miss = adm.miss or self._miss(adm)
        self._pin(adm, session, key, body)
        if adm.strips or adm.rewritten:
            adm.content = orjson.dumps(body)

    def _pin(self, adm: Admission, session: Session, key: str | None, body: dict[str, Any]) -> None:
        for gone in self.sessions.take_dropped():
            self.pins.release(gone.id)
        slot, adm.snapshot = self.pins.pin(
            adm.target, session, key, body, chat=adm.api.name == "chat"
        )
        if slot is not None:
            adm.rewritten = True
            adm.headers["x-prefixreg-slot"] = str(slot)

    def _unpin(self, adm: Admission, evidence: CallEvidence | None) -> None:
        if adm.snapshot and adm.session is not None:
            self.pins.finished(adm.target, adm.session, evidence)
            adm.snapshot = False

    def _miss(self, adm: Admission) -> str | None:
        """Why this call might find its head uncached, before the server says whether it did."""
        head, session = adm.head, adm.session
        if head is None:
            return None
        if adm.drift is not None:
            return f"head changed (drift: {adm.drift.header()})"
        where = self.seen_on.get(head.sha256, {})
        if not where:
            return "first call of this head"
        if session is not None and session.worker not in (None, adm.target):
            return "routed elsewhere (the session's last call went to another worker)"
        if adm.target not in where:
            return "routed elsewhere (the head was served by another worker)"
        return "evicted since the last call"

    # -- after -------------------------------------------------------------------------------
    def tally(self, adm: Admission) -> Tally:
        # The proof folds a stream's text to hash it: a cap per stream bounds what a thousand
        # streams hold at once (the stream itself is forwarded whole, whatever its size).
        return Tally(adm.api, min(self.config.max_reply_bytes, MAX_PROOF_BYTES))

    def settle(
        self, adm: Admission, status: int, data: bytes, *, streamed: bool, added_s: float
    ) -> list[tuple[bytes, bytes]]:
        """Judge a buffered reply; the proof headers to send with it."""
        t0 = time.perf_counter()
        try:
            evidence = evidence_of(adm.api, status, data, wall_s=added_s)
            self._unpin(adm, evidence)
            proof = self._settle(adm, status, evidence, streamed=False)
            adm.headers["x-prefixreg-verdict"] = proof.verdict
            cached = proof.judgement.cached_tokens
            adm.headers["x-prefixreg-cached"] = "" if cached is None else str(cached)
            reason = proof.miss if proof.miss else proof.judgement.reason
            adm.headers["x-prefixreg-reason"] = header_value(reason)
            if adm.session_verdict is not None:
                adm.headers["x-prefixreg-session-verdict"] = adm.session_verdict
        except Exception as exc:  # noqa: BLE001 -- never the loop's failure
            self.failure("judge", exc)
        finally:
            self._unpin(adm, None)
        self.metrics.observe_added(adm.door_s + time.perf_counter() - t0)
        return adm.raw_headers()

    def settle_stream(self, adm: Admission, status: int, tally: Tally, *, added_s: float) -> None:
        t0 = time.perf_counter()
        try:
            evidence = tally.evidence(status, wall_s=added_s, ttft_s=None)
            self._unpin(adm, evidence)
            self._settle(adm, status, evidence, streamed=True)
        except Exception as exc:  # noqa: BLE001 -- never the loop's failure
            self.failure("judge", exc)
        finally:
            self._unpin(adm, None)  # a judge that failed still frees the slot's turn
        self.metrics.observe_added(adm.door_s + time.perf_counter() - t0)

    def failed(self, adm: Admission, status: int, message: str) -> None:
        """An upstream call that got no reply the client could use (unreachable, deadline)."""
        try:
            ev = evidence_from_response({"error": {"status": status}})
            self._unpin(adm, None)
            self._settle(adm, status, ev, streamed=False)
        except Exception as exc:  # noqa: BLE001
            self.failure("judge", exc)

    def abandoned(self, adm: Admission, why: str) -> None:
        self.metrics.add("cancelled_total")
        self.failed(adm, 499, why)

    def _settle(
        self, adm: Admission, status: int, evidence: CallEvidence, *, streamed: bool
    ) -> Proof:
        head, session = adm.head, adm.session
        worker = display_url(adm.target)
        proof = prove(evidence, head, adm.rest_bytes, miss=adm.miss)
        again = None  # the session's previous prompt, judged as the head this call extends
        if head is not None and adm.extends and evidence.cache_state != "unverified":
            seen = (adm.rest_bytes or 0) - text_bytes(adm.history[adm.extends :])
            again = judge(
                evidence, head_bytes=head.head_bytes + seen, rest_bytes=(adm.rest_bytes or 0) - seen
            )
            adm.session_verdict = again.verdict
            if proof.verdict == "resumed" and not again.resumed:
                self.metrics.add("session_misses_total", head=adm.head_label, worker=worker)
        labels = {"head": adm.head_label, "worker": worker}
        self.metrics.add("calls_total", api=adm.api.name, verdict=proof.verdict, **labels)
        prompt, cached = evidence.prompt_tokens, evidence.cached_tokens
        if evidence.cache_state != "unverified" and prompt is not None and cached is not None:
            self.metrics.add("prompt_tokens_total", prompt, **labels)
            self.metrics.add("resumed_tokens_total", cached, **labels)
            self.metrics.add("uncached_tokens_total", prompt - cached, **labels)
        if proof.miss is not None:
            self.metrics.add("misses_total", reason=proof.miss.split(" (")[0], **labels)
        if head is not None and 200 <= status < 300:
            where = self.seen_on.setdefault(head.sha256, {})
            where[adm.target] = where.get(adm.target, 0) + 1
            self.seen_on.move_to_end(head.sha256)
            while len(self.seen_on) > MAX_SEEN_HEADS:
                self.seen_on.popitem(last=False)
        if session is not None and 200 <= status < 300:
            session.head = heads.kept(head) if head is not None else session.head
            session.worker = adm.target
            session.owner = adm.owner
            session.calls += 1
            session.prompt_tokens = prompt
            self.sessions.record(session, adm.chain, head.sha256 if head is not None else None)
        if (
            self.keeper is not None
            and head is not None
            and adm.api.name == "chat"
            and (200 <= status < 300 and adm.body is not None)
            and not self.pins.snapshots_cover(adm.target)
        ):
            self.keeper.saw(adm.target, head, adm.body.get("tools"), adm.body)
        gw = adm.log_view(proof, worker, status, streamed=streamed, again=again)
        if self.log.path is None:  # no log: GET /prefixreg/calls/ID shows the proof alone
            line: JSONObject = {"evidence": evidence.to_dict(), "gateway": dict(gw)}
        else:
            if adm.api.name == "chat" and isinstance((adm.body or {}).get("messages"), list):
                sent: dict[str, Any] = adm.body or {}  # the chat body itself, as forwarded
            else:
                system = head.system if head is not None else None
                sent = calllog.chat_body(system, adm.history, (adm.body or {}).get("tools"))
            line = calllog.record(sent, evidence, gw)
            before = self.log.failures
            self.log.write(line)
            if self.log.failures != before:
                self.metrics.add("failures_total", where="log")
        self.calls[adm.call_id] = line
        while len(self.calls) > MAX_CALLS_KEPT:
            self.calls.popitem(last=False)
        return proof

    # -- the gateway's own routes --------------------------------------------------------------
    def call_record(self, call_id: str) -> JSONObject | None:
        return self.calls.get(call_id)

    def heads_view(self) -> list[JSONObject]:
        """Each head seen: its name, where it was served, what its sessions share after it."""
        out: list[JSONObject] = []
        for sha in self.leads.heads():
            lead = self.leads.view(sha) or {}
            where = self.seen_on.get(sha, {})
            workers: JSONObject = {display_url(w): n for w, n in where.items()}
            out.append({"head": sha, "workers": workers, **lead})
        return out

    def metrics_text(self, *, inflight: int) -> str:
        gauges = {"upstream_inflight": float(inflight), "sessions": float(len(self.sessions))}
        gauges["registered_heads"] = float(self.known.registered)
        gauges["registry_failures"] = float(self.known.failures)
        gauges["registrations_dropped"] = float(self.known.dropped)
        gauges["log_lines"] = float(self.log.lines)
        if self.pins.plan is not None:
            gauges["owned_slots"] = float(self.pins.plan.owned())
        return self.metrics.render(gauges)
