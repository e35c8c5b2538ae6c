"""SmartSplit's section of ``edgeswarm bench peers``: federated learning beside Flower, deployed as its users deploy
it (a SuperLink, one SuperNode a device, ``flwr run``), on the same cluster, model, data, partitions and seeds.

A cluster in network namespaces: SmartSplit's phones (``bench splitfed``'s: the slowest, a middle and the fastest
of its Table I) on their emulated Wi-Fi links and an edge server. Per data setting (IID, Dirichlet 0.1, two classes
a device), the same rounds of LeNet-5 on the digits, every device training every round, one local epoch each (SGD,
lr 0.01, momentum 0.9, batches of 32):

1. our ``fedavg`` mode (whole-model local training, averaged by samples);
2. Flower's ``FedAvg`` strategy, its SuperLink on the edge server and a SuperNode in each device's namespace, each
   client training as our fedavg device does (``splitfed.peer_flower``: same initial weights, batches, order,
   optimizer, device class) so the cross-check holds only if both federate with the same math: the first round's
   held-out loss within 1e-5 (relative), every round's accuracy within 2 points of ours (the two averages round
   differently, float32 and float64, and the difference grows over rounds);
3. SmartSplit (``smartsplit`` mode), every device's training memory capped at SMARTSPLIT_BUDGET (below what
   whole-model training needs): the time it takes to reach Flower's final accuracy, and its devices' training
   memory peak against a Flower client's.

Time per round is each side's own round (model out, local training, replies, average; evaluation excluded); bytes
are what crossed each device's link (the kernel's counters), per device and round: ours as measured (our services'
heartbeats included: they are our cost), Flower's less our idle services' traffic over its run (measured just before
it: not its cost). Flower runs from the environment ``PeersConfig.flower_env`` names (``make peers-venv``): flwr
pins typer below what ``edgeswarm[broker]``'s amqtt needs, so the two cannot share one environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.splitfed import RoundSetup
from edgeswarm.workloads.peers import Figure, PeerRow, PeersConfig, PeerSection, peer_env

if TYPE_CHECKING:
    from edgeswarm.bus import Bus
    from edgeswarm.messages.jobs import JobState
    from edgeswarm.splitfed.spec import SplitfedSpec
    from edgeswarm.workloads.commands import BenchCluster, CommandTools

PEER = "Flower FedAvg (SuperLink, SuperNodes)"
PORT = 9200  # the SuperLink's HTTP port, in the edge server's namespace (nothing else listens there but its broker)
SERVER = "edge-0"
FLOWER_COMMANDS = ("flower-superlink", "flower-supernode", "flwr")
FIRST_LOSS_TOLERANCE = 1e-5  # relative: the first round's held-out loss, ours against Flower's
CURVE_TOLERANCE = 0.02  # every round's held-out accuracy
# SmartSplit's devices train under this budget (bytes): LeNet-5's whole-model training on the digits needs 2.6 MiB
# (FedAvg's devices, ours and Flower's, could not train under it); the U-split at its first units needs about 1.
SMARTSPLIT_BUDGET = 2 << 20
QUICK_SAMPLES = 480  # training samples of --quick (of the digits' 1437), its held-out ones half as many
IDLE_S = 3.0  # the window our idle services' traffic is measured over, before Flower runs
START_S = 90.0  # for the SuperLink to take the run
ROUND_WAIT_S = 120.0  # per round, for Flower's run to end
SETTINGS = {"iid": {"kind": "iid"}, "dirichlet-0.1": {"kind": "dirichlet", "alpha": 0.1},
            "label-skew-2": {"kind": "label-skew", "classes_per_device": 2}}


class Side(BaseModel):
    """One side of a cell: per-round held-out accuracy and loss and seconds, the device training-memory peak
    (bytes), bytes through a device's link per round and before its rounds (means over the devices), and why it has
    nothing."""

    accuracies: list[float] = []
    losses: list[float] = []
    round_s: list[float] = []
    peak_bytes: int = 0
    link_bytes: float | None = None
    setup_bytes: float | None = None
    train_s: list[float] = []
    rss_bytes: int = 0
    error: str = ""

    @property
    def mean_round_s(self) -> float | None:
        return sum(self.round_s) / len(self.round_s) if self.round_s else None

    def seconds_to(self, accuracy: float) -> float | None:
        """Round seconds until a round's model first scores ``accuracy`` or better; None if none does."""
        spent = 0.0
        for got, seconds in zip(self.accuracies, self.round_s, strict=False):
            spent += seconds
            if got >= accuracy:
                return spent
        return None


