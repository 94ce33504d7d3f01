"""tasks/datasets.py — a dataset as rows: local files, the Hugging Face hub, reasoning-gym.

Role: `load_rows` (JSONL, JSON, Parquet, a Hugging Face dataset by hub name or folder, or
reasoning-gym's procedural datasets: `--task rg:NAME`, rows generated here by `rg_rows`),
`load_splits` (a Hugging Face dataset's splits), `check_rows` (every row has a usable prompt and
answer), `row_columns` (what a row gives reward functions). Importable without vLLM or torch;
`datasets`, `pyarrow` and `reasoning_gym` are imported only when a dataset needs them.
Data contract: a row is a dict; its prompt column holds a string or a list of {"role", "content"}
messages. Rows come as [(where, row)]: `where` names the row in error messages. Problems raise
`DataError`, worded for the user, one line per problem. tasks/prompts.py turns rows into prompts;
this file imports nothing of the project.
May touch: the files it is pointed at (and the Hugging Face cache). Nothing of the engine or the
trainer.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import logging
import os
import socket
import sys
from urllib.parse import urlparse

# `--task rg:NAME`: reasoning-gym's dataset NAME, generated (no download): training rows from one
# seed, held-out rows from another, less the training questions (row i's seed is seed + i: seeds
# further apart than a split).
RG = "rg:"
RG_SIZES = {"train": 1000, "test": 200}
RG_SEEDS = {"train": 0, "test": 1_000_000}
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A problem with the user's data or reward spec, worded for the user (one line per problem)."""


def is_local(dataset: str) -> bool:
    return (
        dataset.endswith(LOCAL_SUFFIXES)
        or os.path.exists(dataset)
        or dataset.startswith((".", "/", "~"))
    )


def is_file(dataset: str) -> bool:
    """A dataset given as one file (JSONL, JSON, Parquet): it has no splits."""
    return is_local(dataset) and not os.path.isdir(os.path.expanduser(dataset))


# --------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------
def load_rows(dataset: str, split: str = "train") -> list[tuple[str, dict]]:
    """[(where, row)]: `where` names the row for error messages ("file.jsonl line 7", "NAME[split]
    row 7")."""
    if is_rg(dataset):
        return rg_rows(dataset, split)
    path = os.path.expanduser(dataset)
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # optional: Parquet files only
        except ImportError:
            raise DataError("reading Parquet needs pyarrow: pip install pyarrow") from None
        rows = pq.read_table(path).to_pylist()
        return [(f"{dataset} row {i + 1}", row) for i, row in enumerate(rows)]
    if path.endswith((".jsonl", ".json")) and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if path.endswith(".json") and text.lstrip().startswith("["):  # one JSON list of rows
            return [(f"{dataset} row {i + 1}", row) for i, row in enumerate(json.loads(text))]
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{dataset} line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{dataset} line {n}: not valid JSON ({e.msg}, column {e.colno})"
                ) from None
        return rows
    if is_file(dataset):
        what = "not a .jsonl, .json or .parquet file" if os.path.exists(path) else "no such file"
        raise DataError(f"{dataset}: {what}")
    splits = load_splits(dataset)
    if split not in splits:
        raise DataError(
            f"{dataset}: no split {split!r} (splits: {', '.join(splits)}); choose one with --split "
            "or --eval-split"
        )
    return [(f"{dataset}[{split}] row {i + 1}", row) for i, row in enumerate(splits[split])]


