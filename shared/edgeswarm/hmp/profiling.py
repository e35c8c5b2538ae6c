"""Galaxy's profiler (spec 1.1): one device's latency of the MHA, MLP and connective blocks of one layer at a
sequence length, on grids of heads, columns and rows, as that device computes (its emulated slow-down included).

Protocol (spec 1.1 resolution): random weights of layer 0 at the model's shapes and dtype, ``warmup`` untimed runs
then the median of ``repeats`` timed ones of each phase of a point, the points of a grid taking turns
(``_phase_medians``), and each grid made non-decreasing in its share (``stats.non_decreasing``). Each block is timed
in the compute phases a pass runs it in (``hmp.layer``: the attention as q/k/v, core and output projection, whose
times at every head the profile keeps for the planner's split of the block; a connective block as residual and norm),
each phase stretched to the device's slow-down on its own, as the pass's recorder stretches it: an emulated device
sleeps after every phase, and the phase after a sleep starts on cold caches (timed whole, a Nano-M-like device's
attention block came out 5-7% faster than the same block in its three phases; natively the two agree). The grids are
capped (``profile_grids``: at most 16 head counts, ``column_points`` column counts, the rows of up to ``max_devices``
slices) so a paper-sized model profiles in bounded time. Every model also gets one row against a KV cache of
``seq_len`` tokens (a decoder's generation, and the one-row cost of each GEMM call that a row tile or a slice of the
rows pays), decoders one row's logits over the vocabulary (``head_s``, from a HEAD_ROWS slice of it), and every
model the embeddings of the ``seq_len`` rows (``embed_s``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from edgeswarm.devices.compute import synchronized, use_device_threads
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.models.text.ops import HeadCache, attention, embed, mlp_inner, norm, torch_dtype
from edgeswarm.models.text.reference import init_weights, weight_shapes
from edgeswarm.planning.hmp.synthetic import MAX_COLUMN_POINTS, profile_grids
from edgeswarm.planning.hmp.types import BlockProfile
from edgeswarm.stats import non_decreasing
from edgeswarm.values.text_model import TextModelConfig

LAYER = "layers.0."
# Vocabulary rows of the lm_head timed: its logits are a matrix-vector product, as slow per row of the vocabulary
# whatever the vocabulary's size (each row is read once), so a slice is timed and scaled (a 128k-token vocabulary in
# full would be a gigabyte to allocate for the timing).
HEAD_ROWS = 8192

Phases = Sequence[Callable[[], object]]  # a block's compute phases, in the order a pass runs them


def _phase_medians(points: Sequence[Phases], device: DeviceProfile, compute: torch.device, warmup: int,
                   repeats: int) -> list[list[float]]:
    """Each point's median seconds of each of its ``phases``, each run through ``device.run`` on its own. The points
    take turns, one run each a round, so a spell of load on the host (seconds, on a shared machine) slows one run of
    every point rather than every run of a few neighbouring ones: timed point after point, a loaded host's DistilBERT
    profile had 5 heads at 6.7 ms and 6 at 3.0 ms, and a plan priced on it bought the dip."""
    runs = [[partial(device.run, partial(synchronized, fn, compute)) for fn in phases] for phases in points]
    times: list[list[list[float]]] = [[[] for _ in steps] for steps in runs]
    for round_ in range(warmup + repeats):
        for steps, seen in zip(runs, times, strict=True):
            for step, phase in zip(steps, seen, strict=True):
                start = time.perf_counter()
                step()
                if round_ >= warmup:
                    phase.append(time.perf_counter() - start)
    return [[float(statistics.median(t)) for t in seen] for seen in times]


def _medians(points: Sequence[Phases], device: DeviceProfile, compute: torch.device, warmup: int, repeats: int
             ) -> list[float]:
    """Each point's seconds: the sum of its phases' medians (``_phase_medians``)."""
    return [sum(phases) for phases in _phase_medians(points, device, compute, warmup, repeats)]


def profile_blocks(cfg: TextModelConfig, seq_len: int, *, node: str, device: DeviceProfile,
                   compute: torch.device, warmup: int = 3, repeats: int = 10, max_devices: int = 4,
                   column_points: int = MAX_COLUMN_POINTS, seed: int = 0) -> BlockProfile:
    """``node``'s BlockProfile of ``cfg`` at ``seq_len`` rows (seconds per block of one layer), timed through
    ``device.run`` (its emulated slow-down) on ``compute``, with ``device``'s memory budget. The calling thread
    computes on the torch threads the device computes with from then on (``devices.compute.use_device_threads``)."""
    if warmup < 0 or repeats < 1:
        raise ValueError("at least one timed run and no negative warm-ups")
    # Whoever calls, a profile on other threads than the device's passes would mislead the planner: on a loaded host
    # a multi-threaded run stalls for scheduler slices that the emulated slow-down does not scale.
    use_device_threads(device)
    names = {n for n in weight_shapes(cfg) if n.startswith(LAYER)}
    w = {k.removeprefix(LAYER): v.to(compute) for k, v in init_weights(cfg, seed, names=names).items()}
    dtype = torch_dtype(cfg)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seq_len, cfg.hidden, generator=gen).to(dtype).to(compute)
    row = x[-1:].clone()
    hd, group = cfg.head_dim, cfg.group
    heads, columns, rows = profile_grids(cfg, seq_len, max_devices, column_points)
    phase_medians = partial(_phase_medians, device=device, compute=compute, warmup=warmup, repeats=repeats)
    medians = partial(_medians, device=device, compute=compute, warmup=warmup, repeats=repeats)
    cache_k = torch.randn(max(1, cfg.n_kv), seq_len, hd, generator=gen).to(dtype).to(compute)
    cache_v = torch.randn(max(1, cfg.n_kv), seq_len, hd, generator=gen).to(dtype).to(compute)

    def lin(t: torch.Tensor, name: str, rows_of: int | None = None, cols_of: int | None = None,
            bias: bool = True) -> torch.Tensor:
        weight = w[name + ".weight"]
        weight = weight[:rows_of] if rows_of is not None else weight
        weight = weight[:, :cols_of] if cols_of is not None else weight
        b = w.get(name + ".bias") if bias else None
        b = b[:rows_of] if (b is not None and rows_of is not None) else b
        return F.linear(t, weight, b)

    def mha(k: int, inp: torch.Tensor, cached: bool) -> Phases:
        kv = k // group * hd
        held: dict[str, torch.Tensor] = {}

        def qkv() -> None:
            held["q"], held["k"], held["v"] = lin(inp, "q", k * hd), lin(inp, "k", kv), lin(inp, "v", kv)

        def core() -> None:
            cache = None
            if cached:
                cache = HeadCache()
                cache.k, cache.v = cache_k[: k // group], cache_v[: k // group]
            q, k_, v = held.pop("q"), held.pop("k"), held.pop("v")
            held["att"] = attention(cfg, q, k_, v, seq_len if cached else 0, cache, w)

        # Each phase pops what it reads: every point of a grid is held at once (``_medians``), not its tensors.
        return qkv, core, lambda: lin(held.pop("att"), "o", cols_of=k * hd)

    def mlp(c: int, inp: torch.Tensor) -> Phases:
        gate = w["gate.weight"][:c] if cfg.gated else None
        up_b = w.get("up.bias")

        def block() -> torch.Tensor:
            inner = mlp_inner(cfg, inp, w["up.weight"][:c], up_b[:c] if up_b is not None else None, gate)
            return lin(inner, "down", cols_of=c)
        return (block,)

    def con(r: int) -> Phases:
        part = x[:r]
        held: dict[str, torch.Tensor] = {}

        def residual() -> None:
            held["u"] = part + part
        return residual, lambda: norm(cfg, held.pop("u"), w, "attn_norm")

    with torch.inference_mode():
        # Each grid's times made non-decreasing: a larger share computes a superset of a smaller one's work, so a
        # share measured faster than a smaller one is noise.
        mha_p = phase_medians([mha(k, x, False) for k in heads])
        mha_t = non_decreasing([sum(p) for p in mha_p])
        mlp_t = non_decreasing(medians([mlp(c, x) for c in columns]))
        con_t = non_decreasing(medians([con(r) for r in rows]))
        # One row, for an encoder too: every GEMM call reads its whole weight, so a row tile or a slice of the rows
        # costs its one-row time beside its rows' share (``planning.hmp.latency.gemm_s``).
        mha_dp = phase_medians([mha(k, row, True) for k in heads])
        mha_d = non_decreasing([sum(p) for p in mha_dp])
        mlp_d = non_decreasing(medians([mlp(c, row) for c in columns]))
        embed_w = {k: v.to(compute) for k, v in init_weights(cfg, seed, names={
            n for n in weight_shapes(cfg) if n.startswith("embed.") and n != "embed.tokens"}).items()}
        # A slice of the token table: a lookup costs its rows, not the vocabulary (whose table may be a gigabyte).
        sliced = min(cfg.vocab, HEAD_ROWS)
        embed_w["embed.tokens"] = torch.randn(sliced, cfg.hidden, generator=gen).to(dtype).to(compute)
        ids = torch.randint(0, sliced, (seq_len,), generator=gen).to(compute)
        (embed_t,) = medians([(partial(embed, cfg, embed_w, ids),)])
        head = 0.0
        if cfg.decoder:
            head_w = torch.randn(sliced, cfg.hidden, generator=gen).to(dtype).to(compute)
            head = medians([(partial(F.linear, row, head_w),)])[0] * cfg.vocab / sliced
    return BlockProfile(node=node, device_class=device.device_class, memory_budget_bytes=device.memory_budget_bytes,
                        seq_len=seq_len, heads=heads, mha_s=mha_t, columns=columns, mlp_s=mlp_t, rows=rows,
                        con_s=con_t, mha_decode_s=mha_d, mlp_decode_s=mlp_d, mha_phases_s=mha_p[-1],
                        mha_decode_phases_s=mha_dp[-1], head_s=head, embed_s=embed_t, compute=str(compute))
