"""The latency and communication model of spec 4.5 and 2.8 over measured block profiles.

A block's latency at a share between two measured points is interpolated linearly (with zero work at zero share,
proportional beyond the last point). The overlap forms need the GEMM part of a block: a block's measured time is
split among its GEMMs and its attention core in the shares the profile timed its phases in, else in proportion to
their FLOPs (``phase_fractions``). A GEMM on fewer rows than profiled is priced between its one-row (decode) time and
its ``seq_len``-row time (``gemm_s``): every call streams the whole weight, so Galaxy's row tiles cost more than their
share of the rows, and the planner tiles only where the overlap gains more than that (``priced_plan``). One ring
step costs tau = message_s + hop_s + latency_s + tile bytes / bandwidth on the slowest link of the ring: every tensor
goes sender -> receiver's broker -> receiver, one broker hop per message (``hop_s``) beside the link's own fixed cost.

Decode steps (one row: fewer rows than devices) synchronise with direct collectives, as the runtime does
(``hmp.layer.direct_syncs``): galaxy and megatron two direct AllReduces per layer, sp its K and V AllGathers direct.
A direct round sends one row from every device to every other at once, D - 1 messages in parallel on separate
links, so it costs one message on the slowest link of the mesh: message_s + hop_s + latency_s + row bytes /
bandwidth.

Beside its layers, a request pays its embeddings (``embeddings_s``) and its round trips with the job's coordinator
(``control_s``): two for its prefill (its admission and the pass), one for each decode step (its pass).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace

from edgeswarm.errors import ProfileError
from edgeswarm.planning.hmp.algorithm import equal_split
from edgeswarm.planning.hmp.shares import splits_head, vocab_bounds
from edgeswarm.planning.hmp.types import BlockProfile, CommModel, DecodePrediction, HmpMode, LatencySplit
from edgeswarm.planning.vocabulary import request_seconds
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.values.text_model import TextModelConfig

# The elementwise add of one received tile costs about a quarter of a connective block on the same rows (the
# block reads and writes the rows about four times: residual add, mean, variance, scale).
ADD_FRACTION = 0.25
# Without decode measurements, one row through a block is priced at this many times its share of the prefill
# time: a one-row GEMM streams the whole weight and runs far below the many-row GEMM rate.
DECODE_SLOWDOWN = 8.0


def interpolate(grid: Sequence[int], times: Sequence[float], x: float) -> float:
    """Seconds at share ``x`` from ``times`` measured at ascending ``grid``: linear between points, from (0, 0)
    below the first, proportional to ``x`` beyond the last."""
    if x <= 0:
        return 0.0
    if x >= grid[-1]:
        return times[-1] * x / grid[-1]
    i = bisect.bisect_left(grid, x)
    if grid[i] == x:
        return float(times[i])
    x0, t0 = (grid[i - 1], times[i - 1]) if i > 0 else (0, 0.0)
    x1, t1 = grid[i], times[i]
    return float(t0 + (t1 - t0) * (x - x0) / (x1 - x0))


def mha_s(p: BlockProfile, heads: float) -> float:
    return interpolate(p.heads, p.mha_s, heads)


def mlp_s(p: BlockProfile, columns: float) -> float:
    return interpolate(p.columns, p.mlp_s, columns)


def con_s(p: BlockProfile, rows: float) -> float:
    return interpolate(p.rows, p.con_s, rows)


def capacity(p: BlockProfile, cfg: TextModelConfig) -> float:
    """V_d (Eq. 6): 1 / (the whole MHA block + the whole MLP block), per second."""
    whole = mha_s(p, cfg.heads) + mlp_s(p, cfg.ffn)
    if whole <= 0:
        raise ProfileError(f"device {p.node}'s profile has zero latency for the whole blocks")
    return 1.0 / whole


@dataclass(frozen=True)
class BlockFractions:
    """Shares of a block's time: MHA = ``qkv`` + ``core`` + ``oproj``; MLP = ``up`` (with the activation) +
    ``down``. Each triple or pair sums to 1."""

    qkv: float
    core: float
    oproj: float
    up: float
    down: float


def block_fractions(cfg: TextModelConfig, rows: int, keys: int) -> BlockFractions:
    """FLOP shares of ``rows`` query rows against ``keys`` keys (per head, so independent of the head count)."""
    hd, h = cfg.head_dim, cfg.hidden
    qkv = 2.0 * rows * h * hd * (1 + 2 / cfg.group)
    core = 4.0 * rows * keys * hd
    oproj = 2.0 * rows * hd * h
    mha = qkv + core + oproj
    up = (2.0 if cfg.gated else 1.0)
    return BlockFractions(qkv / mha, core / mha, oproj / mha, up / (up + 1.0), 1.0 / (up + 1.0))


def phase_fractions(cfg: TextModelConfig, p: BlockProfile, rows: int, keys: int) -> BlockFractions:
    """``block_fractions``, with the MHA block's shares (QKV, core, output projection) as ``p`` timed its phases at
    every head where it did: on ``seq_len`` rows (``mha_phases_s``) or one row against a cache of ``seq_len``
    (``mha_decode_phases_s``). FLOPs misplace them: DistilBERT's core, 16% of its MHA's FLOPs at 284 tokens, took
    34-40% of its time on a Nano-M-like device (its softmax and its scaling read and write every score)."""
    fr = block_fractions(cfg, rows, keys)
    if keys != p.seq_len or rows not in (1, keys):
        return fr
    measured = p.mha_phases_s if rows == keys else p.mha_decode_phases_s
    total = sum(measured)
    if len(measured) != 3 or total <= 0:
        return fr
    return replace(fr, qkv=measured[0] / total, core=measured[1] / total, oproj=measured[2] / total)


def ring_link(links: Sequence[LinkProfile], devices: Sequence[str]) -> list[LinkProfile]:
    """The links i -> i + 1 of the ring over ``devices`` (either direction); a pair with no profile is priced as
    the slowest profiled link. Raises ProfileError when a ring of two or more has no link profile at all."""
    if len(devices) < 2:
        return []
    by = {(lk.src, lk.dst): lk for lk in links}
    out: list[LinkProfile] = []
    for i, a in enumerate(devices):
        b = devices[(i + 1) % len(devices)]
        lk = by.get((a, b)) or by.get((b, a))
        if lk is None:
            if not links:
                raise ProfileError(f"no link profile between {a} and {b} (and none at all): profile the links")
            lk = min(links, key=lambda x: x.bandwidth_bps)
        out.append(lk)
    return out


def mesh_links(links: Sequence[LinkProfile], devices: Sequence[str]) -> list[LinkProfile]:
    """The links between every two of ``devices`` (either direction), what a direct collective uses; a pair with no
    profile is priced as the slowest profiled link. Raises ProfileError when two or more devices have no link
    profile at all."""
    if len(devices) < 2:
        return []
    by = {(lk.src, lk.dst): lk for lk in links}
    out: list[LinkProfile] = []
    for i, a in enumerate(devices):
        for b in devices[i + 1:]:
            lk = by.get((a, b)) or by.get((b, a))
            if lk is None:
                if not links:
                    raise ProfileError(f"no link profile between {a} and {b} (and none at all): profile the links")
                lk = min(links, key=lambda x: x.bandwidth_bps)
            out.append(lk)
    return out


def step_s(ring: Sequence[LinkProfile], payload: float) -> float:
    """tau: one ring step of ``payload`` bytes, paced by the slowest link (seconds)."""
    return max((lk.per_message_s + lk.latency_s + payload / lk.bandwidth_bps for lk in ring), default=0.0)


def _ag_gemm(c: float, whole: float, tau: float, d: int, overlap: bool) -> float:
    """AllGather and GEMM: ``c`` one tile's GEMM, ``whole`` the GEMM on every row at once."""
    return c + (d - 1) * max(c, tau) if overlap else (d - 1) * tau + whole


