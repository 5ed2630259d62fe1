"""Use cases that join a registry and a worker (warm, probe, keepalive, mirror, audit, doctor,
snapshot, pool). Each asks the store for bytes and records and the server layer for calls;
none builds a registry path itself."""
