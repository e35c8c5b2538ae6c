"""A chat model's conversation as its prompt: the model folder's own chat template (``tokenizer_config.json``'s
``chat_template``, or ``chat_template.jinja`` beside it) rendered with ``jinja2`` the way ``transformers``'
``apply_chat_template`` renders it (a sandbox, blocks trimmed, ``loopcontrols``, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, the special tokens' texts as variables). The tokens that
end the assistant's turn are the tokenizer's end of sequence (``TextTokenizer.special.eos``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgeswarm.models.text.hf import ModelFolderError, is_gguf
from edgeswarm.models.text.tokenizer import token_text
from edgeswarm.values.chat import ChatMessage

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_BYTES = 1 << 20
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ModelFolderError):
    """The folder's chat template cannot be read or rendered; the message says which and why."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which a prompt must not see changed
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A chat template and the special tokens' texts it may use (``bos_token`` ...)."""

    def __init__(self, source: str, special: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not parse: {exc}") from exc
        self.special = dict(special)

    @classmethod
    def from_folder(cls, folder: Path | str) -> ChatTemplate | None:
        """The folder's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``:
        a string, or a list of named ones of which ``default`` is taken), or a GGUF file's
        (``tokenizer.chat_template``); None when it has none."""
        folder = Path(folder)
        if is_gguf(folder):
            from edgeswarm.models.text.gguf_tokenizer import read_chat_template

            template, special = read_chat_template(folder)
            return cls(template, special) if template is not None else None
        config = _read_config(folder / CONFIG_FILE)
        source: object = None
        file = folder / TEMPLATE_FILE
        if file.is_file():
            if file.stat().st_size > MAX_TEMPLATE_BYTES:
                raise ChatTemplateError(f"{file} is larger than {MAX_TEMPLATE_BYTES} bytes")
            source = file.read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ChatTemplateError(f"{folder / CONFIG_FILE}: chat_template is neither a string nor a list of named "
                                    "templates with a 'default'")
        special = {role: text for role in SPECIAL_ROLES if (text := token_text(config.get(role))) is not None}
        return cls(source, special)

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (with the assistant's turn opened when ``add_generation_prompt``).
        Raises ChatTemplateError when the template refuses the conversation (its ``raise_exception``)."""
        try:
            return self._template.render(messages=[m.model_dump() for m in messages],
                                         add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                                         **self.special)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from exc


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{path} is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatTemplateError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}

