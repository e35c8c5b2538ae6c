"""The node's accelerator as it reports itself: busy fraction, temperature and power, where the device tells them.

Jetson boards (no NVML) publish their integrated GPU's load and thermal zones in sysfs: ``.../gpu.0/load`` (or the
Orin's ``...ga10b/load``) in per mille, and ``/sys/class/thermal/thermal_zone*/{type,temp}`` in millidegrees, the
GPU's zone typed ``GPU-therm`` or ``gpu-thermal``. A discrete NVIDIA GPU tells NVML: read through ``nvidia-smi``
when the driver installed it (no CUDA context, and no torch import, in the process that asks), else through
``torch.cuda`` when the process already loaded torch. A reading nobody reports is None; on a CPU-only machine every
field is. Nothing here raises: a sampler that cannot read simply reports less.
"""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

log = logging.getLogger(__name__)

SMI_TIMEOUT_S = 1.0  # on the main thread of the node agent, beside its heartbeat
# Where Jetson kernels put the GPU's load (per mille), relative to the sysfs root; the first that exists is read.
_LOAD_GLOBS = ("devices/gpu.0/load", "devices/platform/gpu.0/load", "devices/platform/*.gpu/load",
               "devices/platform/bus@0/*.gpu/load", "devices/platform/*.ga10b/load", "devices/*.ga10b/load")
_MAX_ZONES = 64
_SMI_QUERY = "utilization.gpu,temperature.gpu,power.draw"


class AcceleratorReading(BaseModel):
    """One sample: ``utilization`` busy fraction 0-1, ``temperature_c`` degrees Celsius, ``power_w`` watts; None
    where the device does not report it."""

    model_config = ConfigDict(frozen=True)

    utilization: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None

    def merged(self, other: AcceleratorReading) -> AcceleratorReading:
        """This reading with the fields it lacks taken from ``other``."""
        return AcceleratorReading(
            utilization=self.utilization if self.utilization is not None else other.utilization,
            temperature_c=self.temperature_c if self.temperature_c is not None else other.temperature_c,
            power_w=self.power_w if self.power_w is not None else other.power_w)


