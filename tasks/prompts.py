"""tasks/prompts.py — bring your own data: the data flags, the order prompts are used in, prompts.

Role: from the data flags and a dataset's rows to the token ids the generator samples from, with
no engine and no trainer in sight (importable without vLLM or torch): `spec_of` (flags ->
DataSpec; the built-in `GSM8K` preset, with --data-dir GSM8K's own files, `--task rg:NAME`),
`check_flags` (prepare.check: the data flags, one line per problem), `eval_source` (where the
held-out prompts come from), `walk` (the order prompts are used in), `encode_prompt` (chat template
for message lists, `--system-prompt`).
Rows: tasks/datasets.py. Reward functions: tasks/rewards.py.
Data flows one way, tasks/builtin.py and tasks/envs.py -> this file: `spec_of`, `prompt_limit`,
`dataset_rows` (training and held-out rows), `encode_rows` (rows -> Prompts, too-long ones
dropped); it imports neither.
Data contract: a row is a dict; its prompt column holds a string or a list of {"role", "content"}
messages. `walk(g, n, seed)` gives group id g the row of epoch g // n.
May touch: the files it is pointed at (and the Hugging Face cache). Nothing of the engine or the
trainer.
"""

from __future__ import annotations

import functools
import math
import os
import random
import re
import sys
from dataclasses import dataclass, field, replace

from tasks import chat
from tasks.chat import plain_prompt, uses_chat_template  # (the rules episodes share: chat.Renderer)
from tasks.datasets import (  # noqa: F401 (also prompts.X)
    RG,
    DataError,
    check_rows,
    is_file,
    is_rg,
    load_rows,
    load_splits,
    rg_dataset,
    rg_module,
    rg_name,
    row_columns,
)

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Prompt:
    """One prompt as the generator samples it (tasks/builtin.py and tasks/envs.py make them from
    rows)."""

    prompt_ids: list[int]
    answer: str
    # keyword arguments for reward functions (the row's columns)
    columns: dict = field(default_factory=dict)
    prompt: object = None  # the prompt as the dataset gives it (text or messages): what rewards see
    # an env task: reset's keyword arguments (the row's columns)
    row: dict = field(default_factory=dict)


BUILTIN_REWARDS = {
    "math": "tasks.rewards:math_reward",  # --reward NAME
    "rg": "tasks.rewards:reasoning_gym_reward",
}
GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem step by step. "
    "End with the final answer on its own line, as '#### <number>'."
)
# The GSM8K-style task (`--task gsm8k`): a preset for the dataset task; flags given explicitly win.
# With --data-dir, GSM8K itself from the user's copy: GSM8K_FILES' training file and held-out file.
GSM8K_FILES = ("train.jsonl", "test.jsonl")
GSM8K = {
    "dataset": os.path.join(HERE, "data", "gsm8k_sample.jsonl"),
    "prompt_column": "question",
    "answer_column": "answer",
    "reward": "math",
    "system_prompt": GSM8K_SYSTEM_PROMPT,
}
# The names --task takes, besides rg:NAME; reveal is the built-in multi-turn task.
TASKS = ("auto", "copy", "dataset", "gsm8k", "reveal")


# --------------------------------------------------------------------------------------------------
# Flags -> what the generator needs
# --------------------------------------------------------------------------------------------------
@dataclass
class DataSpec:
    """The resolved data/reward settings of a dataset task (the copy task has none)."""

    dataset: str
    split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    rewards: tuple = ()  # "module:function" specs
    weights: tuple = ()  # one float per spec
    system_prompt: str = ""
    reward_workers: int = 0
    eval_dataset: str = ""  # "": the held-out prompts are `dataset`'s test split, when it has one
    eval_split: str = ""  # "": "test"


def split_list(text: str) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


@dataclass
class DataFlags:
    """The data flags `resolve` reads, under config.Config's names and with its defaults."""

    task: str = "auto"
    dataset: str = ""
    split: str = "train"
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    reward: str = ""
    reward_weights: str = ""
    system_prompt: str = ""
    reward_workers: int = 0
    eval_dataset: str = ""
    eval_split: str = ""
    env: str = ""
    teacher: str = ""
    data_dir: str = ""


