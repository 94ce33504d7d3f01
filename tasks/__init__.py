"""tasks/ — what the generator trains on: tasks, datasets and prompts, rewards, environments, tools.

Files
    builtin.py: `make_task` (the task the flags ask for); the copy and reveal tasks, dataset tasks;
        the tiny model (`build_tiny_model`)
    datasets.py: a dataset as rows: local files, the Hugging Face hub, reasoning-gym (rg:NAME)
    prompts.py: the data flags (`spec_of`, `check_flags`), the order prompts are used in, prompts
    rewards.py: reward functions in TRL's convention, their `Scorer`; how `module:NAME` resolves
    envs.py: --env loaded and checked, groups of episodes, the env task (`EnvTask`)
    episodes.py: an episode as a chain of engine requests, token in / token out
    protocols.py: the seams of an episode: the env's contract (`Env`), the generator's (`Sampler`)
    tools.py: --tools, TRL's tool functions and environment classes as episode environments
    tool_calls.py: the tool calls of a model turn (vLLM's parsers), the template's tool checks
    textarena.py: TextArena's games as environments (`--env tasks.textarena:TextArenaEnv`)
    data/: the shipped GSM8K sample (`--task gsm8k`)
Data flows one way: rollout.py (and evaluation, prepare, train) call into tasks/; nothing here
imports the generator (an episode sees it through protocols.Sampler) or the trainer.
May touch: nothing on import (this file imports nothing).
"""