def _gemm_rs(c: float, whole: float, tau: float, t_add: float, d: int, overlap: bool) -> float:
    return c + (d - 1) * (max(c, tau) + t_add) if overlap else whole + (d - 1) * (tau + t_add)


def gemm_s(whole_s: float, one_row_s: float, seq_len: int, rows: float) -> float:
    """A GEMM's seconds on ``rows`` rows, from its seconds on ``seq_len`` rows and on one: affine between the two
    (the weight is read once a call whatever its rows, then every row costs alike), never below proportional."""
    if rows <= 0:
        return 0.0
    linear = whole_s * rows / seq_len
    if seq_len <= 1:
        return linear
    return max(linear, one_row_s + (whole_s - one_row_s) * (rows - 1) / (seq_len - 1))


def tp_gemms_s(cfg: TextModelConfig, p: BlockProfile, heads: float, columns: float, seq_len: int,
               rows: float) -> tuple[float, float, float, float]:
    """Device ``p``'s four tensor-parallel GEMMs (QKV, output projection, MLP up with its activation, MLP down) at
    ``heads`` and ``columns``, on ``rows`` rows of a pass of ``seq_len`` (seconds, by ``gemm_s``)."""
    fr, one = phase_fractions(cfg, p, seq_len, seq_len), phase_fractions(cfg, p, 1, seq_len)
    mha, mlp = mha_s(p, heads), mlp_s(p, columns)
    mha1 = _decode_block(p, p.heads, p.mha_decode_s, p.mha_s, heads, seq_len)
    mlp1 = _decode_block(p, p.columns, p.mlp_decode_s, p.mlp_s, columns, seq_len)
    return (gemm_s(fr.qkv * mha, one.qkv * mha1, seq_len, rows),
            gemm_s(fr.oproj * mha, one.oproj * mha1, seq_len, rows),
            gemm_s(fr.up * mlp, one.up * mlp1, seq_len, rows),
            gemm_s(fr.down * mlp, one.down * mlp1, seq_len, rows))


