"""Talking to workers and judging what they say: `worker` (the `Worker` API), `engines`
(every profile and engine: detection, what it proves, its build identity, the zero rule,
Prometheus counters), `transport` (HTTP with a whole-call deadline and a reply cap), `sse`
and `replies` (decoding a reply), `evidence` (what it proves), `counters` (`/cache` math),
`activity` (foreign traffic for keepalive), `slots` (llama.cpp).

Invariant: imports `core` only, never the registry; only `worker`, `transport`, `activity`
and `slots` do I/O (sse, replies, evidence, counters and engines are pure).
"""
