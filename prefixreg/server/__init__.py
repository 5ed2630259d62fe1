"""Talking to workers and judging what they say.

- `worker`: the `Worker` API (routes, profile detection, chat); `identity`: what each server
  profile proves, and its build identity;
- `transport`: HTTP with a whole-call deadline and a reply size cap on every call;
- `sse`: event-stream decoding by the spec; `replies`: folding a reply into its parts;
- `evidence`: what a reply proves (`evidence_from_response`); `counters`: `/cache` math;
- `activity`: counters of foreign traffic for keepalive; `slots`: llama.cpp's slot API.

Invariant: imports `core` only, never the registry; only `worker`, `transport`, `activity`
and `slots` do I/O (sse, replies, evidence, counters and identity are pure).
"""
