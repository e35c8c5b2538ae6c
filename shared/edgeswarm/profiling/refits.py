"""The closed loop's memory: each device's compute speed and each link's transfers as jobs measured them, kept in
the profile cache so that the next job on the same devices starts from what was measured rather than from the
profile alone.

A device's profile is measured once, alone, and a link's probe sends bulk bytes; a job then measures what the
device really takes beside the bus's threads and its neighbours' load, and what its tensors of several chunks take
to arrive, and fits a scale (measured over profiled; planning.refit). ``saved_scales`` reads the scales saved for a
cluster's devices (a device whose fingerprint changed under the same name has none) and links (keyed
``link_key``); ``save_scales`` blends a job's into them. Nothing here reads an emulation setting: the scales come
from measured rounds.
"""

from __future__ import annotations

import itertools
import logging
import math

from edgeswarm.planning.refit import link_key, link_nodes, speeds
from edgeswarm.profiling.cache import ProfileCache
from edgeswarm.values.profiles import MAX_SCALE, MIN_SCALE, ClusterProfile, ComputeRefit, LinkRefit, Work

log = logging.getLogger(__name__)

MIN_ROUNDS = 3  # a scale fitted from fewer measured rounds is not saved: one slow first round is no speed
HISTORY_ROUNDS = 10  # the most rounds the saved history weighs: a device that changed is followed within some jobs


def saved_scales(cache: ProfileCache, cluster: ClusterProfile, work: Work) -> dict[str, float]:
    """Each device of ``cluster`` with a scale saved by jobs of ``work`` for its model and device fingerprints
    (node -> scale), and each pair of its devices with a saved link scale (``link_key`` -> scale; any work)."""
    out: dict[str, float] = {}
    nodes = sorted(entry.device.node for entry in cluster.devices)
    for entry in cluster.devices:
        try:
            refit = cache.refit(entry.compute.model_fingerprint, entry.device.node, entry.compute.device_fingerprint,
                                work)
            if refit is not None:
                out[entry.device.node] = refit.scale
        except ValueError as exc:  # a node name that is no file name: nothing can have been saved for it
            log.debug("no saved refit for %s: %s", entry.device.node, exc)
    for a, b in itertools.combinations(nodes, 2):
        try:
            link = cache.link_refit(a, b)
            if link is not None:
                out[link_key(a, b)] = link.scale
        except ValueError as exc:
            log.debug("no saved refit for the link %s-%s: %s", a, b, exc)
    return out


def _blended(before: ComputeRefit | LinkRefit | None, scale: float, seen: int) -> tuple[float, int]:
    """``scale`` measured over ``seen`` rounds blended with what was saved before: their geometric mean weighted by
    rounds, the history's weight capped at HISTORY_ROUNDS. The blended scale and the rounds it now stands for."""
    weight = 0 if before is None else min(before.rounds, HISTORY_ROUNDS)
    logged = (weight * math.log(before.scale) if before is not None else 0.0) + seen * math.log(scale)
    return min(MAX_SCALE, max(MIN_SCALE, math.exp(logged / (weight + seen)))), min(weight + seen, HISTORY_ROUNDS)


def save_scales(cache: ProfileCache, cluster: ClusterProfile, scales: dict[str, float],
                rounds: dict[str, int], work: Work) -> dict[str, float]:
    """Save each device's and link's ``scales`` (measured over ``cluster``'s unscaled profile; links keyed
    ``link_key``) fitted from ``rounds`` measured rounds (training rounds or served items: ``work``), for those with
    at least MIN_ROUNDS, blended with what was saved before (``_blended``: one job's plan shapes its fit, since a
    device given a stage of its own measures that stage's per-call costs too, so no single job overwrites the
    history). Returns each key saved with its saved scale. A write that fails is logged and skipped: the job that
    measured it goes on."""
    saved: dict[str, float] = {}
    devices = {entry.device.node: entry for entry in cluster.devices}
    for key, scale in scales.items():
        seen = rounds.get(key, 0)
        if seen < MIN_ROUNDS:
            continue
        try:
            pair = link_nodes(key)
            if pair is not None:
                a, b = pair
                if a not in devices or b not in devices:
                    continue
                blended, total = _blended(cache.link_refit(a, b), scale, seen)
                cache.put_link_refit(LinkRefit(a=a, b=b, scale=blended, rounds=total))
            else:
                if key not in devices:
                    continue
                model_fp, device_fp = devices[key].compute.model_fingerprint, devices[key].compute.device_fingerprint
                blended, total = _blended(cache.refit(model_fp, key, device_fp, work), scale, seen)
                cache.put_refit(ComputeRefit(model_fingerprint=model_fp, node=key, device_fingerprint=device_fp,
                                             scale=blended, rounds=total, work=work))
        except (OSError, ValueError) as exc:
            log.warning("could not save the measured speed of %s (%s): the next job starts from its profile",
                        key, exc)
            continue
        saved[key] = blended
    return saved


def started_from(cache: ProfileCache, cluster: ClusterProfile, work: Work) -> tuple[dict[str, float], str | None]:
    """The scales jobs saved for ``cluster``'s devices and links (``saved_scales``; the job plans on ``cluster``
    scaled by them) and what the job's refit event says of them (None when none was saved)."""
    scales = saved_scales(cache, cluster, work)
    return scales, (f"starts from the speeds earlier jobs measured: {speeds(scales)}" if scales else None)


def save_measured(cache: ProfileCache, cluster: ClusterProfile, base: dict[str, float], fitted: dict[str, float],
                  rounds: dict[str, int], work: Work) -> str | None:
    """Save what a job of ``work`` measured of each device and link (``save_scales``): its ``fitted`` scale over
    ``cluster``, which started from the ``base`` scales (``started_from``), so base times fitted over the profile.
    What the job's refit event says; None when nothing was saved."""
    scales = {n: base.get(n, 1.0) * s for n, s in fitted.items()}
    saved = save_scales(cache, cluster, scales, rounds, work)
    if not saved:
        return None
    return (f"saved the measured speeds for the next job: {speeds(saved)} (this job measured "
            f"{speeds({n: scales[n] for n in saved})})")
