"""Communication volume per global mini-batch of HPP against HetPipe-style HDP (Eqs. 1-2, spec 1.2). Bytes."""

from __future__ import annotations

from collections.abc import Sequence


def hpp_volume(group_sizes: Sequence[int], stage_param_bytes: Sequence[float], batch: int,
               cut_bytes_per_sample: Sequence[float]) -> float:
    """Eq. 2: ring AllReduce inside each group plus activations and gradients across the G-1 cuts.

    ``cut_bytes_per_sample[j]`` is the per-sample tensor group j exports (G-1 entries). With one group this is
    pure DP: 2 (|g| - 1) Psz.
    """
    if len(group_sizes) != len(stage_param_bytes) or len(cut_bytes_per_sample) != len(group_sizes) - 1:
        raise ValueError("need one size and one parameter total per group and one cut size per boundary")
    allreduce = sum(2 * (g - 1) * p for g, p in zip(group_sizes, stage_param_bytes, strict=True))
    return allreduce + 2 * batch * sum(cut_bytes_per_sample)


def hdp_volume(model_param_bytes: float, group_batches: Sequence[int],
               group_cut_bytes_per_sample: Sequence[Sequence[float]]) -> float:
    """Eq. 1: HetPipe-style virtual workers: a parameter-server exchange of the whole model per group (when
    there is more than one) plus each group's internal pipeline traffic for its share of the batch.

    ``group_cut_bytes_per_sample[i]`` lists the per-sample tensors crossing the |g_i| - 1 cuts inside group i.
    """
    if len(group_batches) != len(group_cut_bytes_per_sample):
        raise ValueError("need one batch share and one cut list per group")
    pipeline = sum(2 * b * sum(cuts) for b, cuts in zip(group_batches, group_cut_bytes_per_sample, strict=True))
    server = 2 * len(group_batches) * model_param_bytes if len(group_batches) > 1 else 0.0
    return server + pipeline
