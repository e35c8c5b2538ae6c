"""Flower's FedAvg on our federated job: the ServerApp and ClientApp that ``splitfed.peers`` deploys on a real
SuperLink and one SuperNode a device (Flower's deployment engine, not its simulation), in an environment with
``flwr`` installed (``edgeswarm[peers]``). Imported only there: the rest of edgeswarm never imports flwr.

Flower does the federating: its ``FedAvg`` strategy picks the clients, sends the global model, waits for their
replies and averages them, weighted by the samples each reports. What a client does with the model is ours, so the
math can be cross-checked: the job's ``RoundSetup`` (the model, data, partition and local training our ``fedavg``
mode trains with), the device's partition by its SuperNode's ``partition-id``, the same batches in the same order
(``compute.run_epochs``) and the same optimizer, computing as its device class (``device-class``), as our
stage-workers do. The server starts from the same initial weights (the job's seed) and scores every round's model on
the same held-out split, as our coordinator does.

The run's configuration is a ``FlowerJob`` in a JSON file named by the run config's ``job``; the ServerApp writes a
``FlowerResult`` (both in ``splitfed.peers``) to the job's ``out`` when it ends (with ``error`` when it failed).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from edgeswarm.extras import missing_extra

try:
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
except ModuleNotFoundError:  # flwr is the `peers` extra
    raise missing_extra("peers") from None

from edgeswarm.evaluation import held_out
from edgeswarm.models.zoo import build_model
from edgeswarm.runtime.program import ComputeGate
from edgeswarm.splitfed.compute import DevicePart, Reassembly, partition_of, run_epochs
from edgeswarm.splitfed.peers import FlowerJob, FlowerResult
from edgeswarm.splitfed.weights import flatten
from edgeswarm.workloads.peers import rank_device

SERVER_CLASS = "edge-server"  # where the SuperLink (and its ServerApp) runs: the cluster's edge server


def _job(context: Context) -> FlowerJob:
    return FlowerJob.model_validate_json(Path(str(context.run_config["job"])).read_text())


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    """One round on this SuperNode's partition: the global model in, E local epochs as our fedavg device trains
    them, the trained model and the round's figures out (``num-examples`` weighs the average)."""
    job = _job(context)
    index = int(context.node_config["partition-id"])
    device, compute = rank_device(job.classes[index], collectives=False)
    part = DevicePart(job.setup, 1, compute=compute, gate=ComputeGate(), run=device.run)
    part.load(flatten(msg.content["arrays"].to_torch_state_dict(), part.layout))
    round_index = int(msg.content["config"]["server-round"]) - 1  # Flower counts from 1, our rounds from 0
    data = part.partition_data(index)
    started = time.monotonic()
    done = run_epochs(part, data, index, round_index, lambda _step, x, y, _last: part.local_step(x, y))
    train_s = time.monotonic() - started
    trained = Reassembly(job.setup, compute=compute).full_state(part.cut, part.flat(), {})
    metrics = MetricRecord({"num-examples": data.size, "loss": done.loss_sum / max(done.seen, 1),
                            "peak-bytes": part.peak_bytes, "train-s": train_s,
                            "rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    return Message(content=RecordDict({"arrays": ArrayRecord.from_torch_state_dict(trained), "metrics": metrics}),
                   reply_to=msg)


def _peaks(records: list[RecordDict], _weighting: str) -> MetricRecord:
    """A round's client figures: the largest memory peaks and training time (the slowest client's), not a
    weighted mean."""
    figures = [next(iter(r.metric_records.values())) for r in records]
    return MetricRecord({"peak-bytes": max(int(f["peak-bytes"]) for f in figures),
                         "rss-bytes": max(int(f["rss-bytes"]) for f in figures),
                         "train-s": max(float(f["train-s"]) for f in figures)})


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    """The job's rounds with Flower's FedAvg, every SuperNode training every round, the global model scored on the
    held-out split after each; the FlowerResult written to the job's ``out`` whatever happens."""
    job = _job(context)
    result = FlowerResult()
    try:
        _, compute = rank_device(SERVER_CLASS, collectives=False)
        torch.manual_seed(job.seed)  # the initial weights our coordinator starts from
        model = build_model(job.setup.model).to(compute)
        dataset, _ = partition_of(job.setup)
        marks: list[tuple[float, float]] = []  # (entered, left) each evaluation

        def evaluate(_round: int, arrays: ArrayRecord) -> MetricRecord:
            entered = time.monotonic()
            model.load_state_dict(arrays.to_torch_state_dict())
            accuracy, loss = held_out(model, dataset, batch_size=256)
            marks.append((entered, time.monotonic()))
            return MetricRecord({"accuracy": accuracy, "loss": loss})

        n = len(job.classes)
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n,
                          train_metrics_aggr_fn=_peaks)
        run = strategy.start(grid=grid, initial_arrays=ArrayRecord.from_torch_state_dict(model.state_dict()),
                             num_rounds=job.rounds, evaluate_fn=evaluate)
        scores = [run.evaluate_metrics_serverapp[r] for r in range(1, job.rounds + 1)
                  if r in run.evaluate_metrics_serverapp]
        peaks = list(run.train_metrics_clientapp.values())
        result = FlowerResult(
            accuracies=[float(s["accuracy"]) for s in scores], losses=[float(s["loss"]) for s in scores],
            round_s=[marks[i][0] - marks[i - 1][1] for i in range(1, len(marks))],
            train_s=[float(p["train-s"]) for p in peaks],
            peak_bytes=max((int(p["peak-bytes"]) for p in peaks), default=0),
            rss_bytes=max((int(p["rss-bytes"]) for p in peaks), default=0))
    except Exception as exc:  # noqa: BLE001 - the bench reads why from the result file, not the SuperLink's log
        result = result.model_copy(update={"error": f"{type(exc).__name__}: {exc}"[:2000]})
        raise
    finally:
        # Whole or not at all: the bench reads the file as soon as it appears.
        part = job.out.with_suffix(".part")
        part.write_text(result.model_dump_json())
        part.replace(job.out)
