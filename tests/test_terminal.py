"""What a person sees and types: `--help` from the Config's own comments, a quiet terminal (vLLM's
per-sync log and the expected reload warnings left out, real ones kept), the progress line; and the
rule that every tensor-parallel vLLM worker serves the same weight version before tokens are
tagged."""

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys

import pytest

import config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_flag_has_help_text_and_a_default_from_the_config_comments():
    parser = config.build_parser()
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    fields = {f.name: f for f in dataclasses.fields(config.Config)}
    assert set(actions) == set(fields)
    docs = config.field_help(config.Config)
    for name, action in actions.items():
        assert action.help and len(action.help) > 8, f"--{name.replace('_', '-')} has no help text"
        assert action.help == docs[name][1]  # the comment on the field, not a second list
        assert action.default == fields[name].default
    text = subprocess.run(
        [sys.executable, "train.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    for name, field in fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text
        block = text[text.index(flag) :].split("\n  --", 1)[0]  # this flag's entry
        assert "(default:" in block, f"{flag} shows no default"
    assert "--model S" in text and '(default: "")' in text and "(default: 300)" in text


def test_help_groups_follow_the_dataclass_groups():
    parser = config.build_parser()
    titles = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    lora = next(t for t in titles if t.startswith("LoRA"))
    assert {"lora_rank", "lora_alpha", "merge_at_end"} <= titles[lora]
    assert {"max_lag", "queue_size", "sync_every"} <= titles["asynchrony"]
    assert {"log_every", "log_level", "wandb"} <= titles["logging"]
    assert "max_lag" not in titles["sizes"]


def test_a_field_comment_with_hashes_and_strings_is_read_whole():
    @dataclasses.dataclass
    class Example:
        """A docstring
        spanning lines # not a comment"""

        # first group
        name: str = "a # b"  # the help, with "quotes" and # a hash
        plain: int = 3
        # second group: with a colon
        other: float = 1.0  # more help
        #   that wraps,
        #     twice
        # third group
        last: int = 0  # the last

        #   not a continuation (a blank line above): a group

    docs = config.field_help(Example)
    assert docs == {
        "name": ("first group", 'the help, with "quotes" and # a hash'),
        "plain": ("first group", ""),
        "other": ("second group: with a colon", "more help that wraps, twice"),
        "last": ("third group", "the last"),
    }


def test_configure_terminal_sets_vllm_level_and_silences_progress_bars(monkeypatch):
    from run import metrics

    for key in ("VLLM_LOGGING_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS", "PYTHONWARNINGS"):
        monkeypatch.delenv(key, raising=False)
    metrics.configure_terminal("info")
    assert (
        os.environ["VLLM_LOGGING_LEVEL"] == "INFO"
        and "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    )
    metrics.configure_terminal("warning")
    assert (
        os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
        and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    )
    assert "reduce_op" in os.environ["PYTHONWARNINGS"]
    import transformers.utils.logging

    assert not transformers.utils.logging.is_progress_bar_enabled()


def test_only_the_expected_reload_warnings_are_dropped():
    from generator.vllm_worker import ExpectedReloadWarnings

    def record(layer, msg="%s: Failed to load weights"):
        return logging.LogRecord(
            name="vllm",
            level=logging.WARNING,
            pathname="layerwise.py",
            lineno=266,
            msg=msg,
            args=(layer,),
            exc_info=None,
        )

    tied, untied = ExpectedReloadWarnings(True), ExpectedReloadWarnings(False)
    assert not tied.filter(record("RotaryEmbedding")) and not untied.filter(
        record("Llama3RotaryEmbedding")
    )
    assert not tied.filter(record("ParallelLMHead"))
    # untied: the head's weights are in the buffer; a real failure
    assert untied.filter(record("ParallelLMHead"))
    assert tied.filter(record("QKVParallelLinear")) and tied.filter(
        record("Anything", msg="%s: other")
    )


def test_workers_that_report_different_versions_load_again_until_they_agree():
    from generator.weight_swaps import load_same_version

    def workers(*reports):
        calls = []

        async def load():
            calls.append(1)
            return reports[min(len(calls), len(reports)) - 1]

        return load, calls

    load, calls = workers([7])
    assert asyncio.run(load_same_version(load)) == 7 and len(calls) == 1
    # a publish landed between the workers' reads, twice
    load, calls = workers([6, 7], [7, 8], [8, 8])
    assert asyncio.run(load_same_version(load)) == 8 and len(calls) == 3
    load, calls = workers([1, 2])
    with pytest.raises(RuntimeError, match="different weight versions 5 times"):
        asyncio.run(load_same_version(load, max_tries=5))
    assert len(calls) == 5


def test_the_progress_line_says_where_the_run_is_how_it_learns_and_when_it_ends(tmp_path):
    from run import metrics

    log = metrics.RunLog(config.Config(out=str(tmp_path), steps=100, log_every=10), world_size=1)
    # rows are written by step(); fill them as it would
    for step in range(21):
        log.rows.append(
            {"step": step, "reward": 0.5 if step >= 11 else 0.0, "lag_mean": 1.25, "lag_max": 2}
        )
        if step == 0:
            log.first_step_end = log.start
    log.first_step_end -= 10.0  # 20 steps after the first took 10 s: 79 steps left take 39 s
    line = log.progress_line(20, 21, wait_s=0.012, train_s=0.08)
    assert line.startswith("step  21/100  v21")
    assert "reward 0.500" in line and "lag 1.25 (max 2)" in line and "wait   12 ms" in line
    assert line.endswith("ETA 0m39s") or line.endswith("ETA 0m40s"), line
    log.file.close()


def test_an_evaluation_gets_a_line_of_its_own():
    from run import metrics

    keys = {
        "eval/step": 50,
        "eval/version": 51,
        "eval/last_version": 51,
        "eval/prompts": 93,
        "eval/greedy_pass@1": 0.25,
        "eval/greedy_reward": 0.5,
        "eval/reward": None,
        "eval/pass@1": 0.125,
        "eval/pass@4": 0.5,
        "eval/time_s": 1.0,
    }
    assert metrics.evaluation_line(keys) == (
        "eval at step 50 (v51, 93 held-out prompts): greedy pass@1 0.250  reward -  "
        "pass@1 0.125  pass@4 0.500"
    )
    # weight loads went on during it (--eval-weights inflight): the versions at its start and end
    assert metrics.evaluation_line({**keys, "eval/last_version": 53}).startswith(
        "eval at step 50 (v51-v53, 93 held-out prompts): "
    )
