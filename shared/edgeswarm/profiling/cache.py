"""Profiles on disk, so that a model is measured once per device and reused across runs.

Layout under the cache directory (``EDGESWARM_PROFILE_DIR``)::

    models/{model_fingerprint}.json                                 a ModelProfile
    compute/{model_fingerprint}/{device_fingerprint}.{method}.json  a ComputeProfile
    refits/{model_fingerprint}/{node}.{work}.json                   a ComputeRefit (what jobs measured)
    links/{a}/{b}.json                                              a LinkRefit (what jobs measured)

Each file is a JSON object ``{"format": 5, "kind": "model" | "compute" | "refit" | "link", "profile": {...}}``.
Writes are atomic (a temporary file in the same folder, then a rename), so a reader never sees half a file and
concurrent writers leave one whole file. A file that does not parse, does not validate, or whose
fingerprints do not match its name is ignored with a warning and counts as a miss: the caller measures
again and overwrites it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from edgeswarm.files import write_atomically
from edgeswarm.values.profiles import ComputeProfile, ComputeRefit, LinkRefit, ModelProfile, Work

log = logging.getLogger(__name__)

# 2: unit timings scaled to the units run in a row; 3: forward and backward timed in turns, and the cold calls
# (profiling.compute); 4: the cold calls timed each beside a hot one; 5: the units in a row timed in rounds spread over
# the profile; 6: the halves of the model in a row too (ComputeProfile.chain). A file of an older format is measured
# again.
FORMAT = 6
_SAFE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def _checked(fingerprint: str, what: str) -> str:
    if not _SAFE.fullmatch(fingerprint) or fingerprint in (".", ".."):
        raise ValueError(f"{what} fingerprint {fingerprint!r} is not a safe file name "
                         "(letters, digits, '_', '.', '-', at most 128)")
    return fingerprint


class ProfileCache:
    """A profile cache rooted at ``directory`` (created on the first write). Thread- and process-safe
    for readers and writers; the last writer of a key wins."""

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory).expanduser()

    # --- paths --------------------------------------------------------------------------------------

    def model_path(self, model_fingerprint: str) -> Path:
        return self.directory / "models" / f"{_checked(model_fingerprint, 'model')}.json"

    def compute_path(self, model_fingerprint: str, device_fingerprint: str, method: str) -> Path:
        if method not in ("measured", "calibrated"):
            raise ValueError(f"method must be 'measured' or 'calibrated', not {method!r}")
        return (self.directory / "compute" / _checked(model_fingerprint, "model")
                / f"{_checked(device_fingerprint, 'device')}.{method}.json")

    def refit_path(self, model_fingerprint: str, node: str, work: Work) -> Path:
        return (self.directory / "refits" / _checked(model_fingerprint, "model")
                / f"{_checked(node, 'node')}.{_checked(work, 'work')}.json")

    def link_refit_path(self, a: str, b: str) -> Path:
        return self.directory / "links" / _checked(a, "node") / f"{_checked(b, 'node')}.json"

    # --- reads --------------------------------------------------------------------------------------

    def model(self, model_fingerprint: str) -> ModelProfile | None:
        """The cached ModelProfile of ``model_fingerprint``, or None (missing, corrupt or mismatching)."""
        path = self.model_path(model_fingerprint)
        profile = self._load(path, "model", ModelProfile)
        if profile is not None and profile.fingerprint != model_fingerprint:
            log.warning("ignoring cached profile %s: it holds model %s, not %s", path, profile.fingerprint,
                        model_fingerprint)
            return None
        return profile

    def compute(self, model_fingerprint: str, device_fingerprint: str, method: str,
                batch_sizes: list[int] | None = None) -> ComputeProfile | None:
        """The cached ComputeProfile for the pair, or None.

        With ``batch_sizes``, a cached grid that lacks any of them is a miss; one that has them all is
        returned restricted to exactly those batch sizes (in ascending order).
        """
        path = self.compute_path(model_fingerprint, device_fingerprint, method)
        profile = self._load(path, "compute", ComputeProfile)
        if profile is None:
            return None
        if (profile.model_fingerprint, profile.device_fingerprint, profile.method) != (
                model_fingerprint, device_fingerprint, method):
            log.warning("ignoring cached profile %s: it holds %s on %s (%s), not what its name says", path,
                        profile.model_fingerprint, profile.device_fingerprint, profile.method)
            return None
        if profile.inference_s is None:
            log.info("cached profile %s predates inference timings: measuring again", path)
            return None
        if batch_sizes is None:
            return profile
        wanted = sorted(set(batch_sizes))
        if not set(wanted) <= set(profile.batch_sizes):
            log.info("cached profile %s covers batch sizes %s, not all of %s: measuring again", path,
                     profile.batch_sizes, wanted)
            return None
        return restrict(profile, wanted)

    def refit(self, model_fingerprint: str, node: str, device_fingerprint: str, work: Work) -> ComputeRefit | None:
        """What jobs of ``work`` measured of ``node``'s compute on this model, or None (none saved, corrupt, or saved
        for another device under the same node name)."""
        refit = self._load(self.refit_path(model_fingerprint, node, work), "refit", ComputeRefit)
        if refit is None or (refit.model_fingerprint, refit.node, refit.device_fingerprint, refit.work) != (
                model_fingerprint, node, device_fingerprint, work):
            return None
        return refit

    def link_refit(self, a: str, b: str) -> LinkRefit | None:
        """What jobs measured of the link between nodes ``a`` and ``b`` (``a`` sorts first), or None."""
        refit = self._load(self.link_refit_path(a, b), "link", LinkRefit)
        return refit if refit is not None and (refit.a, refit.b) == (a, b) else None

    def _load(self, path: Path, kind: str, cls: type[Any]) -> Any:
        try:
            raw = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("ignoring cached profile %s: cannot read it (%s)", path, exc)
            return None
        try:
            doc = json.loads(raw)
            if isinstance(doc, dict) and isinstance(doc.get("format"), int) and doc["format"] < FORMAT:
                log.info("cached profile %s is from an older edgeswarm (format %s): measuring again", path,
                         doc["format"])
                return None
            if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("kind") != kind:
                raise ValueError(f"not a format-{FORMAT} {kind} profile file")
            return cls.model_validate(doc["profile"])
        except (ValueError, KeyError, ValidationError) as exc:
            log.warning("ignoring corrupt cached profile %s (%s); it will be measured again",
                        path, str(exc).splitlines()[0])
            return None

    # --- writes -------------------------------------------------------------------------------------

    def put_model(self, profile: ModelProfile) -> Path:
        """Store ``profile`` under its fingerprint; returns the file written. Raises OSError."""
        path = self.model_path(profile.fingerprint)
        write_json_atomic(path, {"format": FORMAT, "kind": "model", "profile": profile.model_dump(mode="json")})
        return path

    def put_compute(self, profile: ComputeProfile) -> Path:
        """Store ``profile`` under its (model, device) fingerprints and method; returns the file written."""
        path = self.compute_path(profile.model_fingerprint, profile.device_fingerprint, profile.method)
        write_json_atomic(path, {"format": FORMAT, "kind": "compute", "profile": profile.model_dump(mode="json")})
        return path

    def put_refit(self, refit: ComputeRefit) -> Path:
        """Store ``refit`` under its model fingerprint and node; returns the file written."""
        path = self.refit_path(refit.model_fingerprint, refit.node, refit.work)
        write_json_atomic(path, {"format": FORMAT, "kind": "refit", "profile": refit.model_dump(mode="json")})
        return path

    def put_link_refit(self, refit: LinkRefit) -> Path:
        """Store ``refit`` under its two nodes; returns the file written."""
        path = self.link_refit_path(refit.a, refit.b)
        write_json_atomic(path, {"format": FORMAT, "kind": "link", "profile": refit.model_dump(mode="json")})
        return path


def restrict(profile: ComputeProfile, batch_sizes: list[int]) -> ComputeProfile:
    """``profile`` with only the columns of ``batch_sizes`` (each must be on its grid)."""
    columns = [profile.batch_sizes.index(b) for b in batch_sizes]
    if columns == list(range(len(profile.batch_sizes))):
        return profile
    return profile.model_copy(update={
        "batch_sizes": list(batch_sizes),
        "forward_s": [[row[k] for k in columns] for row in profile.forward_s],
        "backward_s": [[row[k] for k in columns] for row in profile.backward_s],
        "inference_s": None if profile.inference_s is None else [[row[k] for k in columns]
                                                                 for row in profile.inference_s],
        "chain": None if profile.chain is None else [profile.chain[k] for k in columns],
    })


def write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as JSON to ``path`` all or nothing (edgeswarm.files), creating the folder: a reader never sees
    a half-written file."""
    write_atomically(path, json.dumps(doc).encode())
