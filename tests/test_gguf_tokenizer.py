"""A GGUF file's own tokenizer: byte-level BPE vocabularies in the shapes Llama 3, Qwen2 and GPT-2/SmolLM2 publish
(their text splits, special tokens, a BOS added or not), trained here, written into a GGUF file's metadata as
llama.cpp's converter writes them, and rebuilt from it: every text encodes to the ids the ``tokenizer.json`` gives
and decodes back; the chat template and the end-of-turn tokens come from the file too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_model import CHATML, CONVERSATION, HEADERS, SPECIAL, folder_with
from edgeswarm.models.text import reference
from edgeswarm.models.text.chat import ChatTemplate
from edgeswarm.models.text.errors import UnsupportedModelError
from edgeswarm.models.text.gguf_tokenizer import SPLITS
from edgeswarm.models.text.gguf_writer import write_gguf
from edgeswarm.models.text.tokenizer import load_tokenizer
from edgeswarm.values.text_model import TextModelConfig
from gguf_model import vocabulary

pytest.importorskip("gguf")

TEXTS = ["Hello world", "  two  spaces and\n\nnew lines\r\n", "I'LL say 12345678 and 3.14159", "Österreich 🙂 東京",
         "<|eot_id|>inside<|im_end|> text", "tabs\tand ...!!! punctuation", ""]
TINY = TextModelConfig(family="llama", layers=1, hidden=64, heads=2, kv_heads=1, ffn=64, vocab=512,
                       max_positions=128, type_vocab=0, activation="silu", bias=False, tie_embeddings=True)


def _trained(root: Path, pre: str, add_bos: bool) -> Path:
    """A tokenizer.json split as ``pre`` says (the models' own pre-tokenizers), trained here; with ``add_bos``, a
    post-processor that adds <|begin_of_text|> (Llama 3's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = root / pre
    folder.mkdir()
    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(e), behavior="isolated") for e in SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=480, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m.content for m in CONVERSATION] * 20 + TEXTS[:4] * 10, trainer)
    if add_bos:
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[
            (bos, tok.token_to_id(bos))])
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _file(root: Path, folder: Path, pre: str, **kw: object) -> Path:
    tokens = json.loads((folder / "tokenizer.json").read_text())
    size = max(t["id"] for t in tokens["added_tokens"]) + 1 + len(tokens["model"]["vocab"])
    cfg = TINY.model_copy(update={"vocab": size})
    return write_gguf(root / f"{pre}.gguf", cfg, reference.init_weights(cfg).__getitem__, matrices="F32", embed="F32",
                      metadata=vocabulary(folder / "tokenizer.json", pre, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize(("pre", "add_bos"), [("llama-bpe", True), ("qwen2", False), ("gpt2", False),
                                               ("smollm", False)])
def test_the_files_tokenizer_encodes_and_decodes_as_the_tokenizer_json(tmp_path: Path, pre: str,
                                                                        add_bos: bool) -> None:
    from tokenizers import Tokenizer

    # GPT-2's split is the ByteLevel pre-tokenizer's own expression: that folder's tokenizer checks ours against it.
    folder = folder_with(tmp_path, pre, CHATML) if pre == "gpt2" else _trained(tmp_path, pre, add_bos)
    path = _file(tmp_path, folder, pre, eos="<|endoftext|>", add_bos=add_bos,
                 bos="<|begin_of_text|>", eot="<|eot_id|>")
    theirs = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ours = load_tokenizer(path)
    for text in TEXTS:
        want = theirs.encode(text).ids
        got = ours.encode(text).ids
        assert got == want, (pre, text, got, want)
        assert ours.decode(got, skip_special_tokens=False) == theirs.decode(want, skip_special_tokens=False)
    assert (ours.encode("Hi").ids[0] == theirs.token_to_id("<|begin_of_text|>")) is add_bos
    eot = theirs.token_to_id("<|eot_id|>")
    assert eot in ours.special.eos and theirs.token_to_id("<|endoftext|>") in ours.special.eos
    assert ours.decode([eot, *theirs.encode("ok").ids]) == "ok"  # special tokens left out
    assert ours.max_length == TINY.max_positions


def test_the_chat_template_and_its_end_of_turn_come_from_the_file(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, "chat", HEADERS)
    path = _file(tmp_path, folder, "gpt2", eos="<|eot_id|>", bos="<|begin_of_text|>", template=HEADERS)
    from_file = ChatTemplate.from_folder(path)
    from_folder = ChatTemplate.from_folder(folder)
    assert from_file is not None and from_folder is not None
    assert from_file.render(CONVERSATION) == from_folder.render(CONVERSATION)
    assert from_file.render(CONVERSATION).startswith("<|begin_of_text|><|start_header_id|>system")
    tok = load_tokenizer(path)
    assert tok.special.eos == (tok.encode("<|eot_id|>", special_tokens=False).ids[0],)
    plain = _file(tmp_path, folder_with(tmp_path, "plain", CHATML), "qwen2", eos="<|im_end|>")
    assert ChatTemplate.from_folder(plain) is None


def test_a_sentencepiece_vocabulary_is_refused_with_what_to_do(tmp_path: Path) -> None:
    def sentencepiece(w: object) -> None:
        w.add_tokenizer_model("llama")  # type: ignore[attr-defined]
        w.add_token_list(["<unk>", "<s>", "</s>", "\u2581a"])  # type: ignore[attr-defined]

    cfg = TINY.model_copy(update={"vocab": 4})
    path = write_gguf(tmp_path / "spm.gguf", cfg, reference.init_weights(cfg).__getitem__, matrices="F32",
                      embed="F32", metadata=sentencepiece)
    with pytest.raises(UnsupportedModelError, match="send token ids, or serve the model's HF folder"):
        load_tokenizer(path)
