"""``edgeswarm chaos cut|heal|partition|heal-partition|restart-broker|pause|resume ...``: the faults of a real network,
on a namespace cluster (``edgeswarm up --netns``) of this machine.

The cluster is found by the state file its launcher wrote (``netns.state``): the only one running, or the one
``--cluster RUN_ID`` names. Every action needs root, as the cluster does.
"""

from __future__ import annotations

import argparse
import signal
import time

from edgeswarm.cli.console import console
from edgeswarm.errors import ConfigError, EdgeswarmError
from edgeswarm.netns import faults, host, network
from edgeswarm.netns.clock import find_libfaketime, set_skew
from edgeswarm.netns.shaping import LinkShape
from edgeswarm.netns.state import NetnsState, clock_file, owner_alive, saved_states

ACTIONS = {
    "cut": "cut NODE off the network (its link goes down, its processes keep running) until `chaos heal` or for "
           "--for seconds",
    "heal": "bring a cut NODE's link back",
    "partition": "split the cluster into GROUPs (comma-separated nodes): nothing passes between groups, until "
                 "`chaos heal-partition` or for --for seconds",
    "heal-partition": "remove every partition",
    "link": "change the link between NODE and PEER in both directions: only what is named (--loss percent, --delay "
            "ms, --rate Mbit/s), the rest stays; for --for seconds, then put back exactly as it was (default: "
            "leave it)",
    "restart-broker": "restart NODE's broker (the hub's too): SIGTERM, or SIGKILL with --kill, then start it again",
    "pause": "SIGSTOP every process of NODE, its broker included, until `chaos resume` or for --for seconds",
    "resume": "SIGCONT every process of NODE",
    "skew": "set NODE's wall clock SECONDS off the real time (negative: behind), for every process of the node, "
            "live (libfaketime); 0 puts it right",
}


class NetnsChaosRefused(EdgeswarmError):
    """No namespace cluster to act on, or an unknown node. Exit status 1."""


