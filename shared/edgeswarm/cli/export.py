"""``edgeswarm export JOB --out FILE``: a training job's checkpoint as one standard safetensors file.

The file holds the whole model's state dict under the plain torch model's names (``load_state_dict`` takes it
as is) with the model, its config, the job and the version in its metadata; docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeswarm.cli.common import add_hub_arg, hub_url
from edgeswarm.cli.console import console
from edgeswarm.errors import ConfigError
from edgeswarm.runtime.client import client_bus
from edgeswarm.settings import Settings

STORE_NODE = "hub"


def add_export_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``edgeswarm export``."""
    p = sub.add_parser("export", help="write a training job's checkpoint as one safetensors file (plain torch and "
                                      "Hugging Face tools load it)")
    p.add_argument("job", help="the training job's name")
    p.add_argument("--version", type=int, default=None, help="the checkpoint version (default: the latest complete)")
    p.add_argument("--out", required=True, help="the safetensors file to write (replaced if it exists)")
    add_hub_arg(p)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each part of the checkpoint")


def run_export(args: argparse.Namespace) -> int:
    from edgeswarm.checkpoints.client import loader_status
    from edgeswarm.hpp.export import export_model
    from edgeswarm.hpp.model_file import write_model_file

    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; name the file to write, e.g. {out / (args.job + '.safetensors')}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist")
    if args.version is not None and args.version < 0:
        raise ConfigError(f"--version {args.version}: versions are 0 or more")
    bus = client_bus(Settings(hub_url=hub_url(args.hub) or "mqtt://127.0.0.1:1883"), role="export")
    try:
        with loader_status(bus):
            exported = export_model(bus, STORE_NODE, args.job, args.version, timeout_s=args.timeout)
    finally:
        bus.stop()
    size, sha256 = write_model_file(out, exported.state, exported.metadata())
    params = sum(t.numel() for t in exported.state.values())
    console.print(f"wrote {out}: {exported.model.name}, version {exported.version} of job {exported.job_id}, "
                  f"{len(exported.state)} tensors ({params} values), {size} bytes, sha256 {sha256[:16]}...")
    return 0
