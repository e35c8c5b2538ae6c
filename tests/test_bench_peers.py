"""``edgeswarm bench peers``: our kinds beside the tools their users would pick instead.

First the peers alone, over gloo on loopback: torch's tensor parallelism (``hmp.peer_tp``, two ranks): its plain
module equals the single-device forward, split by torch it still does (within 1e-5), its greedy tokens are the single
device's, and a model whose KV heads do not divide over the ranks is refused with the reason, as torch's even split
must; torch's pipelining (``hpp.peer_pipeline``, three stages at our cut points): its first round's gradients are the
single device's; the Flower section's rows compare like with like, and it names the environment it lacks. Then,
where namespaces can run (root), the command as a user runs it with ``--quick``: every section's rows have figures
on both sides and every cross-check holds (Flower's with the environment `make test` makes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from edgeswarm.errors import EdgeswarmError
from edgeswarm.hmp.peer_model import PlainDecoder
from edgeswarm.hmp.peer_tp import PeerResult
from edgeswarm.local.broker import free_port
from edgeswarm.models.text import reference
from edgeswarm.splitfed.peers import SMARTSPLIT_BUDGET, Side, cell_rows, flower_env, missing_flower_commands, same_math
from edgeswarm.values.text_model import PRESETS
from helpers import netns_unavailable

PROMPT = [5, 17, 250, 3, 99, 64, 1, 400]


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "qwen3-tiny"])
def test_the_plain_module_is_the_single_device_forward(preset: str) -> None:
    cfg = PRESETS[preset]
    w = reference.init_weights(cfg, 0)
    model = PlainDecoder(cfg, w)
    with torch.inference_mode():
        caches = model.new_caches()
        hidden = model(torch.tensor(PROMPT), caches)
        torch.testing.assert_close(hidden, reference.forward(cfg, w, torch.tensor(PROMPT)), rtol=0, atol=0)
        torch.testing.assert_close(model.logits(hidden), reference.logits(w, hidden), rtol=0, atol=0)
        step = model(torch.tensor([7]), caches)  # from the KV cache
        whole = reference.forward(cfg, w, torch.tensor([*PROMPT, 7]))[-1:]
        torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)


def _run_ranks(folder: Path, world: int, argv: list[str], rank_argv: Callable[[int], list[str]] = lambda _r: []
               ) -> tuple[list[int], str]:
    """``world`` ranks of ``python -m`` ``argv`` + ``--rank r`` + ``rank_argv(r)``, each stopped by its PID within
    120 s: their exit codes, and what they wrote to stderr (for a failing assertion's message)."""
    folder.mkdir(parents=True, exist_ok=True)
    logs = [folder / f"rank{r}.log" for r in range(world)]
    procs = []
    for r, log_path in enumerate(logs):
        with open(log_path, "wb") as err:
            procs.append(subprocess.Popen([sys.executable, "-m", *argv, "--rank", str(r), *rank_argv(r)],
                                          stdout=subprocess.DEVNULL, stderr=err))
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return codes, "\n".join(f"rank {r}: {log.read_text(errors='replace')[-2000:]}" for r, log in enumerate(logs))


def _ranks(tmp_path: Path, world: int, preset: str, cls: str = "native") -> tuple[list[int], PeerResult, str]:
    """``world`` tensor-parallel ranks: their exit codes, rank 0's result and what they wrote to stderr."""
    folder = tmp_path / f"tp-{world}"  # each run its own: never an earlier run's result
    out = folder / "result.json"
    codes, said = _run_ranks(folder, world, [
        "edgeswarm.hmp.peer_tp", "--world", str(world), "--master", f"127.0.0.1:{free_port()}", "--preset", preset,
        "--prompt", ",".join(map(str, PROMPT)), "--new-tokens", "4", "--repeats", "1", "--device-class", cls,
        "--out", str(out)])
    assert out.exists(), f"exit codes {codes}, no result: {said}"
    return codes, PeerResult.model_validate_json(out.read_text()), said


def test_the_torch_tensor_parallel_peer_equals_one_device_and_says_when_torch_cannot_split(tmp_path: Path) -> None:
    codes, result, said = _ranks(tmp_path, 2, "llama-tiny", "jetson-nano-l")
    assert codes == [0, 0], f"{result.error}\n{said}"
    assert result.max_difference is not None and result.scale is not None
    assert result.max_difference <= 1e-5 * max(1.0, result.scale), result
    cfg = PRESETS["llama-tiny"]
    assert result.tokens == result.reference_tokens == reference.generate(cfg, reference.init_weights(cfg, 0),
                                                                          PROMPT, 4)
    assert result.ttft_s is not None and result.tpot_s is not None and result.ttft_s > 0 < result.tpot_s
    # llama-tiny has 2 KV heads: torch cannot split them evenly over 3 ranks, and the peer says so.
    codes, refused, _ = _ranks(tmp_path, 3, "llama-tiny")
    assert codes[0] == 1 and refused.ttft_s is None
    assert "2 KV heads" in refused.error and "do not divide over 3 devices" in refused.error, refused.error


@pytest.mark.parametrize(("cuts", "replicas"), [((3, 7), 1), ((5,), 2)], ids=["3-stages", "2-stages-x-2-ddp"])
def test_the_torch_pipeline_peers_first_round_has_the_single_devices_gradients(tmp_path: Path, cuts: tuple[int, ...],
                                                                              replicas: int) -> None:
    """LeNet-5 in stages at our cut points, GPipe over four micro-batches (and, with replicas, two such pipelines on
    halves of the batch, each stage's replicas averaging with DDP): every stage's gradients after the first round
    equal the whole model's on one device over the same micro-batches; the rounds are timed."""
    from edgeswarm.hpp.peer_pipeline import PipelineResult
    from edgeswarm.models.zoo import unit_count
    from edgeswarm.values.profiles import ModelSpec

    model = ModelSpec(name="lenet5", config={})
    units = unit_count(model)
    out = tmp_path / "pipeline.json"
    world = (len(cuts) + 1) * replicas
    bounds = ",".join(map(str, (0, *cuts, units)))
    codes, said = _run_ranks(tmp_path / "ranks", world, [
        "edgeswarm.hpp.peer_pipeline", "--world", str(world), "--master", f"127.0.0.1:{free_port()}", "--model",
        model.model_dump_json(), "--data", '{"kind": "teacher", "size": 64, "test_size": 16}', "--bounds", bounds,
        "--global-batch", "16", "--micro-batches", "4", "--rounds", "2", "--replicas", str(replicas), "--out",
        str(out)], lambda r: ["--device-class", "jetson-nano" if r == 1 else "native"])
    assert out.exists(), f"exit codes {codes}, no result: {said}"
    result = PipelineResult.model_validate_json(out.read_text())
    assert codes == [0] * world, result.error
    assert result.max_difference is not None and result.scale is not None and result.scale > 0
    assert result.max_difference <= 1e-5 * max(1.0, result.scale), result
    assert len(result.round_s) == 2 and result.samples_per_s is not None and result.samples_per_s > 0


def test_bench_peers_says_in_a_line_what_a_machine_without_namespaces_lacks(tmp_path: Path) -> None:
    bare = {**os.environ, "PATH": str(Path(sys.executable).parent), "COLUMNS": "200"}  # no ip, tc, nft, mosquitto
    done = subprocess.run([sys.executable, "-m", "edgeswarm", "bench", "peers", "--sections", "tp,pipeline"],
                          capture_output=True, text=True, timeout=120, env=bare)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "tp: cannot start a namespace cluster" in done.stderr and "not found on PATH" in done.stderr, done.stderr
    unknown = subprocess.run([sys.executable, "-m", "edgeswarm", "bench", "peers", "--sections", "nosuch"],
                             capture_output=True, text=True, timeout=120, env=bare)
    assert unknown.returncode != 0 and "nosuch is not a section" in unknown.stderr, unknown.stderr
    assert "flower" in unknown.stderr, unknown.stderr


def _flower_env() -> str:
    """Where Flower is installed for these tests (`make test` makes .venv-peers and names it), or "". (Only its
    commands are looked for: the bench itself checks that the environment loads our Flower apps, and a broken one
    fails the test there.)"""
    configured = os.environ.get("EDGESWARM_FLOWER_ENV", "")
    return configured if configured and not missing_flower_commands(Path(configured)) else ""


def test_the_flower_section_names_the_environment_it_lacks(tmp_path: Path) -> None:
    with pytest.raises(EdgeswarmError, match=r"Flower is not installed in .*make peers-venv.*EDGESWARM_FLOWER_ENV"):
        flower_env(str(tmp_path / "no-venv"))


def test_the_flower_rows_compare_like_with_like() -> None:
    """Our FedAvg and Flower's on the same curve hold the cross-check; a first round's loss off by 1e-3, or a curve
    3 points off, does not; SmartSplit's time to Flower's final accuracy counts its rounds until it first gets there,
    and says when it never does."""
    ours = Side(accuracies=[0.5, 0.8, 0.9], losses=[1.5, 0.7, 0.4], round_s=[1.0, 1.0, 2.0], peak_bytes=2_600_000,
                link_bytes=500_000.0)
    flower = ours.model_copy(update={"losses": [1.5, 0.7, 0.4 * (1 + 1e-6)], "round_s": [9.0, 9.0, 9.0],
                                     "link_bytes": 550_000.0})
    smartsplit = Side(accuracies=[0.6, 0.9, 0.95], losses=[1.0, 0.5, 0.3], round_s=[3.0, 3.0, 3.0],
                      peak_bytes=700_000)
    rows = {r.metric: r for r in cell_rows("cell", ours, smartsplit, flower)}
    assert all(r.checked for r in rows.values())
    assert rows["time per round"].advantage == pytest.approx(9.0 / (4.0 / 3))
    assert rows["bytes per device per round"].advantage == pytest.approx(1.1)
    reach = rows["time to Flower FedAvg's final accuracy"]
    assert (reach.ours_value, reach.peer_value) == (6.0, 27.0) and not reach.error
    assert rows["device training-memory peak"].advantage == pytest.approx(2_600_000 / 700_000)
    assert same_math(ours, flower.model_copy(update={"losses": [1.5 * (1 + 1e-3), 0.7, 0.4]}))[0] is False
    assert same_math(ours, flower.model_copy(update={"accuracies": [0.5, 0.8, 0.87]}))[0] is False
    assert "accuracy equal in 3 of 3 rounds" in rows["time per round"].check
    slow = smartsplit.model_copy(update={"accuracies": [0.6, 0.7, 0.8]})
    never = {r.metric: r for r in cell_rows("cell", ours, slow, flower)}["time to Flower FedAvg's final accuracy"]
    assert never.ours_value is None and "did not reach Flower's final accuracy 90.0%" in never.error


@pytest.mark.slow
@pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")
def test_bench_peers_quick_has_figures_on_both_sides_and_every_cross_check_holds(tmp_path: Path) -> None:
    """Every section (Flower's where `make test` installed it): figures on both sides, cross-checks held; our FedAvg
    and Flower's trained the same model, and SmartSplit's devices stayed within their budget."""
    out = tmp_path / "peers.json"
    flower = _flower_env()
    done = subprocess.run([sys.executable, "-m", "edgeswarm", "bench", "peers", "--quick", "--requests", "1",
                           "--json", str(out), "--flower-env", flower], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    if flower:
        assert not report["problems"], report["problems"]
    else:  # pytest run by hand, without .venv-peers: the section says how to get it
        assert [p.split(":")[0] for p in report["problems"]] == ["flower"], report["problems"]
        assert "make peers-venv" in report["problems"][0]
    sections = {r["section"] for r in report["rows"]}
    assert {"tp", "pipeline", "transport"} | ({"flower"} if flower else set()) == sections, sections
    for row in report["rows"]:
        assert row["ours_value"] and row["peer_value"] and not row["error"], row
        assert row["checked"] is True and row["advantage"] > 0, row
    tp = [r for r in report["rows"] if r["section"] == "tp"]
    assert {r["metric"] for r in tp} == {"time to first token", "time per output token"}
    assert "tokens equal" in tp[0]["check"], tp[0]["check"]
    assert "time to first token" in done.stdout and "torch TP" in done.stdout, done.stdout
    if flower:
        fl = {r["metric"]: r for r in report["rows"] if r["section"] == "flower"}
        assert "round 1's held-out loss within" in fl["time per round"]["check"], fl["time per round"]["check"]
        assert fl["device training-memory peak"]["ours_value"] <= SMARTSPLIT_BUDGET < \
            fl["device training-memory peak"]["peer_value"]
        assert "Flower FedAvg" in done.stdout