def resolve(task: str = "auto", **flags) -> DataSpec | None:
    """The flags' data settings (DataFlags' names; None for the built-in copy and reveal tasks;
    raises DataError). `env` makes the dataset (rows for reset) and rewards optional, `teacher` the
    rewards (none: all 0, it learns from the teacher); `data_dir` the user's copy of GSM8K
    (`gsm8k_files`)."""
    flags = with_task(DataFlags(task=task, **flags))
    if flags.task in ("copy", "reveal"):
        refuse_own_data(flags)
        return None
    flags = with_preset(flags)
    check_sources(flags)
    specs = reward_specs(flags.reward)
    weights = weights_of(flags.reward_weights, len(specs))
    if flags.reward_workers < 0:
        raise DataError(f"--reward-workers must be >= 0 (got {flags.reward_workers})")
    return DataSpec(
        dataset=flags.dataset,
        split=flags.split,
        prompt_column=flags.prompt_column,
        answer_column=flags.answer_column,
        rewards=tuple(specs),
        weights=tuple(weights),
        system_prompt=flags.system_prompt,
        reward_workers=flags.reward_workers,
        eval_dataset=flags.eval_dataset,
        eval_split=flags.eval_split,
    )


def with_task(flags: DataFlags) -> DataFlags:
    """The task checked and named (`auto`: a dataset task when there is a dataset or an env, else
    the copy task); with --data-dir, GSM8K's files where no flag names others."""
    task, data_dir = flags.task, flags.data_dir
    if task not in TASKS and not task.startswith(RG):
        raise DataError(f"--task must be one of {', '.join(TASKS)} or rg:NAME (got {task!r})")
    if task == "auto":
        task = "dataset" if flags.dataset or flags.env else "copy"
    if data_dir and task != "gsm8k":
        raise DataError(
            f"--data-dir {data_dir} holds a built-in task's files: it needs --task gsm8k "
            "(another dataset: --dataset and --eval-dataset)"
        )
    if not data_dir:
        return replace(flags, task=task)
    train_file, test_file = gsm8k_files(data_dir)
    return replace(
        flags,
        task=task,
        dataset=flags.dataset or train_file,
        eval_dataset=flags.eval_dataset or test_file,
    )


def refuse_own_data(flags: DataFlags):
    """The copy and reveal tasks have their own data: DataError when a data flag was given."""
    if flags.dataset or flags.reward or flags.eval_dataset or flags.eval_split or flags.env:
        raise DataError(
            f"the {flags.task} task has its own data and reward (and held-out set): --dataset, "
            "--reward, --eval-dataset, --eval-split and --env need --task auto, dataset or gsm8k"
        )


def with_preset(flags: DataFlags) -> DataFlags:
    """A preset task's values for whatever was left at its default: GSM8K's, or reasoning-gym's
    (its rows, its system prompt asking for answers in <answer> tags, its scorer)."""
    if flags.task == "gsm8k":
        return replace(
            flags,
            dataset=flags.dataset or GSM8K["dataset"],
            prompt_column=GSM8K["prompt_column"]
            if flags.prompt_column == "prompt"
            else flags.prompt_column,
            reward=flags.reward or GSM8K["reward"],
            system_prompt=flags.system_prompt or GSM8K["system_prompt"],
        )
    if not flags.task.startswith(RG):
        return flags
    if flags.dataset or flags.eval_dataset or flags.eval_split:
        raise DataError(
            f"--task {flags.task} generates its own training and held-out rows: --dataset, "
            "--eval-dataset and --eval-split do not apply"
        )
    return replace(
        flags,
        dataset=RG + rg_name(flags.task),
        prompt_column="question",
        answer_column="answer",
        reward=flags.reward or "rg",
        system_prompt=flags.system_prompt or rg_module("utils").SYSTEM_PROMPTS["default"],
    )


def check_sources(flags: DataFlags):
    """DataError unless the task has prompts (a dataset or an env) and a reward (a reward
    function, an env's rewards or a teacher)."""
    if not flags.dataset and not flags.env:
        raise DataError(
            "--task dataset needs --dataset (a .jsonl/.json/.parquet file or a Hugging Face "
            "dataset name)"
        )
    if not flags.dataset and (flags.eval_dataset or flags.eval_split):
        raise DataError(
            "--eval-dataset / --eval-split: an --env without --dataset has its own held-out rows"
        )
    if not flags.reward and not flags.env and not flags.teacher:
        raise DataError(
            "a dataset task needs --reward module:function (or --reward math), or --teacher to "
            "learn from a teacher alone"
        )


def reward_specs(reward: str) -> list[str]:
    """--reward's "module:function" specs, the built-in names expanded (DataError: malformed)."""
    specs = [BUILTIN_REWARDS.get(s, s) for s in split_list(reward)]
    for spec in specs:
        module, _, func = spec.rpartition(":")
        if not module or not func.isidentifier():
            raise DataError(
                f"--reward {spec!r}: expected module:function or path/to/file.py:function "
                f"(built-in: {', '.join(BUILTIN_REWARDS)})"
            )
    return specs


