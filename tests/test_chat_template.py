"""A chat model's conversation as its prompt (``models.text.chat``): the folder's own chat template rendered as
``transformers``' ``apply_chat_template`` renders it, on the same folder (text and token ids), the template's refusals
as errors a user can read, and the tokens that end a turn."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from chat_model import AS_JSON, CHATML, CONVERSATION, HEADERS, SPECIAL, folder_with
from edgeswarm.models.text.chat import ChatTemplate, ChatTemplateError
from edgeswarm.models.text.tokenizer import load_tokenizer
from edgeswarm.values.chat import ChatMessage


@pytest.fixture(scope="module")
def transformers() -> ModuleType:
    import transformers as t

    t.logging.set_verbosity_error()
    return t


@pytest.mark.parametrize(("name", "template"), [("chatml", CHATML), ("headers", HEADERS), ("json", AS_JSON)])
@pytest.mark.parametrize("in_file", [False, True])
def test_the_prompt_equals_transformers_apply_chat_template(transformers: ModuleType, tmp_path: Path, name: str,
                                                            template: str, in_file: bool) -> None:
    folder = folder_with(tmp_path, name, template, in_file=in_file)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    chat = ChatTemplate.from_folder(folder)
    assert chat is not None
    tokenizer = load_tokenizer(folder)
    as_dicts = [m.model_dump() for m in CONVERSATION]
    for conversation, dicts in ((CONVERSATION, as_dicts), (CONVERSATION[1:2], as_dicts[1:2])):
        for opened in (True, False):
            text = chat.render(conversation, add_generation_prompt=opened)
            assert text == theirs.apply_chat_template(dicts, tokenize=False, add_generation_prompt=opened)
            ids = tokenizer.encode(text, special_tokens=False).ids
            assert ids == theirs.apply_chat_template(dicts, tokenize=True, add_generation_prompt=opened)["input_ids"]
    if template is AS_JSON:
        assert "Österreich" in chat.render(CONVERSATION)  # tojson keeps non-ASCII text, as transformers' does


def test_a_turn_the_template_refuses_and_a_broken_template_are_errors(tmp_path: Path) -> None:
    chat = ChatTemplate.from_folder(folder_with(tmp_path, "headers", HEADERS))
    assert chat is not None
    with pytest.raises(ChatTemplateError, match="only system, user and assistant turns"):
        chat.render([ChatMessage(role="tool", content="42")])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}", {})
    plain = tmp_path / "plain"
    plain.mkdir()
    assert ChatTemplate.from_folder(plain) is None  # no template: not a chat model


def test_a_turn_ends_at_the_templates_end_of_turn_token(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, "chatml", CHATML)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [SPECIAL.index("<|endoftext|>")]}))
    tokenizer = load_tokenizer(folder)
    ids = {token: tokenizer.encode(token, special_tokens=False).ids[0] for token in SPECIAL}
    # the base model's end of sequence (generation_config.json) and the chat's end of turn (tokenizer_config.json)
    assert set(tokenizer.special.eos) == {ids["<|endoftext|>"], ids["<|im_end|>"]}
