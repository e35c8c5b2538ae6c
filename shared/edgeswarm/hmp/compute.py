"""A tensor-shard-worker's shard of a model, made and run: the bridge from the worker program to ``hmp.layer``.

``load_shard`` makes rank ``rank``'s weights (only its slices: read from the model folder, or drawn tensor by tensor
from a preset's seed, so a rank never holds the whole model), on the worker's compute device, computing as its
device class (the emulated slow-down applies to each compute phase, not to the waits between them, so overlap is
what it would be on the device). ``run_pass`` runs one pass and says what the coordinator gets back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgeswarm.hmp.layer import HmpRank, RequestCache, Ring
from edgeswarm.hmp.sharding import shard_shapes
from edgeswarm.messages.hmp import PassSegment, PassSplit
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.values.text_model import TextModelConfig, TextModelSource

if TYPE_CHECKING:
    import torch

    from edgeswarm.devices.emulation import DeviceProfile


@dataclass
class Shard:
    """One rank's part of a model: ``rank`` computes it; ``parameters`` counts its weights; ``wire_dtype`` is what
    its collective slices travel as."""

    rank: HmpRank
    cfg: TextModelConfig
    parameters: int
    wire_dtype: str


@dataclass
class PassOutput:
    """What a rank answers a pass with: ``tensor`` (its rows of the final hidden states for an encoder, else empty;
    on the compute device until the wire), ``row_start``, a decoder's ``tokens`` and where its time went."""

    tensor: torch.Tensor
    row_start: int
    tokens: list[int]  # a decoder's next token per segment (-1: not this rank's); empty when it answers none
    split: PassSplit


def shard_memory(cfg: TextModelConfig, shares: HmpShares, rank: int, max_tokens: int) -> int:
    """Bytes rank ``rank`` holds for the job: its weights and one pass's activations (a few [tokens, max(hidden,
    ffn)] tensors for up to ``max_tokens`` rows). Each request's KV cache comes on top (``request_kv_bytes``)."""
    shapes = shard_shapes(cfg, shares, rank)
    weights = sum(cfg.tensor_bytes(name, _numel(s)) for name, s in shapes.items())
    activations = 6 * max_tokens * max(cfg.hidden, cfg.ffn) * cfg.dtype_bytes
    return int(weights + activations)


def request_kv_bytes(cfg: TextModelConfig, shares: HmpShares, rank: int, tokens: int) -> int:
    """Bytes of one request's KV cache of ``tokens`` positions on rank ``rank``: keys and values of its KV heads in
    every layer (sp and local: every head)."""
    heads = cfg.heads if shares.mode in ("sp", "local") else shares.heads[rank]
    return 2 * cfg.layers * (heads // cfg.group) * cfg.head_dim * tokens * cfg.dtype_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load_shard(source: TextModelSource, cfg: TextModelConfig, shares: HmpShares, rank: int,
               compute: torch.device, *, device: DeviceProfile) -> Shard:
    """Rank ``rank``'s shard of ``source`` (with ``cfg``, its resolved shape) on ``compute``, computing as
    ``device``. Raises ConfigError (the folder cannot be read) or ValueError (the shares do not fit the model)."""
    from edgeswarm.devices.compute import use_device_threads
    from edgeswarm.models.text.reference import init_weights

    # The job's pass thread and the rank's communication threads start after this: they take the count set here.
    use_device_threads(device)
    if source.path is not None:
        from edgeswarm.models.text.hf import ModelFolderError, open_model

        try:
            with open_model(source.path, cfg.dtype) as folder:
                rank_of = HmpRank.from_reader(cfg, shares, rank, folder.read_slice, compute,
                                              slowdown=device.compute_slowdown)
        except ModelFolderError as exc:
            from edgeswarm.errors import ConfigError

            raise ConfigError(f"model folder {source.path}: {exc}") from None
    else:
        # One whole tensor at a time, cut at once: a rank never holds more than its shard and one tensor.
        rank_of = HmpRank.from_reader(
            cfg, shares, rank, lambda s: s.cut(init_weights(cfg, source.seed, names={s.name})[s.name]), compute,
            slowdown=device.compute_slowdown)
    parameters = sum(_numel(s) for s in shard_shapes(cfg, shares, rank).values())
    return Shard(rank_of, cfg, parameters, cfg.dtype)


def new_cache(shard: Shard) -> RequestCache:
    """An empty KV cache for a new request on ``shard``."""
    return shard.rank.new_cache()


def run_pass(shard: Shard, tokens: torch.Tensor, segments: list[tuple[PassSegment, RequestCache]], ring: Ring
             ) -> PassOutput:
    """One pass of ``tokens``: each segment's rows continue its request's cache (which must hold ``start`` tokens).
    For a decoder, the rank holding a segment's last row chooses the request's next token where the segment asks
    for one (``models.text.sampling.next_token``, over the request's tokens so far; the logits from the head split
    over every rank where the pass allows, ``HmpRank.answer_logits``); an encoder's pass (one segment) answers its
    hidden states."""
    import torch

    from edgeswarm.models.text.sampling import next_token

    for segment, cache in segments:
        if cache.length != segment.start:
            raise ValueError(f"request {segment.request}'s cache holds {cache.length} tokens, the pass starts at "
                             f"{segment.start}")
    rank = shard.rank
    rank.recorder.reset()
    out = rank.forward(tokens, ring, batch=[(cache, segment.tokens) for segment, cache in segments])
    chosen: list[int] = []
    if shard.cfg.decoder:
        tensor = torch.empty(0)
        answered = rank.answer_logits(out, [k for k, (segment, _) in enumerate(segments) if segment.answer], ring)
        if answered:
            chosen = [-1] * len(segments)
            for k, logits in answered.items():
                segment, cache = segments[k]
                chosen[k] = next_token(logits, cache.tokens, segment.sampling, cache.length)
    elif rank.shares.mode in ("galaxy", "sp") or out.last:
        tensor = out.hidden.float()  # megatron's ranks all hold every row: one of them answers
    else:
        tensor = torch.empty(0)
    times = rank.recorder.times()
    split = PassSplit(compute_s=sum(t.compute_s for t in times), sync_s=sum(t.sync_s for t in times),
                      waiting_s=sum(t.wait_s for t in times))
    return PassOutput(tensor, out.start, chosen, split)
