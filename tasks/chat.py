"""tasks/chat.py — chat templates: how prompts, episodes, tool calls and evaluation render messages,
one way for all.

Role
    `load_tokenizer(path, template_file, template_kwargs)`: a model's tokenizer, its chat template
        replaced by --chat-template FILE's, and --chat-template-kwargs (a JSON object, e.g.
        '{"enable_thinking": false}') kept on it for every rendering (TRL's and vLLM's
        `chat_template_kwargs`);
    `render(tokenizer, messages, generation_prompt, tools)`: the template's text, with those
    arguments; `uses_chat_template`, `plain_prompt`: how a prompt is rendered, for --dataset
    prompts (tasks/prompts.py) and episodes alike; `Renderer`: initial contexts and observations
    as token ids, token in / token out (below); `template_problem(tokenizer, tools)`: the check
    made once before a run with chat episodes: why the template cannot be extended turn by turn,
    in one line, or None.
Data contract
    Messages are {"role", "content"} dicts (tool calls as `tool_calls`, tool results as role
    "tool"). An episode is never rendered again from its history: after a model turn, only the new
    messages' text is rendered and tokenized, and appended to the ids as sampled.
May touch: nothing (reads template files; pure functions of the tokenizer).
"""

from __future__ import annotations

import json
import os

TEMPLATE_WAY_OUT = (
    "give --chat-template FILE with a template that renders a new message after the last without "
    "rewriting them (e.g. TRL's trl/chat_templates/*_training.jinja)"
)


class TemplateError(ValueError):
    """A chat template, its file or its arguments that cannot be used, in one line."""


def read_template(path: str) -> str:
    """--chat-template: a Jinja file, or a tokenizer_config.json whose `chat_template` it takes."""
    try:
        with open(os.path.expanduser(path)) as f:
            text = f.read()
    except OSError as e:
        raise TemplateError(f"--chat-template {path}: cannot read it ({e.strerror})") from None
    if path.endswith(".json"):
        try:
            text = json.loads(text).get("chat_template")
        except (json.JSONDecodeError, AttributeError):
            text = None
        if isinstance(text, list):  # the named-templates form: the default one
            text = next((t.get("template") for t in text if t.get("name") == "default"), None)
        if not isinstance(text, str):
            raise TemplateError(
                f'--chat-template {path}: a .json file must hold a "chat_template" string'
            )
    if "{{" not in text and "{%" not in text:
        raise TemplateError(
            f"--chat-template {path}: not a Jinja chat template (no {{{{ or {{% in it)"
        )
    try:
        import jinja2

        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(
            f"--chat-template {path}: Jinja syntax error at line {e.lineno}: {e.message}"
        ) from None
    return text


def template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object ("" for none)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise TemplateError(
            f"--chat-template-kwargs {text!r}: not JSON ({e.msg}, column {e.colno})"
        ) from None
    if not isinstance(value, dict):
        raise TemplateError(
            f"--chat-template-kwargs {text!r}: give a JSON object, "
            "e.g. '{\"enable_thinking\": false}'"
        )
    reserved = {"messages", "tools", "add_generation_prompt", "tokenize"} & set(value)
    if reserved:
        raise TemplateError(
            f"--chat-template-kwargs: {', '.join(sorted(reserved))} is set by the run itself"
        )
    return value


def load_tokenizer(path: str, template_file: str = "", kwargs: str = ""):
    """The tokenizer of `path` with the run's chat template (--chat-template) and its arguments
    (--chat-template-kwargs, kept as `chat_template_kwargs`, which `render` passes on)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if template_file:
        tokenizer.chat_template = read_template(template_file)
    tokenizer.chat_template_kwargs = template_kwargs(kwargs)
    return tokenizer


def render(tokenizer, messages: list, generation_prompt: bool, tools=None) -> str:
    """The chat template's text of `messages` (with `tools`' schemas, and the run's template
    arguments)."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            "chat messages need a tokenizer with a chat template (or --chat-template FILE)"
        )
    extra = dict(getattr(tokenizer, "chat_template_kwargs", None) or {})
    if tools:
        extra["tools"] = tools  # the one place tool schemas reach the template
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
    )