def weights_of(text: str, count: int) -> list[float]:
    """--reward-weights for `count` reward functions: each 1.0 when it is not given."""
    if not text:
        return [1.0] * count
    try:
        weights = [float(w) for w in split_list(text)]
    except ValueError:
        raise DataError(f"--reward-weights {text!r}: expected comma-separated numbers") from None
    if len(weights) != count:
        raise DataError(
            f"--reward-weights has {len(weights)} value(s) for {count} reward function(s)"
        )
    if not all(math.isfinite(w) for w in weights):
        raise DataError(f"--reward-weights {text!r}: weights must be finite")
    return weights


def gsm8k_files(folder: str) -> tuple[str, str]:
    """(training file, held-out file) of a copy of GSM8K in `folder` (DataError: one is missing)."""
    paths = tuple(os.path.join(folder, name) for name in GSM8K_FILES)
    missing = [name for name, path in zip(GSM8K_FILES, paths) if not os.path.isfile(path)]
    if missing:
        raise DataError(
            f"--data-dir {folder} has no {' or '.join(missing)}: give the folder holding GSM8K's "
            f"{' and '.join(GSM8K_FILES)} (openai/grade-school-math, grade_school_math/data)"
        )
    return paths


def spec_of(settings) -> DataSpec | None:
    """`resolve` for an object with the flags as attributes (config.Config)."""
    return resolve(
        task=settings.task,
        dataset=settings.dataset,
        split=settings.split,
        prompt_column=settings.prompt_column,
        answer_column=settings.answer_column,
        reward=settings.reward,
        reward_weights=settings.reward_weights,
        system_prompt=settings.system_prompt,
        reward_workers=settings.reward_workers,
        eval_dataset=settings.eval_dataset,
        eval_split=settings.eval_split,
        env=getattr(settings, "env", ""),
        teacher=getattr(settings, "teacher", ""),
        data_dir=getattr(settings, "data_dir", ""),
    )


def check_flags(cfg) -> list[str]:
    """prepare.check's data/reward check: one line per problem, before any process starts. Loads the
    training and held-out rows (a Hugging Face dataset downloads into its cache here, for the
    generator); rewards.check: rewards."""
    try:
        spec = spec_of(cfg)
    except DataError as e:
        return [str(e)]
    if spec is None:
        refused = (
            "--stop: the copy task ends its answers with <eos>; stop strings are for dataset tasks"
        )
        return [refused] if cfg.stop else []
    if not spec.dataset:  # an --env without a dataset: its rows are seeds (envs.EnvTask)
        return []
    # rows it generates are always complete: only whether the dataset builds
    if is_rg(spec.dataset):
        try:
            rg_dataset(spec.dataset, spec.split)
            return []
        except DataError as e:
            return [str(e)]
    problems = []
    sources = [("--dataset", spec.dataset, spec.split)]
    try:
        held_out = eval_source(spec)
        if held_out is not None and held_out != (spec.dataset, spec.split):
            sources.append(("--eval-dataset", *held_out))
    except DataError as e:
        problems.append(flagged("--eval-dataset" if spec.eval_dataset else "--dataset", e))
    for flag, dataset, split in sources:
        try:
            rows = load_rows(dataset, split)
        except DataError as e:
            problems.append(flagged(flag, e))
            continue
        try:
            check_rows(
                rows, spec.prompt_column, spec.answer_column, required=not getattr(cfg, "env", "")
            )
        except DataError as e:
            problems.append(str(e).replace("\n", "\n  "))
    # the training set and the held-out set may share a problem
    return list(dict.fromkeys(problems))


def stop_strings(values) -> tuple[str, ...]:
    """--stop values with `\\n`, `\\t` and `\\\\` unescaped (`--stop '\\n\\n'` is two newlines)."""
    escapes = {"n": "\n", "t": "\t", "\\": "\\"}
    return tuple(re.sub(r"\\([nt\\])", lambda m: escapes[m.group(1)], v) for v in values)


def flagged(flag: str, error: DataError) -> str:
    """A loading error ("NAME: why") named by the flag that gave the dataset."""
    return str(error) if str(error).startswith("--") else f"{flag} {error}"


def has_eval_set(cfg) -> bool:
    """Whether the run has held-out prompts: the copy task always; a dataset task
    with --eval-dataset, or with a Hugging Face dataset that has a test split (or the --eval-split
    asked for)."""
    spec = spec_of(cfg)
    return spec is None or not spec.dataset or eval_source(spec) is not None


def eval_source(spec: DataSpec) -> tuple[str, str] | None:
    """(dataset, split) of the held-out prompts; None when there are none. Raises DataError when the
    split asked for does not exist. A file has no splits: it is held out only when given
    as --eval-dataset."""
    dataset = spec.eval_dataset or spec.dataset
    if is_rg(dataset):
        return dataset, "test"
    if is_file(dataset):
        if spec.eval_split and not spec.eval_dataset:
            raise DataError(
                f"--eval-split {spec.eval_split}: {dataset} is a file, it has no splits; give the "
                "held-out prompts with --eval-dataset"
            )
        return (dataset, "") if spec.eval_dataset else None
    split = spec.eval_split or "test"
    splits = load_splits(dataset)
    if split in splits:
        return dataset, split
    if spec.eval_split:
        raise DataError(
            f"--eval-split {split}: {dataset} has no such split (splits: {', '.join(splits)})"
        )
    return None