def _number(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")[:64]
    except OSError:
        return None


class JetsonFiles(NamedTuple):
    """Where a Jetson tells its GPU's load (the first match of each of ``_LOAD_GLOBS``, in their order) and its
    temperature (the ``temp`` file of each thermal zone typed as the GPU's); both empty off a Jetson."""

    loads: tuple[Path, ...]
    temps: tuple[Path, ...]


def find_jetson_files(sysfs: Path = Path("/sys")) -> JetsonFiles:
    """The Jetson files under the sysfs tree at ``sysfs``. Their places do not change while a node runs, so a
    sampler finds them once instead of globbing the tree every second."""
    loads = []
    for pattern in _LOAD_GLOBS:
        found = sorted(sysfs.glob(pattern))
        if found:
            loads.append(found[0])
    zones = sorted((sysfs / "class" / "thermal").glob("thermal_zone*"))[:_MAX_ZONES]
    temps = [zone / "temp" for zone in zones if (_read(zone / "type") or "").strip().lower().startswith("gpu")]
    return JetsonFiles(loads=tuple(loads), temps=tuple(temps))


def read_jetson_files(files: JetsonFiles) -> AcceleratorReading:
    """The integrated GPU's load and temperature from ``files``: the first file of each kind that holds a number."""
    utilization = None
    for path in files.loads:
        raw = _read(path)
        per_mille = _number(raw) if raw is not None else None
        if per_mille is not None:
            utilization = min(max(per_mille / 1000.0, 0.0), 1.0)
            break
    temperature = None
    for path in files.temps:
        raw = _read(path)
        milli = _number(raw) if raw is not None else None
        if milli is not None:
            temperature = milli / 1000.0
            break
    return AcceleratorReading(utilization=utilization, temperature_c=temperature)


def read_jetson(sysfs: Path = Path("/sys")) -> AcceleratorReading:
    """The integrated GPU's load and temperature from the sysfs tree at ``sysfs`` (empty reading off a Jetson)."""
    return read_jetson_files(find_jetson_files(sysfs))


def parse_smi(output: str, index: int = 0) -> AcceleratorReading:
    """The reading of GPU ``index`` from ``nvidia-smi --query-gpu=utilization.gpu,temperature.gpu,power.draw
    --format=csv,noheader,nounits`` output (one line a GPU; "[N/A]" where it has no figure)."""
    lines = [line for line in output.splitlines() if line.strip()]
    if not 0 <= index < len(lines):
        return AcceleratorReading()
    fields = [f.strip() for f in lines[index].split(",")]
    if len(fields) != 3:
        return AcceleratorReading()
    utilization, temperature, power = (_number(f) for f in fields)
    return AcceleratorReading(utilization=None if utilization is None else min(max(utilization / 100.0, 0.0), 1.0),
                              temperature_c=temperature, power_w=power)


def read_smi(index: int = 0, binary: str | None = None) -> AcceleratorReading:
    """GPU ``index``'s reading from ``nvidia-smi`` at ``binary`` (found on PATH when None; an empty reading when it
    is not installed or fails)."""
    binary = binary or shutil.which("nvidia-smi")
    if binary is None:
        return AcceleratorReading()
    try:
        done = subprocess.run([binary, f"--query-gpu={_SMI_QUERY}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("nvidia-smi failed: %s", exc)
        return AcceleratorReading()
    return parse_smi(done.stdout[:65536], index) if done.returncode == 0 else AcceleratorReading()


def read_torch_cuda(index: int = 0) -> AcceleratorReading:
    """GPU ``index``'s reading through torch.cuda (NVML underneath), only in a process that already loaded torch:
    importing it here would cost a service that never computes seconds and hundreds of MB."""
    torch = sys.modules.get("torch")
    if torch is None:
        return AcceleratorReading()
    cuda = torch.cuda
    try:
        if not cuda.is_available() or index >= cuda.device_count():
            return AcceleratorReading()
    except Exception:  # noqa: BLE001 - a broken driver must not stop the sampler
        return AcceleratorReading()

    def ask(fn_name: str, scale: float) -> float | None:
        fn = getattr(cuda, fn_name, None)
        if fn is None:
            return None
        try:
            value = float(fn(index))
        except Exception:  # noqa: BLE001 - NVML missing (no pynvml), not supported on this GPU, ...
            return None
        return value * scale if math.isfinite(value) else None

    utilization = ask("utilization", 0.01)
    return AcceleratorReading(utilization=None if utilization is None else min(max(utilization, 0.0), 1.0),
                              temperature_c=ask("temperature", 1.0), power_w=ask("power_draw", 0.001))


class AcceleratorSampler:
    """Reads the node's accelerator: the Jetson's sysfs under ``sysfs``, then NVIDIA GPU ``index`` (nvidia-smi, then
    torch.cuda) for what the first did not give. ``nvidia`` False skips the discrete GPU (a node that computes on
    its CPU by its settings)."""

    def __init__(self, *, sysfs: Path = Path("/sys"), nvidia: bool = True, index: int = 0) -> None:
        self.sysfs = sysfs
        self.nvidia = nvidia
        self.index = index
        # Found at the first sample: a node agent samples every second, and an idle edge device should not spend
        # its CPU globbing sysfs and searching PATH each time.
        self._jetson: JetsonFiles | None = None
        self._smi: str | None = None

    def sample(self) -> AcceleratorReading:
        """One reading now (every field None where nothing reports it). Never raises."""
        try:
            if self._jetson is None:
                self._jetson = find_jetson_files(self.sysfs)
                self._smi = shutil.which("nvidia-smi") if self.nvidia else None
            reading = read_jetson_files(self._jetson)
            if self.nvidia and None in (reading.utilization, reading.temperature_c):
                if self._smi is not None:
                    reading = reading.merged(read_smi(self.index, self._smi))
                if None in (reading.utilization, reading.temperature_c, reading.power_w):
                    reading = reading.merged(read_torch_cuda(self.index))
            return reading
        except Exception:  # noqa: BLE001 - a reading is never worth a handler's life
            log.debug("accelerator sample failed", exc_info=True)
            return AcceleratorReading()
