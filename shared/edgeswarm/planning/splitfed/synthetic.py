"""Synthetic inputs for the planner: the paper's device mix (spec 10.1) with its memory budgets, and random
instances for the BO quality check (U6). Everything is drawn from a generator the caller seeds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgeswarm.planning.splitfed.statistics import dis
from edgeswarm.planning.splitfed.types import ModelCost, SplitDevice, SplitMec, UnitCost

GIB = 1 << 30
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class PhoneType:
    """A Table I phone: its name, RAM (bytes) and fastest core clock (GHz), which its speed is proportional to."""

    name: str
    ram_bytes: int
    big_core_ghz: float


# Table I (spec 10.1); the OnePlus 9's big core is the real SD888's 2.84 GHz either way.
PHONES = (
    PhoneType("redmi-2", 2 * GIB, 1.20),
    PhoneType("honor-8", 4 * GIB, 2.30),
    PhoneType("redmi-note-10", 6 * GIB, 2.20),
    PhoneType("pixel-6", 8 * GIB, 2.80),
    PhoneType("oneplus-9", 12 * GIB, 2.84),
)
FLOPS_PER_GHZ = 2e9     # effective training FLOP/s per big-core GHz of a phone (simulation constant)
MEC_FLOPS = 1e13        # an RTX 3090's effective training throughput
BUDGET_RANGE = (0.1, 0.4)


def budget_fraction(rng: np.random.Generator) -> float:
    """u of a round: U[0.1, 0.4]; the budget is RAM x u."""
    return float(rng.uniform(*BUDGET_RANGE))


def label_skews(devices: int, classes: int, concentration: float, samples: np.ndarray,
                rng: np.random.Generator) -> np.ndarray:
    """Dis of each device when class k's samples spread over devices as Dir_N(concentration) (spec 10.2)."""
    shares = rng.dirichlet(np.full(devices, concentration), size=classes).T  # (devices, classes)
    counts = shares * samples[:, None]
    return np.array([dis(row.tolist()) for row in counts])


def paper_devices(rng: np.random.Generator, per_type: int = 20, mecs: int = 5, classes: int = 10,
                  samples: tuple[int, int] = (200, 800), concentration: float = 0.1,
                  ) -> tuple[list[SplitDevice], list[SplitMec]]:
    """The paper's fleet: ``per_type`` of each Table I phone (100 by default), round-robin over ``mecs`` MECs,
    speed = big-core GHz x FLOPS_PER_GHZ, link U[20, 100] Mbit/s, budget RAM x U[0.1, 0.4], |D| uniform in
    ``samples`` and Dis from a Dirichlet label split."""
    phones = [p for p in PHONES for _ in range(per_type)]
    n = len(phones)
    sizes = rng.integers(samples[0], samples[1] + 1, size=n)
    skews = label_skews(n, classes, concentration, sizes, rng)
    devices = [
        SplitDevice(node=f"dev{k:03d}", mec=f"mec{k % mecs}", speed_flops=p.big_core_ghz * FLOPS_PER_GHZ,
                    link_bytes_s=float(rng.uniform(20, 100)) * MBIT,
                    budget_bytes=int(p.ram_bytes * budget_fraction(rng)), samples=int(sizes[k]),
                    dis=float(skews[k]), stat=float(rng.uniform(0.0, 100.0)))
        for k, p in enumerate(phones)
    ]
    return devices, [SplitMec(node=f"mec{m}", speed_flops=MEC_FLOPS) for m in range(mecs)]


def random_instance(rng: np.random.Generator, devices: int = 100, units: int = 10, mecs: int = 5,
                    classes: int = 10) -> tuple[ModelCost, list[SplitDevice], list[SplitMec]]:
    """A random planning instance for the BO quality check (U6): a chain model of ``units`` units with random
    per-unit costs, and ``devices`` random devices (speed 1-6 GFLOP/s, links 20-100 Mbit/s, budgets between the
    shallowest cut's memory and the whole model's, Dis of a Dirichlet split) under ``mecs`` MECs."""
    bs = 32
    unit_list = []
    for u in range(units):
        act = int(rng.uniform(0.2, 4.0) * 1e6 * (units - u) / units)
        unit_list.append(UnitCost(name=f"u{u}", flops_fwd=float(rng.uniform(0.5, 5.0)) * 1e9,
                                  flops_bwd=float(rng.uniform(1.0, 10.0)) * 1e9, out_bytes=act,
                                  param_bytes=int(rng.uniform(0.1, 8.0) * 1e6 * (u + 1) / units),
                                  act_bytes=act, backward_bytes=2 * act))
    model = ModelCost(name="random", batch_size=bs, units=unit_list, optimizer_states=1, classes=classes)
    per_unit = [u.param_bytes * 3 + u.act_bytes for u in unit_list]
    full = sum(per_unit)
    sizes = rng.integers(50, 600, size=devices)
    skews = label_skews(devices, classes, 0.3, sizes, rng)
    devs = [SplitDevice(node=f"d{k:03d}", mec=f"m{k % mecs}", speed_flops=float(rng.uniform(1.0, 6.0)) * 1e9,
                        link_bytes_s=float(rng.uniform(20, 100)) * MBIT,
                        budget_bytes=int(rng.uniform(0.15, 1.2) * full), samples=int(sizes[k]),
                        dis=float(skews[k]))
            for k in range(devices)]
    mec_list = [SplitMec(node=f"m{m}", speed_flops=float(rng.uniform(2e11, 1e12))) for m in range(mecs)]
    return model, devs, mec_list
