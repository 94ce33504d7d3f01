"""generator/ — the generator's parts: the vLLM engine's side of the weights and of MoE routes.

Files
    shared_weights.py: the packed weight buffer and its seqlock, shared between the trainer and
        the generator's workers (copyable alone)
    vllm_worker.py: the vLLM worker extension (`generator.vllm_worker.WeightSyncWorker`): reads
        the buffer into the engine's weights, records MoE routes
    weight_swaps.py: when new weights go into the running engine, between engine steps
    routes.py: the experts each MoE layer sent every sampled token to, recorded per token
Data flows one way: rollout.py (and tasks/' episodes for routes) call into generator/; nothing here
imports the trainer, the loop or run/. May touch: the engine's weights, in the engine's processes.
"""
