"""Block profiles without measuring: from a device's speed and budget and the model's FLOPs, so `edgeswarm plan`
and tests can plan for an emulated cluster that is not running. Also the grids the profiler measures at.

The reference is the host an emulated device's slow-down is relative to (device class ``edge-server``, slow-down
1): one core of a server CPU at REFERENCE_FLOPS, streaming memory at REFERENCE_BYTES_PER_S. A class's slow-down
divides both (the emulation scales a device's CPU time; spec 3.4 notes the connective blocks are memory bound).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeswarm.planning.hmp.types import BlockProfile, HmpCluster
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.values.text_model import TextModelConfig

if TYPE_CHECKING:  # only read: the planner sits below the device emulation
    from edgeswarm.devices.cluster import ClusterSpec

REFERENCE_FLOPS = 3e10
REFERENCE_BYTES_PER_S = 1e10
# The fixed cost of one tensor message through a broker on a LAN (encode, publish, the receiver's broker,
# dispatch), when no link was measured: a typical figure of the platform's data plane on one host.
SYNTHETIC_MESSAGE_S = 5e-4
MAX_COLUMN_POINTS = 8


def profile_grids(cfg: TextModelConfig, seq_len: int, max_devices: int = 4,
                  column_points: int = MAX_COLUMN_POINTS) -> tuple[list[int], list[int], list[int]]:
    """The grids to profile at (spec 1.1, coarsened): every whole KV group of heads (at most 16 points, evenly
    spread, the full count last), ``column_points`` column counts up to f (multiples of 64 where f allows), and
    the rows ceil(s / D) for D = 1 .. ``max_devices``."""
    groups = cfg.heads // cfg.group
    step = max(1, -(-groups // 16))
    heads = sorted({g * cfg.group for g in range(step, groups + 1, step)} | {cfg.heads})
    quantum = 64 if cfg.ffn >= 64 * column_points else 1
    columns = sorted({max(1, round(cfg.ffn * k / column_points / quantum) * quantum)
                      for k in range(1, column_points)} | {cfg.ffn})
    columns = [c for c in columns if c <= cfg.ffn]
    rows = sorted({-(-seq_len // d) for d in range(1, max_devices + 1)} | {1})
    return heads, columns, rows


def _mha_flops(cfg: TextModelConfig, heads: int, rows: int, keys: int) -> float:
    hd, h = cfg.head_dim, cfg.hidden
    return heads * (2.0 * rows * h * hd * (1 + 2 / cfg.group) + 4.0 * rows * keys * hd + 2.0 * rows * hd * h)


def _mlp_flops(cfg: TextModelConfig, columns: int, rows: int) -> float:
    return (3.0 if cfg.gated else 2.0) * 2.0 * rows * cfg.hidden * columns


def synthetic_profile(node: str, cfg: TextModelConfig, seq_len: int, *, slowdown: float, budget_bytes: int,
                      device_class: str = "", max_devices: int = 4) -> BlockProfile:
    """A BlockProfile of a device ``slowdown`` times slower than the reference, from FLOP counts (compute bound)
    and bytes moved (the connective blocks and one-row decoding, memory bound)."""
    flops = REFERENCE_FLOPS / slowdown
    bandwidth = REFERENCE_BYTES_PER_S / slowdown
    beta = cfg.dtype_bytes
    heads, columns, rows = profile_grids(cfg, seq_len, max_devices)
    att_per_head = cfg.attention_bytes() / cfg.heads
    mlp_per_col = cfg.mlp_bytes() / cfg.ffn
    return BlockProfile(
        node=node, device_class=device_class, memory_budget_bytes=budget_bytes, seq_len=seq_len,
        heads=heads, mha_s=[_mha_flops(cfg, k, seq_len, seq_len) / flops for k in heads],
        columns=columns, mlp_s=[_mlp_flops(cfg, c, seq_len) / flops for c in columns],
        rows=rows, con_s=[4.0 * r * cfg.hidden * beta / bandwidth for r in rows],
        mha_decode_s=[max(_mha_flops(cfg, k, 1, seq_len) / flops, k * att_per_head / bandwidth) for k in heads],
        mlp_decode_s=[max(_mlp_flops(cfg, c, 1) / flops, c * mlp_per_col / bandwidth) for c in columns],
        compute="synthetic", method="synthetic")


def synthetic_cluster(spec: ClusterSpec, cfg: TextModelConfig, seq_len: int, model_name: str = "") -> HmpCluster:
    """An HmpCluster for the devices of a cluster file: each one's class gives its slow-down and budget, the
    file's links (or the classes' defaults) the bandwidth and latency, SYNTHETIC_MESSAGE_S the cost per
    message."""
    devices = []
    for entry in spec.devices:
        dc = spec.device_class_of(entry.id)
        devices.append(synthetic_profile(entry.id, cfg, seq_len, slowdown=dc.compute_slowdown,
                                         budget_bytes=dc.memory_budget_bytes, device_class=dc.name,
                                         max_devices=min(32, max(4, len(spec.devices)))))
    links = []
    for a in spec.devices:
        for b in spec.devices:
            if a.id == b.id:
                continue
            link = spec.link(a.id, b.id)
            links.append(LinkProfile(src=a.id, dst=b.id, bandwidth_bps=link.bandwidth_bps,
                                     latency_s=link.latency_s, message_s=SYNTHETIC_MESSAGE_S))
    return HmpCluster(model=cfg, model_name=model_name, seq_len=seq_len, devices=devices, links=links)
