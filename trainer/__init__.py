"""trainer/ — the trainer's parts: what an FSDP2 rank builds, scores with and saves.

Files
    models.py: the policy, the reference and the teacher, sharded with FSDP2 (one copy of the
        weights per node while loading); activation checkpointing
    logprobs.py: log-probs of sampled tokens under the generator's sampling distribution, a chunk
        of the LM head at a time, with each model family's head transform (copyable alone)
    heads.py: which families the trainer scores as vLLM samples them, and why a model is refused
    packing.py: sequence packing (--packing): micro-batches that run no padding
    checkpoint.py: sharded, atomic checkpoints (DCP) and what a resume needs; the final model
    lora.py: LoRA adapters (--lora-rank): what trains, what the generator serves, the merge
    replay.py: routing replay (--router-replay): MoE layers route as the generator routed
Data flows one way: update.py and train.py call into trainer/; nothing here imports the generator,
the loop or run/. May touch: the models and optimizers it is given, files under --out.
"""
