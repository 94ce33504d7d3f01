"""generator/ — the generator's parts: its vLLM engine, its counters, the engine's side of the
weights and of MoE routes.

Files
    shared_weights.py: the packed weight buffer and its seqlock, shared between the trainer and
        the generator's workers (copyable alone)
    vllm_worker.py: the vLLM worker extension (`generator.vllm_worker.WeightSyncWorker`): reads
        the buffer into the engine's weights, records MoE routes
    weight_swaps.py: when new weights go into the running engine, between engine steps
    routes.py: the experts each MoE layer sent every sampled token to, recorded per token
    engine.py: the vLLM engine (built, shut down) and each request's sampling params and prompt
    counters.py: the generator's counters (`GeneratorStats`) and the engine's idle time
Data flows one way: rollout.py (and tasks/' episodes for routes) call into generator/; nothing here
imports the trainer, the loop, run/ or tasks/ (tasks/ imports routes.py). May touch: the engine
and its weights, in the engine's processes.
"""