def sp_blocks_s(cfg: TextModelConfig, p: BlockProfile, seq_len: int, rows: float) -> tuple[float, float, float]:
    """Device ``p``'s share of a sequence-parallel layer, ``rows`` of a pass of ``seq_len`` with every head and
    column: (its QKV GEMM, its attention core over all ``seq_len`` keys with the output projection, its MLP), in
    seconds. The GEMMs are priced by ``gemm_s`` (a slice of the rows still reads every weight), the core in
    proportion to the rows."""
    qkv, oproj, up, down = tp_gemms_s(cfg, p, cfg.heads, cfg.ffn, seq_len, rows)
    core = phase_fractions(cfg, p, seq_len, seq_len).core * mha_s(p, cfg.heads) * rows / seq_len
    return qkv, core + oproj, up + down


@dataclass(frozen=True)
class Prediction:
    """One layer's latency, communication and the decode prediction."""

    layer: LatencySplit
    comm: CommModel
    decode: DecodePrediction | None


def _split(total: float, compute: float, comm: float) -> LatencySplit:
    return LatencySplit(total_s=total, compute_s=compute, comm_s=comm, exposed_s=max(0.0, total - compute))


def predict(cfg: TextModelConfig, seq_len: int, mode: HmpMode, profiles: Sequence[BlockProfile],
            heads: Sequence[int], columns: Sequence[int], links: Sequence[LinkProfile], *, overlap: bool = True,
            decode_cache: int = 0, direct_syncs: bool = True) -> Prediction:
    """Spec 4.5's per-layer latency of ``mode`` on ``profiles`` (ring order) with the given head and column
    shares (galaxy, megatron; sp and local hold everything), and for decoders one token's with a cache of
    ``decode_cache`` tokens (0: ``seq_len``)."""
    d = len(profiles)
    s, h, beta = seq_len, cfg.hidden, cfg.dtype_bytes
    rows = equal_split(s, d)
    ring = ring_link(links, [p.node for p in profiles])
    msg_s = max((lk.per_message_s for lk in ring), default=0.0)
    if mode in ("galaxy", "megatron"):
        mha = [mha_s(p, a) for p, a in zip(profiles, heads, strict=True)]
        mlp = [mlp_s(p, b) for p, b in zip(profiles, columns, strict=True)]
        tau = step_s(ring, max(rows) * h * beta)
        messages = 4 * (d - 1)
        sent = 4 * (s - min(rows)) * h * beta if d > 1 else 0
        comm = messages * tau
        if mode == "galaxy":
            def slowest(rows_each: int) -> list[float]:
                per_device = [tp_gemms_s(cfg, p, a, b, s, rows_each)
                              for p, a, b in zip(profiles, heads, columns, strict=True)]
                return [max(g[k] for g in per_device) for k in range(4)]
            tile, whole = slowest(max(rows)), slowest(s)
            core = max(phase_fractions(cfg, p, s, s).core * m for p, m in zip(profiles, mha, strict=True))
            con = max(con_s(p, r) for p, r in zip(profiles, rows, strict=True))
            t_add = ADD_FRACTION * max(con_s(p, max(rows)) for p in profiles) if d > 1 else 0.0
            total = (_ag_gemm(tile[0], whole[0], tau, d, overlap) + core
                     + _gemm_rs(tile[1], whole[1], tau, t_add, d, overlap) + con
                     + _ag_gemm(tile[2], whole[2], tau, d, overlap)
                     + _gemm_rs(tile[3], whole[3], tau, t_add, d, overlap) + con)
            gemms = d * sum(tile) if overlap else sum(whole)
            compute = gemms + core + 2 * con + 2 * (d - 1) * t_add
        else:
            con = max(con_s(p, s) for p in profiles)
            compute = max(mha) + max(mlp) + 2 * con
            total = compute + comm
    elif mode == "sp":
        kv_width = cfg.n_kv * cfg.head_dim
        tau = step_s(ring, max(rows) * kv_width * beta)
        messages = 2 * (d - 1)
        sent = 2 * (s - min(rows)) * kv_width * beta if d > 1 else 0
        comm = messages * tau
        blocks = [sp_blocks_s(cfg, p, s, r) for p, r in zip(profiles, rows, strict=True)]
        con = max(con_s(p, r) for p, r in zip(profiles, rows, strict=True))
        compute = sum(max(b[k] for b in blocks) for k in range(3)) + 2 * con
        total = compute + comm
    else:
        if d != 1:
            raise ValueError("a local plan has one device")
        p = profiles[0]
        tau, messages, sent, comm = 0.0, 0, 0, 0.0
        compute = mha_s(p, cfg.heads) + mlp_s(p, cfg.ffn) + 2 * con_s(p, s)
        total = compute
    layer = _split(total, compute, comm)
    cm = CommModel(messages=messages, bytes=int(sent), broker_hops=messages, tau_s=tau, message_s=msg_s)
    mesh = (mesh_links(links, [p.node for p in profiles]) if direct_syncs else ring) if cfg.decoder else []
    dec = _decode(cfg, seq_len, mode, profiles, heads, columns, mesh, decode_cache or seq_len, direct_syncs,
                  control_s(links, [p.node for p in profiles])) if cfg.decoder else None
    return Prediction(layer, cm, dec)


