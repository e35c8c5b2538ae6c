"""The tensor-parallel (HMP) runtime on one host: every rank in a thread over the in-memory ring.

Spec checks C-N1..C-N5 (numerics), C-C1..C-C3 (counted on the transport), C-C4's spans, generation from the
sharded KV cache equal to one device token for token, decode steps (fewer rows than ranks) synchronised by direct
collectives, and the baselines (megatron, sp, local) equal to the reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from edgeswarm.hmp.layer import HmpRank, RankOutput, last_row_rank
from edgeswarm.hmp.loopback import Loopback
from edgeswarm.hmp.sharding import rank_slices, read_shard, shard_shapes
from edgeswarm.hmp.tiles import CommThreads, ag_gemm, gemm_rs
from edgeswarm.hmp.trace import Recorder, chrome_events, write_chrome_trace
from edgeswarm.models.text import reference as ref
from edgeswarm.models.text.ops import embed, norm
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.runtime.collectives import ring_all_gather, ring_reduce_scatter
from edgeswarm.values.text_model import PRESETS, TextModelConfig
from hmp_driver import generate, in_threads, run_pass, shares_for

FAMILIES = ["bert-tiny", "gpt2-tiny", "opt-tiny", "llama-tiny"]
DECODERS = ["gpt2-tiny", "opt-tiny", "llama-tiny"]


def one_layer(name: str) -> TextModelConfig:
    return PRESETS[name].model_copy(update={"layers": 1})


def close(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> None:
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * scale * want.abs().max().item() + 1e-5 * scale, err


def assemble(outputs: list[RankOutput]) -> torch.Tensor:
    """All rows [s, h] from every rank's output (overlapping rows, megatron's, are taken once)."""
    s = outputs[0].rows
    full = outputs[0].hidden.new_zeros((s, outputs[0].hidden.shape[1]))
    for o in outputs:
        full[o.start:o.start + o.hidden.shape[0]] = o.hidden.to(full.device)
    return full


def tokens_of(cfg: TextModelConfig, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (s,), generator=torch.Generator().manual_seed(seed))


# -- sharding ----------------------------------------------------------------------------------------------------


def test_a_rank_holds_its_heads_kv_groups_and_columns_and_whole_row_parallel_biases() -> None:
    cfg = PRESETS["llama-tiny"]  # 8 query heads in 2 KV groups of 4, head_dim 8
    shares = HmpShares(devices=["a", "b", "c"], heads=[4, 0, 4], columns=[100, 0, 76])
    shapes = shard_shapes(cfg, shares, 2)
    assert shapes["layers.0.q.weight"] == (32, 64) and shapes["layers.0.k.weight"] == (8, 64)
    assert shapes["layers.0.o.weight"] == (64, 32) and shapes["layers.0.up.weight"] == (76, 64)
    assert shapes["layers.0.gate.weight"] == (76, 64) and shapes["layers.0.down.weight"] == (64, 76)
    empty = shard_shapes(cfg, shares, 1)
    assert empty["layers.1.q.weight"] == (0, 64) and empty["layers.1.down.weight"] == (64, 0)
    cut = {s.name: s for s in rank_slices(cfg, shares, 2)}
    assert cut["layers.0.k.weight"].rows == (8, 16) and cut["layers.0.down.weight"].columns == (100, 176)
    gpt = PRESETS["gpt2-tiny"]
    g = HmpShares(devices=["a", "b"], heads=[1, 3], columns=[64, 192])
    gs = shard_shapes(gpt, g, 1)
    assert gs["layers.0.q.bias"] == (48,) and gs["layers.0.up.bias"] == (192,)
    assert gs["layers.0.o.bias"] == (64,) and gs["layers.0.down.bias"] == (64,)  # whole: added once, after the sum
    w = ref.init_weights(gpt, 3)
    shard = read_shard(gpt, g, 1, lambda s: s.cut(w[s.name]))
    assert torch.equal(shard["layers.1.v.weight"], w["layers.1.v.weight"][16:64])
    assert torch.equal(shard["layers.1.o.weight"], w["layers.1.o.weight"][:, 16:64])
    sp = HmpShares(mode="sp", devices=["a", "b"], heads=[0, 0], columns=[0, 0])
    assert shard_shapes(gpt, sp, 1)["layers.0.q.weight"] == (64, 64)


def test_shares_that_do_not_fit_the_model_are_refused() -> None:
    cfg = PRESETS["llama-tiny"]
    with pytest.raises(ValueError, match="multiples of 4"):
        rank_slices(cfg, HmpShares(devices=["a", "b"], heads=[2, 6], columns=[88, 88]), 0)
    with pytest.raises(ValueError, match="column shares"):
        rank_slices(cfg, HmpShares(devices=["a", "b"], heads=[4, 4], columns=[88, 80]), 0)


# -- C-N1, C-N2 --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_cn1_a_layer_split_any_way_equals_the_single_device_layer(name: str, n: int) -> None:
    cfg = one_layer(name)
    w = ref.init_weights(cfg, 11)
    for kind in ("equal", "uneven"):
        for s in (3 * n, 3 * n + 1, 1):
            tokens = tokens_of(cfg, s, seed=s)
            want = ref.forward(cfg, w, tokens)
            outs, _, _ = run_pass(cfg, shares_for(cfg, "galaxy", n, kind), w, tokens)
            close(assemble(outs), want)
            assert sum(o.hidden.shape[0] for o in outs) == s  # each rank ends with its rows only


@pytest.mark.parametrize("name", FAMILIES)
def test_cn1_not_overlapped_and_a_long_uneven_sequence(name: str) -> None:
    cfg = one_layer(name)
    w = ref.init_weights(cfg, 12)
    tokens = tokens_of(cfg, 100, seed=1)  # 100 rows on 3 ranks: 34, 33, 33
    want = ref.forward(cfg, w, tokens)
    for overlap in (False, True):
        outs, _, _ = run_pass(cfg, shares_for(cfg, "galaxy", 3, "uneven", overlap), w, tokens)
        close(assemble(outs), want)


def test_cn1_284_rows_on_3_ranks() -> None:
    cfg = one_layer("bert-tiny").model_copy(update={"max_positions": 300})
    w = ref.init_weights(cfg, 13)
    tokens = tokens_of(cfg, 284)
    outs, _, _ = run_pass(cfg, shares_for(cfg, "galaxy", 3, "uneven"), w, tokens)
    close(assemble(outs), ref.forward(cfg, w, tokens))


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("mode", ["galaxy", "megatron", "sp"])
def test_cn2_the_whole_model_equals_one_device_in_every_mode(name: str, mode: str) -> None:
    cfg = PRESETS[name].model_copy(update={"layers": 4})
    w = ref.init_weights(cfg, 21)
    tokens = tokens_of(cfg, 11, seed=2)
    types = torch.tensor([0] * 5 + [1] * 6) if cfg.family == "bert" else None
    want = ref.forward(cfg, w, tokens, types=types)
    kind = "equal" if mode == "megatron" else "uneven"
    outs, _, ranks = run_pass(cfg, shares_for(cfg, mode, 3, kind), w, tokens, types=types)
    close(assemble(outs), want, math.sqrt(cfg.layers))
    if cfg.decoder:
        answering = [o for o in outs if o.last]
        assert len(answering) == 1 and answering[0].rank == last_row_rank(mode, 11, 3)
        got = ranks[answering[0].rank].next_logits(answering[0])
        assert got is not None
        exp = ref.logits(w, want[-1:])[0]
        assert int(got.argmax()) == int(exp.argmax())
        assert set(got.topk(5).indices.tolist()) == set(exp.topk(5).indices.tolist())
        assert all(ranks[o.rank].next_logits(o) is None for o in outs if not o.last)


def test_local_mode_equals_the_reference() -> None:
    cfg = PRESETS["llama-tiny"]
    w = ref.init_weights(cfg, 22)
    tokens = tokens_of(cfg, 9)
    shares = HmpShares(mode="local", devices=["a"], heads=[cfg.heads], columns=[cfg.ffn])
    outs, loop, _ = run_pass(cfg, shares, w, tokens)
    close(outs[0].hidden, ref.forward(cfg, w, tokens))
    assert loop.counts[0].messages == 0


# -- C-N3 --------------------------------------------------------------------------------------------------------


def _uneven_bounds(n: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 5, (n,), generator=g).tolist()
    sizes[seed % n] = 0  # always one empty tile
    sizes[(seed + 1) % n] += 1
    out, at = [], 0
    for size in sizes:
        out.append((at, at + size))
        at += size
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_cn3_tiled_collectives_equal_the_collective_then_the_gemm(n: int) -> None:
    bounds = _uneven_bounds(n, n)
    s, h, f = bounds[-1][1], 8, 12
    g = torch.Generator().manual_seed(n)
    parts = [torch.randn(b - a, h, generator=g) for a, b in bounds]
    weights = [torch.randn(f, h, generator=g) for _ in range(n)]
    fulls = [torch.randn(s, f, generator=g) for _ in range(n)]
    downs = [torch.randn(h, f, generator=g) for _ in range(n)]
    x = torch.cat(parts)
    loop = Loopback(n)
    recs = [Recorder() for _ in range(n)]
    ios = [CommThreads(recs[r]) for r in range(n)]

    def body(r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        send, recv = loop.ring(r, 0)(0)
        tiled_ag = ag_gemm(parts[r], r, bounds, lambda t: torch.relu(t @ weights[r].T), send, recv, ios[r], recs[r])
        send, recv = loop.ring(r, 0)(1)
        tiled_rs = gemm_rs(fulls[r], r, bounds, lambda t: t @ downs[r].T, send, recv, ios[r], recs[r])
        send, recv = loop.ring(r, 1)(0)
        flat_b = [(a * h, b * h) for a, b in bounds]
        plain_ag = torch.relu(ring_all_gather(parts[r], r, flat_b, send, recv).view(s, h) @ weights[r].T)
        send, recv = loop.ring(r, 1)(1)
        plain_rs = ring_reduce_scatter(fulls[r] @ downs[r].T, r, flat_b, send, recv).view(-1, h)
        return tiled_ag, plain_ag, tiled_rs, plain_rs

    try:
        results = in_threads(n, body)
    finally:
        for io in ios:
            io.close()
        loop.close()
    total = sum(fulls[r] @ downs[r].T for r in range(n))
    for r, (tiled_ag, plain_ag, tiled_rs, plain_rs) in enumerate(results):  # type: ignore[misc]
        # row tiles are the same products, up to the BLAS kernel a tile's row count picks
        torch.testing.assert_close(tiled_ag, plain_ag, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(plain_ag, torch.relu(x @ weights[r].T), rtol=1e-5, atol=1e-6)
        a, b = bounds[r]
        assert tiled_rs.shape == (b - a, h)
        torch.testing.assert_close(tiled_rs, plain_rs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tiled_rs, total[a:b], rtol=1e-5, atol=1e-5)
    # both forms send the same messages (the platform's ring steps), tiles of no rows never
    for r in range(n):
        c = loop.counts[r].per_collective
        assert c.get((0, 0)) == c.get((1, 0)) and c.get((0, 1)) == c.get((1, 1))


# -- C-N4, C-N5 --------------------------------------------------------------------------------------------------


def _zeroed(cfg: TextModelConfig, seed: int) -> dict[str, torch.Tensor]:
    w = ref.init_weights(cfg, seed)
    for name, t in w.items():
        if name.startswith("layers.") and "norm" not in name:
            t.zero_()
    return w


@pytest.mark.parametrize("n", [2, 3, 4])
def test_cn4_row_parallel_biases_are_added_once(n: int) -> None:
    cfg = one_layer("gpt2-tiny")
    w = _zeroed(cfg, 31)  # attention and MLP outputs are their biases alone
    b_o, b_d = torch.randn(cfg.hidden), torch.randn(cfg.hidden)
    w["layers.0.o.bias"], w["layers.0.down.bias"] = b_o, b_d
    tokens = tokens_of(cfg, 2 * n + 1)
    x = embed(cfg, w, tokens)
    want = norm(cfg, x + b_o + b_d, w, "final_norm")
    for mode, kind in (("galaxy", "uneven"), ("megatron", "equal")):
        outs, _, _ = run_pass(cfg, shares_for(cfg, mode, n, kind), w, tokens)
        close(assemble(outs), want)


def test_cn5_a_zero_attention_output_leaves_the_normalised_residual() -> None:
    cfg = one_layer("bert-tiny")
    w = _zeroed(cfg, 32)  # attention output and MLP output are zero
    tokens = tokens_of(cfg, 7)
    x = embed(cfg, w, tokens)
    want = norm(cfg, norm(cfg, x, w, "layers.0.attn_norm"), w, "layers.0.mlp_norm")
    outs, _, _ = run_pass(cfg, shares_for(cfg, "galaxy", 3, "uneven"), w, tokens)
    got = assemble(outs)
    close(got, want)
    assert got.abs().max() > 0.5  # LN(residual), not LN(0) (which would be the norm's bias alone)
    pre = one_layer("opt-tiny")
    wp = _zeroed(pre, 33)
    tp = tokens_of(pre, 7)
    outs, _, _ = run_pass(pre, shares_for(pre, "galaxy", 3, "uneven"), wp, tp)
    close(assemble(outs), norm(pre, embed(pre, wp, tp), wp, "final_norm"))


# -- C-C1..C-C3 --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_cc1_cc2_cc3_messages_bytes_and_norm_rows_per_layer(n: int) -> None:
    cfg = PRESETS["gpt2-tiny"].model_copy(update={"layers": 3})
    w = ref.init_weights(cfg, 41)
    s, h, beta = 4 * n + 1, cfg.hidden, 4
    tokens = tokens_of(cfg, s)
    per_layer: dict[str, list[dict[int, tuple[int, int]]]] = {}
    norm_rows: dict[str, list[int]] = {}
    for mode in ("galaxy", "megatron", "sp"):
        _, loop, ranks = run_pass(cfg, shares_for(cfg, mode, n), w, tokens)
        layers: list[dict[int, tuple[int, int]]] = [{} for _ in range(cfg.layers)]
        for r in range(n):
            for (_, c), (msgs, nbytes) in loop.counts[r].per_collective.items():
                m0, b0 = layers[c // 4].get(r, (0, 0))
                layers[c // 4][r] = (m0 + msgs, b0 + nbytes)
            if mode == "galaxy":
                biggest = math.ceil(s / n) * h * beta
                assert all(b <= m * biggest for m, b in loop.counts[r].per_collective.values())
        per_layer[mode] = layers
        norm_rows[mode] = [sum(t.norm_rows for rk in ranks for t in rk.recorder.times() if t.layer == i)
                           for i in range(cfg.layers)]
    ideal = 4 * (n - 1) / n * s * h * beta
    galaxy, megatron, sp = per_layer["galaxy"], per_layer["megatron"], per_layer["sp"]
    # C-C1: 2 RS + 2 AG per layer; no AllGather into layer 0 (embeddings replicated), none after the last layer
    assert all(galaxy[1][r][0] == 4 * (n - 1) for r in range(n))
    assert all(galaxy[0][r][0] == 3 * (n - 1) and galaxy[-1][r][0] == 4 * (n - 1) for r in range(n))
    # C-C2: 4(D-1)/D s h beta per rank per layer (within a row per message), megatron's two AllReduce the same,
    # SP half
    for r in range(n):
        assert abs(galaxy[1][r][1] - ideal) <= 4 * (n - 1) * h * beta
        assert abs(megatron[1][r][1] - ideal) <= 4 * (n - 1) * h * beta
        assert abs(sp[1][r][1] - ideal / 2) <= 2 * (n - 1) * h * beta
        assert megatron[1][r][0] == 4 * (n - 1) and sp[1][r][0] == 2 * (n - 1)
    assert sum(galaxy[1][r][1] for r in range(n)) == sum(megatron[1][r][1] for r in range(n))
    assert sum(galaxy[1][r][1] for r in range(n)) == 2 * sum(sp[1][r][1] for r in range(n))
    # C-C3: each connective block normalises s rows summed over ranks (two per layer), megatron D*s
    assert norm_rows["galaxy"] == [2 * s] * cfg.layers
    assert norm_rows["megatron"] == [2 * n * s] * cfg.layers
    assert norm_rows["sp"] == [2 * s] * cfg.layers


# -- C-C4: time split and spans ----------------------------------------------------------------------------------


def test_cc4_comm_spans_overlap_gemm_spans_and_the_time_split_is_recorded(tmp_path: Path) -> None:
    cfg = PRESETS["gpt2-tiny"]
    w = ref.init_weights(cfg, 51)
    tokens = tokens_of(cfg, 30)
    loop = Loopback(3, latency_s=0.01)
    outs, _, ranks = run_pass(cfg, shares_for(cfg, "galaxy", 3, "uneven"), w, tokens, loop=loop)
    close(assemble(outs), ref.forward(cfg, w, tokens))
    for rank in ranks:
        spans = rank.recorder.spans()
        comm = [sp for sp in spans if sp.kind == "comm" and sp.name.startswith("recv")]
        gemms = [sp for sp in spans if sp.kind == "compute" and sp.name in ("qkv", "o", "up", "down")]
        assert comm and gemms
        assert {sp.thread for sp in comm}.isdisjoint({sp.thread for sp in gemms})
        assert any(c.start < g.start and g.end < c.end for c in comm for g in gemms)
        times = {t.layer: t for t in rank.recorder.times()}
        assert set(times) == {-1, 0, 1}
        assert all(times[i].compute_s > 0 and times[i].sync_s > 0 for i in (0, 1))
        assert sum(times[i].wait_s for i in (0, 1)) > 0.005  # the emulated link's latency is waited for
        events = chrome_events(spans, pid=rank.rank, origin=spans[0].start)
        assert len(events) == len(spans) and all(e.dur >= 0 for e in events)
    path = tmp_path / "trace.json"
    count = write_chrome_trace(path, [rank.recorder.spans() for rank in ranks])
    written = json.loads(path.read_text())["traceEvents"]
    assert len(written) == count and {e["pid"] for e in written} == {0, 1, 2}
    assert any(e["tid"].startswith("hmp1-recv") for e in written)


# -- generation from the sharded KV cache ------------------------------------------------------------------------


@pytest.mark.parametrize("name", DECODERS)
def test_generation_from_the_sharded_kv_cache_equals_one_device(name: str) -> None:
    cfg = PRESETS[name]
    w = ref.init_weights(cfg, 61)
    prompt = tokens_of(cfg, 7, seed=5).tolist()
    want = ref.generate(cfg, w, prompt, 8)
    shares = shares_for(cfg, "galaxy", 3, "uneven")
    got, caches, held = generate(cfg, shares, w, prompt, 8)
    assert got == want
    single = ref.ModelCache(cfg.layers)
    ref.forward(cfg, w, torch.tensor(prompt + want[:-1]), cache=single)
    assert sum(held) == single.nbytes()  # the cache is the single device's, cut by heads
    assert held[1] == 0  # the rank with no heads caches nothing
    assert all(c.length == len(prompt) + len(want) - 1 for c in caches)
    for c in caches:
        c.free()
        assert c.nbytes() == 0 and c.length == 0


@pytest.mark.parametrize("mode", ["megatron", "sp", "local"])
def test_generation_in_the_baseline_modes_equals_one_device(mode: str) -> None:
    cfg = PRESETS["llama-tiny"]
    w = ref.init_weights(cfg, 62)
    prompt = tokens_of(cfg, 5, seed=6).tolist()
    want = ref.generate(cfg, w, prompt, 6)
    n = 1 if mode == "local" else 3
    got, _, _ = generate(cfg, shares_for(cfg, mode, n, "equal"), w, prompt, 6)
    assert got == want


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_decode_steps_sync_with_two_direct_rounds_per_layer_and_generate_as_one_device(name: str, n: int) -> None:
    """A prefill on the ring, then decode steps (one row: fewer rows than ranks) with the rows replicated and two
    direct AllReduces per layer, each one round of n - 1 messages of one row from every rank, on uneven shares with
    a rank holding no heads, then one direct AllGather of the logits, each rank's share of the vocabulary (in
    proportion to its MLP columns: none from the rank without); the tokens and the KV cache are the single
    device's."""
    cfg = PRESETS[name]
    w = ref.init_weights(cfg, 63)
    prompt = tokens_of(cfg, 6, seed=n).tolist()
    new = 5
    want = ref.generate(cfg, w, prompt, new)
    single = ref.ModelCache(cfg.layers)
    ref.forward(cfg, w, torch.tensor(prompt + want[:-1]), cache=single)
    direct = {4 * i + j for i in range(cfg.layers) for j in (1, 3)}
    row = cfg.hidden * 4
    for mode in ("galaxy", "megatron"):
        shares = shares_for(cfg, mode, n, "uneven")
        assert 0 in shares.heads
        loop = Loopback(n)
        got, _, held = generate(cfg, shares, w, prompt, new, loop=loop)
        assert got == want, mode
        assert sum(held) == single.nbytes() and held[1] == 0  # the prefill's and the steps' caches continue
        vocab = shares.vocab_bounds(cfg.vocab)
        assert vocab[1] == (vocab[0][1], vocab[0][1])  # no columns, no share of the head
        logits = 4 * cfg.layers + 1
        for r in range(n):
            counts = loop.counts[r]
            share = (vocab[r][1] - vocab[r][0]) * 4
            for step in range(1, new):
                per = {c: v for (scope, c), v in counts.per_collective.items() if scope == step}
                assert set(per) - {logits} == direct, (mode, r, step)
                assert all(per[c] == (n - 1, (n - 1) * row) for c in direct)
                assert per.get(logits, (0, 0)) == ((n - 1, (n - 1) * share) if share else (0, 0)), (mode, r, step)
                assert all(counts.steps[(step, c)] == {0} for c in per)  # one round each
            if mode == "galaxy":  # the prefill (6 rows >= n) still runs galaxy's ring collectives; its last row,
                # on one rank, then goes to every rank (4L) for the split head (4L + 1: from the ranks with a share)
                prefill = {c for (scope, c) in counts.per_collective if scope == 0}
                split = {4 * cfg.layers} | ({logits} if share else set())
                assert prefill == set(range(1, 4 * cfg.layers)) | split


