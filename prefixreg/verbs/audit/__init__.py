"""`audit`: token and time accounting over a batch of call outputs, each call judged against the
head it sends (`core.judge`), and the byte identity of each request's system prefix against the
registry. Reads only; writes nothing. Is prompt caching even the lever for this batch (measured on
one night: decode was 73% of the time)? The use case is `run.run_audit`; `read` and `aiperf` read
the inputs, `identity` what each request sent, `saving` what caching saved, `report` and `html`
show it.
"""
