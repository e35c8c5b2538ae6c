"""Quantized weights from GGUF files: a Llama 3 shaped model (grouped-query attention, Llama 3's rotary scaling as
``rope_freqs``), a Qwen2 (q, k and v biases) and a Qwen3 (per-head q/k norms) written here with ggml's own writer
(``gguf``) in Q8_0 and Q4_0, served whole and split unevenly over three ranks, each rank reading only its rows and
columns and keeping them quantized: equal (fp32 logits within 1e-4, greedy tokens equal) to the one-device forward
of the same weights dequantized by ``gguf.quants``. A rank's weight memory is its share of the quantized file, and
the planner counts it so."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from edgeswarm.devices.cluster import load_cluster
from edgeswarm.hmp.compute import shard_memory
from edgeswarm.hmp.layer import HmpRank
from edgeswarm.hmp.loopback import Loopback
from edgeswarm.hmp.sharding import shard_shapes
from edgeswarm.models.text import reference
from edgeswarm.models.text.gguf_file import GgufModel
from edgeswarm.models.text.gguf_writer import write_gguf
from edgeswarm.models.text.hf import UnsupportedModelError, open_model, source_config
from edgeswarm.models.text.quantized import QuantizationError, QuantizedMatrix, dequantize
from edgeswarm.planning.hmp.plan import plan_galaxy, plan_megatron
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.planning.hmp.synthetic import synthetic_cluster
from edgeswarm.planning.hmp.types import HmpOptions
from edgeswarm.values.text_model import RopeScaling, TextModelConfig, TextModelSource
from gguf_model import read_dequantized
from hmp_driver import generate, in_threads

gguf = pytest.importorskip("gguf")

PROMPT = [5, 17, 42, 8, 63, 21, 9, 77, 3, 50, 31]
# Llama 3's shape in small: 8 query heads in 4 KV groups of head_dim 32, an MLP of 12 quantization blocks, 3.x's
# rotary scaling with an original context that puts frequencies in the band it blends.
LLAMA3 = TextModelConfig(
    family="llama", layers=2, hidden=256, heads=8, kv_heads=4, ffn=384, vocab=128, max_positions=256, type_vocab=0,
    norm_eps=1e-5, activation="silu", bias=False, tie_embeddings=True, rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=64))
QWEN2 = LLAMA3.model_copy(update={"rope_scaling": None, "qkv_bias": True, "tie_embeddings": False,
                                  "rope_theta": 1e6})
QWEN3 = LLAMA3.model_copy(update={"rope_scaling": None, "qk_norm": True, "head_size": 64})
# Uneven, in whole KV groups and whole blocks of 32 columns; the middle rank holds the most.
UNEVEN = {"heads": [2, 4, 2], "columns": [64, 224, 96]}


def _model(tmp_path: Path, cfg: TextModelConfig, arch: str, kind: str, seed: int = 3) -> Path:
    # The layers' matrices 3x the default draw: with them at unit gain, a tiny tied model's residual stream is
    # mostly its input embedding and greedy decoding repeats the prompt's last token.
    w = {n: t * 3 if n.startswith("layers.") and t.dim() == 2 else t
         for n, t in reference.init_weights(cfg, seed).items()}
    return write_gguf(tmp_path / f"{arch}-{kind}.gguf", cfg, w.__getitem__, arch=arch, matrices=kind, embed=kind)


def _shares(mode: str) -> HmpShares:
    return HmpShares(mode=mode, devices=["a", "b", "c"], **UNEVEN)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_blocks_dequantize_as_ggml_does_and_cut_on_block_boundaries(kind: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    values = np.random.default_rng(0).standard_normal((6, 128)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    m = QuantizedMatrix(torch.from_numpy(raw), kind, 128)  # type: ignore[arg-type]
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert torch.equal(m.dequantize(), theirs)
    assert m.nbytes == raw.nbytes and m.shape == (6, 128)
    assert torch.equal(m.column_range(32, 96).dequantize(), theirs[:, 32:96])
    assert torch.equal(m.rows(2, 5).dequantize(), theirs[2:5])
    x = torch.randn(3, 128)
    torch.testing.assert_close(m.linear(x), x @ theirs.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.embedding(torch.tensor([4, 0])), theirs[[4, 0]])
    # a rank with no heads or no columns holds an empty part, and multiplies by it
    assert m.rows(3, 3).linear(x).shape == (3, 0) and m.column_range(64, 64).linear(x[:, :0]).shape == (3, 6)
    with pytest.raises(QuantizationError, match="blocks of 32"):
        m.column_range(16, 64)
    # rows chunked through ``linear`` give what one product gives
    big = QuantizedMatrix(torch.from_numpy(gguf.quants.quantize(np.random.default_rng(1).standard_normal(
        (40000, 32)).astype(np.float32), qtype)), kind, 32)  # type: ignore[arg-type]
    x = torch.randn(2, 32)
    torch.testing.assert_close(big.linear(x), x @ dequantize(big.raw, kind).T, rtol=1e-5, atol=1e-4)  # type: ignore


def test_the_file_says_the_shape_and_the_formats(tmp_path: Path) -> None:
    path = _model(tmp_path, LLAMA3, "llama", "Q4_0")
    with open_model(path) as model:
        cfg = model.config
    assert isinstance(model, GgufModel)
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.n_kv, cfg.ffn, cfg.vocab) == (2, 256, 8, 4, 384, 128)
    assert (cfg.quantization, cfg.embed_quantization, cfg.tie_embeddings, cfg.dtype) == (
        "q4_0", "q4_0", True, "float32")
    assert cfg.rope_factors is not None and len(cfg.rope_factors) == 16 and max(cfg.rope_factors) == 8.0
    assert source_config(TextModelSource(path=str(path))) == cfg
    qwen3 = open_model(_model(tmp_path, QWEN3, "qwen3", "Q8_0")).config
    assert qwen3.qk_norm and qwen3.head_dim == 64 and not qwen3.qkv_bias
    qwen2 = open_model(_model(tmp_path, QWEN2, "qwen2", "Q8_0")).config
    assert qwen2.qkv_bias and not qwen2.tie_embeddings and qwen2.head_quantization == "q8_0"
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'mamba' is not supported"):
        open_model(bad)


@pytest.mark.parametrize(("cfg", "arch"), [(LLAMA3, "llama"), (QWEN2, "qwen2"), (QWEN3, "qwen3")],
                         ids=["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_served_whole_and_split_it_equals_the_gguf_dequantized_model(tmp_path: Path, cfg: TextModelConfig,
                                                                     arch: str, kind: str) -> None:
    path = _model(tmp_path, cfg, arch, kind)
    model = GgufModel(path)
    dense_cfg = model.config.model_copy(update={"quantization": None, "embed_quantization": None,
                                                "head_quantization": None})
    dense = read_dequantized(path, dense_cfg, arch)
    ids = torch.tensor(PROMPT)
    want = reference.logits(dense, reference.forward(dense_cfg, dense, ids))
    whole = model.load()
    assert all(isinstance(whole[n], QuantizedMatrix) for n in whole if n.endswith(("q.weight", "down.weight")))
    # Relative too: a quantized matrix and ranks sum their products in other orders, and logits near 10 then differ
    # by 1e-4 in float32 on some CPUs (AVX-512's kernels), while a wrong dequantization is off by far more.
    torch.testing.assert_close(reference.logits(whole, reference.forward(model.config, whole, ids)), want,
                               rtol=1e-5, atol=1e-4)
    greedy = reference.generate(dense_cfg, dense, PROMPT, 8)
    assert len(set(greedy)) > 1
    for mode in ("galaxy", "megatron", "sp"):
        torch.testing.assert_close(_split_logits(model, _shares(mode), ids), want[-1], rtol=1e-5, atol=1e-4)
    tokens, _, _ = generate(model.config, _shares("galaxy"), whole, PROMPT, 8)
    assert tokens == greedy


def _split_logits(model: GgufModel, shares: HmpShares, ids: torch.Tensor) -> torch.Tensor:
    """The next-token logits of one pass over ``ids`` on three ranks, each reading only its part of the file."""
    ranks = [HmpRank.from_reader(model.config, shares, r, model.read_slice) for r in range(3)]
    loop = Loopback(3)
    try:
        outs = in_threads(3, lambda r: ranks[r].forward(ids, loop.ring(r, 0)))
        last = next(o for o in outs if o.last)  # type: ignore[attr-defined]
        logits = ranks[last.rank].next_logits(last)  # type: ignore[attr-defined]
    finally:
        for rank in ranks:
            rank.close()
        loop.close()
    assert logits is not None
    return logits


@pytest.mark.parametrize(("kind", "dtype"), [("F16", "float16"), ("BF16", "bfloat16")])
def test_half_precision_files_are_held_in_their_own_dtype_and_equal_the_gguf_read_model(
        tmp_path: Path, kind: str, dtype: str) -> None:
    path = _model(tmp_path, LLAMA3, "llama", kind)
    held = GgufModel(path)
    assert (held.config.dtype, held.config.quantization) == (dtype, None)  # kept, not upcast
    w = held.get("layers.0.up.weight")
    assert isinstance(w, torch.Tensor) and str(w.dtype) == f"torch.{dtype}"
    cfg = held.config  # the middle rank: 4 of 8 heads, 224 of 384 MLP columns, two bytes a weight
    assert _split_rank_bytes(held) == pytest.approx(
        cfg.layers * (4 / 8 * cfg.attention_bytes() + 224 / 384 * cfg.mlp_bytes()), rel=0.01)
    model = GgufModel(path, dtype="float32")  # computed in float32: the file's values exactly
    dense = read_dequantized(path, model.config, "llama")
    ids = torch.tensor(PROMPT)
    want = reference.logits(dense, reference.forward(model.config, dense, ids))
    for mode in ("galaxy", "megatron"):
        torch.testing.assert_close(_split_logits(model, _shares(mode), ids), want[-1], rtol=1e-5, atol=1e-4)


def _split_rank_bytes(model: GgufModel) -> int:
    """The bytes of the layers the middle rank of the uneven split holds (its weights less the replicated ones)."""
    cfg, shares = model.config, _shares("galaxy")
    rank = HmpRank.from_reader(cfg, shares, 1, model.read_slice)
    try:
        replicated = sum(cfg.tensor_bytes(n, math.prod(s)) for n, s in shard_shapes(cfg, shares, 1).items()
                         if not n.startswith("layers.") or "norm" in n)
        return int(rank.weight_bytes() - replicated)
    finally:
        rank.close()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_a_rank_holds_its_share_of_the_quantized_file_and_the_planner_counts_it(tmp_path: Path, kind: str) -> None:
    path = _model(tmp_path, LLAMA3, "llama", kind)
    model = GgufModel(path)
    cfg = model.config
    shares = _shares("galaxy")
    layers_file = sum(t.n_bytes for t in gguf.GGUFReader(str(path)).tensors if t.name.startswith("blk.")
                      and "norm" not in t.name)
    for r in range(3):
        rank = HmpRank.from_reader(cfg, shares, r, model.read_slice)
        try:
            replicated = sum(cfg.tensor_bytes(n, math.prod(s)) for n, s in shard_shapes(cfg, shares, r).items()
                             if not n.startswith("layers.") or "norm" in n)
            layers_held = rank.weight_bytes() - replicated
            share = (shares.heads[r] / cfg.heads * cfg.attention_bytes()
                     + shares.columns[r] / cfg.ffn * cfg.mlp_bytes()) * cfg.layers
            assert layers_held == pytest.approx(share, rel=0.05), (r, layers_held, share)
            assert rank.weight_bytes() == pytest.approx(
                sum(cfg.tensor_bytes(n, math.prod(s)) for n, s in shard_shapes(cfg, shares, r).items()), rel=0.05)
            assert shard_memory(cfg, shares, r, 64) > rank.weight_bytes()
        finally:
            rank.close()
    dense = cfg.layers * (cfg.attention_params() + cfg.mlp_params()) * 4
    assert layers_file == pytest.approx(cfg.layers * (cfg.attention_bytes() + cfg.mlp_bytes()), rel=0.01)
    assert dense / layers_file == pytest.approx(32 * 4 / (34 if kind == "Q8_0" else 18), rel=0.01)  # Q4_0: 7.1x


def test_the_planner_splits_a_quantized_model_on_block_boundaries(tmp_path: Path) -> None:
    cfg = open_model(_model(tmp_path, LLAMA3, "llama", "Q4_0")).config
    spec = load_cluster("asteroid-env-d-1000mbps")
    cluster = synthetic_cluster(spec, cfg, 32)
    for plan in (plan_galaxy(cluster, HmpOptions(prune=False)), plan_megatron(cluster, HmpOptions())):
        assert all(c % 32 == 0 for c in plan.shares.columns) and sum(plan.shares.columns) == cfg.ffn, plan.shares
    dense = cfg.model_copy(update={"quantization": None, "embed_quantization": None})
    assert plan_galaxy(cluster, HmpOptions(prune=False)).memory_bytes[0] < plan_galaxy(
        synthetic_cluster(spec, dense, 32), HmpOptions(prune=False)).memory_bytes[0]
