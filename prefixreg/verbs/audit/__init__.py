"""`audit`: token and time accounting over a batch of call outputs, and the byte identity of
each request's system prefix against the registry. Reads only; writes nothing.

The questions it answers: is prompt caching even the lever for this batch? (Measured on one
night: decode was 73% of the time, prefill 27%.) How much of the prompt came from the cache,
what prefill and decode time the batch implies and how closely that closes to the measured
wall time; which registered prefix the batch shares, and which calls drifted from it.

One role per module:

- `prompt`: a request's system prefix as a sha and a length;
- `read`: the inputs (responses, request bodies, request+response pairs, measurement
  records; files, JSON lines, directories walked without following anything);
- `timemodel`: prefill/decode seconds per call;
- `match`: naming the shared prefix by measured token span (a likeness);
- `identity`: byte identity of `messages[0].content` against the registry (by sha256);
- `framedrift`: with `--frame`, which part of each request's head drifted from the frame;
- `report`: the JSON and text report;
- `run`: the use case that ties them to the store.
"""

from __future__ import annotations

from prefixreg.verbs.audit.identity import IdentityReport, Lookup, PromptIdentity, check_identity
from prefixreg.verbs.audit.match import (
    PrefixMatch,
    PrefixSpan,
    match_prefix,
    merge_spans,
    prefix_spans,
    span_tolerance,
)
from prefixreg.verbs.audit.prompt import PromptSeen, SystemPrompt, system_prompt
from prefixreg.verbs.audit.read import (
    JSON_SUFFIXES,
    JSONL_SUFFIXES,
    WALL_KEYS,
    AuditCall,
    AuditInput,
    Malformed,
    read_outputs,
)
from prefixreg.verbs.audit.report import AuditReport, TokenStat
from prefixreg.verbs.audit.run import audit_calls, registry_lookup, run_audit
from prefixreg.verbs.audit.timemodel import (
    DEFAULT_DECODE_TPS,
    DEFAULT_PREFILL_TPS,
    CallTime,
    call_time,
)

__all__ = [
    "DEFAULT_DECODE_TPS",
    "DEFAULT_PREFILL_TPS",
    "JSONL_SUFFIXES",
    "JSON_SUFFIXES",
    "WALL_KEYS",
    "AuditCall",
    "AuditInput",
    "AuditReport",
    "CallTime",
    "IdentityReport",
    "Lookup",
    "Malformed",
    "PrefixMatch",
    "PrefixSpan",
    "PromptIdentity",
    "PromptSeen",
    "SystemPrompt",
    "TokenStat",
    "audit_calls",
    "call_time",
    "check_identity",
    "match_prefix",
    "merge_spans",
    "prefix_spans",
    "read_outputs",
    "registry_lookup",
    "run_audit",
    "span_tolerance",
    "system_prompt",
]
