"""A Chrome trace of one Galaxy forward pass (spec C-C4): every rank in a thread of this process over the in-memory
ring with an emulated link, each rank's compute stretched like an emulated Nano-M's, so the communication
threads' send and receive spans are seen running beside the GEMM spans they overlap. Open the file in
https://ui.perfetto.dev (or chrome://tracing): one process per rank, one track per thread."""

from __future__ import annotations

import threading
from pathlib import Path

from edgeswarm.devices.catalogue import device_class
from edgeswarm.hmp.layer import HmpRank
from edgeswarm.hmp.loopback import Loopback
from edgeswarm.hmp.trace import Span, write_chrome_trace
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.values.text_model import PRESETS

GEMMS = ("qkv", "o", "up", "down")


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


def overlapping(spans: list[Span]) -> int:
    """How many communication spans of one rank run at the same time as one of its GEMM spans."""
    gemms = [s for s in spans if s.kind == "compute" and s.name in GEMMS]
    return sum(1 for c in spans if c.kind == "comm" and any(c.start < g.end and g.start < c.end for g in gemms))


def loopback_trace(path: Path, *, model: str = "gpt2-large", layers: int = 1, seq_len: int = 284,
                   bandwidth_mbps: float = 125.0, latency_ms: float = 0.5, devices: int = 3,
                   device_class_name: str = "jetson-nano-m", seed: int = 0) -> int:
    """Run one warm-up and one traced Galaxy pass of ``model`` (``layers`` layers, ``seq_len`` tokens) on
    ``devices`` equal ranks with overlap on, links at ``bandwidth_mbps``, and write the traced pass's spans to
    ``path``. Returns how many communication spans overlap a GEMM span on their rank (C-C4: above 0)."""
    import torch

    from edgeswarm.models.text.reference import init_weights

    cfg = PRESETS[model].model_copy(update={"layers": layers})
    heads = [g * cfg.group for g in _even(cfg.n_kv, devices)]
    shares = HmpShares(mode="galaxy", devices=[f"rank{r}" for r in range(devices)], heads=heads,
                       columns=_even(cfg.ffn, devices), overlap=True)
    weights = init_weights(cfg, seed)
    slowdown = device_class(device_class_name).compute_slowdown
    tokens = torch.randint(0, cfg.vocab, (seq_len,), generator=torch.Generator().manual_seed(seed))
    loop = Loopback(devices, bandwidth_bps=bandwidth_mbps * 1e6, latency_s=latency_ms / 1000)  # bits per second
    ranks = [HmpRank(cfg, shares, r, weights, slowdown=slowdown) for r in range(devices)]
    errors: list[BaseException] = []
    try:
        for scope in (0, 1):
            for rank in ranks:
                rank.recorder.reset()

            def go(r: int, scope: int = scope) -> None:
                try:
                    ranks[r].forward(tokens, loop.ring(r, scope))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    errors.append(exc)

            threads = [threading.Thread(target=go, args=(r,), name=f"rank-{r}") for r in range(devices)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            if errors:
                raise errors[0]
        spans = [rank.recorder.spans() for rank in ranks]
    finally:
        for rank in ranks:
            rank.close()
        loop.close()
    write_chrome_trace(path, spans)
    return sum(overlapping(s) for s in spans)
