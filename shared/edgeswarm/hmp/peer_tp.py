"""One rank of the torch tensor-parallel peer of ``bench peers`` (``python -m edgeswarm.hmp.peer_tp``): a process
per device, in the device's namespace, joined over gloo (TCP to rank 0's address), computing as the device's class.

Every rank builds the same model from the preset's seed (``models.text.reference.init_weights``, as the
tensor-shard-workers do), splits it with torch's tensor parallelism (``hmp.peer_model``) and runs the same prompt:
a warm-up, then ``repeats`` times a prefill and ``new_tokens`` - 1 greedy decode steps from a KV cache, every rank
in step (each step's logits are whole on every rank, so every rank picks the same token). Rank 0 times each from
a barrier: the prefill to its first token (TTFT) and each further token (TPOT), and writes them as a ``PeerResult``
with the cross-check: its prefill's final hidden states against the whole model computed on one device
(``reference.forward``, the largest difference over the largest value) and its tokens against
``reference.generate``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

from pydantic import BaseModel


class PeerResult(BaseModel):
    """What rank 0 measured (seconds, medians over the repeats) and the cross-check (see the module's docstring);
    ``error``: why the peer could not run (its model does not split evenly, say)."""

    world: int
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: list[int] = []
    reference_tokens: list[int] = []
    max_difference: float | None = None
    scale: float | None = None
    error: str = ""


def main(argv: list[str] | None = None) -> int:
    from edgeswarm.workloads.peers import finish_rank, rank_parser

    p = rank_parser("python -m edgeswarm.hmp.peer_tp", __doc__)
    p.add_argument("--preset", required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", required=True, help="comma-separated token ids")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    result = run_rank(args)
    return finish_rank(args, result, result.error)


def run_rank(args: argparse.Namespace) -> PeerResult:
    """This rank's part of the run (see the module's docstring); rank 0's result."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from edgeswarm.hmp.peer_model import PlainDecoder, UnevenSplitError, emulate, tensor_parallel
    from edgeswarm.models.text import reference
    from edgeswarm.models.text.hf import source_config
    from edgeswarm.values.text_model import TextModelSource
    from edgeswarm.workloads.peers import rank_device

    device, compute = rank_device(args.device_class)
    cfg = source_config(TextModelSource(preset=args.preset, layers=args.layers, seed=args.seed))
    w = {name: t.to(compute) for name, t in reference.init_weights(cfg, args.seed).items()}
    prompt = [int(t) for t in args.prompt.split(",")]
    result = PeerResult(world=args.world)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=600))
    try:
        mesh = init_device_mesh(compute.type, (args.world,))
        model = PlainDecoder(cfg, w)
        try:
            tensor_parallel(model, mesh)
        except UnevenSplitError as exc:
            return result.model_copy(update={"error": str(exc)})
        ttfts, tpots, tokens, hidden = [], [], [], None
        with torch.inference_mode():
            for repeat in range(args.repeats + 1):  # the first: a warm-up
                if repeat == 1:
                    # Emulated after the warm-up: its first calls' set-up, stretched by a slow class, took seconds
                    # of sleep that measure nothing.
                    emulate(model, device)
                caches = model.new_caches()
                dist.barrier()
                started = time.perf_counter()
                out = model(torch.tensor(prompt, device=compute), caches)
                token = int(model.logits(out[-1:])[0].argmax())
                ttft = time.perf_counter() - started
                if repeat == 0:
                    hidden = out
                tokens, steps = [token], []
                while len(tokens) < args.new_tokens:
                    began = time.perf_counter()
                    out = model(torch.tensor([token], device=compute), caches)
                    token = int(model.logits(out[-1:])[0].argmax())
                    steps.append(time.perf_counter() - began)
                    tokens.append(token)
                if repeat:
                    ttfts.append(ttft)
                    if steps:
                        tpots.append(statistics.mean(steps))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if args.rank != 0:
        return result
    with torch.inference_mode():
        whole = reference.forward(cfg, w, torch.tensor(prompt, device=compute))
        expected = reference.generate(cfg, w, prompt, args.new_tokens)
    assert hidden is not None
    return result.model_copy(update={
        "ttft_s": statistics.median(ttfts), "tpot_s": statistics.median(tpots) if tpots else None,
        "tokens": tokens, "reference_tokens": expected,
        "max_difference": float((hidden.float() - whole.float()).abs().max()),
        "scale": float(whole.float().abs().max())})


if __name__ == "__main__":
    from edgeswarm.workloads.peers import exit_rank

    exit_rank(main())