def test_sp_decode_steps_gather_keys_and_values_direct() -> None:
    cfg = PRESETS["llama-tiny"]
    w = ref.init_weights(cfg, 64)
    n, prompt = 3, tokens_of(cfg, 5, seed=8).tolist()
    loop = Loopback(n)
    got, _, _ = generate(cfg, shares_for(cfg, "sp", n), w, prompt, 4, loop=loop)
    assert got == ref.generate(cfg, w, prompt, 4)
    kv = cfg.n_kv * cfg.head_dim * 4
    for r in range(n):
        per = {c: v for (scope, c), v in loop.counts[r].per_collective.items() if scope == 2}
        if r == 0:  # the step's one row is rank 0's: it sends its keys and values to the others at once
            assert per == {4 * i + j: (n - 1, (n - 1) * kv) for i in range(cfg.layers) for j in (0, 1)}
            assert all(loop.counts[r].steps[(2, c)] == {0} for c in per)
        else:
            assert per == {}


@pytest.mark.parametrize("n", [3, 4])
def test_a_prompt_shorter_than_the_ring_syncs_direct_with_replicated_rows(n: int) -> None:
    cfg = PRESETS["opt-tiny"].model_copy(update={"layers": 3})
    w = ref.init_weights(cfg, 65)
    for s in range(1, n):
        tokens = tokens_of(cfg, s, seed=s)
        outs, loop, ranks = run_pass(cfg, shares_for(cfg, "galaxy", n, "uneven"), w, tokens)
        close(assemble(outs), ref.forward(cfg, w, tokens), math.sqrt(cfg.layers))
        assert [o.hidden.shape[0] for o in outs] == [1] * s + [0] * (n - s)  # galaxy answers with its row slice
        assert [o.rank for o in outs if o.last] == [last_row_rank("galaxy", s, n)]
        for r in range(n):
            per = loop.counts[r].per_collective
            assert set(per) == {(0, 4 * i + j) for i in range(cfg.layers) for j in (1, 3)}
            assert all(m == n - 1 for m, _ in per.values())
        rows = [sum(t.norm_rows for rk in ranks for t in rk.recorder.times() if t.layer == i)
                for i in range(cfg.layers)]
        assert rows == [2 * n * s] * cfg.layers  # the connective blocks run on every rank


