"""serve-hmp's closed loop on real tensor-shard-workers: a job planned on profiles that one device stops living up to
(its worker is stopped 9 ms of every 10 once the job serves, as a throttled or shared device would be)
fits that device's speed from the ranks' measured arithmetic, re-plans itself between two requests to give it less of
every layer, says so in a ``rebalanced`` event, and answers every request once with the hidden states of the model
computed whole on one device. Stopped, it saves each device's measured speed, and the next job starts from it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from edgeswarm.hmp.client import Answer, ask
from edgeswarm.hmp.spec import HmpProgress
from edgeswarm.messages.jobs import JobEvent
from edgeswarm.models.text import reference
from edgeswarm.models.text.hf import source_config
from edgeswarm.planning.hmp.types import HmpPlan
from edgeswarm.values.text_model import TextModelSource
from edgeswarm.workloads.client import JobFollower, cancel_job, submit_job
from helpers import wait_for_event, wait_for_peers, wait_serving, wait_until

NODES = ("a", "b", "c")
SLOW = "b"
# Two of DistilBERT's layers at 128 tokens: milliseconds of arithmetic per rank and pass on a native device, so what a
# rank measures is its speed rather than the runtime's per-call costs. At 32 tokens a CI run's plan, priced on links
# profiled under load, hid most of b's arithmetic under the syncs' messages: the best plan on b measured 14x slower
# was only 8-10% faster than the running one, under the rebalancer's margin, and the job rightly kept its plan.
# (At 128 tokens beside two busy loops, a profile timed point after point once had dips the planner bought: its best
# plan was priced 57% slower than the running one; hmp.profiling now times a grid's points in turns.)
MODEL = {"preset": "distilbert", "layers": 2, "seed": 3}
SEQ = 128


def _throttle(pid: int, stop: threading.Event, most_s: float) -> None:
    """Stop ``pid`` 9 ms of every 10 ms until ``stop`` is set or ``most_s`` seconds have passed; left running. A run
    window shorter than a rank's arithmetic between two syncs: with 80 ms of every 100, a pass of a few milliseconds
    mostly fitted in the 20 ms the device ran and measured the device as fast as its profile; with 2 ms of every 10,
    a CI run once saw no re-plan in two minutes (the job did not log its fit then, so why is not known)."""
    until = time.monotonic() + most_s
    try:
        while not stop.is_set() and time.monotonic() < until:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.009)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.001)
    except ProcessLookupError:
        return
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


# Alone: the speeds it saves are measured, and another test's load beside it once measured a and c slower than the
# throttled b (the next job then gave b the most heads).
@pytest.mark.alone
def test_a_device_slower_than_its_profile_is_refitted_and_the_job_gives_it_less_of_every_layer(
        broker, make_bus, services, tmp_path: Path) -> None:
    services.start("planner", "hub", broker.url)
    saved = tmp_path / "profiles-hub"
    coordinator = services.start("coordinator", "hub", broker.url, EDGESWARM_REBALANCE="true",
                                 EDGESWARM_PROFILE_DIR=str(saved))
    workers = {}
    for node in NODES:
        services.start("node-agent", node, broker.url)
        services.start("profiler", node, broker.url, EDGESWARM_PROFILE_DIR=str(tmp_path / f"profiles-{node}"))
        workers[node] = services.start("tensor-shard-worker", node, broker.url)
    bus = make_bus("test", "cli")
    wait_for_peers(bus, NODES, ("node-agent", "profiler", "tensor-shard-worker"))
    events: list[JobEvent] = []
    name = "hmp-rebalance"
    follower = JobFollower(bus, name, on_event=events.append)
    spec = {"kind": "serve-hmp", "name": name, "model": MODEL, "mode": "galaxy", "seq_len": SEQ,
            "planner": {"prune": False}}
    submit_job(bus, json.dumps(spec), submission=follower.submission)
    g = torch.Generator().manual_seed(7)
    cfg = source_config(TextModelSource.model_validate(MODEL))
    prompts = [torch.randint(0, cfg.vocab, (SEQ,), generator=g).tolist() for _ in range(4)]
    stop = threading.Event()
    # The bound counts from the throttle's start, not the job's submission: a slow start on a loaded machine must not
    # let b run free while the job still measures it (the saved scale is the last rounds' median).
    throttle = threading.Thread(target=_throttle, args=(workers[SLOW].pid, stop, 300.0), daemon=True)

    def of(kind: str) -> list[str]:
        return [e.detail for e in list(events) if e.kind == kind]

    try:
        first = wait_serving(follower, 180).plan
        assert isinstance(first, HmpPlan) and SLOW in first.devices, first
        throttle.start()
        answers: list[tuple[list[int], Answer]] = []
        deadline = time.monotonic() + 120
        while not of("rebalanced") and time.monotonic() < deadline:  # bounded: about 2 minutes of requests at most
            answers += zip(prompts, ask(bus, name, list(prompts), window=1, timeout_s=60), strict=True)
        moved = of("rebalanced")
        # Every event's kind and only the last few in full: the whole list once filled pytest's message with the
        # same progress events and cut off what said why no re-plan came.
        assert moved, (f"no rebalance within 120 s of throttling {SLOW}: events by kind "
                       f"{dict(Counter(e.kind for e in events))}, the last three "
                       f"{[(e.kind, e.detail[:300]) for e in events[-3:]]}; shares {first.shares}; the first plan's "
                       f"pass {first.model}, its syncs {first.comm}; progress "
                       f"{follower.state.progress}; the coordinator's last words on the fit "
                       f"{[ln for ln in services.log_of(coordinator).splitlines() if 'keeps its plan' in ln][-3:]}")
        assert "compute measured against the profile: " in moved[0] and f"{SLOW} " in moved[0], moved
        assert "faster)" in moved[0], moved
        wait_until(lambda: isinstance(follower.state.plan, HmpPlan) and follower.state.plan.epoch > first.epoch, 10,
                   message="the new plan in the job's state")
        new = follower.state.plan
        assert isinstance(new, HmpPlan)
        i, j = first.devices.index(SLOW), new.devices.index(SLOW) if SLOW in new.devices else None
        assert j is None or (new.shares.heads[j] + new.shares.columns[j] / cfg.ffn * cfg.heads
                             < first.shares.heads[i] + first.shares.columns[i] / cfg.ffn * cfg.heads), (first.shares,
                                                                                                      new.shares)
        # Every request was answered, once, with the single-device hidden states, before and after the move (b still
        # throttled).
        answers += zip(prompts, ask(bus, name, list(prompts), window=1, timeout_s=60), strict=True)
        w = reference.init_weights(cfg, MODEL["seed"])  # type: ignore[arg-type]
        with torch.inference_mode():
            for prompt, answer in answers:
                assert answer.reply is not None and answer.hidden is not None, (answer.reason, answer.error)
                torch.testing.assert_close(answer.hidden, reference.forward(cfg, w, torch.tensor(prompt)),
                                           rtol=1e-4, atol=1e-4)
        wait_until(lambda: follower.state.progress_as(HmpProgress).answered == len(answers), 10,
                   message="every request counted once")
        assert follower.state.progress_as(HmpProgress).refitted_latency_s is not None
    finally:
        cancel_job(bus, name)
        follower.wait(60)
        stop.set()
        throttle.join(5)
    # Stopped, it saved each device's measured speed under the served model (b's several times its profile); the
    # next job on the same model starts from it.
    wait_for_event(events, "refit", "saved the measured speeds for the next job: ")
    files = {p.name: json.loads(p.read_text())["profile"] for p in saved.glob("refits/hmp-*/*.json")}
    # Above 1.5 rather than near 5: after the move b holds a sliver of each layer, which now and then runs whole in
    # the 2 ms b is let run, and the saved scale is the median of the last rounds.
    assert files[f"{SLOW}.serve.json"]["scale"] > 1.5, files
    events.clear()
    nxt = JobFollower(bus, "hmp-next", on_event=events.append)
    submit_job(bus, json.dumps({**spec, "name": "hmp-next"}), submission=nxt.submission)
    try:
        plan = wait_serving(nxt, 180, message="the next job serving").plan
        assert any(d.startswith("starts from the speeds earlier jobs measured: ") and f"{SLOW} " in d
                   for d in of("refit")), [(e.kind, e.detail) for e in events]
        assert isinstance(plan, HmpPlan) and SLOW in plan.devices
        i = plan.devices.index(SLOW)
        assert plan.shares.heads[i] < max(plan.shares.heads), (plan.shares, files)  # planned on b's measured speed
    finally:
        cancel_job(bus, "hmp-next")
        nxt.wait(60)