def add_network_actions(actions: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the network actions under ``edgeswarm chaos``."""
    for name, text in ACTIONS.items():
        p = actions.add_parser(name, help=text, description=text)
        if name == "partition":
            p.add_argument("groups", nargs="+", metavar="GROUP", help="nodes of one side, comma-separated")
        elif name != "heal-partition":
            p.add_argument("node", metavar="NODE", help="a node of the namespace cluster")
        if name in ("cut", "partition", "pause"):
            p.add_argument("--for", dest="for_s", type=float, default=None, metavar="SECONDS",
                           help="undo it after this many seconds (the command waits); default: leave it")
        if name == "link":
            p.add_argument("peer", metavar="PEER", help="the node at the link's other end")
            p.add_argument("--loss", type=float, default=None, metavar="PERCENT",
                           help="packets lost, 0 to 100 (default: as it is)")
            p.add_argument("--delay", type=float, default=None, metavar="MS",
                           help="one-way delay in milliseconds, 0 for none (default: as it is)")
            p.add_argument("--rate", type=float, default=None, metavar="MBIT",
                           help="bandwidth in Mbit/s (default: as it is)")
            p.add_argument("--for", dest="for_s", type=float, default=None, metavar="SECONDS",
                           help="put the link back after this many seconds (the command waits)")
        if name == "skew":
            p.add_argument("seconds", type=float, metavar="SECONDS", help="the offset, e.g. 30 or -12.5")
        if name == "restart-broker":
            p.add_argument("--kill", action="store_true", help="SIGKILL, as a crash (retained messages since the "
                                                               "last save are lost)")
            p.add_argument("--down", dest="down_s", type=float, default=1.0, metavar="SECONDS",
                           help="how long it stays down (default 1)")
        p.add_argument("--cluster", default=None, metavar="RUN_ID",
                       help="which namespace cluster (default: the only one running)")


def find_cluster(run_id: str | None) -> NetnsState:
    """The running namespace cluster ``run_id`` names, or the only one. Raises NetnsChaosRefused."""
    running = [s for s in saved_states() if owner_alive(s)]
    if run_id is not None:
        running = [s for s in running if s.run_id == run_id]
    if len(running) == 1:
        return running[0]
    if not running:
        raise NetnsChaosRefused("no namespace cluster is running here" + (f" with id {run_id}" if run_id else "")
                                + ": start one with `edgeswarm up --netns`")
    raise NetnsChaosRefused(f"{len(running)} namespace clusters run here; name one with --cluster "
                            f"({', '.join(s.run_id for s in running)})")


def _node(state: NetnsState, name: str) -> str:
    try:
        return state.node(name).node
    except KeyError:
        raise NetnsChaosRefused(f"unknown node {name!r}; nodes: {', '.join(n.node for n in state.nodes)}") from None


def run_network_chaos(args: argparse.Namespace) -> int:
    """One network action; 0 done, 1 refused (NetnsChaosRefused or NetnsUnavailableError), 2 usage."""
    for_s = getattr(args, "for_s", None)
    if for_s is not None and not for_s > 0:
        raise ConfigError(f"--for must be a positive number of seconds, not {for_s:g}")
    host.preflight(("ip",))
    state = find_cluster(args.cluster)
    action = args.chaos
    if action == "partition":
        groups = [[_node(state, n) for n in g.split(",") if n] for g in args.groups]
        if len(groups) < 2:
            raise ConfigError("a partition needs at least two groups, e.g. `chaos partition hub,nano-0 nano-1`")
        faults.partition(state.nodes, [[state.node(n) for n in g] for g in groups])
        console.print(f"partitioned: {' | '.join(','.join(g) for g in groups)}")
        if for_s:
            time.sleep(for_s)
            faults.heal_partition(state.nodes)
            console.print(f"healed after {for_s:g} s")
        return 0
    if action == "heal-partition":
        faults.heal_partition(state.nodes)
        console.print("every partition removed")
        return 0
    node = state.node(_node(state, args.node))
    if action in ("cut", "heal"):
        network.set_link(node, up=action == "heal")
        console.print(f"{node.node} ({node.address}) {'cut off' if action == 'cut' else 'back on the network'}")
        if action == "cut" and for_s:
            time.sleep(for_s)
            network.set_link(node, up=True)
            console.print(f"healed after {for_s:g} s")
        return 0
    if action == "link":
        return _change_link(state, node.node, _node(state, args.peer), args, for_s)
    if action == "restart-broker":
        _proc, down = faults.restart_broker(state, node.node, down_s=args.down_s, kill=args.kill)
        console.print(f"the broker of {node.node} restarted ({'killed' if args.kill else 'stopped'}; unreachable "
                      f"{down:.1f} s)")
        return 0
    if action == "skew":
        path = clock_file(state.workdir, node.node)
        find_libfaketime()  # raises, naming the package, where the cluster's services could not be skewed
        if not path.exists():
            raise NetnsChaosRefused(f"{node.node}'s services were started without a skewable clock: start the "
                                    f"cluster with `edgeswarm up --netns --skewable {node.node}`")
        set_skew(path, args.seconds)
        console.print(f"{node.node}'s clock is {args.seconds:+g} s off (its processes read it within a second)")
        return 0
    count = faults.signal_node(node, signal.SIGSTOP if action == "pause" else signal.SIGCONT)
    console.print(f"{'paused' if action == 'pause' else 'resumed'} {count} processes of {node.node}")
    if action == "pause" and for_s:
        time.sleep(for_s)
        faults.signal_node(node, signal.SIGCONT)
        console.print(f"resumed after {for_s:g} s")
    return 0


def _change_link(state: NetnsState, node: str, peer: str, args: argparse.Namespace, for_s: float | None) -> int:
    """``chaos link``: only the properties named change, at both ends (the cluster file's rate stays under a
    ``--loss``); ``--for`` puts back exactly the shapes before. 0 done."""
    loss, delay, rate = args.loss, args.delay, args.rate
    if loss is None and delay is None and rate is None:
        raise ConfigError("name what to change: --loss PERCENT, --delay MS and/or --rate MBIT (the rest of the link "
                          "stays as it is)")
    if (loss is not None and not 0 <= loss <= 100) or (delay is not None and not 0 <= delay <= 60_000) or (
            rate is not None and not rate > 0):
        raise ConfigError("--loss is a percentage (0 to 100), --delay a non-negative number of milliseconds (at most "
                          "60000) and --rate a positive number of Mbit/s")
    changes: dict[str, float | None] = {}
    said = []
    if loss is not None:
        changes["loss"] = loss / 100
        said.append(f"loss {loss:g}%")
    if delay is not None:
        changes["delay_s"] = delay / 1000
        said.append(f"delay {delay:g} ms")
    if rate is not None:
        changes["rate_bps"] = rate * 1e6 / 8
        said.append(f"{rate:g} Mbit/s")
    before = faults.change_link(state, node, peer, **changes)
    now = before[node].changed(**changes)
    console.print(f"{node} <-> {peer}: {', '.join(said)} (the link from {node} now: {_shape_text(now)})")
    if for_s:
        time.sleep(for_s)
        faults.restore_link(state, node, peer, before)
        console.print(f"put back after {for_s:g} s")
    return 0


def _shape_text(shape: LinkShape) -> str:
    rate = "unlimited" if shape.rate_bps is None else f"{shape.rate_bps * 8 / 1e6:g} Mbit/s"
    return f"{rate}, delay {shape.delay_s * 1000:g} ms, loss {shape.loss * 100:g}%"