def test_a_rank_built_from_a_reader_reads_only_its_slices() -> None:
    cfg = PRESETS["opt-tiny"]
    w = ref.init_weights(cfg, 71)
    shares = shares_for(cfg, "galaxy", 3, "uneven")
    asked: list[str] = []

    def read(piece):  # type: ignore[no-untyped-def]
        asked.append(piece.name)
        return piece.cut(w[piece.name])

    rank = HmpRank.from_reader(cfg, shares, 2, read)
    rank.close()
    assert sorted(asked) == sorted(s.name for s in rank_slices(cfg, shares, 2))
    held = sum(math.prod(shape) * 4 for shape in shard_shapes(cfg, shares, 2).values())
    assert rank.weight_bytes() == held


def test_bad_tokens_are_refused_before_any_collective() -> None:
    cfg = PRESETS["gpt2-tiny"]
    w = ref.init_weights(cfg, 72)
    rank = HmpRank(cfg, shares_for(cfg, "galaxy", 2), 0, w)

    def ring(c: int):  # type: ignore[no-untyped-def]
        raise AssertionError("no collective for a refused pass")

    try:
        for bad in ([], [cfg.vocab], [-1], [0] * (cfg.max_positions + 1)):
            with pytest.raises(ValueError):
                rank.forward(bad, ring)
    finally:
        rank.close()