def uses_chat_template(tokenizer, prompt, system_prompt: str = "") -> bool:
    """How a prompt is rendered, for --dataset prompts and episodes alike: chat messages always
    through the chat template; plain text only to carry a system prompt (else as it is)."""
    return not isinstance(prompt, str) or bool(
        system_prompt and getattr(tokenizer, "chat_template", None)
    )


def plain_prompt(text: str, system_prompt: str = "") -> str:
    """A plain-text prompt: the system prompt as its prefix, a blank line between."""
    return f"{system_prompt}\n\n{text}" if system_prompt else text


def as_messages(value) -> list[dict]:
    return [{"role": "user", "content": value}] if isinstance(value, str) else list(value)


def stop_ids(tokenizer) -> set[int]:
    """The ids that end a model's turn: the tokenizer's eos and those its model's generation config
    lists."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    path = os.path.join(getattr(tokenizer, "name_or_path", "") or "", "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


class Renderer:
    """Initial contexts and observations as token ids. The initial context is rendered as a
    --dataset prompt is (`initial`); text mode: plain text, tokenized. Chat mode (a prompt or an
    observation made of messages, tools, a system prompt or reset's text after the prompt, with a
    chat template): the chat template, rendering only what is new. A fixed dummy conversation (a
    user turn, an assistant turn whose content is MARK) is rendered with the observation and the
    next generation prompt after it; the text after MARK is the observation's, the template's end of
    turn and separator included. Nothing before MARK is used, so a template that rewrites earlier
    turns once another message follows (Qwen3 drops the empty think block it writes into the last
    assistant turn, and strips think blocks from history) cannot change an episode's tokens: they
    stay as sampled. When the model ended its turn itself (a stop id), the template's own
    end-of-turn token is not repeated after it. A template that alternates strictly (Gemma) gets
    consecutive user messages joined into one."""

    MARK = "#y#"  # the dummy assistant turn's content: where the model's own tokens end
    DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}]

    def __init__(self, tokenizer, system_prompt: str = ""):
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        self.special = set(tokenizer.all_special_ids)
        self.stop_ids = stop_ids(tokenizer)
        self._alternates = None

    @property
    def alternates(self) -> bool:
        """Whether the template refuses two user messages in a row (Gemma's strict user/model
        alternation)."""
        if self._alternates is None:
            try:
                render(
                    self.tokenizer,
                    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                    True,
                )
                self._alternates = False
            except Exception:
                self._alternates = True
        return self._alternates

    def joined(self, messages: list[dict]) -> list[dict]:
        """For a template that alternates strictly: consecutive user messages as one (contents
        joined by a blank line), so a prompt followed by reset's message, or an observation of
        several messages, renders."""
        if not self.alternates:
            return messages
        out = []
        for m in messages:
            if (
                out
                and m.get("role") == "user" == out[-1].get("role")
                and isinstance(m.get("content"), str)
            ):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{m['content']}"}
            else:
                out.append(dict(m))
        return out

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def chat_text(self, messages, tools, generation_prompt: bool) -> str:
        return render(self.tokenizer, messages, generation_prompt, tools)

    def initial(self, prompt, reset_out, tools=None) -> tuple[list[int], bool]:
        """(ids of the prompt followed by what reset returned, chat mode?), rendered as a --dataset
        prompt is (tasks/prompts.encode_prompt). One text alone (the prompt, or reset's text
        without one) is a dataset's string prompt: the chat template with the --system-prompt
        system message where the tokenizer has a template and a system prompt is set, else plain
        text (the system prompt as its prefix). Messages, tools, or a prompt and reset's text
        both where the tokenizer has a template: the chat template, each text a user message
        (without a template two texts are plain text, a blank line apart)."""
        # The rows were checked: a list is messages.
        parts = [part for part in (prompt, reset_out) if part]
        chat_mode = bool(tools) or any(isinstance(part, list) for part in parts)
        if not chat_mode and len(parts) > 1:
            chat_mode = bool(getattr(self.tokenizer, "chat_template", None))
        if not chat_mode and not uses_chat_template(self.tokenizer, "", self.system_prompt):
            text = plain_prompt("\n\n".join(parts), self.system_prompt)
            return self.encode(text, special=True), False
        messages = (as_messages(prompt) if prompt else []) + (
            as_messages(reset_out) if reset_out else []
        )
        if self.system_prompt and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.encode(self.chat_text(self.joined(messages), tools, True)), True

    def tail(self, observation, tools=None) -> str:
        """The template's text after an assistant turn's content: its end of turn, the observation,
        the next generation prompt. Raises TemplateError when the template does not render it after
        the turn."""
        full = self.chat_text(self.DUMMY + self.joined(as_messages(observation)), tools, True)
        at = full.find(self.MARK)
        if at < 0 or full.find(self.MARK, at + 1) >= 0:
            raise TemplateError(
                "the chat template does not render an assistant turn's content once, as it is, "
                "before the messages that follow it"
            )
        return full[at + len(self.MARK) :]

    def observation(self, observation, chat: bool, last_token: int | None, tools=None) -> list[int]:
        """The ids appended after a model turn that ended with `last_token`: the observation (in
        chat mode with the template's end of turn before it and the next generation prompt after
        it)."""
        if not chat:
            text = (
                observation
                if isinstance(observation, str)
                else "\n".join(m["content"] for m in observation)
            )
            return self.encode(text)
        ids = self.encode(self.tail(observation, tools))
        if (
            ids
            and ids[0] in self.special
            and (ids[0] == last_token or (last_token in self.stop_ids and ids[0] in self.stop_ids))
        ):
            # the model ended its turn itself: the template's end-of-turn token is not repeated
            ids = ids[1:]
        return ids


def generation_prompt(tokenizer, tools=None) -> str:
    """What the template adds for the assistant's next turn ("" when it is not a plain suffix)."""
    messages = [{"role": "user", "content": "x"}]
    without, with_ = (
        render(tokenizer, messages, False, tools),
        render(tokenizer, messages, True, tools),
    )
    return with_[len(without) :] if with_.startswith(without) else ""


