"""What `doctor` says: findings (`ok`, `info`, or `warn`: something to change) and the numbers
they quote, gathered in one `Diagnosis` that every doctor module adds to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from prefixreg.core.jsonio import JSONObject, JSONValue

Level = Literal["ok", "info", "warn"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One observation: `warn` means something to change."""

    level: Level
    topic: str
    text: str


@dataclass(slots=True)
class Diagnosis:
    """Everything doctor found, and the numbers it used."""

    profile: str
    findings: list[Finding] = field(default_factory=list)
    numbers: dict[str, JSONValue] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return not any(f.level == "warn" for f in self.findings)

    def add(self, level: Level, topic: str, text: str) -> None:
        self.findings.append(Finding(level, topic, text))

    def to_dict(self) -> JSONObject:
        return {**asdict(self), "healthy": self.healthy}

    @property
    def outcome(self) -> str:
        return "healthy" if self.healthy else "unhealthy"

    def receipt(self, worker_url: str) -> JSONObject:
        """The `--json` output: the worker asked, then the diagnosis."""
        return {"worker": worker_url, **self.to_dict()}

    def text(self, worker_url: str) -> str:
        """The findings a person reads, under the worker asked."""
        lines = [f"worker {worker_url} ({self.profile})"]
        lines += [f"  [{f.level}] {f.text}" for f in self.findings]
        return "\n".join(lines) + "\n"
