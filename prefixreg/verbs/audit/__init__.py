"""`audit`: token and time accounting over a batch of call outputs, each call judged against
the head it sends (`core.judge`), and the byte identity of each request's system prefix
against the registry. Reads only; writes nothing. Is prompt caching even the lever for this
batch (measured on one night: decode was 73% of the time)? Modules: `identity` (what each
request sent), `read` (the inputs), `run` (the judge's states, the shared head: the use
case; `run_audit` is the entry point), `report` (JSON and text).
"""
