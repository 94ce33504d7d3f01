"""infra/ — process and device plumbing, under everything else.

Files
    processes.py: spawning children, the run's control flags, waits with timeouts, exits
    devices.py: which local devices the generator and the trainer ranks get, dtypes, GPU checks
    kv_cache.py: vLLM's CPU KV cache sized to what a run keeps in flight
    tracing.py: the trace events every process records (copyable alone)
Data flows one way: everything may import infra/; infra/ imports nothing of the project's (but
devices.py its neighbour kv_cache.py). May touch: process state, environment variables of the
process it runs in, files under --out/trace.
"""
