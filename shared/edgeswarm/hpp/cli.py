"""The verbs HPP training adds to the command line (the kind's ``commands``): ``edgeswarm export JOB --out FILE``,
a training job's checkpoint as one standard safetensors file.

The file holds the whole model's state dict under the plain torch model's names (``load_state_dict`` takes it
as is) with the model, its config, the job and the version in its metadata; docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgeswarm.errors import ConfigError
from edgeswarm.workloads.commands import Command, CommandTools

STORE_NODE = "hub"


class ExportCommand(Command):
    name = "export"
    help = "write a training job's checkpoint as one safetensors file (plain torch and Hugging Face tools load it)"
    hub = True

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("job", help="the training job's name")
        p.add_argument("--version", type=int, default=None,
                       help="the checkpoint version (default: the latest complete)")
        p.add_argument("--out", required=True, help="the safetensors file to write (replaced if it exists)")
        p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each part of the checkpoint")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        from edgeswarm.checkpoints.client import loader_status
        from edgeswarm.hpp.export import export_model
        from edgeswarm.hpp.model_file import write_model_file

        out = Path(args.out)
        if out.is_dir():
            raise ConfigError(f"--out {out} is a folder; name the file to write, e.g. "
                              f"{out / (args.job + '.safetensors')}")
        if not out.parent.is_dir():
            raise ConfigError(f"--out {out}: the folder {out.parent} does not exist")
        if args.version is not None and args.version < 0:
            raise ConfigError(f"--version {args.version}: versions are 0 or more")
        bus = tools.hub_bus("export")
        try:
            with loader_status(bus):
                exported = export_model(bus, STORE_NODE, args.job, args.version, timeout_s=args.timeout)
        finally:
            bus.stop()
        size, sha256 = write_model_file(out, exported.state, exported.metadata())
        params = sum(t.numel() for t in exported.state.values())
        tools.console.print(f"wrote {out}: {exported.model.name}, version {exported.version} of job "
                            f"{exported.job_id}, {len(exported.state)} tensors ({params} values), {size} bytes, "
                            f"sha256 {sha256[:16]}...")
        return 0