def control_s(links: Sequence[LinkProfile], devices: Sequence[str]) -> float:
    """One control round trip between the job's coordinator and all of ``devices`` at once (seconds): the slowest
    device's request round trip through the hub (``vocabulary.request_seconds`` over every link it measured, those to
    devices outside the plan too: a plan on one device pays its round trips as well). A pass is one (the
    coordinator's ShardPass out, each rank's ShardResult back), a request's admission another (its KV cache reserved
    on every rank before its first pass)."""
    if not devices:
        return 0.0
    nodes = sorted({lk.src for lk in links} | {lk.dst for lk in links} | set(devices))
    trips = dict(zip(nodes, request_seconds(links, nodes), strict=True))
    return float(max(trips[d] for d in devices))


def rank_embed_s(mode: HmpMode, p: BlockProfile, rows: int, seq_len: int) -> float:
    """Device ``p``'s embeddings in a pass of ``seq_len`` rows (seconds): galaxy, megatron and local embed every row
    on every rank (galaxy's first layer takes its input whole), sp a rank its ``rows``."""
    return p.embed_s * rows / seq_len if mode == "sp" else p.embed_s


def embeddings_s(mode: HmpMode, profiles: Sequence[BlockProfile], seq_len: int) -> float:
    """A pass's embeddings on its slowest rank (seconds; ``rank_embed_s``, sp's rows the equal split)."""
    rows = equal_split(seq_len, len(profiles))
    return max(rank_embed_s(mode, p, r, seq_len) for p, r in zip(profiles, rows, strict=True))


def head_s(profiles: Sequence[BlockProfile], rows: int) -> float:
    """A pass's logits (seconds): the lm_head of its last row, on the rank that holds that row. Every mode splits or
    answers rows as the equal split does (the first ranks one more), so that is the last rank holding any of
    ``rows``. 0 for an encoder (its profiles measure none)."""
    return profiles[min(rows, len(profiles)) - 1].head_s


