"""Chat prompts: the model's own template, rendered with Jinja2 as transformers renders it, or a plain
fallback for models without one (random models, directories with no tokenizer_config.json template).

The fallback (``FALLBACK_TEMPLATE``) writes each message as ``<|role|>`` on a line, then its content
on the next, and ends with ``<|assistant|>`` and a newline for the model to answer.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sloserve.core.errors import ConfigError
from sloserve.engine.tokenizer import read_tokenizer_config, special_token_text

FALLBACK_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TemplateError(ConfigError):
    """The template refused the messages (e.g. roles that do not alternate); the message says why."""


class ChatOptionError(ConfigError):
    """An option of ``ChatTemplate.render`` that cannot apply to the messages; ``option`` names it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def check_render_options(
    last_role: str, *, add_generation_prompt: bool, continue_final_message: bool, variables: dict[str, Any] | None
) -> None:
    """A ChatOptionError for options that contradict each other or the messages (``last_role``: the
    last message's role), as vLLM refuses them."""
    if continue_final_message:
        if add_generation_prompt:
            raise ChatOptionError(
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true (add_generation_prompt is "
                "true by default)",
            )
        if last_role != "assistant":
            raise ChatOptionError(
                "continue_final_message",
                f"continue_final_message continues an assistant message; the last message is {last_role!r}",
            )
    taken = sorted(set(variables or {}) & {"messages", "add_generation_prompt"})
    if taken:
        raise ChatOptionError(
            "chat_template_kwargs", f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields do"
        )


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter (Jinja's own escapes HTML characters), with its options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _with_call_arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its tool calls' ``arguments`` JSON text read into an object, as vLLM passes
    them: the templates of Qwen and Hermes write ``arguments | tojson``."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    read = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        read.append(call)
    return {**message, "tool_calls": read}


def read_template_option(value: str) -> str:
    """vLLM's ``--chat-template``: a file's text, or the template itself; a ConfigError for neither."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {value}: cannot read ({e})") from None
    if "{" in value:  # Jinja's {{ }} or {% %}: the template's own text
        return value
    raise ConfigError(f"--chat-template {value!r}: no such file (and not a template: it has no Jinja tags)")


class ChatTemplate:
    """Renders a list of ``{"role", "content"}`` messages into one prompt string.

    ``from_model`` is True for the model's own template and one given by the user (``--chat-template``):
    its text carries the special tokens (BOS), so it is tokenized without adding them again (as vLLM
    does).
    """

    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None, from_model: bool = False) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"chat template: {e.message} (line {e.lineno})") from None
        self.special_tokens = special_tokens or {}
        self.from_model = from_model

    @classmethod
    def for_checkpoint(cls, model: str, chat_template: str | None = None) -> ChatTemplate:
        """The template of what ``--model`` names: a GGUF file's, an HF directory's, else (``random:``
        models) the fallback; ``chat_template`` (``--chat-template``: a file or the text) instead, with
        the model's special tokens."""
        from sloserve.checkpoint.gguf import is_gguf

        path = Path(model).expanduser()
        found = cls.for_gguf(path) if is_gguf(model) else cls.for_model(path if path.is_dir() else None)
        return found if chat_template is None else found.replaced_by(chat_template)

    def replaced_by(self, chat_template: str) -> ChatTemplate:
        """The template ``chat_template`` names (a file or the text), with this one's special tokens."""
        return self.with_source(read_template_option(chat_template))

    def with_source(self, source: str) -> ChatTemplate:
        """The template ``source`` (its text), with this one's special tokens."""
        return ChatTemplate(source, special_tokens=self.special_tokens, from_model=True)

    @classmethod
    def for_model(cls, model_dir: Path | None) -> ChatTemplate:
        """The template of a local HF directory (``chat_template.jinja``, or ``chat_template`` in
        tokenizer_config.json, or in a processor's chat_template.json), else the fallback."""
        if model_dir is None or not model_dir.is_dir():
            return cls(FALLBACK_TEMPLATE)
        config = read_tokenizer_config(model_dir)
        special = {
            name: special_token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        jinja_path = model_dir / "chat_template.jinja"
        source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
        processor_path = model_dir / "chat_template.json"  # a multimodal model's processor's (Gemma 3 4B)
        if not source and processor_path.is_file():
            try:
                source = json.loads(processor_path.read_text()).get("chat_template")
            except (OSError, json.JSONDecodeError, AttributeError) as e:
                raise ConfigError(f"{processor_path}: cannot read ({e})") from None
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return cls(FALLBACK_TEMPLATE, special_tokens=special)
        return cls(source, special_tokens=special, from_model=True)

    @classmethod
    def for_gguf(cls, path: Path) -> ChatTemplate:
        """The template in a GGUF file's metadata (``tokenizer.chat_template``), else the fallback."""
        from sloserve.checkpoint.gguf import read_gguf

        checkpoint = read_gguf(path)
        source = checkpoint.chat_template
        if not isinstance(source, str) or not source:
            return cls(FALLBACK_TEMPLATE, special_tokens=checkpoint.special_tokens())
        return cls(source, special_tokens=checkpoint.special_tokens(), from_model=True)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt for ``messages``, ending where the assistant's answer starts (transformers'
        ``apply_chat_template``). ``continue_final_message``: the prompt ends with the last message's
        content instead, for the model to go on with it (an assistant's answer begun by the client).
        ``variables``: more for the template to read (vLLM's ``chat_template_kwargs``, e.g. Qwen3's
        ``enable_thinking``). ``tools``: the functions the model may call (OpenAI's
        ``{"type": "function", "function": {...}}``), for templates that show them. ``documents``: for
        retrieval-augmented templates to show (transformers' ``documents``). Options that contradict
        each other are a ChatOptionError."""
        check_render_options(
            messages[-1]["role"] if messages else "",
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables=variables,
        )
        try:
            # as transformers: the request's variables may override the special tokens' names
            text = self._template.render(
                {**self.special_tokens, **(variables or {})},
                messages=[_with_call_arguments_as_objects(m) for m in messages],
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed on these messages: {e}") from None
        except Exception as e:  # noqa: BLE001 - NOTE: the template is code the messages drive: what it raises (a
            # TypeError from `'a' + 1`, a ZeroDivisionError, the sandbox's OverflowError for a huge range) is theirs
            raise TemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
        if continue_final_message:  # cut after the last message's content, as transformers does
            final = messages[-1]["content"]
            if final not in text:
                final = final.strip()
                if final not in text:
                    raise TemplateError("continue_final_message: the final message is not in the rendered chat")
            text = text[: text.rindex(final) + len(final)]
        return text
