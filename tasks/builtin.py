"""tasks/builtin.py — the task the generator trains on: copy, dataset tasks; the tiny model.

Role
    `make_task(settings, tokenizer, max_len)` returns the task the flags ask for (an --env or the
    built-in multi-turn `reveal` task: tasks/envs.EnvTask, `is_env` True, scored per episode); the
    generator sees only
        prompts: list[Prompt]   training prompts, encoded, too-long ones dropped (walked in epochs:
                                prompts.walk)
        held_out: list[Prompt]  held-out prompts in a fixed order (evaluation takes the first K)
        score(prompt, completion_texts, completion_ids, step)
                                -> (rewards, {name: stats}, unscored indices)
        needs_text: bool        False: `score` reads token ids only, so vLLM skips detokenizing
        dropped_long: int       prompts dropped as too long;  close()
    `rewards` has one float per completion (never None/NaN: tasks/rewards.py's fault rules);
    `score` runs in a worker thread. `build_tiny_model` writes the default model: a random-init
    Qwen2 and a character tokenizer (with `experts`, the `--model TINY_MOE` model: a random-init
    Qwen3-MoE and the same tokenizer).
    Data flows one way, this file -> tasks/prompts.py: `make_task` calls prompts.spec_of and
    prompts.prompt_limit, a dataset task prompts.dataset_rows once and prompts.encode_rows once per
    set; prompts.py never calls back (nor imports this module). rollout.py calls `make_task`;
    nothing here imports the generator.
May touch: the tokenizer, the files tasks/prompts.py is pointed at. No engine, no queue, no
trainer.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tasks import prompts, rewards
from tasks.envs import EnvTask
from tasks.prompts import Prompt

SPECIALS = ["<pad>", "<bos>", "<eos>"]
SYMBOLS = list("0123456789abcdefghij+=_")
ASCII = [chr(i) for i in range(32, 127)] + ["\n", "\t"]  # printable ASCII, newline, tab
# --model TINY_MOE: the copy task on a tiny Qwen3-MoE (build_tiny_model's `experts`)
TINY_MOE = "TINY_MOE"
TINY_MOE_EXPERTS, TINY_MOE_ACTIVE = 8, 2  # experts per MoE layer, experts routed per token
LETTERS = "abcdefghij"
COPY_LENGTH = 3
# A chat template that uses only printable ASCII (so
# the "ascii" tiny tokenizer encodes it faithfully).
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The same with tool use (tasks/tools.py): the schemas in a system block, an assistant's calls in
# the Hermes format tools.parse_tool_calls reads (so a call the model writes renders back to the
# same text), tool results as `tool` messages. Without tools it renders exactly as
# TINY_CHAT_TEMPLATE; the "ascii" tiny model has it.
# (transformers renders templates with trim_blocks: a newline right after a block tag is dropped.)
TINY_TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n{% if messages and messages[0]['role'] == 'system' %}{{ "
    "messages[0]['content'] }}\n"
    "{% endif %}Tools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'To call a tool write <tool_call>{"name": NAME, "arguments": {...}}</tool_call>\n{% endif %}'
    "{% for m in messages %}{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] if m['content'] is not none else '' }}"
    "{% for call in m['tool_calls'] or [] %}{% set f = call['function'] if call['function'] is "
    "defined else call %}"
    '<tool_call>{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}</tool_call>{% "
    "endfor %}{{ '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_model(
    path: str,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    alphabet: str = "copy",
    vocab_size: int = 0,
    experts: int = 0,
) -> str:
    """Write a random-init Qwen2 model and its character tokenizer to `path` (Hugging Face format).

    alphabet="copy": the default 26 symbols (the copy task's), 64 positions.
    alphabet="ascii": one token per printable ASCII character plus newline and tab (100 tokens with
    the specials), 1024 positions and a small chat template with tool use (TINY_TOOL_CHAT_TEMPLATE):
    for trying datasets, prompts, rewards and tools on real text (it is random-init: it writes
    garbage, but the whole path runs). Llama architecture, not Qwen2:
    transformers 5 loads any tokenizer saved next to a Qwen2 config as `Qwen2Tokenizer`, whose
    byte-level pre-tokenizer would drop every space and newline of a character vocabulary.
    vocab_size > the alphabet's: the vocabulary is filled up to that size with tokens `<|N|>` that
    text never encodes to but the model can sample (the LM head and softmax of a real model, e.g.
    151,936). experts > 0 (copy alphabet): a Qwen3-MoE instead, every layer a mixture of `experts`
    experts of `hidden` intermediate units each, TINY_MOE_ACTIVE routed per token (`--model
    TINY_MOE`: 8 experts)."""
    if alphabet not in ("copy", "ascii"):
        raise ValueError(f"alphabet must be 'copy' or 'ascii' (got {alphabet!r})")
    ascii_ = alphabet == "ascii"
    vocab = {tok: i for i, tok in enumerate(SPECIALS + (ASCII if ascii_ else SYMBOLS))}
    vocab.update({f"<|{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    pattern = r"<pad>|<bos>|<eos>|[\s\S]" if ascii_ else "<[a-z]+>|."
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    if ascii_:
        tokenizer.chat_template = TINY_TOOL_CHAT_TEMPLATE
    config_class, model_class = (
        (LlamaConfig, LlamaForCausalLM) if ascii_ else (Qwen2Config, Qwen2ForCausalLM)
    )
    moe = {}
    if experts:
        if ascii_:
            raise ValueError("build_tiny_model: experts with the copy alphabet only")
        config_class, model_class = Qwen3MoeConfig, Qwen3MoeForCausalLM
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=TINY_MOE_ACTIVE,
            moe_intermediate_size=hidden,
            head_dim=hidden // heads,
        )
    config = config_class(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=1024 if ascii_ else 64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
        **moe,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    tmp = path + ".tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path) if not os.path.exists(path) else None
    return path


def is_held_out(letters: str) -> bool:
    """The copy task's fixed held-out split: ~1 triple in 10, chosen by a hash of the triple
    alone."""
    return int.from_bytes(hashlib.sha256(letters.encode()).digest()[:8], "big") % 10 == 0


def match_score(prediction, answer: str) -> float:
    """Matching positions / max(len(prediction), len(answer)): partial credit, and never stopping
    does not pay."""
    matches = sum(p == a for p, a in zip(prediction, answer))
    return matches / max(len(prediction), len(answer), 1)


class CopyTask:
    """Copy 3 letters: `<bos>abc=` -> `abc<eos>`. Reward: matching positions / max(len(prediction),
    len(answer)), the prediction being the tokens before the first `<eos>` (never stopping does not
    pay). Of the 1000 triples ~10% are held out (`is_held_out`) for evaluation; the others are the
    training prompts."""

    names = ["copy"]
    needs_text = False  # scored by token ids: vLLM need not detokenize
    is_env = False

    def __init__(self, tokenizer, limit: int | None = None):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.id_to_token = {i: t for t, i in tokenizer.get_vocab().items()}
        triples = ["".join(t) for t in itertools.product(LETTERS, repeat=COPY_LENGTH)]
        held = [t for t in triples if is_held_out(t)]
        training = [self.encode(t) for t in triples if not is_held_out(t)]
        self.prompts, dropped = prompts.drop_long(training, limit, "training")
        held_out = [self.encode(held[i]) for i in prompts.held_out_order(len(held))]
        self.held_out, dropped_held = prompts.drop_long(held_out, limit, "held-out")
        self.dropped_long = dropped + dropped_held
        if not self.prompts:
            raise RuntimeError(f"every copy prompt is longer than {limit} tokens")

    def encode(self, letters: str) -> Prompt:
        return Prompt(
            self.tokenizer(f"<bos>{letters}=", add_special_tokens=False)["input_ids"], letters
        )

    def reward(self, completion_ids: list[int], answer: str) -> float:
        prediction = []
        for token_id in completion_ids:
            if token_id == self.eos_id:
                break
            prediction.append(self.id_to_token.get(token_id, "?"))
        return match_score(prediction, answer)

    def score(self, prompt: Prompt, completion_texts, completion_ids, step: int = 0):
        t0 = time.perf_counter()
        rewards = [self.reward(ids, prompt.answer) for ids in completion_ids]
        n = len(rewards)
        stats = {
            "n": n,
            "count": n,
            "sum": sum(rewards),
            "sumsq": sum(r * r for r in rewards),
            "none": 0,
            "invalid": 0,
            "errors": 0,
            "time_s": time.perf_counter() - t0,
        }
        return rewards, {"copy": stats}, []

    def close(self):
        pass


class DatasetTask:
    """Prompts from a dataset, scored by TRL-convention reward functions. prompts.dataset_rows loads
    and checks the training and held-out rows; prompts.encode_rows encodes every row when the task
    is built (before training starts), so prompts longer than `limit` tokens are dropped up front,
    counted and reported once."""

    needs_text = True  # reward functions get completion texts (TRL's convention)
    is_env = False

    def __init__(self, spec, tokenizer, limit: int | None = None):
        train_rows, held_rows = prompts.dataset_rows(spec)
        self.scorer = rewards.Scorer(spec.rewards, spec.weights, workers=spec.reward_workers)
        self.names = self.scorer.names
        self.prompts, dropped = prompts.encode_rows(train_rows, tokenizer, spec, limit, "training")
        if not self.prompts:
            raise RuntimeError(
                f"every prompt of {spec.dataset} is longer than {limit} tokens "
                f"(--max-prompt-tokens, or the model's context minus --max-new-tokens)"
            )
        self.held_out, dropped_held = prompts.encode_rows(
            held_rows, tokenizer, spec, limit, "held-out"
        )
        self.dropped_long = dropped + dropped_held

    def score(self, prompt: Prompt, completion_texts, completion_ids, step: int = 0):
        return self.scorer.score(
            prompt.prompt, completion_texts, completion_ids, prompt.columns, step
        )

    def close(self):
        self.scorer.close()


class RevealEnv:
    """The built-in multi-turn task (`--task reveal`): a hidden word of 3 letters that only the
    environment shows, and only when asked. The prompt is `<bos>=`. A model turn that contains `+`
    asks: the env answers with the word and `=` (`abc=`), and scores the next turn like the copy
    task (partial credit; done). Any other turn gets `_=` (nothing shown) and costs a turn
    of --max-turns. So the reward can only be earned by acting (asking), then using what the env
    revealed. The words are the copy task's triples and split."""

    async def reset(self, secret: str, **row):  # async: pure Python, no thread hop per call
        self.secret, self.revealed = secret, False
        return "<bos>="

    async def step(self, action: str):
        if self.revealed:
            return None, match_score(action, self.secret), True
        if "+" in action:
            self.revealed = True
            return f"{self.secret}=", 0.0, False
        return "_=", 0.0, False


def reveal_rows() -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows) of the reveal task: {"secret": triple}, held out (and ordered)
    as the copy task's."""
    triples = ["".join(t) for t in itertools.product(LETTERS, repeat=COPY_LENGTH)]
    held = [t for t in triples if is_held_out(t)]
    return (
        [{"secret": t} for t in triples if not is_held_out(t)],
        [{"secret": held[i]} for i in prompts.held_out_order(len(held))],
    )


def make_task(settings, tokenizer, max_len: int | None = None):
    """The task the run's flags ask for: the copy task (default), a dataset task
    (--dataset / --task), or an env task (--env, --task reveal)."""
    if settings.task == "reveal" or settings.env or settings.tools:
        if settings.task == "reveal":
            return EnvTask(settings, tokenizer, RevealEnv, reveal_rows())
        return EnvTask(settings, tokenizer)
    spec = prompts.spec_of(settings)
    limit = prompts.prompt_limit(settings.max_prompt_tokens, max_len, settings.max_new_tokens)
    if spec is None:
        return CopyTask(tokenizer, limit)
    return DatasetTask(spec, tokenizer, limit)
