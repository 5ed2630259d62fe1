"""One call as the door admitted it: where it goes, what is sent, what is known of its head,
and the gateway's part of its call-log line. Plain data; the door fills it in.

Invariants: header values are ASCII and single-line (`header_value`); the log view holds
hashes, counts and names only, never prompt text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixreg.core.judge import Judgement
from prefixreg.gateway import head as heads
from prefixreg.gateway.apis import Api, clean_message
from prefixreg.gateway.proof import Proof
from prefixreg.gateway.sessions import Session


def header_value(text: str) -> str:
    return clean_message(text).encode("ascii", "replace").decode("ascii")


@dataclass
class Admission:
    """One call as admitted: where it goes, what is sent, what is known of its head."""

    call_id: str
    api: Api
    started: float
    target: str
    content: bytes
    body: dict[str, Any] | None = None
    upstream_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    refuse: str | None = None
    head: heads.Head | None = None
    head_label: str = "none"
    session: Session | None = None
    chain: list[str] = field(default_factory=list)
    history: list[Any] = field(default_factory=list)
    rest_bytes: int | None = None
    drift: heads.HeadDrift | None = None
    extends: int = 0  # leading history messages the session's last call sent
    session_verdict: str | None = None  # the judge's, against the session's last prompt
    strips: int = 0
    miss: str | None = None
    door_s: float = 0.0
    owner: str | None = None  # `sessions.owner_of` this call's headers
    rewritten: bool = False  # the body changed at the door (a pinned slot): re-serialised
    snapshot: bool = False  # pinned for `Snapshots`: its slot is saved once the call is over

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        return [(k.encode("ascii"), v.encode("ascii")) for k, v in self.headers.items()]

    def log_view(
        self, proof: Proof, worker: str, status: int, *, streamed: bool, again: Judgement | None
    ) -> dict[str, Any]:
        """The `gateway` part of this call's call-log line."""
        head, session = self.head, self.session
        return {
            "call": self.call_id,
            "api": self.api.name,
            "head": head.sha256 if head is not None else None,
            "head_name": self.head_label if head is not None else None,
            "session": session.id if session is not None else None,
            "worker": worker,
            "status": status,
            "streamed": streamed,
            "verdict": proof.verdict,
            "reason": proof.judgement.reason,
            "miss": proof.miss,
            "judgement": proof.judgement.to_dict(),
            "session_judgement": None if again is None else again.to_dict(),
            "extends": self.extends,
            "drift": self.drift.log_view() if self.drift is not None else None,
            "strips": self.strips,
            "door_ms": round(self.door_s * 1000, 3),
        }
