"""An MEC's round, checkpointed on its own disk after every device it finishes: the reports so far and the weighted
sum of the reassembled models (``aggregation.PartialSum``). A restarted MEC given the same round again resumes from
it and trains only the devices it had not finished."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from edgeswarm.aggregation import FedAvg, PartialSum, UpdateRejectedError
from edgeswarm.files import write_atomically
from edgeswarm.messages.splitfed import DeviceReport

log = logging.getLogger(__name__)


class RoundCheckpoint:
    """The checkpoints of the rounds this MEC serves, under ``directory`` (one folder per job)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _folder(self, job_id: str) -> Path:
        return self.directory / job_id

    def save(self, job_id: str, round_: int, reports: Sequence[DeviceReport], partial: PartialSum) -> None:
        """Record round ``round_``'s ``reports`` and ``partial`` sum (replacing the previous record of the job). A
        disk that refuses the write costs the checkpoint, not the round."""
        folder = self._folder(job_id)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if partial.count:
                save_file({k: v.detach().cpu().contiguous() for k, v in partial.sums.items()},
                          str(folder / "sums.safetensors"))
            meta = {"round": round_, "weight": partial.weight, "heaviest": partial.heaviest, "count": partial.count,
                    "reports": [r.model_dump(mode="json") for r in reports]}
            write_atomically(folder / "round.json", json.dumps(meta).encode())
        except OSError as exc:
            log.warning("splitfed job %s: round %d's MEC checkpoint was not written: %s", job_id, round_, exc)

    def resume(self, job_id: str, round_: int, into: FedAvg) -> list[DeviceReport]:
        """The reports of round ``round_`` finished before a restart, their sum merged ``into`` the round's
        aggregate; nothing for another round, or a record that cannot be read (the round starts afresh)."""
        folder = self._folder(job_id)
        try:
            meta = json.loads((folder / "round.json").read_text())
            if meta.get("round") != round_:
                return []
            reports = [DeviceReport.model_validate(r) for r in meta["reports"]]
            if int(meta["count"]):
                sums = load_file(str(folder / "sums.safetensors"))
                into.merge(PartialSum(sums=dict(sums), weight=float(meta["weight"]),
                                      heaviest=float(meta["heaviest"]), count=int(meta["count"])),
                           who="the checkpointed sum")
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError, ValidationError, SafetensorError,
                UpdateRejectedError) as exc:
            log.warning("splitfed job %s: round %d's MEC checkpoint is unusable (%s); the round starts afresh",
                        job_id, round_, exc)
            return []
        log.info("splitfed job %s: resuming round %d with %d device(s) already finished", job_id, round_,
                 len(reports))
        return reports

    def forget(self, job_id: str) -> None:
        """Remove the job's record (it ended)."""
        shutil.rmtree(self._folder(job_id), ignore_errors=True)
