"""A GGUF file's tokenizer, rebuilt from its metadata for the ``tokenizers`` library: the byte-level BPE
(``tokenizer.ggml.model`` "gpt2") that Llama 3, Qwen2/2.5/3 and SmolLM2 use, with the text split llama.cpp applies
for the file's ``tokenizer.ggml.pre`` (the same expressions as the models' own ``tokenizer.json``), the control and
user-defined tokens as special tokens, a BOS added when the file says so, and the chat template.

SentencePiece vocabularies (``tokenizer.ggml.model`` "llama": Llama 2, Mistral v0.1) are not rebuilt: the error
names what to do (token ids, or the model's HF folder).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from edgeswarm.models.text.errors import ModelFolderError, UnsupportedModelError
from edgeswarm.models.text.gguf_file import metadata, open_reader

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
           r"|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the expressions the text is split by, one after another (as llama.cpp's llama-vocab.cpp)
SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,), "gpt2": (_GPT2,), "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,), "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,), "smollm": (r"\p{N}", _GPT2),
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of the tokens matched before the BPE


@dataclass(frozen=True)
class GgufVocabulary:
    """What a GGUF file says about its tokens: the ``tokenizer``, the special ids (``eos``: every id that ends a
    generation: end of sequence, end of turn) and the context length."""

    tokenizer: Tokenizer
    bos: int | None
    eos: tuple[int, ...]
    pad: int | None
    max_length: int | None


def _text_keys(name: str) -> bool:
    return name.startswith("tokenizer.") or name.endswith(".context_length") or name == "general.architecture"


def read_vocabulary(path: Path | str) -> GgufVocabulary:
    """The tokenizer of GGUF file ``path``. Raises UnsupportedModelError for a vocabulary kind or split it does not
    rebuild, ModelFolderError when the metadata is missing or inconsistent."""
    path = Path(path)
    meta = metadata(open_reader(path), _text_keys, path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{path}: its {kind!r} tokenizer is not rebuilt here (only byte-level BPE, tokenizer.ggml.model 'gpt2', "
            "as Llama 3, Qwen and SmolLM2 use); send token ids, or serve the model's HF folder")
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    if pre not in SPLITS:
        raise UnsupportedModelError(f"{path}: tokenizer.ggml.pre {pre!r} is not known here (known: "
                                    f"{', '.join(sorted(SPLITS))}); send token ids, or serve the model's HF folder")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    if not isinstance(tokens, list) or not tokens:
        raise ModelFolderError(f"{path} has no tokenizer.ggml.tokens")
    pairs = []
    for merge in merges:
        first, sep, second = str(merge).partition(" ")
        if not sep:
            raise ModelFolderError(f"{path}: merge {merge!r} is not two tokens")
        pairs.append((first, second))
    special = [i for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)]
    vocab = {str(t): i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in ("llama-bpe", "llama3", "smaug-bpe")))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(e), behavior="isolated") for e in SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(str(tokens[i]), special=types[i] == CONTROL, normalized=False)
                            for i in special])

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}")
        return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

    bos = token_id("bos_token_id")
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token"):
        text = str(tokens[bos])
        tok.post_processor = processors.TemplateProcessing(single=f"{text} $A", pair=f"{text} $A {text} $B",
                                                           special_tokens=[(text, bos)])
    eos = tuple(dict.fromkeys(i for i in (token_id("eos_token_id"), token_id("eot_token_id"),
                                          token_id("eom_token_id")) if i is not None))
    arch = meta.get("general.architecture")
    length = meta.get(f"{arch}.context_length")
    return GgufVocabulary(tokenizer=tok, bos=bos, eos=eos, pad=token_id("padding_token_id"),
                          max_length=int(length) if isinstance(length, int) and length > 0 else None)


def read_chat_template(path: Path | str) -> tuple[str | None, dict[str, str]]:
    """GGUF file ``path``'s chat template (None: it has none) and the texts of the special tokens it may name
    (``bos_token``, ``eos_token``), without building the tokenizer."""
    path = Path(path)
    meta = metadata(open_reader(path), lambda n: n.startswith("tokenizer."), path)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    texts = {}
    for role in ("bos", "eos"):
        i = meta.get(f"tokenizer.ggml.{role}_token_id")
        if isinstance(i, int) and 0 <= i < len(tokens):
            texts[f"{role}_token"] = str(tokens[i])
    template = meta.get("tokenizer.chat_template")
    return (template if isinstance(template, str) else None), texts