class FlowerJob(BaseModel):
    """One Flower run: ``rounds`` rounds of FedAvg over ``len(classes)`` SuperNodes (partition i computes as
    ``classes[i]``), every one training every round, from the model ``torch.manual_seed(seed)`` builds; the
    ServerApp writes its FlowerResult to ``out``."""

    model_config = ConfigDict(extra="forbid")

    setup: RoundSetup
    seed: int = Field(ge=0)
    rounds: int = Field(ge=1, le=500)
    classes: list[str] = Field(min_length=1, max_length=64)
    out: Path


class FlowerResult(BaseModel):
    """What the ServerApp measured: each round's held-out accuracy and loss and its seconds (the strategy's train
    round: the model out to every client, their training, the replies back, the average; the evaluation between
    rounds is not counted) and its slowest client's local training (seconds), the largest training-memory peak a
    client measured (bytes, as our devices measure it) and the largest resident set of a ClientApp process (bytes),
    and ``error`` when the run failed."""

    accuracies: list[float] = []
    losses: list[float] = []
    round_s: list[float] = []
    train_s: list[float] = []
    peak_bytes: int = 0
    rss_bytes: int = 0
    error: str = ""


class FederatedPeers(PeerSection):
    name = "flower"
    title = "federated learning: our FedAvg and SmartSplit against Flower's FedAvg, deployed"
    extra = "peers"

    def run(self, config: PeersConfig, tools: CommandTools) -> list[PeerRow]:
        from edgeswarm.splitfed.bench_splitfed import CLUSTER_CLASSES

        flower = flower_env(config.flower_env)
        classes = ("redmi-2", "pixel-6") if config.quick else CLUSTER_CLASSES
        settings = ["iid"] if config.quick else list(SETTINGS)
        rounds = 2 if config.quick else 10
        # Quick: a third of the digits, a third of each side's local training (a Flower round stays about 12 s: it
        # is mostly its ClientApp processes starting).
        data = {"kind": "digits", **({"size": QUICK_SAMPLES, "test_size": QUICK_SAMPLES // 2} if config.quick else {})}
        spec = ClusterSpec(name="peers-flower", description="SmartSplit's phones and an edge server",
                           devices=tuple(DeviceEntry(id=f"{c}-{i}", device_class=c) for i, c in enumerate(classes)),
                           edges=(DeviceEntry(id=SERVER, device_class="edge-server"),))
        rows: list[PeerRow] = []
        with tempfile.TemporaryDirectory(prefix="edgeswarm-peers-flower-") as tmp:
            root = Path(tmp)
            env = {"EDGESWARM_CHECKPOINT_DIR": str(root / "checkpoints"),
                   "EDGESWARM_PROFILE_DIR": str(root / "profiles")}
            tools.log(f"flower: starting {', '.join(classes)} and an edge server")
            with tools.cluster(spec, workdir=root / "cluster", extra_env=env, skip_services=("tensor-shard-worker",),
                               netns=True, timeout_s=300) as (running, bus):
                devices = sorted(d.id for d in spec.devices)  # a device's partition: its index in name order
                for setting in settings:
                    job = {"kind": "train-splitfed", "rounds": rounds, "participants": len(devices), "data": data,
                           "partition": {**SETTINGS[setting], "devices": len(devices), "seed": 1},
                           "training": {"epochs": 1, "batch_size": 32, "lr": 0.01}, "wait_s": 60, "seed": 0}
                    ours = {mode: self._ours(running, bus, devices, {
                        **job, "mode": mode, "name": f"peers-{setting}-{mode}",
                        "memory_budget_bytes": SMARTSPLIT_BUDGET if mode == "smartsplit" else 0}, tools)
                        for mode in ("fedavg", "smartsplit")}
                    tools.log(f"flower: {setting}: {PEER}")
                    peer = self._flower(running, flower, devices, {d.id: d.device_class for d in spec.devices},
                                        job, root / setting)
                    rows += cell_rows(f"{len(devices)} phones + edge server, {setting}", ours["fedavg"],
                                      ours["smartsplit"], peer)
        return rows

    def _ours(self, running: BenchCluster, bus: Bus, devices: list[str], job: dict[str, object],
              tools: CommandTools) -> Side:
        """Our job ``job`` on the cluster. Its bytes a round are those of its rounds after the first (the first
        also profiles the devices and their links: the job's setup, a figure of its own)."""
        from edgeswarm.splitfed.bench_splitfed import job_rows
        from edgeswarm.splitfed.spec import SplitfedProgress

        ended: dict[int, list[int] | None] = {}  # link bytes when each round's state came

        def on_state(state: JobState) -> None:
            if isinstance(state.progress, SplitfedProgress):
                ended.setdefault(state.progress.rounds_done, _link_bytes(running, devices))

        tools.log(f"flower: {job['name']}")
        before = _link_bytes(running, devices)
        rows = job_rows(bus, job, tools.log, on_state=on_state)
        after = _link_bytes(running, devices)
        if rows[0].error:
            return Side(error=f"{job['mode']}: {rows[0].error}")
        first, last = ended.get(1), ended.get(len(rows))
        per_round = _per_round(first, last, len(rows) - 1) if len(rows) > 1 else None
        setup = None
        if per_round is None:
            per_round = _per_round(before, after, len(rows))
        else:
            setup = (_per_round(before, first, 1) or 0.0) - per_round
        return Side(accuracies=[r.accuracy or 0.0 for r in rows], losses=[r.loss or 0.0 for r in rows],
                    round_s=[r.round_s for r in rows], peak_bytes=max(r.peak_bytes for r in rows),
                    link_bytes=per_round, setup_bytes=setup)

    def _flower(self, running: BenchCluster, flower: Path, devices: list[str], classes: dict[str, str],
                job: dict[str, object], folder: Path) -> Side:
        from edgeswarm.splitfed.spec import SplitfedSpec

        spec = SplitfedSpec.model_validate({**job, "mode": "fedavg", "name": "flower"})
        idle = _link_bytes(running, devices) or [0] * len(devices)
        time.sleep(IDLE_S)
        idle_rate = [(b - a) / IDLE_S for a, b in zip(idle, _link_bytes(running, devices) or idle, strict=True)]
        before, started = _link_bytes(running, devices), time.monotonic()
        try:
            result = run_flower(running, flower, spec, [classes[d] for d in devices], devices, folder)
        except EdgeswarmError as exc:
            return Side(error=str(exc))
        spent = time.monotonic() - started
        after = _link_bytes(running, devices)
        if before is not None:  # our idle services' traffic over Flower's run is not Flower's
            before = [a + int(rate * spent) for a, rate in zip(before, idle_rate, strict=True)]
        if result.error:
            return Side(error=f"{PEER}: {result.error}")
        return Side(**result.model_dump(exclude={"error"}), link_bytes=_per_round(before, after, len(result.round_s)))


def cell_rows(cell: str, fedavg: Side, smartsplit: Side, flower: Side) -> list[PeerRow]:
    """The cell's rows: our FedAvg against Flower's (time per round and bytes per device per round, with the
    same-math cross-check), and SmartSplit against Flower's FedAvg (time to Flower's final accuracy, device
    training-memory peak)."""
    checked, check = same_math(fedavg, flower)
    curves = [Figure(name=f"{who} held-out accuracy, round {i + 1}", value=a)
              for who, side in (("our FedAvg", fedavg), ("Flower", flower), ("SmartSplit", smartsplit))
              for i, a in enumerate(side.accuracies)]
    base = {"section": "flower", "cell": cell, "peer": PEER, "checked": checked, "check": check}
    rows = [
        PeerRow(**base, metric="time per round", ours="our FedAvg", ours_value=fedavg.mean_round_s,
                peer_value=flower.mean_round_s, error=fedavg.error or flower.error,
                figures=[Figure(name="Flower's slowest client's local training a round (mean)",
                                value=sum(flower.train_s) / len(flower.train_s) if flower.train_s else None,
                                unit="s"), *curves]),
        PeerRow(**base, metric="bytes per device per round", ours="our FedAvg", unit="B",
                ours_value=fedavg.link_bytes, peer_value=flower.link_bytes, error=fedavg.error or flower.error,
                figures=[Figure(name="our FedAvg's setup bytes per device (profiling the devices and links)",
                                value=fedavg.setup_bytes, unit="B"),
                         Figure(name="SmartSplit's bytes per device per round", value=smartsplit.link_bytes,
                                unit="B")]),
    ]
    target = flower.accuracies[-1] if flower.accuracies else None
    reached = smartsplit.seconds_to(target) if target is not None else None
    why = smartsplit.error or flower.error
    if not why and target is not None and reached is None:
        why = (f"SmartSplit did not reach Flower's final accuracy {100 * target:.1f}% in {len(smartsplit.accuracies)}"
               f" rounds (best {100 * max(smartsplit.accuracies, default=0.0):.1f}%)")
    flower_total = sum(flower.round_s) if flower.round_s else None
    rows.append(PeerRow(**base | {"ours": "SmartSplit"}, metric="time to Flower FedAvg's final accuracy",
                        ours_value=reached, peer_value=flower_total, error=why,
                        figures=[Figure(name="Flower's final accuracy", value=target),
                                 Figure(name="SmartSplit's final accuracy",
                                        value=smartsplit.accuracies[-1] if smartsplit.accuracies else None)]))
    rows.append(PeerRow(**base | {"ours": "SmartSplit"}, metric="device training-memory peak", unit="B",
                        ours_value=float(smartsplit.peak_bytes) or None, peer_value=float(flower.peak_bytes) or None,
                        error=smartsplit.error or flower.error,
                        figures=[Figure(name="our FedAvg's device peak", value=float(fedavg.peak_bytes) or None,
                                        unit="B"),
                                 Figure(name="SmartSplit's budget a device", value=float(SMARTSPLIT_BUDGET), unit="B"),
                                 Figure(name="a Flower ClientApp process's resident set, largest",
                                        value=float(flower.rss_bytes) or None, unit="B")]))
    return rows


def same_math(ours: Side, flower: Side) -> tuple[bool | None, str]:
    """Whether our FedAvg and Flower's train the same model: from the same weights and batches, the first round's
    held-out loss within FIRST_LOSS_TOLERANCE (relative: only float rounding differs, Flower averaging in float32,
    ours in float64) and every round's accuracy within CURVE_TOLERANCE (that rounding grows as the rounds go,
    most where training leaves a plateau). None when a side has no rounds."""
    if not ours.losses or not flower.losses:
        return None, ""
    if len(ours.losses) != len(flower.losses):
        return False, f"{len(ours.losses)} rounds of ours against {len(flower.losses)} of Flower's"
    first = abs(ours.losses[0] - flower.losses[0]) / max(abs(flower.losses[0]), 1e-12)
    loss = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours.losses, flower.losses, strict=True))
    gap = max(abs(a - b) for a, b in zip(ours.accuracies, flower.accuracies, strict=True))
    same = sum(a == b for a, b in zip(ours.accuracies, flower.accuracies, strict=True))
    held = first <= FIRST_LOSS_TOLERANCE and gap <= CURVE_TOLERANCE
    return held, (f"same initial weights and batches: round 1's held-out loss within {first:.1e} (relative); "
                  f"accuracy equal in {same} of {len(ours.accuracies)} rounds, within {100 * gap:.2f} points in all "
                  f"(loss within {loss:.1e})")


def _link_bytes(running: BenchCluster, nodes: list[str]) -> list[int] | None:
    counts = [running.link_bytes(n) for n in nodes]
    return None if any(c is None for c in counts) else [int(c) for c in counts if c is not None]


def _per_round(before: list[int] | None, after: list[int] | None, rounds: int) -> float | None:
    if before is None or after is None or not rounds:
        return None
    return sum(b - a for a, b in zip(before, after, strict=True)) / len(before) / rounds


def missing_flower_commands(prefix: Path) -> list[str]:
    """Flower's commands that the Python environment at ``prefix`` lacks (none: Flower is installed there)."""
    return [c for c in FLOWER_COMMANDS if not (prefix / "bin" / c).exists()]


def flower_env(configured: str) -> Path:
    """The Python environment Flower runs from: ``configured`` (a virtual environment's folder) or this one. Raises
    EdgeswarmError naming what is missing when it lacks Flower's commands or cannot import this module's Flower
    apps."""
    prefix = Path(configured) if configured else Path(sys.prefix)
    missing = missing_flower_commands(prefix)
    if missing:
        raise EdgeswarmError(f"Flower is not installed in {prefix} (no {missing[0]} in {prefix / 'bin'}): install "
                             "edgeswarm[peers] into an environment of its own (`make peers-venv` makes .venv-peers; "
                             "flwr needs typer below 0.21, edgeswarm[broker] 0.24 or later) and point "
                             "EDGESWARM_FLOWER_ENV or --flower-env at it")
    done = subprocess.run([str(prefix / "bin" / "python"), "-c", "import edgeswarm.splitfed.peer_flower"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise EdgeswarmError(f"{prefix}'s Python cannot load edgeswarm's Flower apps: "
                             f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return prefix


APP_TOML = """[project]
name = "edgeswarm-flower-peer"
version = "1.0.0"
description = "edgeswarm's federated job as Flower apps (edgeswarm.splitfed.peer_flower)"
dependencies = ["flwr>=1.42"]

[tool.flwr.app]
publisher = "edgeswarm"

[tool.flwr.app.components]
serverapp = "flower_peer:server"
clientapp = "flower_peer:client"

[tool.flwr.app.config]
job = ""
"""


def run_flower(running: BenchCluster, flower: Path, spec: SplitfedSpec, classes: list[str], devices: list[str],
               folder: Path) -> FlowerResult:
    """Flower's FedAvg on ``spec``'s job: its SuperLink on the edge server, a SuperNode on each of
    ``devices`` (partition i on devices[i], computing as classes[i]), each in its node's namespace, the run started
    with ``flwr run``; the ServerApp's result. Every process is stopped before this returns. Raises EdgeswarmError
    when the run does not start or end in time."""
    folder.mkdir(parents=True, exist_ok=True)
    app = folder / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(APP_TOML)
    # flwr run checks the components by reading the module's assignments, not by importing it
    (app / "flower_peer.py").write_text("from edgeswarm.splitfed import peer_flower\n\n"
                                        "client = peer_flower.client\nserver = peer_flower.server\n")
    out = folder / "result.json"
    setup = RoundSetup(model=spec.model, dataset=spec.data, partition=spec.partition, training=spec.local_training())
    (folder / "job.json").write_text(FlowerJob(setup=setup, seed=spec.seed, rounds=spec.rounds, classes=classes,
                                               out=out).model_dump_json())
    link = f"{running.address(SERVER)}:{PORT}"
    home = folder / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "{link}"\n'
                                      "insecure = true\n")
    bin_dir = flower / "bin"
    base = peer_env()
    base["PATH"] = f"{bin_dir}{os.pathsep}{base.get('PATH', '')}"  # the SuperLink and SuperNodes start Flower's
    # A benchmark sends nothing home: no telemetry events, no check for a newer flwr (a namespace has no route out).
    base.update({"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"})

    def env(node: str) -> dict[str, str]:
        return {**base, "FLWR_HOME": str(home if node == SERVER else folder / f"flwr-home-{node}")}

    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(running.spawn(SERVER, [str(bin_dir / "flower-superlink"), "--insecure", "--host",
                                            running.address(SERVER), "--port", str(PORT),
                                            "--disable-runtime-dependency-installation"],
                                   env=env(SERVER), log_path=folder / "superlink.log"))
        for i, node in enumerate(devices):
            procs.append(running.spawn(node, [str(bin_dir / "flower-supernode"), "--insecure", "--superlink", link,
                                              "--node-config", f"partition-id={i} num-partitions={len(devices)}"],
                                       env=env(node), log_path=folder / f"supernode-{node}.log"))
        _start_run(running, bin_dir, app, folder, env(SERVER), procs)
        deadline = time.monotonic() + ROUND_WAIT_S * spec.rounds
        while not out.exists() and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise EdgeswarmError(f"{PEER}: a Flower process ended: {_tail(folder)}")
            time.sleep(0.5)
        if not out.exists():
            raise EdgeswarmError(f"{PEER}: no result within {ROUND_WAIT_S * spec.rounds:.0f} s: {_tail(folder)}")
        return FlowerResult.model_validate_json(out.read_text())
    finally:
        _stop(procs)


def _start_run(running: BenchCluster, bin_dir: Path, app: Path, folder: Path, env: dict[str, str],
               procs: list[subprocess.Popen[bytes]]) -> None:
    """``flwr run`` the app on the SuperLink, from the edge server, until the SuperLink takes it (it may still be
    starting). Raises EdgeswarmError after START_S seconds."""
    deadline = time.monotonic() + START_S
    config = f"job='{folder / 'job.json'}'"
    while time.monotonic() < deadline:
        if procs[0].poll() is not None:
            raise EdgeswarmError(f"{PEER}: the SuperLink ended: {_tail(folder)}")
        log = folder / "flwr-run.log"
        log.unlink(missing_ok=True)
        run = running.spawn(SERVER, [str(bin_dir / "flwr"), "run", str(app), "bench", "--run-config", config,
                                     "--format", "json"], env=env, log_path=log)
        try:
            run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait(10)
        if '"success": true' in log.read_text(errors="replace"):
            return
        time.sleep(1.0)
    raise EdgeswarmError(f"{PEER}: the SuperLink did not take the run within {START_S:.0f} s: {_tail(folder)}")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM (Flower's processes stop the ones they started), then SIGKILL what is left after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10.0
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def _tail(folder: Path) -> str:
    logs = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime)
    return " | ".join(f"{p.name}: {p.read_text(errors='replace')[-600:]}" for p in logs[-2:])