# --------------------------------------------------------------------------------------------------
# The order prompts are used in
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    """The rows of one epoch in the order they are used: a shuffle seeded by (seed, epoch)."""
    order = list(range(n))
    random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
    return tuple(order)


def walk(group_id: int, n: int, seed: int) -> tuple[int, int]:
    """(epoch, row) of group `group_id`: every row once per epoch, in an order shuffled per
    epoch."""
    epoch, position = divmod(group_id, n)
    return epoch, epoch_order(n, seed, epoch)[position]


def held_out_order(n: int) -> list[int]:
    """The fixed order of a held-out set (the same for every seed): --eval-prompts K takes the first
    K."""
    order = list(range(n))
    random.Random("held-out").shuffle(order)
    return order


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------
def render_prompt(tokenizer, prompt, system_prompt: str = "") -> str:
    """The text the model sees: chat template for messages, the plain text otherwise (see module
    doc)."""
    if not uses_chat_template(tokenizer, prompt, system_prompt):
        return plain_prompt(prompt, system_prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the prompt is a list of chat messages but the tokenizer has no chat template: give "
            "plain-text prompts, a model whose tokenizer has one, or --chat-template FILE"
        )
    return chat.render(tokenizer, messages, True)  # (with --chat-template-kwargs)


def encode_prompt(tokenizer, prompt, system_prompt: str = "") -> list[int]:
    """Token ids of the rendered prompt. A chat template writes its own special tokens (BOS
    included); plain text gets the tokenizer's usual ones, as vLLM does for a text prompt."""
    text = render_prompt(tokenizer, prompt, system_prompt)
    chat = uses_chat_template(tokenizer, prompt, system_prompt)
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


# --------------------------------------------------------------------------------------------------
# From a DataSpec to prompts: what tasks/builtin.py (and tasks/envs.py) call, each once per set
# --------------------------------------------------------------------------------------------------
def prompt_limit(
    max_prompt_tokens: int = 0, max_len: int | None = None, max_new_tokens: int = 0
) -> int | None:
    """The longest prompt kept: --max-prompt-tokens, and room for --max-new-tokens within the
    context."""
    limits = ([max_prompt_tokens] if max_prompt_tokens else []) + (
        [max_len - max_new_tokens] if max_len else []
    )
    return min(limits) if limits else None


def dataset_rows(spec: DataSpec, check: bool = True) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of `spec`'s dataset, the held-out ones (eval_source's; none
    when it has none) in held_out_order. `check`: check_rows on both (an --env's rows are not
    checked)."""
    train = load_rows(spec.dataset, spec.split)
    if check:
        check_rows(train, spec.prompt_column, spec.answer_column)
    source = eval_source(spec)
    held = load_rows(*source) if source is not None else []
    if check and source is not None:
        check_rows(held, spec.prompt_column, spec.answer_column)
    return [row for _, row in train], [held[i][1] for i in held_out_order(len(held))]


def encode_rows(
    rows: list[dict], tokenizer, spec: DataSpec, limit: int | None, what: str
) -> tuple[list[Prompt], int]:
    """(prompts, how many dropped) of dataset rows: encode_prompt, the columns rewards get
    (row_columns), and those longer than `limit` tokens dropped (drop_long; `what`: "training" or
    "held-out", in its report)."""
    column, answer = spec.prompt_column, spec.answer_column
    prompts = [
        Prompt(
            encode_prompt(tokenizer, row[column], spec.system_prompt),
            str(row[answer]),
            row_columns(row, column, answer),
            row[column],
        )
        for row in rows
    ]
    return drop_long(prompts, limit, what)


def drop_long(prompts: list[Prompt], limit: int | None, what: str) -> tuple[list[Prompt], int]:
    """The prompts of at most `limit` tokens, and how many were dropped (reported once, here)."""
    if limit is None:
        return prompts, 0
    kept = [p for p in prompts if len(p.prompt_ids) <= limit]
    dropped = len(prompts) - len(kept)
    if dropped:
        print(
            f"[data] {dropped} of {len(prompts)} {what} prompts are longer than {limit} tokens: "
            "dropped before training (--max-prompt-tokens, or too long to leave room for "
            "--max-new-tokens in the model's context)",
            file=sys.stderr,
            flush=True,
        )
    return kept, dropped