def template_problem(tokenizer, tools=None) -> str | None:
    """Why the chat template cannot be extended turn by turn (a user observation, and with `tools` a
    tool result, after a model turn), in one line naming the way out; None when it can."""
    if not getattr(tokenizer, "chat_template", None):
        return None  # text mode
    renderer = Renderer(tokenizer)
    kinds = [("a user message", [{"role": "user", "content": "probe observation 5c1e"}])]
    if tools:
        kinds.append(
            (
                "a tool result",
                [
                    {
                        "role": "tool",
                        "name": tools[0]["function"]["name"],
                        "content": "probe result 7d2a",
                    }
                ],
            )
        )
    try:
        next_turn = generation_prompt(tokenizer, tools)
    except Exception as e:
        return (
            "the chat template cannot render a first user turn "
            f"({type(e).__name__}: {first_line(e)})"
        )
    for what, messages in kinds:
        try:
            tail = renderer.tail(messages, tools)
        except TemplateError as e:
            return f"{e}; {TEMPLATE_WAY_OUT}"
        # jinja2's TemplateError (e.g. Gemma 3's strict user/model alternation) and kin
        except Exception as e:
            return (
                f"the chat template cannot render {what} after a model turn ({type(e).__name__}: "
                f"{first_line(e)}); {TEMPLATE_WAY_OUT}"
            )
        if messages[0]["content"] not in tail:
            return f"the chat template drops {what} that follows a model turn; {TEMPLATE_WAY_OUT}"
        if next_turn and not tail.endswith(next_turn):
            return (
                f"what the chat template renders after {what} does not end with its generation "
                f"prompt {next_turn!r}; {TEMPLATE_WAY_OUT}"
            )
    return None


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]