def test_a_pass_that_fails_part_way_leaves_the_cache_as_it_was() -> None:
    cfg = PRESETS["gpt2-tiny"]
    w = ref.init_weights(cfg, 73)
    prompt = tokens_of(cfg, 6, seed=7).tolist()
    want = ref.generate(cfg, w, prompt, 2)
    shares = shares_for(cfg, "galaxy", 2, "uneven")
    loop = Loopback(2, timeout_s=5)
    ranks = [HmpRank(cfg, shares, r, w) for r in range(2)]
    caches = [rank.new_cache() for rank in ranks]

    def broken(r: int):  # type: ignore[no-untyped-def]
        def factory(c: int):  # type: ignore[no-untyped-def]
            if c >= 4:  # layer 1's first collective: layer 0 has cached this pass's keys already
                raise ConnectionError("peer gone")
            return loop.ring(r, 1)(c)
        return factory

    def body(r: int) -> int | None:
        out = ranks[r].forward(prompt, loop.ring(r, 0), cache=caches[r])
        logits = ranks[r].next_logits(out)
        with pytest.raises(ConnectionError):
            ranks[r].forward([want[0]], broken(r), cache=caches[r])
        assert caches[r].length == len(prompt)
        assert all(c.length in (0, len(prompt)) for c in caches[r].layers)
        again = ranks[r].next_logits(ranks[r].forward([want[0]], loop.ring(r, 2), cache=caches[r]))
        return None if logits is None and again is None else int(again.argmax()) if again is not None else -1

    try:
        answers = in_threads(2, body)
    finally:
        for rank in ranks:
            rank.close()
        loop.close()
    assert want[1] in answers


@pytest.mark.parametrize("mode", ["galaxy", "megatron", "sp"])
def test_half_precision_runs_within_the_fp16_tolerance(mode: str) -> None:
    cfg = PRESETS["llama-tiny"].model_copy(update={"dtype": "bfloat16"})
    w = ref.init_weights(cfg, 81)
    tokens = tokens_of(cfg, 10)
    want = ref.forward(cfg, w, tokens).float()
    outs, loop, _ = run_pass(cfg, shares_for(cfg, mode, 3, "equal" if mode == "megatron" else "uneven"), w, tokens)
    got = assemble(outs)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 3e-2 * want.abs().max().item()
    assert loop.counts[0].bytes % 2 == 0 and loop.counts[0].messages > 0