def hub_unreachable() -> bool:
    """True when the hub's host does not resolve (no network): loading goes offline at once (cache
    only), not ~25 s of retries. Sets HF_HUB_OFFLINE here, for child processes, and in
    `huggingface_hub`/`datasets` if imported."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # behind a proxy the hub's name need not resolve here
    host = (
        urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
        or "huggingface.co"
    )
    try:
        socket.getaddrinfo(host, 443)
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        for module, name in (
            ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
            ("datasets.config", "HF_HUB_OFFLINE"),
        ):
            if module in sys.modules:  # they read the variable when imported
                setattr(sys.modules[module], name, True)
        return True


@functools.lru_cache(maxsize=8)
def load_splits(dataset: str) -> dict:
    """{split: rows} of a Hugging Face dataset: hub name `NAME[:CONFIG]` (downloaded once into its
    cache), or a folder of data files or `save_to_disk`'s (a saved `Dataset`, not a `DatasetDict`:
    split "train"). DataError."""
    path = os.path.expanduser(dataset)
    local = os.path.isdir(path)
    offline = False if local else hub_unreachable()
    try:
        # optional, and only once HF_HUB_OFFLINE is decided: the hub reads it at import
        import datasets
    except ImportError:
        raise DataError(
            f"{dataset}: a Hugging Face dataset needs `pip install datasets` "
            "(it is in requirements.txt; or give a .jsonl/.parquet file)"
        ) from None
    # The hub client logs each retry of a failed request; the one line we raise says it all.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    datasets.logging.set_verbosity_error()
    try:
        saved = local and any(
            os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json")
        )
        if saved:  # written by Dataset(Dict).save_to_disk
            loaded = datasets.load_from_disk(path)
        elif local:
            loaded = datasets.load_dataset(path)
        else:
            name, _, config = dataset.partition(":")
            loaded = datasets.load_dataset(name, config or None)
    except Exception as e:
        raise DataError(f"{dataset}: {load_failure(e, offline)}") from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    return dict(loaded)


def is_rg(dataset: str) -> bool:
    return dataset.startswith(RG)


def rg_module(name: str = ""):
    """reasoning_gym (or its submodule `name`), or the one-line DataError saying how to install
    it."""
    try:
        return importlib.import_module("reasoning_gym" + (f".{name}" if name else ""))
    except ImportError:
        raise DataError("--task rg:NAME needs reasoning-gym: pip install reasoning-gym") from None


def rg_name(task: str) -> str:
    """NAME of `rg:NAME`, checked against reasoning-gym's registry (DataError naming close or a few
    valid ones)."""
    name, known = task[len(RG) :], rg_module().factory.DATASETS
    if name not in known:
        near = difflib.get_close_matches(name, known, n=3) or [
            "leg_counting",
            "basic_arithmetic",
            "countdown",
        ]
        raise DataError(
            f"--task {task}: reasoning-gym has no dataset {name!r} (e.g. {', '.join(near)}; "
            f"{len(known)} in all: reasoning_gym.factory.DATASETS)"
        )
    return name


def rg_dataset(dataset: str, split: str):
    """reasoning-gym's generator for `rg:NAME`'s split (its default configuration), or a
    DataError."""
    if split not in RG_SIZES:
        raise DataError(
            f"--task {dataset}: the splits are {' and '.join(RG_SIZES)} (got --split {split})"
        )
    try:
        return rg_module().create_dataset(
            rg_name(dataset), seed=RG_SEEDS[split], size=RG_SIZES[split]
        )
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"--task {dataset}: reasoning-gym cannot build it with its default configuration "
            f"({type(e).__name__}: {e})"
        ) from None


@functools.lru_cache(maxsize=4)
def rg_rows(dataset: str, split: str) -> list[tuple[str, dict]]:
    """The rows of `rg:NAME` as reasoning-gym makes them ({question, answer, metadata}); "test" less
    train's."""
    entries = list(rg_dataset(dataset, split))
    if split != "train":
        seen = {row["question"] for _, row in rg_rows(dataset, "train")}
        entries = [entry for entry in entries if entry["question"] not in seen]
    return [(f"{dataset}[{split}] row {i + 1}", entry) for i, entry in enumerate(entries)]


def load_failure(error: Exception, offline: bool) -> str:
    """Why a Hugging Face dataset did not load, in one line."""
    name = type(error).__name__
    text = (str(error).strip().splitlines() or [""])[0]
    if name == "DatasetNotFoundError" or "doesn't exist on the Hub" in text:
        return (
            "no such dataset on the Hugging Face hub (or it is gated or private: accept its terms "
            "and log in with `hf auth login`)"
        )
    if offline:
        return (
            "the Hugging Face hub cannot be reached (offline) and the dataset is not in the "
            "local cache"
        )
    if isinstance(error, ConnectionError):
        return (
            "cannot reach the Hugging Face hub and the dataset is not in the local cache "
            f"({name}: {text})"
        )
    return f"cannot load it ({name}: {text})"


def is_conversation(prompt) -> bool:
    return isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    )


def check_rows(
    rows: list[tuple[str, dict]],
    prompt_column: str,
    answer_column: str,
    show: int = 5,
    required: bool = True,
) -> None:
    """Raise DataError naming every row (up to `show`, then a count) that lacks a usable prompt or
    answer (`required` False, for an --env's rows: either may be absent, a prompt present must be
    usable)."""
    bad = []
    for where, row in rows:
        if not isinstance(row, dict):
            bad.append(f"{where}: not an object (got {type(row).__name__})")
            continue
        missing = [c for c in (prompt_column, answer_column) if row.get(c) is None]
        if missing and not required:
            if row.get(prompt_column) is None:
                continue
        elif missing:
            have = ", ".join(sorted(row)) or "none"
            bad.append(
                f"{where}: no {' and no '.join(repr(c) for c in missing)} field (columns: {have})"
            )
            continue
        prompt = row[prompt_column]
        if not isinstance(prompt, str) and not (is_conversation(prompt) and prompt):
            bad.append(
                f"{where}: {prompt_column!r} must be a string or a list of {{'role', 'content'}} "
                f"messages (got {type(prompt).__name__})"
            )
    if not rows:
        raise DataError("the dataset has no rows")
    if bad:
        more = f"\n... and {len(bad) - show} more" if len(bad) > show else ""
        raise DataError(
            f"{len(bad)} of {len(rows)} rows are unusable "
            f"(--prompt-column {prompt_column}, --answer-column {answer_column}):\n"
            + "\n".join(bad[:show])
            + more
        )


def row_columns(row: dict, prompt_column: str, answer_column: str) -> dict:
    """The keyword arguments a row gives reward functions: every column but the prompt (TRL), plus
    `answer` = the answer column when the row has no column of that name."""
    columns = {k: v for k, v in row.items() if k != prompt_column}
    if "answer" not in columns:
        columns["answer"] = row[answer_column]
    return columns