def logits_s(cfg: TextModelConfig, mode: HmpMode, profiles: Sequence[BlockProfile], columns: Sequence[int],
             mesh: Sequence[LinkProfile], rows: int, direct_syncs: bool) -> tuple[float, float]:
    """A pass of ``rows`` rows answered: the lm_head of its last row, as (compute, network) seconds. Galaxy and
    megatron on two or more devices (with ``direct_syncs``: ``HmpShares.splits_head``) split the head by vocabulary
    (``vocab_bounds``, by the ranks' MLP columns): each rank's share at its device's speed, the slowest pacing;
    then one direct AllGather of the logits, each rank sending its share to the D - 1 others one after another on
    the slowest link of ``mesh``; before it, where the row is on one rank (galaxy's pass on the ring, of at least
    as many rows as devices), one direct AllReduce of the row. Otherwise the rank holding the row computes it whole
    (``head_s``). (0, 0) for an encoder."""
    d = len(profiles)
    if not (cfg.decoder and splits_head(mode, d, direct_syncs)):
        return head_s(profiles, rows), 0.0
    bounds = vocab_bounds(columns, cfg.vocab)
    compute = max(p.head_s * (b - a) / cfg.vocab for p, (a, b) in zip(profiles, bounds, strict=True))
    widest = max(b - a for a, b in bounds) * cfg.dtype_bytes
    network = step_s(mesh, (d - 1) * widest)
    if mode == "galaxy" and rows >= d:
        network += step_s(mesh, cfg.hidden * cfg.dtype_bytes)
    return compute, network


def _decode_block(p: BlockProfile, grid: Sequence[int], measured: Sequence[float], prefill: Sequence[float],
                  share: float, seq_len: int) -> float:
    if measured:
        return interpolate(grid, measured, share)
    return min(interpolate(grid, prefill, share), DECODE_SLOWDOWN * interpolate(grid, prefill, share) / seq_len)


def _decode(cfg: TextModelConfig, seq_len: int, mode: HmpMode, profiles: Sequence[BlockProfile],
            heads: Sequence[int], columns: Sequence[int], mesh: Sequence[LinkProfile],
            cache: int, direct_syncs: bool = True, control: float = 0.0) -> DecodePrediction:
    """One new token per layer times the layers: its blocks on one row (the attention core scaled from the
    profiled cache of ``seq_len`` to ``cache`` keys) and the two direct AllReduces (or, for SP, the K and V
    direct AllGathers) of one row, which no GEMM hides: two rounds per layer, each one message on the slowest
    link of ``mesh`` (``mesh_links``), whatever the number of devices. Without ``direct_syncs`` (``mesh`` is then
    the ring's links) the syncs are ring collectives, one hop after another: 4(D-1) per layer (SP: 2(D-1)). Then
    the logits (``logits_s``), and the pass's ``control`` round trip with the coordinator (``control_s``)."""
    d = len(profiles)

    def core_scale(p: BlockProfile) -> float:
        core = phase_fractions(cfg, p, 1, seq_len).core
        return (1.0 - core) + core * cache / seq_len

    if mode in ("sp", "local"):
        heads, columns = [cfg.heads] * d, [cfg.ffn] * d
    mha = max(_decode_block(p, p.heads, p.mha_decode_s, p.mha_s, a, seq_len) * core_scale(p)
              for p, a in zip(profiles, heads, strict=True))
    mlp = max(_decode_block(p, p.columns, p.mlp_decode_s, p.mlp_s, b, seq_len)
              for p, b in zip(profiles, columns, strict=True))
    con = max(con_s(p, 1) for p in profiles)
    compute = mha + mlp + 2 * con
    beta = cfg.dtype_bytes
    if d == 1:
        net = 0.0
    else:
        row = (cfg.n_kv * cfg.head_dim if mode == "sp" else cfg.hidden) * beta
        rounds = 2 if direct_syncs else (2 if mode == "sp" else 4) * (d - 1)
        net = rounds * step_s(mesh, row)
    per_layer = compute + net
    head, head_net = logits_s(cfg, mode, profiles, columns, mesh, 1, direct_syncs)  # every token's, from its row
    total = cfg.layers * per_layer + head + head_net + control
    network = cfg.layers * net + head_net + control
    return DecodePrediction(cache_tokens=cache, per_token_s=total, network_s=network,
                            network_share=network / total if total > 0 else 0.0)


def check_profiles(cfg: TextModelConfig, seq_len: int, profiles: Sequence[BlockProfile]) -> None:
    """Raise ProfileError unless every profile is of ``seq_len`` rows (spec A9: profile at the deployment
    length)."""
    for p in profiles:
        if p.seq_len != seq_len:
            raise ProfileError(f"device {p.node} was profiled at {p.seq_len} rows, not at the planned {seq_len}: "
                               "profile it at the deployment sequence length")
