"""tasks/examples/my_rewards.py — reward functions as a researcher writes them (TRL's GRPOTrainer
convention).

Role
    A template to copy, and the user module the tests load. Use with
    `--reward tasks/examples/my_rewards.py:format_reward` (a file path) or `--reward
    tasks.examples.my_rewards:format_reward` (a module on the path); several: `--reward
    math,tasks/examples/my_rewards.py:format_reward --reward-weights 1,0.2`.

Data contract
    Each function is called with keyword arguments, one list entry per completion:
    `prompts`, `completions` (strings, or [{"role": "assistant", "content": ...}] for chat prompts),
    `completion_ids`, `trainer_state` (`.global_step`), and every dataset column under its own name
    (the answer column also as `answer`). Take `**kwargs` for what you do not use.
    Return one float per completion, or None where the function does not apply.
"""

import re


def _text(completion) -> str:
    """A completion as text, for plain-text and chat datasets alike."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion ends with a GSM8K-style final line `#### <number>`, else 0.0."""
    pattern = re.compile(r"####\s*-?[\d,]*\.?\d+\s*$")
    return [1.0 if pattern.search(_text(c).strip()) else 0.0 for c in completions]


def brevity_reward(completion_ids, **kwargs) -> list[float]:
    """Shorter is better: 1 / (1 + tokens / 100)."""
    return [1.0 / (1.0 + len(ids) / 100) for ids in completion_ids]


def numbers_from_question(prompts, completions, **kwargs) -> list[float | None]:
    """Share of the question's numbers that the completion mentions; None when the question has
    none."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        question = _text(prompt) if isinstance(prompt, list) else prompt
        wanted = set(re.findall(r"\d+", question))
        if not wanted:
            rewards.append(None)
            continue
        rewards.append(len(wanted & set(re.findall(r"\d+", _text(completion)))) / len(wanted))
    return rewards
