"""Talking to workers and judging what they say: `worker` (the `Worker` API), `identity`
(what each profile proves, its build identity), `engines` (vLLM, SGLang, TensorRT-LLM,
Ollama: detection, identity, the zero rule, Prometheus counters), `transport` (HTTP with a
whole-call deadline and a reply cap), `sse` and `replies` (decoding a reply), `evidence`
(what it proves), `counters` (`/cache` math), `activity` (foreign traffic for keepalive),
`slots` (llama.cpp).

Invariant: imports `core` only, never the registry; only `worker`, `transport`, `activity`
and `slots` do I/O (sse, replies, evidence, counters, identity and engines are pure).
"""
