"""Galaxy's section of ``edgeswarm bench peers``: serve-hmp beside torch's own tensor parallelism over gloo, on the
same devices, links, model, weights and prompt, in one run per cell.

A cell is a cluster of 2 to 4 emulated Jetson Nano CPUs in network namespaces at one bandwidth: the same class on
every device (Nano-M) or a mixed set (Nano-L, -S, then -M), where Galaxy's planner gives each device the share its
speed earns and torch splits evenly. On each cell's cluster Galaxy serves the model (``bench_hmp.serve_and_measure``:
a warm-up and ``requests`` prompts one at a time, each generating ``new_tokens``), then one peer process per
device, each in its device's namespace (``hmp.peer_tp``), runs the same prompt the same way. The rows are the time
to the first token (a prefill of the prompt) and the time per further token, both medians. The cross-check: the
peer's final hidden states equal the model computed whole on one device to 1e-5 of their largest value, and its
greedy tokens equal Galaxy's and the single device's. Outside quick, Megatron on our runtime (the peer's even split,
our messages) is measured too, beside: what the planner gains and what the runtime costs, apart.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry, NetworkDefaults
from edgeswarm.errors import EdgeswarmError
from edgeswarm.workloads.peers import Figure, PeerRow, PeersConfig, PeerSection, run_ranks

if TYPE_CHECKING:
    from edgeswarm.hmp.bench_hmp import HmpRun
    from edgeswarm.hmp.peer_tp import PeerResult
    from edgeswarm.workloads.commands import BenchCluster, CommandTools

MIXED = ("jetson-nano-l", "jetson-nano-s", "jetson-nano-m", "jetson-nano-m")
SAME = "jetson-nano-m"
NANO_GB = 4.0  # a Jetson Nano's memory: a Llama-3.2-1B-shaped model's embeddings alone take 1 GB in float32
TOLERANCE = 1e-5  # the peer's hidden states against the single device's, over their largest value
PEER = "torch TP (gloo)"
PEER_WAIT_S = 900.0


class TensorParallelPeers(PeerSection):
    name = "tp"
    title = "tensor-parallel inference: Galaxy against torch.distributed.tensor.parallel over gloo"

    def run(self, config: PeersConfig, tools: CommandTools) -> list[PeerRow]:
        if config.quick:
            model, layers, prompt_len, new_tokens = "llama-tiny", 2, 8, 4
            cells = [(2, "mixed", config.bandwidths[-1])]
        else:
            model, layers, prompt_len, new_tokens = "llama-3.2-1b", 2, 32, 8
            cells = [(n, kind, bw) for n in config.devices for kind in ("same", "mixed") for bw in config.bandwidths]
        rows: list[PeerRow] = []
        for devices, kind, bandwidth in cells:
            rows += self._cell(config, tools, devices, kind, bandwidth, model, layers, prompt_len, new_tokens)
        return rows

    def _cell(self, config: PeersConfig, tools: CommandTools, devices: int, kind: str, bandwidth: float, model: str,
              layers: int, prompt_len: int, new_tokens: int) -> list[PeerRow]:
        from edgeswarm.hmp.bench_hmp import prompts_of, serve_and_measure

        classes = [SAME] * devices if kind == "same" else list(MIXED[:devices])
        spec = ClusterSpec(name=f"peers-tp-{devices}-{kind}-{bandwidth:g}mbps",
                           description=f"{devices} devices ({', '.join(classes)}) at {bandwidth:g} Mbps",
                           devices=tuple(DeviceEntry(id=f"d{i}", device_class=c, memory_budget_gb=NANO_GB)
                                         for i, c in enumerate(classes)),
                           network=NetworkDefaults(bandwidth_mbps=bandwidth, latency_ms=0.5))
        cell = (f"{devices} x {'Nano-M' if kind == 'same' else 'mixed ' + '/'.join(c[-1].upper() for c in classes)}"
                f", {bandwidth:g} Mbps")
        section = "peers"  # the prompt's seed in serve_and_measure: the peer runs the first measured prompt
        prompt = prompts_of(model, config.requests + 1, prompt_len, seed=len(section))[1]
        tools.log(f"tp: {cell}: starting the cluster")
        megatron: HmpRun | None = None
        try:
            with tools.cluster(spec, netns=True, extra_env={"EDGESWARM_REBALANCE": "false"}) as (running, bus):
                measure = dict(section=section, env=kind, bandwidth_mbps=bandwidth, model=model, layers=layers,
                               seq_len=prompt_len, requests=config.requests, new_tokens=new_tokens, log=tools.log)
                # Quick: every device used, so the cross-check covers our split (the planner would serve the tiny
                # model on the fast device alone).
                ours = serve_and_measure(bus, mode="galaxy", prune=not config.quick, **measure)  # type: ignore[arg-type]
                if not config.quick:
                    megatron = serve_and_measure(bus, mode="megatron", **measure)  # type: ignore[arg-type]
                for run in (ours, megatron):
                    if run is not None and run.error:
                        tools.log(f"tp: {cell}: {run.mode}: {run.error}")
                tools.log(f"tp: {cell}: {PEER}")
                peer = run_peer(running, [d.id for d in spec.devices], classes, model=model, layers=layers,
                                prompt=prompt, new_tokens=new_tokens, repeats=config.requests)
        except EdgeswarmError as exc:
            return [PeerRow(section=self.name, cell=cell, metric=metric, ours="Galaxy", peer=PEER, error=str(exc))
                    for metric in ("time to first token", "time per output token")]
        return _rows(self.name, cell, ours, megatron, peer)


def run_peer(running: BenchCluster, nodes: list[str], classes: list[str], *, model: str, layers: int,
             prompt: list[int], new_tokens: int, repeats: int) -> PeerResult:
    """One ``hmp.peer_tp`` process per node of ``nodes`` (as ``classes``), each in its node's namespace, rank 0 on
    the first; rank 0's result (``workloads.peers.run_ranks``)."""
    from edgeswarm.hmp.peer_tp import PeerResult

    def argv(rank: int, master: str, out: Path) -> list[str]:
        return [sys.executable, "-m", "edgeswarm.hmp.peer_tp", "--rank", str(rank), "--world", str(len(nodes)),
                "--master", master, "--preset", model, "--layers", str(layers), "--prompt", ",".join(map(str, prompt)),
                "--new-tokens", str(new_tokens), "--repeats", str(repeats), "--device-class", classes[rank],
                "--out", str(out)]

    return run_ranks(running, nodes, argv, PeerResult, name=PEER, wait_s=PEER_WAIT_S)


