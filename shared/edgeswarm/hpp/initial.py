"""A training job that starts from a weights file: the file becomes version 0 of the job's checkpoints.

The coordinator cannot read a file on the user's machine, and the stage-workers already know how to start from a
checkpoint version (as after a restart: ``StageAssign.checkpoint``). So ``edgeswarm train`` checks the file named in
the spec's ``init`` against the model, uploads its tensors to the checkpoint store as stage ``stage-0`` of version
0 (holding every unit) with a layout naming the model and the file's SHA-256, and only then submits the job. The
coordinator checks that version 0 is there and is that file, and deploys the plan with every stage loading its
units from it; the optimizer starts empty, as it does from the seed.
"""

from __future__ import annotations

from edgeswarm.bus import Bus
from edgeswarm.checkpoints.client import save_checkpoint
from edgeswarm.errors import CheckpointError, CheckpointForbiddenError, CheckpointVersionError, ConfigError
from edgeswarm.hpp.model_file import ModelFile, describe_problems, specs_of, state_problems
from edgeswarm.hpp.spec import JobSpec
from edgeswarm.messages.training import CheckpointSource
from edgeswarm.models.zoo import unit_count
from edgeswarm.state.layout import load_layout_meta, save_layout, stage_entry

INIT_VERSION = 0
SOURCE_SHA256 = "source_sha256"  # the layout's meta: the SHA-256 of the file version 0 was made from


class InitError(CheckpointError):
    """A job's initial weights cannot be uploaded, or are not in the checkpoint store as the job expects."""


def check_initial(job: JobSpec, file: ModelFile) -> None:
    """Raise ConfigError listing every tensor of ``file`` that does not fit ``job``'s model (missing, unexpected, of
    another shape or dtype)."""
    assert job.init is not None
    problems = state_problems(specs_of(file.tensors), job.model)
    if problems:
        raise ConfigError(f"the weights file {job.init.file} does not fit {job.model.name} "
                          f"{job.model.config or ''} ({len(problems)} problems):\n{describe_problems(problems)}")


def upload_initial(bus: Bus, store_node: str, job: JobSpec, file: ModelFile, *, timeout_s: float = 60.0) -> None:
    """Store ``file``'s tensors (checked with ``check_initial``) as version 0 of ``job``: one stage holding every
    unit, and its layout with the model and the file's SHA-256. Raises InitError when the store refuses it (the job's
    name already has checkpoints, or is a running job's) or another CheckpointError (store unreachable)."""
    units = unit_count(job.model)
    try:
        save_checkpoint(bus, store_node, job.name, stage_entry(0), INIT_VERSION, file.tensors,
                        meta={SOURCE_SHA256: file.sha256}, timeout_s=timeout_s)
        save_layout(bus, store_node, job.name, INIT_VERSION, [(0, units)], model=job.model,
                    extra={SOURCE_SHA256: file.sha256}, timeout_s=timeout_s)
    except (CheckpointVersionError, CheckpointForbiddenError) as exc:
        raise InitError(f"cannot store the weights of {job.init.file if job.init else 'the file'} as version 0 of "
                        f"job {job.name}: {exc}. A job that starts from a file needs a name with no checkpoints "
                        "yet: rename the job") from None


def initial_checkpoint(bus: Bus, store_node: str, job: JobSpec, *, timeout_s: float = 60.0) -> CheckpointSource:
    """Where ``job``'s stages load their initial weights from: version 0 of its checkpoints, checked to be the file
    its spec names (same SHA-256 when the spec has one) and of its model. Raises InitError saying what to do."""
    assert job.init is not None
    try:
        layout = load_layout_meta(bus, store_node, job.name, INIT_VERSION, timeout_s=timeout_s)
    except CheckpointError as exc:
        raise InitError(f"job {job.name} starts from {job.init.file}, but the checkpoint store on {store_node} does "
                        f"not hold it as version {INIT_VERSION} ({exc}); submit the job with `edgeswarm train`, which "
                        "uploads the file first") from None
    source = layout.meta.get(SOURCE_SHA256)
    if job.init.sha256 is not None and source != job.init.sha256:
        raise InitError(f"job {job.name}: version {INIT_VERSION} in the checkpoint store was made from another file "
                        f"(SHA-256 {source}) than {job.init.file} ({job.init.sha256}); submit the job "
                        "again with `edgeswarm train` under a new name")
    if layout.model is not None and layout.model != job.model:
        raise InitError(f"job {job.name}: version {INIT_VERSION} in the checkpoint store holds another model than "
                        f"{job.model.name}")
    return CheckpointSource(store_node=store_node, version=INIT_VERSION, stages=layout.ranges)

