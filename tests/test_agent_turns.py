"""Agent turns as vLLM's OpenAI server reads them, and episode prompts as --dataset renders them,
on the shipped templates (tests/shipped.py; tokenizers only, the engine scripted as in
test_templates.py).

- qwen3_coder calls on the shipped Qwen3 template: the request carries the tool schemas, so integer
  arguments arrive as integers; a call in another format is a parse failure shown to the model.
- The reasoning parser (qwen3, chosen from the template) runs first: a think block that weighs a
  call, followed by an answer, ends the episode; the kept message is the server's.
- A string prompt with --system-prompt: the episode trains on the tokens the dataset path renders
  for it (the plain-text prefix without a template); reset's text after it is joined by the
  template.
"""

import copy
import functools
from types import SimpleNamespace

import pytest
from shipped import tokenizer_dir
from test_templates import CHAT_FAMILIES, THINK, episode, tool_cfg

import config
from tasks import chat, envs, prompts, tools

# Qwen3-Coder's and Qwen3.5's call format (vLLM's qwen3_coder parser), add(2, 3)
CODER_CALL = (
    "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
    "</function>\n</tool_call>"
)
QUESTION = {"prompt": [{"role": "user", "content": "2 + 3?"}], "answer": "5"}


@functools.cache
def shipped(name: str):
    """The shipped tokenizer of `name`, loaded once for this module (the tests do not change it)."""
    return chat.load_tokenizer(tokenizer_dir(name))


def test_qwen3_coder_calls_arrive_typed_and_a_malformed_one_is_a_parse_failure(tmp_path):
    """--tool-parser qwen3_coder on the shipped Qwen3 template, each turn read as vLLM's server
    reads it: the request carries the tool schemas, so add(a: int, b: int) called as
    <parameter=a>2</parameter> gets the integers 2 and 3 (its result 5, not '23'); a call in another
    format (Hermes JSON) is a parse failure shown to the model, not a final answer; the message kept
    is the server's: the content without the call text, the reasoning apart."""
    path, tokenizer = tokenizer_dir("qwen3"), shipped("qwen3")
    cfg = tool_cfg(path, tmp_path, tool_parser="qwen3_coder")
    hermes = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    turns = [THINK + "Let me add.\n" + CODER_CALL, THINK + hermes, THINK + "It is 5."]
    ep, engine, env = episode(cfg, tokenizer, None, QUESTION, turns, 151_645)
    assert not ep.error and ep.turns == 3, (ep.error, ep.turns)
    assert (env.tool_calls, env.tool_call_parse_failures, env.tool_errors) == (1, 1, 0)
    first = ep.transcript[0]
    arguments = first["tool_calls"][0]["function"]["arguments"]
    assert arguments == {"a": 2, "b": 3} and all(type(v) is int for v in arguments.values())
    assert first["content"] == "Let me add." and first["reasoning"].strip() == "Let me see."
    result = tokenizer.decode(ep.ids[len(engine.prompts[0]) : len(engine.prompts[1])])
    assert "<tool_response>\n5\n</tool_response>" in result, result
    failure = tokenizer.decode(ep.ids[len(engine.prompts[1]) : len(engine.prompts[2])])
    assert "could not parse a tool call" in failure and "qwen3_coder" in failure
    assert ep.transcript[-1]["content"].strip() == "It is 5."


def test_a_thinking_turn_whose_reasoning_mentions_a_call_is_a_final_answer(tmp_path):
    """The reasoning parser (chosen from Qwen3's template: qwen3) separates the think block first,
    as vLLM's server does, and calls are read from the content only: a turn that weighs a call in
    its reasoning and answers ends the episode. (vLLM's qwen3 reasoning parser takes a literal
    <tool_call> as the end of reasoning, so the mention here is the call without it.)"""
    path, tokenizer = tokenizer_dir("qwen3"), shipped("qwen3")
    mention = CODER_CALL.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    answer = f"<think>\nI could write {mention}, but I know it.\n</think>\n\n5"
    cfg = tool_cfg(path, tmp_path, tool_parser="qwen3_coder")
    ep, _, env = episode(cfg, tokenizer, None, QUESTION, [answer, THINK + "5"], 151_645)
    assert not ep.error and ep.turns == 1, (ep.error, ep.turns)
    assert (env.tool_calls, env.tool_call_parse_failures) == (0, 0)
    assert (
        ep.transcript[0]["content"].strip() == "5"
        and "<function=add>" in (ep.transcript[0]["reasoning"])
    )
    # the reasoning parser named by the template's family: Qwen3's
    assert tools.reasoning_parser_name("", tokenizer.chat_template) == "qwen3"
    assert tools.reasoning_parser_name("none", tokenizer.chat_template) == ""
    assert tools.reasoning_parser_name("", shipped("qwen2_5").chat_template) == ""
    with pytest.raises(ValueError, match="--reasoning-parser NAME"):  # <think>, family unknown
        tools.reasoning_parser_name("", "{{ '<think>' }}{{ messages[0].content }}")


class AnswerEnv:
    """reset adds nothing (or the row's `hint` text); the first turn ends the episode."""

    def reset(self, hint=None, **row):
        return hint

    def step(self, action):
        return None, 1.0, True


@pytest.mark.parametrize("family", CHAT_FAMILIES)
def test_an_episodes_string_prompt_trains_on_the_tokens_the_dataset_path_renders(family):
    """A string prompt in an episode is rendered as --dataset renders it (tasks/prompts.py): with
    --system-prompt, the chat template with the system message (the plain-text prefix where the
    tokenizer has no template); without, plain text. What reset adds after it is joined by the
    template, as a user message, never glued to the prompt's text."""
    tokenizer = shipped(family)
    no_template = copy.copy(tokenizer)
    no_template.chat_template = None
    stop, question, hint = CHAT_FAMILIES[family][0], "What is 2+2?", "Count on your fingers."
    for tok, system_prompt in ((tokenizer, "Be brief."), (tokenizer, ""), (no_template, "Be.")):
        cfg = config.Config(max_turns=2, max_new_tokens=16, system_prompt=system_prompt)
        ep, engine, _ = episode(cfg, tok, AnswerEnv, {"prompt": question}, ["4"], stop)
        expected = prompts.encode_prompt(tok, question, system_prompt)
        assert not ep.error and ep.turns == 1, ep.error
        # what the group trains on: its shared prompt, the episodes' common start
        shared, _ = envs.group_of(SimpleNamespace(prompt_ids=None), [ep])
        assert engine.prompts[0] == ep.ids[: ep.start] == shared == expected
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": question},
        {"role": "user", "content": hint},
    ]
    if family == "gemma3":  # strict alternation: one user turn
        conversation[1:] = [{"role": "user", "content": f"{question}\n\n{hint}"}]
    for system_prompt in ("Be brief.", ""):
        cfg = config.Config(max_turns=2, max_new_tokens=16, system_prompt=system_prompt)
        row = {"prompt": question, "hint": hint}
        ep, _, _ = episode(cfg, tokenizer, AnswerEnv, row, ["4"], stop)
        messages = conversation if system_prompt else conversation[1:]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ep.ids[: ep.start] == tokenizer(text, add_special_tokens=False)["input_ids"]