def _rows(section: str, cell: str, ours: HmpRun, megatron: HmpRun | None, peer: PeerResult) -> list[PeerRow]:
    """The cell's two rows (time to first token, time per output token) with the cross-check and the raw figures."""
    problems = []
    if ours.error:
        problems.append(f"Galaxy: {ours.error}")
    if peer.error:
        problems.append(f"{PEER}: {peer.error}")
    checked: bool | None = None
    check = ""
    if not peer.error and peer.max_difference is not None and peer.scale is not None:
        close = peer.max_difference <= TOLERANCE * max(1.0, peer.scale)
        same = peer.tokens == peer.reference_tokens and (not ours.answers or ours.answers[0] == peer.tokens)
        checked = close and same
        check = (f"hidden states within {peer.max_difference:.1e} of one device's (largest {peer.scale:.2f}); "
                 f"tokens {'equal' if same else 'DIFFER'}: {peer.tokens} / ours "
                 f"{ours.answers[0] if ours.answers else '-'} / one device {peer.reference_tokens}")
    shares = zip(ours.devices, ours.heads, ours.columns, strict=True)
    plan = f"Galaxy on {', '.join(f'{d} {h}h/{c}c' for d, h, c in shares)}" if ours.devices else ""
    figures = [Figure(name="Galaxy predicted TPOT", value=ours.predicted_tpot_s, unit="s")]
    if megatron is not None:
        figures += [Figure(name="Megatron on our runtime TTFT", value=megatron.ttft_s, unit="s"),
                    Figure(name="Megatron on our runtime TPOT", value=megatron.tpot_s, unit="s")]
    return [PeerRow(section=section, cell=cell, metric=metric, ours="Galaxy", peer=PEER, ours_value=a, peer_value=b,
                    checked=checked, check=f"{plan}; {check}" if plan else check, error="; ".join(problems),
                    figures=figures)
            for metric, a, b in (("time to first token", ours.ttft_s, peer.ttft_s),
                                 ("time per output token", ours.tpot_s, peer.tpot_s))]
