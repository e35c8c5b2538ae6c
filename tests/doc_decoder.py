"""An independent decoder for edgeswarm's wire format, written from ``docs/wire-format.md`` alone.

It deliberately does not import ``edgeswarm``: its purpose is to prove that the document is enough to
read every message edgeswarm puts on a broker. Section numbers in comments refer to that document.

Entry points:

* :func:`decode` turns one MQTT payload into a :class:`Frame`, or a :class:`Cleared` for a zero-length
  payload (a retained-topic clear, which carries no message). Anything the document says to reject
  raises :class:`DocDecodeError`.
* :class:`Reassembler` collects the chunk frames of tensors (any order, duplicates) and returns a
  :class:`Tensor` when one is complete.
* :func:`tensor_array` / :func:`bfloat16_to_float32` turn tensor bytes into numpy arrays.
* :func:`schemas_for_topic` says which schemas the document places on a topic.
"""

from __future__ import annotations

import math
import re
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "DTYPES", "DocDecodeError", "Cleared", "Frame", "TensorDescriptor", "Tensor", "Reassembler",
    "decode", "decode_header", "tensor_array", "bfloat16_to_float32", "schemas_for_topic", "writer_of", "SCHEMAS",
]


class DocDecodeError(ValueError):
    """A payload that docs/wire-format.md says a decoder must reject."""


# --------------------------------------------------------------------------------------------------
# Section 1: the frame
# --------------------------------------------------------------------------------------------------

MAGIC = b"ES"
FRAME_VERSION = 1
PREFIX_SIZE = 8
MAX_HEADER = 16 * 1024 * 1024  # section 1: at most 16777216
DEFAULT_MAX_TENSOR_BYTES = 2 * 1024 ** 3  # EDGESWARM_MAX_TENSOR_BYTES default, 2 GiB
DEFAULT_REASSEMBLY_TIMEOUT_S = 30.0  # EDGESWARM_REASSEMBLY_TIMEOUT_S default

# --------------------------------------------------------------------------------------------------
# Section 3: the envelope
# --------------------------------------------------------------------------------------------------

ENVELOPE_KEYS = ("msg_id", "schema_name", "schema_version", "sender_node", "sender_service",
                 "sender_instance", "sent_at", "expires_at", "correlation_id", "reply_to")
_MSG_ID = re.compile(r"[0-9a-f]{32}")
_IDENT = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# --------------------------------------------------------------------------------------------------
# Section 4: tensors
# --------------------------------------------------------------------------------------------------

TENSOR_KEYS = ("dtype", "shape", "nbytes", "chunk_size", "chunk", "n_chunks", "crc32")
MAX_DIMS = 32

#: dtype name -> (item size, little-endian numpy dtype used to read the bytes)
DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (4, np.dtype("<f4")),
    "float16": (2, np.dtype("<f2")),
    "bfloat16": (2, np.dtype("<u2")),  # the upper 16 bits of a binary32, as an unsigned 16-bit integer
    "int64": (8, np.dtype("<i8")),
    "int32": (4, np.dtype("<i4")),
    "uint8": (1, np.dtype("u1")),
    "bool": (1, np.dtype("u1")),  # read as bytes, checked to be 0x00/0x01, then viewed as bool
}


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cleared:
    """A zero-length payload: MQTT's way of clearing a retained topic. It carries no message."""

    kind: str = "clear"


@dataclass(frozen=True)
class TensorDescriptor:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunk_size: int
    chunk: int
    n_chunks: int
    crc32: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def chunk_start(self) -> int:
        return self.chunk * self.chunk_size

    @property
    def chunk_end(self) -> int:
        return min(self.nbytes, (self.chunk + 1) * self.chunk_size)

    def transfer_key(self) -> tuple[str, tuple[int, ...], int, int, int]:
        """The fields every chunk of one tensor shares."""
        return (self.dtype, self.shape, self.nbytes, self.chunk_size, self.n_chunks)


@dataclass
class Frame:
    """One decoded frame."""

    frame_version: int
    flags: int
    header_length: int
    envelope: dict[str, Any]
    body: dict[str, Any]
    tensor: TensorDescriptor | None
    data: bytes  # the body bytes: one chunk of tensor data, or b"" for a control frame
    size: int  # total payload length

    kind: str = "frame"

    @property
    def schema_name(self) -> str:
        return self.envelope["schema_name"]

    @property
    def schema_version(self) -> int:
        return self.envelope["schema_version"]

    def expired(self, now: float | None = None) -> bool:
        expires_at = self.envelope["expires_at"]
        return expires_at is not None and (time.time() if now is None else now) > expires_at

    def array(self) -> np.ndarray:
        """The tensor of a single-chunk frame, read in place (section 4: n_chunks = 1)."""
        if self.tensor is None:
            raise DocDecodeError("frame carries no tensor")
        if self.tensor.n_chunks != 1:
            raise DocDecodeError(f"frame is chunk {self.tensor.chunk} of {self.tensor.n_chunks}; reassemble it")
        return tensor_array(self.tensor.dtype, self.tensor.shape, self.data)


@dataclass
class Tensor:
    """A reassembled tensor with the envelope and body its chunks carried."""

    envelope: dict[str, Any]
    body: dict[str, Any]
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    data: bytes

    def array(self) -> np.ndarray:
        return tensor_array(self.dtype, self.shape, self.data)

    def float32(self) -> np.ndarray:
        """bfloat16 tensors as float32 values; other dtypes unchanged."""
        arr = self.array()
        return bfloat16_to_float32(arr) if self.dtype == "bfloat16" else arr


# --------------------------------------------------------------------------------------------------
# Section 5: schemas, as small type specs
# --------------------------------------------------------------------------------------------------
#
# A spec is one of: "str", "int", "number", "bool", "bin", "scalar" (str, int, number or bool), a spec
# followed by "?" (nil allowed), ("optional", spec) (nil or spec),
# ("list", spec), ("map", value_spec) (string keys), ("record", {field: spec}), ("enum", {values}),
# ("bin_max", n), ("tagged", field, {value: {field: spec}}) (a record whose ``field`` picks its fields), and as a
# record's field ("by_field", sibling, {value: spec}, default_spec) (the record's ``sibling`` field picks the spec).

_IDS = {"node": "str", "service": "str", "instance": "str"}

_SERVICE_VIEW = ("record", {
    "service": "str", "instance": "str", "state": "str", "version": "str", "host": "str", "pid": "int",
    "data_url": "str", "heartbeat_age_s": "number?", "started_at": "number", "reason": "str?",
})
_NODE_VIEW = ("record", {
    "node": "str", "state": ("enum", {"online", "suspect", "offline"}), "device_class": "str",
    "memory_budget_bytes": "int", "free_memory_bytes": "int", "compute": "str", "conflicts": ("list", "str"),
    "services": ("list", _SERVICE_VIEW), "reserved_memory_bytes": "int",
})

_MODEL_SPEC = ("record", {"name": "str", "config": ("map", "scalar")})
_UNIT = ("record", {
    "index": "int", "name": "str", "ops": "str", "output_bytes_per_sample": "int", "weight_bytes": "int",
    "buffer_bytes": "int", "activation_bytes_fixed": "int", "activation_bytes_per_sample": "int",
    "flops_per_sample": "number",
})
_MODEL_PROFILE = ("record", {
    "model": _MODEL_SPEC, "fingerprint": "str", "input_bytes_per_sample": "int", "units": ("list", _UNIT),
})
_DEVICE = ("record", {
    "node": "str", "device_class": "str", "fingerprint": "str", "memory_budget_bytes": "int",
    "compute_flops": "number",
})
_COMPUTE = ("record", {
    "model_fingerprint": "str", "device_fingerprint": "str", "batch_sizes": ("list", "int"),
    "forward_s": ("list", ("list", "number")), "backward_s": ("list", ("list", "number")),
    "inference_s": ("optional", ("list", ("list", "number"))), "method": ("enum", {"measured", "calibrated"}),
    "speed_ratio": "number", "compute": "str", "cold_forward_s": "number", "cold_backward_s": "number",
    "cold_inference_s": "number",
    "chain": ("optional", ("list", ("record", {"whole": ("list", "number"), "half": ("list", "number")}))),
})
_LINK = ("record", {"src": "str", "dst": "str", "bandwidth_bps": "number", "latency_s": "number",
                    "message_s": "number", "request_s": "number", "hop_s": "number"})
_CLUSTER = ("record", {
    "model": _MODEL_PROFILE, "devices": ("list", ("record", {"device": _DEVICE, "compute": _COMPUTE})),
    "links": ("list", _LINK),
})
_STRATEGY = ("enum", {"hpp", "dp", "pp", "single"})
_OPTIMIZER = ("enum", {"sgd", "momentum", "adam"})
_STAGE = ("record", {
    "index": "int", "start": "int", "end": "int", "devices": ("list", "str"), "shares": ("list", "int"),
    "warmup": "int", "forward_s": "number", "backward_s": "number", "allreduce_s": "number",
    "memory_bytes": ("list", "int"), "memory_budget_bytes": ("list", "int"),
})
_COMM_STEP = ("record", {
    "after": "int", "bytes_per_microbatch": "int", "bandwidth_bps": "number", "messages": "int", "forward_s": "number",
    "backward_s": "number",
})
_TRAIN_PLAN = {
    "workload": ("enum", {"train"}), "strategy": _STRATEGY, "model_fingerprint": "str", "units": "int",
    "options": ("record", {"micro_batch_size": "int", "micro_batches": "int", "optimizer": _OPTIMIZER}),
    "stages": ("list", _STAGE), "comm_steps": ("list", _COMM_STEP), "dominant_step": "int",
    "round_latency_s": "number", "round_overhead_s": "number", "throughput_sps": "number", "epoch": "int",
}
_PLAN = ("record", _TRAIN_PLAN)
_SERVE_OPTIONS = ("record", {
    "micro_batch_size": "int", "max_stages": "int?", "method": ("enum", {"auto", "kpath", "greedy", "optimal"}),
    "exclude": ("list", "str"), "seed": "int",
})
_SERVE_PLAN_FIELDS = {
    "workload": ("enum", {"serve-pipeline"}), "model_fingerprint": "str", "micro_batch_size": "int",
    "stages": ("list", ("record", {
        "index": "int", "start": "int", "end": "int", "device": "str", "compute_s": "number",
        "transfer_in_s": "number", "input_bytes": "int", "memory_bytes": "int", "memory_budget_bytes": "int"})),
    "bottleneck_s": "number", "throughput_per_s": "number", "latency_s": "number", "method": "str", "epoch": "int",
    "bottleneck": "str", "units": "int",
}
# The tensor-parallel planner's records (section 5, "Planner schemas": HMP cluster ... HMP comparison).
_TEXT_DTYPE = ("enum", {"float32", "bfloat16", "float16"})
_HMP_MODES = {"galaxy", "megatron", "sp", "local"}
_TEXT_MODEL_CONFIG = ("record", {
    "family": ("enum", {"bert", "gpt2", "opt", "llama"}), "layers": "int", "hidden": "int", "heads": "int",
    "kv_heads": "int", "ffn": "int", "vocab": "int", "max_positions": "int", "type_vocab": "int",
    "norm_eps": "number", "activation": ("enum", {"gelu", "gelu_tanh", "relu", "silu"}), "bias": "bool",
    "position_offset": "int", "rope_theta": "number", "tie_embeddings": "bool", "dtype": _TEXT_DTYPE,
    "rope_scaling": ("optional", ("record", {"kind": ("enum", {"llama3"}), "factor": "number",
                                             "low_freq_factor": "number", "high_freq_factor": "number",
                                             "original_max_positions": "int"})),
    "head_size": "int", "qkv_bias": "bool", "qk_norm": "bool",
    "quantization": ("optional", ("enum", {"q8_0", "q4_0"})), "embed_quantization": ("optional", ("enum", {
        "q8_0", "q4_0"})), "head_quantization": ("optional", ("enum", {"q8_0", "q4_0"})),
    "rope_factors": ("optional", ("list", "number")),
})
_BLOCK_PROFILE = ("record", {
    "node": "str", "device_class": "str", "memory_budget_bytes": "int", "seq_len": "int",
    "heads": ("list", "int"), "mha_s": ("list", "number"), "columns": ("list", "int"), "mlp_s": ("list", "number"),
    "rows": ("list", "int"), "con_s": ("list", "number"), "mha_decode_s": ("list", "number"),
    "mlp_decode_s": ("list", "number"), "mha_phases_s": ("list", "number"),
    "mha_decode_phases_s": ("list", "number"), "head_s": "number", "embed_s": "number", "compute": "str",
    "method": ("enum", {"measured", "synthetic"}),
})
_HMP_CLUSTER = ("record", {
    "model": _TEXT_MODEL_CONFIG, "model_name": "str", "seq_len": "int", "devices": ("list", _BLOCK_PROFILE),
    "links": ("list", _LINK),
})
_HMP_OPTIONS = ("record", {
    "mode": ("enum", _HMP_MODES | {"auto"}), "exclude": ("list", "str"), "overlap": "bool",
    "shift": ("enum", {"paper", "water"}), "paper": "bool", "prune": "bool", "max_tokens": "int",
    "decode_cache": "int", "margin_bytes": "int", "direct_syncs": "bool", "new_tokens": "int",
})
_HMP_SHARES = ("record", {
    "mode": ("enum", _HMP_MODES), "devices": ("list", "str"), "heads": ("list", "int"),
    "columns": ("list", "int"), "overlap": "bool", "direct_syncs": "bool",
})
_LATENCY_SPLIT = ("record", {"total_s": "number", "compute_s": "number", "comm_s": "number", "exposed_s": "number"})
_HMP_PLAN_FIELDS = {
    "workload": ("enum", {"serve-hmp"}), "model_name": "str", "seq_len": "int", "shares": _HMP_SHARES,
    "rows": ("list", "int"), "capacity": ("list", "number"), "memory_bytes": ("list", "int"),
    "memory_budget_bytes": ("list", "int"), "layer": _LATENCY_SPLIT, "model": _LATENCY_SPLIT,
    "comm": ("record", {"messages": "int", "bytes": "int", "broker_hops": "int", "tau_s": "number",
                        "message_s": "number"}),
    "decode": ("optional", ("record", {"cache_tokens": "int", "per_token_s": "number", "network_s": "number",
                                       "network_share": "number"})),
    "logits_s": "number", "shift": ("enum", {"paper", "water"}), "paper": "bool", "left_out": ("list", "str"),
    "epoch": "int",
}
_HMP_PLAN = ("record", _HMP_PLAN_FIELDS)
_HMP_COMPARISON = ("record", {
    "verdicts": ("list", ("record", {"mode": ("enum", _HMP_MODES), "plan": ("optional", _HMP_PLAN),
                                     "reason": "str"})),
})
# Section 5, "Tensor-parallel serving schemas": the text model source.
_TEXT_MODEL_SOURCE = ("record", {"preset": "str?", "path": "str?", "layers": "int?", "dtype": ("optional", _TEXT_DTYPE),
                                 "seed": "int"})

_LAYER_SPLIT = ("record", {"compute_ms": "number", "sync_ms": "number", "waiting_ms": "number"})

# Section 5, "Split federated learning schemas": the planner's records, the round setup, the device report.
_SPLIT_SOLVER = ("enum", {"bo", "exhaustive", "global"})
_MODEL_COST = ("record", {
    "name": "str", "batch_size": "int", "optimizer_states": "int", "classes": "int",
    "units": ("list", ("record", {"name": "str", "flops_fwd": "number", "flops_bwd": "number", "out_bytes": "int",
                                  "param_bytes": "int", "act_bytes": "int", "backward_bytes": "int",
                                  "expensive": "bool"})),
})
_SPLIT_DEVICE = ("record", {
    "node": "str", "mec": "str", "speed_flops": "number", "link_bytes_s": "number", "link_message_s": "number",
    "budget_bytes": "int", "samples": "int", "dis": "number", "stat": "number", "available": "bool",
    "setup_s": "number", "unit_share": ("list", "number"),
})
_SPLIT_MEC = ("record", {"node": "str", "speed_flops": "number", "unit_share": ("list", "number")})
_SPLIT_OPTIONS = ("record", {
    "participants": "int", "gamma": "number", "lam": "number", "normalise": "bool", "tail": "int", "epochs": "int",
    "d_threshold": "int", "overhead_bytes": "int", "latency_model": ("enum", {"usplit", "vanilla", "paper"}),
    "solver": _SPLIT_SOLVER, "bo_budget": "int", "bo_init": "int", "seed": "int", "fixed_cut": "int?",
    "local_only": "bool", "previous_best": ("optional", ("list", "int")), "n_min": "int?", "n_max": "int?",
    "comm_buffers": "bool", "plan_with_recompute": "bool",
})
_SPLIT_SELECTION_FIELDS = {
    "selected": ("list", ("record", {"node": "str", "mec": "str", "cut": "int", "round_s": "number",
                                     "memory_bytes": "int", "compute_s": "number", "transfer_s": "number",
                                     "mec_s": "number"})),
    "objective": "number", "t_system_s": "number", "target_cut": "int", "count": "int", "evaluations": "int",
    "solver": _SPLIT_SOLVER, "infeasible": ("list", "str"),
}
_ROUND_SETUP = ("record", {
    "model": _MODEL_SPEC,
    "dataset": ("record", {"kind": ("enum", {"teacher", "tokens", "cifar10", "npz", "digits"}), "path": "str?",
                           "size": "int?", "test_size": "int?", "seed": "int", "noise": "number",
                           "teacher_grid": "int?"}),
    "partition": ("record", {"kind": ("enum", {"iid", "dirichlet", "label-skew"}), "devices": "int",
                             "alpha": "number?", "classes_per_device": "int?", "seed": "int"}),
    "training": ("record", {
        "mode": ("enum", {"usplit", "vanilla", "local"}), "tail": "int", "epochs": "int", "batch_size": "int",
        "lr": "number", "momentum": "number", "weight_decay": "number", "sample_pruning": "bool",
        "prune_percentile": "number", "prune_ratio": "number", "recompute": ("enum", {"adaptive", "always", "off"}),
        "theta": ("enum", {"peak", "budget"})}),
})
_DEVICE_REPORT = ("record", {
    "node": "str", "outcome": ("enum", {"trained", "failed", "lost", "refused", "skipped"}), "cut": "int",
    "samples": "int", "iterations": "int", "loss": "number?", "loss_sq_sum": "number", "peak_bytes": "int",
    "budget_bytes": "int", "recompute": "str", "pruned": "int", "compute_s": "number", "setup_s": "number",
    "dis": "number?",
    "stat": "number?", "detail": "str",
})
_SPLITFED_PROGRESS = {
    "kind": ("enum", {"train-splitfed"}), "rounds_done": "int", "rounds_total": "int", "accuracy": "number?",
    "loss": "number?", "refused": "int",
    "history": ("list", ("record", {
        "round": "int", "accuracy": "number?", "loss": "number?", "predicted_s": "number",
        "refitted_s": "number?", "round_s": "number",
        "lan_bytes": "int", "wan_bytes": "int", "refused": "int", "left_out": ("list", "str"),
        "participants": ("list", ("record", {"node": "str", "mec": "str", "cut": "int", "outcome": "str",
                                             "peak_bytes": "int", "loss": "number?", "samples": "int",
                                             "recompute": "str", "iterations": "int",
                                             "compute_s": "number", "setup_s": "number"}))})),
}

_ANY_PLAN = ("tagged", "workload", {"train": _TRAIN_PLAN, "serve-pipeline": _SERVE_PLAN_FIELDS,
                                    "serve-hmp": _HMP_PLAN_FIELDS})
# A job state's plan: a train-splitfed job's (a split selection) has no ``workload``, so the job's ``kind`` picks it.
_JOB_PLAN = ("by_field", "kind", {"train-splitfed": ("optional", ("record", _SPLIT_SELECTION_FIELDS))},
             ("optional", _ANY_PLAN))
_PROGRESS = ("tagged", "kind", {
    "train": {
        "kind": ("enum", {"train"}), "strategy": _STRATEGY, "round": "int", "total_rounds": "int",
        "loss": "number?", "accuracy": "number?", "round_s": "number?", "predicted_round_s": "number?",
        "refitted_round_s": "number?",
        "samples_per_s": "number?", "checkpoint_version": "int?", "test_accuracy": "number?",
        "predictions": ("list", ("record", {"strategy": _STRATEGY, "round_s": "number?", "samples_per_s": "number?",
                                            "error": "str?"})),
        "reconfigurations": "int"},
    "serve-pipeline": {
        "kind": ("enum", {"serve-pipeline"}), "answered": "int", "samples": "int", "errors": "int", "replayed": "int",
        "in_flight": "int", "queued": "int", "throughput_per_s": "number?", "latency_p50_s": "number?",
        "latency_p99_s": "number?", "predicted_throughput_per_s": "number?", "predicted_latency_s": "number?",
        "refitted_throughput_per_s": "number?", "offered_per_s": "number?",
        "at_load": ("optional", ("record", {"throughput_per_s": "number", "latency_s": "number?",
                                            "utilisation": "number"})),
        "reconfigurations": "int", "weights": "str"},
    "serve-hmp": {
        "kind": ("enum", {"serve-hmp"}), "answered": "int", "errors": "int", "recomputed": "int", "queued": "int",
        "tokens": "int", "reconfigurations": "int", "latency_p50_s": "number?", "latency_p99_s": "number?",
        "ttft_p50_s": "number?", "tpot_p50_s": "number?", "tokens_per_s": "number?",
        "split": ("optional", _LAYER_SPLIT), "predicted_latency_s": "number?", "predicted_tpot_s": "number?",
        "refitted_latency_s": "number?", "passes": "int", "peak_batch": "int"},
    "train-splitfed": _SPLITFED_PROGRESS,
})
_COMPARISON = ("record", {
    "hpp": _PLAN, "planning_s": "number",
    "baselines": ("list", ("record", {"strategy": _STRATEGY, "plan": ("optional", _PLAN), "error": "str?",
                                      "speedup": "number?"})),
})

_SAMPLING = {"temperature": "number", "top_k": "int", "top_p": "number", "min_p": "number",
             "repetition_penalty": "number", "presence_penalty": "number", "frequency_penalty": "number", "seed": "int"}
_CKPT_IDS = {"transfer_id": "str", "job_id": "str", "stage": "str"}
_CKPT_STORED = {"nbytes": "int", "file_bytes": "int", "sha256": "str", "created_at": "number"}

_SPAN = ("record", {
    "name": "str", "cat": ("enum", {"compute", "transfer", "collective", "wait", "other"}), "job_id": "str",
    "node": "str", "service": "str", "lane": "str", "round": "int?", "micro_batch": "int?", "samples": "int?",
    "start": "number", "dur_s": "number",
})

#: (schema_name, schema_version) -> {field: spec}
SCHEMAS: dict[tuple[str, int], dict[str, Any]] = {
    ("edgeswarm.status", 1): {
        "state": ("enum", {"online", "offline"}), **_IDS, "version": "str", "host": "str", "pid": "int",
        "device_class": "str", "memory_budget_bytes": "int", "free_memory_bytes": "int", "data_url": "str",
        "heartbeat_interval_s": "number", "started_at": "number", "reason": "str?", "compute": "str",
        "reserved_memory_bytes": "int",
    },
    ("edgeswarm.heartbeat", 1): {
        **_IDS, "seq": "int", "interval_s": "number", "uptime_s": "number", "free_memory_bytes": "int",
        "inbox_depth": "int",
    },
    ("edgeswarm.metrics", 1): {
        **_IDS, "uptime_s": "number", "counters": ("map", "int"), "gauges": ("map", "number"),
        "histograms": ("map", ("record", {"bounds": ("list", "number"), "counts": ("list", "int"), "sum": "number",
                                          "count": "int"})),
    },
    ("edgeswarm.spans", 1): {
        "node": "str", "service": "str", "job_id": "str", "spans": ("list", _SPAN), "dropped": "int",
    },
    ("edgeswarm.trace.request", 1): {"job_id": "str"},
    ("edgeswarm.trace.reply", 1): {
        "job_id": "str", "found": "bool", "spans": ("list", _SPAN), "dropped": "int", "jobs": ("list", "str"),
    },
    ("edgeswarm.probe", 1): {},
    ("edgeswarm.rejected", 1): {"reason": "str", "detail": "str"},
    ("edgeswarm.probe_reply", 1): {
        **_IDS, "healthy": "bool", "uptime_s": "number", "inbox_depth": "int", "handler_errors": "int",
        "rejected": "int", "detail": "str",
    },
    ("edgeswarm.cluster_view", 1): {
        "generated_at": "number", "heartbeat_timeout_factor": "number", "nodes": ("list", _NODE_VIEW),
    },
    ("edgeswarm.cluster_event", 1): {
        "kind": ("enum", {"service_online", "service_suspect", "service_offline", "duplicate_node"}),
        **_IDS, "detail": "str", "at": "number",
    },
    ("edgeswarm.bench.start", 1): {"run_id": "str", "count": "int", "done_correlation_id": "str"},
    ("edgeswarm.bench.data", 1): {"run_id": "str", "seq": "int"},
    ("edgeswarm.bench.ack", 1): {
        "run_id": "str", "received": "int", "bytes": "int", "first_at": "number?", "last_at": "number?",
    },
    ("edgeswarm.bench.echo", 1): {"payload": ("bin_max", 16 * 1024 * 1024)},
    ("edgeswarm.bench.echo_reply", 1): {"payload": "bin"},
    ("edgeswarm.profile.request", 1): {
        "request_id": "str", "model": _MODEL_SPEC, "batch_sizes": ("list", "int"),
        "method": ("enum", {"calibrated", "measured"}), "peers": ("list", "str"),
    },
    ("edgeswarm.profile.progress", 1): {"request_id": "str", "node": "str", "fraction": "number", "message": "str"},
    ("edgeswarm.profile.report", 1): {
        "request_id": "str", "node": "str", "entry": ("record", {"device": _DEVICE, "compute": _COMPUTE}),
        "model": _MODEL_PROFILE, "links": ("list", _LINK), "cache_hit": "bool", "elapsed_s": "number",
    },
    ("edgeswarm.profile.failed", 1): {
        "request_id": "str", "node": "str", "reason": ("enum", {"bad_request", "busy", "link", "error"}),
        "detail": "str",
    },
    ("edgeswarm.plan.request", 1): {
        "cluster": _CLUSTER, "global_batch": "int", "micro_batches": "int?", "optimizer": _OPTIMIZER,
        "strategy": _STRATEGY, "compare": "bool", "epoch": "int",
    },
    ("edgeswarm.plan.replan_request", 1): {"plan": _PLAN, "cluster": _CLUSTER, "failed": "str", "heavy": "bool"},
    ("edgeswarm.plan.reply", 1): {"plan": _PLAN, "comparison": ("optional", _COMPARISON), "planning_s": "number"},
    ("edgeswarm.plan.failed", 1): {
        "reason": ("enum", {"infeasible", "bad_profile", "bad_request", "too_large", "busy", "error"}), "detail": "str",
    },
    ("edgeswarm.stage.assign", 1): {
        "job_id": "str", "epoch": "int", "stage": "int", "rank": "int", "model": _MODEL_SPEC, "start": "int",
        "end": "int", "groups": ("list", ("list", "str")), "shares": ("list", ("list", "int")),
        "micro_batches": "int", "warmup": "int", "loss_scale": "number",
        "optimizer": ("record", {"name": _OPTIMIZER, "lr": "number", "momentum": "number", "weight_decay": "number"}),
        "data": ("record", {"kind": ("enum", {"teacher", "tokens", "cifar10", "npz", "digits"}), "path": "str?",
                            "size": "int?", "test_size": "int?", "seed": "int", "noise": "number",
                            "teacher_grid": "int?"}),
        "seed": "int", "backup_to": "str?", "backup_interval": "int", "resume_round": "int",
        "restore": ("list", ("record", {"unit": "int", "node": "str", "owner": "str?"})),
        "checkpoint": ("optional", ("record", {"store_node": "str", "version": "int",
                                               "stages": ("list", ("list", "int"))})),
    },
    ("edgeswarm.stage.ready", 1): {"job_id": "str", "epoch": "int", "stage": "int", "rank": "int", "parameters": "int",
                                   "restored_bytes": "int", "restore_s": "number"},
    ("edgeswarm.stage.round", 1): {"job_id": "str", "epoch": "int", "round": "int"},
    ("edgeswarm.stage.round_done", 1): {
        "job_id": "str", "epoch": "int", "round": "int", "stage": "int", "rank": "int", "loss_sum": "number",
        "correct": "int", "terms": "int", "compute_s": "number", "compute_cpu_s": "number", "wait_s": "number",
        "overhead_s": "number",
        "forward_s": ("list", "number"), "backward_s": ("list", "number"),
        "allreduce_s": "number",
        "peak_live": "int", "peak_activation_bytes": "int", "static_bytes": "int", "snapshot_s": "number",
        "arrivals": ("list", ("record", {"src": "str", "bytes": "int", "chunks": "int", "seconds": "number"})),
    },
    ("edgeswarm.stage.failed", 1): {
        "job_id": "str",
        "reason": ("enum", {"bad_request", "not_assigned", "timeout", "memory", "aborted", "error"}),
        "detail": "str",
    },
    ("edgeswarm.stage.abort", 1): {"job_id": "str", "epoch": "int", "round": "int", "reason": "str"},
    ("edgeswarm.job.submit", 1): {"spec": "str", "submission": "str"},
    ("edgeswarm.job.cancel", 1): {"job_id": "str"},
    ("edgeswarm.job.accepted", 1): {"job_id": "str", "detail": "str"},
    ("edgeswarm.job.rejected", 1): {
        "reason": ("enum", {"invalid", "duplicate", "unknown_job", "finished"}), "detail": "str",
    },
    ("edgeswarm.job.state", 1): {
        "job_id": "str", "submission": "str", "spec": "str",
        "kind": ("enum", {"train", "serve-pipeline", "serve-hmp", "train-splitfed"}),
        "status": ("enum", {"queued", "profiling", "planning", "deploying", "running", "recovering", "succeeded",
                            "failed", "cancelled"}),
        "model": "str", "plan": _JOB_PLAN, "progress": _PROGRESS, "detail": "str",
        "submitted_at": "number", "updated_at": "number",
    },
    ("edgeswarm.job.event", 1): {
        "job_id": "str", "submission": "str",
        "kind": ("enum", {"submitted", "profiling", "planned", "deployed", "round", "checkpoint", "device_lost",
                          "recovered", "joined", "resumed", "evaluated", "succeeded", "failed", "cancelled",
                          "serving", "round_started", "mec_restarted", "finished"}),
        "round": "int", "detail": "str",
    },
    ("edgeswarm.plan.serve_request", 1): {"cluster": _CLUSTER, "options": _SERVE_OPTIONS, "epoch": "int"},
    ("edgeswarm.plan.serve_reply", 1): {"plan": ("record", _SERVE_PLAN_FIELDS), "planning_s": "number"},
    ("edgeswarm.serve.assign", 1): {
        "job_id": "str", "epoch": "int", "stage": "int", "model": _MODEL_SPEC, "start": "int", "end": "int",
        "devices": ("list", "str"), "coordinator": "str", "micro_batch_size": "int",
        "weights": ("optional", ("record", {"store_node": "str", "job_id": "str", "version": "int",
                                            "stages": ("list", ("list", "int"))})),
    },
    ("edgeswarm.serve.ready", 1): {"job_id": "str", "epoch": "int", "stage": "int", "parameters": "int",
                                   "memory_bytes": "int", "load_s": "number"},
    ("edgeswarm.serve.release", 1): {"job_id": "str"},
    ("edgeswarm.serve.tensor", 1): {"job_id": "str", "epoch": "int", "item": "int", "stage": "int",
                                    "compute_s": ("list", "number"),
                                    "arrivals": ("list", ("record", {"src": "str", "bytes": "int", "chunks": "int",
                                                                     "seconds": "number"}))},
    ("edgeswarm.infer.request", 1): {"job_id": "str", "request_id": "str"},
    ("edgeswarm.infer.reply", 1): {"job_id": "str", "request_id": "str", "latency_s": "number", "epoch": "int",
                                   "replayed": "bool"},
    ("edgeswarm.infer.error", 1): {
        "job_id": "str", "request_id": "str",
        "reason": ("enum", {"unknown_job", "not_serving", "no_tensor", "bad_dtype", "bad_shape", "too_large", "busy",
                            "failed", "cancelled"}),
        "detail": "str",
    },
    ("edgeswarm.stage.tensor", 1): {
        "job_id": "str", "epoch": "int", "round": "int", "stage": "int",
        "kind": ("enum", {"activation", "gradient"}), "sender": "int", "micro_batch": "int",
    },
    ("edgeswarm.collective.tensor", 1): {
        "job_id": "str", "epoch": "int", "scope": "int", "collective": "int", "step": "int", "sender": "int",
        "resend": "bool", "direct": "bool",
    },
    ("edgeswarm.stage.save", 1): {"job_id": "str", "epoch": "int", "store_node": "str", "version": "int"},
    ("edgeswarm.stage.saved", 1): {
        "job_id": "str", "stage": "int", "version": "int", "checkpoint_stage": "str", "nbytes": "int",
    },
    ("edgeswarm.stage.state", 1): {
        "job_id": "str", "epoch": "int", "round": "int", "unit": "int", "owner": "str",
        "purpose": ("enum", {"backup", "migrate", "gather"}),
        "entries": ("list", ("record", {"name": "str", "dtype": ("enum", {"float32", "float16", "bfloat16", "float64",
                                                                          "int64", "int32"}),
                                        "shape": ("list", "int")})),
    },
    ("edgeswarm.stage.send_state", 1): {
        "job_id": "str", "epoch": "int", "round": "int", "units": ("list", "int"), "owner": "str?", "to": "str",
        "purpose": ("enum", {"migrate", "gather"}),
    },
    ("edgeswarm.stage.state_sent", 1): {
        "job_id": "str", "to": "str", "units": ("list", "int"), "nbytes": "int", "seconds": "number",
    },
    ("edgeswarm.stage.inventory", 1): {"job_id": "str"},
    ("edgeswarm.stage.held", 1): {
        "job_id": "str", "node": "str",
        "snapshots": ("list", ("record", {"round": "int", "units": ("list", "int")})),
        "backups": ("list", ("record", {"owner": "str", "round": "int", "units": ("list", "int")})),
    },
    ("edgeswarm.profile.link_probe", 1): {
        "probe_id": "str", "kind": ("enum", {"ping", "pong", "bulk", "bulk_ack"}), "received_bytes": "int",
    },
    ("edgeswarm.checkpoint.tensor", 1): {**_CKPT_IDS, "version": "int", "name": "str", "index": "int", "count": "int"},
    ("edgeswarm.checkpoint.commit", 1): {
        **_CKPT_IDS, "version": "int", "count": "int", "nbytes": "int", "meta": ("map", "scalar"),
    },
    ("edgeswarm.checkpoint.saved", 1): {
        **_CKPT_IDS, "version": "int", "count": "int", **_CKPT_STORED, "versions": ("list", "int"),
    },
    ("edgeswarm.checkpoint.load", 1): {**_CKPT_IDS, "version": "int?"},
    ("edgeswarm.checkpoint.loaded", 1): {
        **_CKPT_IDS, "version": "int", "count": "int", **_CKPT_STORED, "meta": ("map", "scalar"),
    },
    ("edgeswarm.checkpoint.missing", 1): {**_CKPT_IDS, "version": "int?", "versions": ("list", "int"), "detail": "str"},
    ("edgeswarm.checkpoint.failed", 1): {
        "transfer_id": "str?",
        "reason": ("enum", {"corrupt", "too_large", "stale_version", "incomplete", "busy", "unreachable",
                            "bad_request", "forbidden", "error"}),
        "detail": "str",
    },
    ("edgeswarm.plan.hmp_request", 1): {
        "cluster": _HMP_CLUSTER, "options": _HMP_OPTIONS, "compare": "bool", "epoch": "int",
    },
    ("edgeswarm.plan.hmp_reply", 1): {
        "plan": _HMP_PLAN, "comparison": ("optional", _HMP_COMPARISON), "planning_s": "number",
    },
    ("edgeswarm.hmp.profile", 1): {"model": _TEXT_MODEL_SOURCE, "seq_len": "int"},
    ("edgeswarm.hmp.profile_reply", 1): {"profile": _BLOCK_PROFILE},
    ("edgeswarm.hmp.assign", 1): {
        "job_id": "str", "epoch": "int", "rank": "int", "model": _TEXT_MODEL_SOURCE, "shares": _HMP_SHARES,
        "coordinator": "str", "max_tokens": "int", "qos": "int", "deadline_s": "number", "max_batch": "int",
    },
    ("edgeswarm.hmp.ready", 1): {"job_id": "str", "epoch": "int", "rank": "int", "parameters": "int",
                                 "memory_bytes": "int", "load_s": "number"},
    ("edgeswarm.hmp.release", 1): {"job_id": "str"},
    ("edgeswarm.hmp.admit", 1): {"job_id": "str", "epoch": "int",
                                 "requests": ("list", ("record", {"request": "int", "tokens": "int"}))},
    ("edgeswarm.hmp.admitted", 1): {"job_id": "str", "epoch": "int", "rank": "int",
                                    "refused": ("list", ("record", {"request": "int", "detail": "str"}))},
    ("edgeswarm.hmp.free", 1): {"job_id": "str", "epoch": "int", "requests": ("list", "int")},
    ("edgeswarm.hmp.pass", 2): {"job_id": "str", "epoch": "int", "pass_id": "int", "segments": ("list", ("record", {
        "request": "int", "start": "int", "tokens": "int", "sampling": ("optional", ("record", _SAMPLING)),
        "answer": "bool"}))},
    ("edgeswarm.hmp.result", 2): {
        "job_id": "str", "epoch": "int", "pass_id": "int", "rank": "int", "row_start": "int",
        "tokens": ("list", "int"),
        "split": ("record", {"compute_s": "number", "sync_s": "number", "waiting_s": "number"}), "cache_bytes": "int",
    },
    ("edgeswarm.hmp.request", 1): {"job_id": "str", "request_id": "str", "text": "str?",
                                   "messages": ("optional", ("list", ("record", {
                                       "role": ("enum", {"system", "user", "assistant", "tool"}), "content": "str"}))),
                                   "max_new_tokens": "int?",
                                   "sampling": ("optional", ("record", _SAMPLING)), "stop": ("list", "str"),
                                   "stream": "bool"},
    ("edgeswarm.hmp.delta", 1): {"job_id": "str", "request_id": "str", "first": "int", "tokens": ("list", "int"),
                                 "offset": "int", "text": "str"},
    ("edgeswarm.hmp.cancel", 1): {"job_id": "str", "request_id": "str"},
    ("edgeswarm.hmp.reply", 1): {
        "job_id": "str", "request_id": "str", "prompt_tokens": ("list", "int"), "tokens": ("list", "int"),
        "text": "str", "latency_s": "number", "ttft_s": "number", "tpot_s": "number?",
        "split": ("optional", _LAYER_SPLIT),
        "epoch": "int", "recomputed": "bool", "finish": ("enum", {"stop", "length"}),
    },
    ("edgeswarm.splitfed.plan_request", 1): {
        "model": _MODEL_COST, "devices": ("list", _SPLIT_DEVICE), "mecs": ("list", _SPLIT_MEC),
        "options": _SPLIT_OPTIONS, "round": "int",
    },
    ("edgeswarm.splitfed.plan_reply", 1): {"selection": ("record", _SPLIT_SELECTION_FIELDS), "planning_s": "number"},
    ("edgeswarm.splitfed.prepare", 1): {"job_id": "str", "setup": _ROUND_SETUP, "index": "int?",
                                        "peers": ("list", "str")},
    ("edgeswarm.splitfed.prepared", 1): {"job_id": "str", "node": "str", "setup_s": "number", "step_s": "number"},
    ("edgeswarm.splitfed.enrol", 1): {
        "job_id": "str", "round": "int", "mec": "str", "index": "int", "setup": _ROUND_SETUP, "budget_bytes": "int",
        "wait_s": "number",
    },
    ("edgeswarm.splitfed.enrolled", 1): {"job_id": "str", "round": "int", "node": "str", "budget_bytes": "int"},
    ("edgeswarm.splitfed.round_start", 1): {
        "job_id": "str", "round": "int", "coordinator": "str", "setup": _ROUND_SETUP,
        "candidates": ("list", ("record", {"node": "str", "cut": "int", "index": "int", "samples": "int"})),
        "quota": "int", "epsilon": "number", "seed": "int", "estimator": ("enum", {"grad_nnls", "oracle", "off"}),
        "wait_s": "number",
    },
    ("edgeswarm.splitfed.release", 1): {"job_id": "str"},
    ("edgeswarm.splitfed.global", 1): {"job_id": "str", "round": "int"},
    ("edgeswarm.splitfed.part", 1): {"job_id": "str", "round": "int", "cut": "int"},
    ("edgeswarm.splitfed.tensor", 1): {
        "job_id": "str", "round": "int", "step": "int",
        "kind": ("enum", {"activation", "middle", "tail_gradient", "cut_gradient"}), "last": "bool",
        "labels": ("optional", ("list", "int")),
    },
    ("edgeswarm.splitfed.done", 1): {"job_id": "str", "round": "int", "report": _DEVICE_REPORT},
    ("edgeswarm.splitfed.update", 1): {
        "job_id": "str", "round": "int", "mec": "str", "samples": "int", "heaviest": "int", "count": "int",
        "reports": ("list", _DEVICE_REPORT), "refused": "int", "lan_bytes": "int", "devices_s": "number",
    },
    ("edgeswarm.checkpoint.list", 1): {"job_id": "str?"},
    ("edgeswarm.checkpoint.listing", 1): {
        "entries": ("list", ("record", {"job_id": "str", "stage": "str", "versions": ("list", "int")})),
    },
}

#: Schemas the document says carry a tensor (section 5: bench.data, profile.link_probe and checkpoint.tensor
#: "always carry a tensor").
TENSOR_SCHEMAS = frozenset({"edgeswarm.bench.data", "edgeswarm.profile.link_probe", "edgeswarm.checkpoint.tensor",
                            "edgeswarm.stage.tensor", "edgeswarm.stage.state", "edgeswarm.serve.tensor",
                            "edgeswarm.infer.request", "edgeswarm.infer.reply", "edgeswarm.collective.tensor",
                            "edgeswarm.hmp.request", "edgeswarm.hmp.reply", "edgeswarm.hmp.pass",
                            "edgeswarm.hmp.result", "edgeswarm.hmp.cancel", "edgeswarm.splitfed.global",
                            "edgeswarm.splitfed.part",
                            "edgeswarm.splitfed.tensor", "edgeswarm.splitfed.done", "edgeswarm.splitfed.update"})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(value: Any, spec: Any, where: str) -> None:
    if isinstance(spec, str):
        if spec.endswith("?"):
            if value is None:
                return
            spec = spec[:-1]
        ok = {
            "str": lambda v: isinstance(v, str),
            "int": _is_int,
            "number": lambda v: _is_int(v) or isinstance(v, float),
            "bool": lambda v: isinstance(v, bool),
            "bin": lambda v: isinstance(v, bytes),
            "scalar": lambda v: isinstance(v, str | int | float | bool),
        }[spec](value)
        if not ok:
            raise DocDecodeError(f"{where}: expected {spec}, got {type(value).__name__} {value!r:.60}")
        return
    tag = spec[0]
    if tag == "optional":
        if value is not None:
            _check(value, spec[1], where)
    elif tag == "enum":
        if not isinstance(value, str) or value not in spec[1]:
            raise DocDecodeError(f"{where}: {value!r:.60} is not one of {sorted(spec[1])}")
    elif tag == "bin_max":
        if not isinstance(value, bytes):
            raise DocDecodeError(f"{where}: expected bin, got {type(value).__name__}")
        if len(value) > spec[1]:
            raise DocDecodeError(f"{where}: {len(value)} bytes exceeds the limit of {spec[1]}")
    elif tag == "list":
        if not isinstance(value, list):
            raise DocDecodeError(f"{where}: expected array, got {type(value).__name__}")
        for i, item in enumerate(value):
            _check(item, spec[1], f"{where}[{i}]")
    elif tag == "map":
        if not isinstance(value, dict):
            raise DocDecodeError(f"{where}: expected map, got {type(value).__name__}")
        for key, item in value.items():
            _check(item, spec[1], f"{where}[{key!r}]")
    elif tag == "record":
        _check_record(value, spec[1], where)
    elif tag == "tagged":
        choice = value.get(spec[1]) if isinstance(value, dict) else None
        if choice not in spec[2]:
            raise DocDecodeError(f"{where}.{spec[1]}: {choice!r:.60} is not one of {sorted(spec[2])}")
        _check_record(value, spec[2][choice], where)
    else:  # pragma: no cover - a bug in the spec table
        raise AssertionError(spec)


def _check_record(value: Any, fields: Mapping[str, Any], where: str) -> None:
    if not isinstance(value, dict):
        raise DocDecodeError(f"{where}: expected map, got {type(value).__name__}")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise DocDecodeError(f"{where}: unknown field(s) {unknown}")
    missing = sorted(set(fields) - set(value))
    if missing:
        raise DocDecodeError(f"{where}: missing field(s) {missing}")
    for name, spec in fields.items():
        if isinstance(spec, tuple) and spec[0] == "by_field":  # the spec a sibling field's value picks
            spec = spec[2].get(value[spec[1]], spec[3])
        _check(value[name], spec, f"{where}.{name}")


# --------------------------------------------------------------------------------------------------
# msgpack (section 1, "msgpack details")
# --------------------------------------------------------------------------------------------------


def _reject_ext(code: int, data: bytes) -> object:
    raise DocDecodeError(f"header uses msgpack extension type {code}, which the format never uses")


def _walk_plain(obj: Any, where: str) -> None:
    """Reject anything msgpack can produce that the format does not use (extensions, non-str keys)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise DocDecodeError(f"{where}: map key {key!r:.40} is not a string")
            _walk_plain(value, f"{where}.{key}")
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _walk_plain(value, f"{where}[{i}]")
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return
    else:  # msgpack.Timestamp (extension -1), msgpack.ExtType, ...
        raise DocDecodeError(f"{where}: msgpack value of type {type(obj).__name__} is not allowed")


def decode_header(raw: bytes) -> dict[str, Any]:
    """Unpack the header bytes: exactly one msgpack map, nothing before or after it."""
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True, ext_hook=_reject_ext,
                                 timestamp=0)
    except DocDecodeError:
        raise
    except Exception as exc:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ValueError...
        raise DocDecodeError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise DocDecodeError(f"header is not a msgpack map but {type(header).__name__}")
    _walk_plain(header, "header")
    return header


# --------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------


def _check_keys(name: str, mapping: dict[str, Any], keys: Any) -> None:
    """Section 2: every key present, no other key."""
    unknown = sorted(set(mapping) - set(keys))
    if unknown:
        raise DocDecodeError(f"{name} has unknown key(s) {unknown}")
    missing = [k for k in keys if k not in mapping]
    if missing:
        raise DocDecodeError(f"{name} lacks key(s) {missing}")


def _check_envelope(env: Any) -> dict[str, Any]:
    if not isinstance(env, dict):
        raise DocDecodeError(f"env is not a map but {type(env).__name__}")
    _check_keys("env", env, ENVELOPE_KEYS)
    msg_id = env["msg_id"]
    if not isinstance(msg_id, str) or not _MSG_ID.fullmatch(msg_id):
        raise DocDecodeError(f"env.msg_id {msg_id!r:.60} is not 32 lowercase hex digits")
    if not isinstance(env["schema_name"], str):
        raise DocDecodeError("env.schema_name is not a string")
    version = env["schema_version"]
    if not _is_int(version) or version < 1:
        raise DocDecodeError(f"env.schema_version {version!r} is not an integer >= 1")
    for key in ("sender_node", "sender_service", "sender_instance"):
        value = env[key]
        if not isinstance(value, str) or not _IDENT.fullmatch(value):
            raise DocDecodeError(f"env.{key} {value!r:.80} does not match ^[A-Za-z0-9_.-]{{1,64}}$")
    if not isinstance(env["sent_at"], float) or not math.isfinite(env["sent_at"]):
        raise DocDecodeError(f"env.sent_at {env['sent_at']!r} is not a finite float")
    if env["expires_at"] is not None and (not isinstance(env["expires_at"], float)
                                          or not math.isfinite(env["expires_at"])):
        raise DocDecodeError(f"env.expires_at {env['expires_at']!r} is neither a finite float nor nil")
    for key in ("correlation_id", "reply_to"):
        if env[key] is not None and not isinstance(env[key], str):
            raise DocDecodeError(f"env.{key} is neither a string nor nil")
    return env


def _check_tensor(desc: Any, data_len: int, max_tensor_bytes: int) -> TensorDescriptor:
    if not isinstance(desc, dict):
        raise DocDecodeError(f"tensor is neither a map nor nil but {type(desc).__name__}")
    _check_keys("tensor", desc, TENSOR_KEYS)
    dtype = desc["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise DocDecodeError(f"tensor.dtype {dtype!r:.40} is not one of {sorted(DTYPES)}")
    shape = desc["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise DocDecodeError(f"tensor.shape {shape!r:.80} is not an array of integers >= 0")
    if len(shape) > MAX_DIMS:
        raise DocDecodeError(f"tensor.shape has {len(shape)} dimensions, more than {MAX_DIMS}")
    for key in ("nbytes", "chunk_size", "chunk", "n_chunks", "crc32"):
        if not _is_int(desc[key]):
            raise DocDecodeError(f"tensor.{key} {desc[key]!r:.40} is not an integer")
    nbytes, chunk_size, chunk, n_chunks, crc = (desc[k] for k in ("nbytes", "chunk_size", "chunk", "n_chunks",
                                                                    "crc32"))
    expected_nbytes = math.prod(shape) * DTYPES[dtype][0]
    if nbytes != expected_nbytes:
        raise DocDecodeError(f"tensor.nbytes {nbytes} does not match shape {shape} x {dtype} item size "
                             f"= {expected_nbytes}")
    if nbytes > max_tensor_bytes:
        raise DocDecodeError(f"tensor.nbytes {nbytes} is above the limit of {max_tensor_bytes}")
    if chunk_size < 1:
        raise DocDecodeError(f"tensor.chunk_size {chunk_size} is not >= 1")
    expected_chunks = max(1, -(-nbytes // chunk_size))
    if n_chunks != expected_chunks:
        raise DocDecodeError(f"tensor.n_chunks {n_chunks} does not match max(1, ceil({nbytes} / {chunk_size})) "
                             f"= {expected_chunks}")
    if not 0 <= chunk < n_chunks:
        raise DocDecodeError(f"tensor.chunk {chunk} is out of range 0..{n_chunks - 1}")
    if not 0 <= crc <= 0xFFFFFFFF:
        raise DocDecodeError(f"tensor.crc32 {crc} is not an unsigned 32-bit value")
    result = TensorDescriptor(dtype, tuple(shape), nbytes, chunk_size, chunk, n_chunks, crc)
    expected_len = result.chunk_end - result.chunk_start
    if data_len != expected_len:
        raise DocDecodeError(f"chunk {chunk} body is {data_len} bytes, the descriptor says {expected_len}")
    return result


def decode(payload: bytes | bytearray | memoryview, *, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
           schemas: Mapping[tuple[str, int], Mapping[str, Any]] = SCHEMAS) -> Frame | Cleared:
    """Decode one MQTT payload; raise :class:`DocDecodeError` for anything the document rejects."""
    payload = bytes(payload)
    if len(payload) == 0:
        return Cleared()
    if len(payload) < PREFIX_SIZE:
        raise DocDecodeError(f"payload of {len(payload)} bytes is shorter than the 8-byte prefix")
    magic, version, flags, header_len = struct.unpack_from("<2sBBI", payload, 0)
    if magic != MAGIC:
        raise DocDecodeError(f"wrong magic {magic!r}, expected {MAGIC!r}")
    if version != FRAME_VERSION:
        raise DocDecodeError(f"frame version {version} is not {FRAME_VERSION}")
    # flags: reserved, ignored on read.
    if header_len > MAX_HEADER:
        raise DocDecodeError(f"header length {header_len} is above {MAX_HEADER}")
    if PREFIX_SIZE + header_len > len(payload):
        raise DocDecodeError(f"header length {header_len} runs past the end of a {len(payload)}-byte payload")
    header = decode_header(payload[PREFIX_SIZE:PREFIX_SIZE + header_len])
    data = payload[PREFIX_SIZE + header_len:]

    unknown = sorted(set(header) - {"env", "body", "tensor"})
    if unknown:
        raise DocDecodeError(f"header has unknown key(s) {unknown}")
    if "env" not in header:
        raise DocDecodeError("header has no env")
    if "body" not in header:
        raise DocDecodeError("header has no body")
    env = _check_envelope(header["env"])

    key = (env["schema_name"], env["schema_version"])
    if key not in schemas:
        known = sorted(v for (n, v) in schemas if n == env["schema_name"])
        if known:
            raise DocDecodeError(f"{env['schema_name']} version {env['schema_version']} is unknown "
                                 f"(known: {known})")
        raise DocDecodeError(f"unknown schema {env['schema_name']!r}")
    _check_record(header["body"], schemas[key], f"body({env['schema_name']})")

    raw_tensor = header.get("tensor")
    if raw_tensor is None:
        if data:
            raise DocDecodeError(f"{len(data)} body bytes after a header whose tensor is nil")
        tensor = None
    else:
        tensor = _check_tensor(raw_tensor, len(data), max_tensor_bytes)
        crc = zlib.crc32(data) & 0xFFFFFFFF
        if crc != tensor.crc32:
            raise DocDecodeError(f"chunk {tensor.chunk} CRC-32 is {crc:#010x}, the descriptor says "
                                 f"{tensor.crc32:#010x}")
    if (tensor is not None) != (env["schema_name"] in TENSOR_SCHEMAS):
        raise DocDecodeError(f"{env['schema_name']} frame {'with' if tensor else 'without'} a tensor")
    return Frame(frame_version=version, flags=flags, header_length=header_len, envelope=env,
                 body=header["body"], tensor=tensor, data=data, size=len(payload))


# --------------------------------------------------------------------------------------------------
# Tensor values
# --------------------------------------------------------------------------------------------------


def tensor_array(dtype: str, shape: tuple[int, ...] | list[int], data: bytes) -> np.ndarray:
    """The elements in ``data`` (C order, little-endian, no padding) as a numpy array.

    bfloat16 comes back as its uint16 bits (see :func:`bfloat16_to_float32`); bool is checked to be
    0x00/0x01 bytes.
    """
    if dtype not in DTYPES:
        raise DocDecodeError(f"unknown dtype {dtype!r}")
    itemsize, np_dtype = DTYPES[dtype]
    expected = math.prod(shape) * itemsize
    if len(data) != expected:
        raise DocDecodeError(f"{len(data)} data bytes for shape {list(shape)} of {dtype} (expected {expected})")
    arr = np.frombuffer(data, dtype=np_dtype).reshape(tuple(shape))
    if dtype == "bool":
        if arr.size and arr.max() > 1:
            raise DocDecodeError("bool tensor holds a byte other than 0x00 and 0x01")
        arr = arr.view(np.bool_)
    return arr


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values stored as uint16 bits -> the float32 values they stand for (exact)."""
    bits = np.asarray(bits)
    if bits.dtype.kind != "u" or bits.dtype.itemsize != 2:
        raise TypeError(f"expected uint16 bfloat16 bits, got {bits.dtype}")
    return (bits.astype("<u4") << 16).view("<f4")


# --------------------------------------------------------------------------------------------------
# Reassembly (section 4)
# --------------------------------------------------------------------------------------------------


@dataclass
class _Transfer:
    envelope: dict[str, Any]
    body: dict[str, Any]
    key: tuple[Any, ...]
    buffer: bytearray
    have: set[int] = field(default_factory=set)
    last_progress: float = 0.0


class Reassembler:
    """Collects chunk frames; :meth:`feed` returns a :class:`Tensor` when the last missing chunk comes in.

    Chunks may come in any order and more than once; a chunk already held (or one of a tensor already
    delivered recently) is ignored. A transfer with no new chunk for ``timeout_s`` is freed by
    :meth:`expire` (called on every feed).
    """

    def __init__(self, *, timeout_s: float = DEFAULT_REASSEMBLY_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, remember_completed: int = 1024) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._transfers: dict[tuple[str, str], _Transfer] = {}
        self._completed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._remember = remember_completed
        self.duplicates = 0
        self.freed = 0

    @property
    def pending(self) -> int:
        return len(self._transfers)

    def pending_bytes(self) -> int:
        return sum(len(t.buffer) for t in self._transfers.values())

    def expire(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        stale = [k for k, t in self._transfers.items() if now - t.last_progress > self.timeout_s]
        for k in stale:
            del self._transfers[k]
        self.freed += len(stale)
        return len(stale)

    def feed(self, frame: Frame | bytes) -> Tensor | None:
        if not isinstance(frame, Frame):
            decoded = decode(frame)
            if not isinstance(decoded, Frame):
                return None
            frame = decoded
        desc = frame.tensor
        if desc is None:
            raise DocDecodeError("frame carries no tensor")
        now = self.clock()
        self.expire(now)
        ident = (frame.envelope["sender_instance"], frame.envelope["msg_id"])
        if ident in self._completed:
            self.duplicates += 1
            return None
        transfer = self._transfers.get(ident)
        if transfer is None:
            if desc.n_chunks == 1:  # read in place, no copy needed
                self._done(ident)
                return Tensor(frame.envelope, frame.body, desc.dtype, desc.shape, desc.nbytes, frame.data)
            transfer = _Transfer(frame.envelope, frame.body, desc.transfer_key(), bytearray(desc.nbytes),
                                 last_progress=now)
            self._transfers[ident] = transfer
        else:
            if desc.transfer_key() != transfer.key:
                raise DocDecodeError(f"chunk {desc.chunk} of {ident[1]} disagrees with earlier chunks: "
                                     f"{desc.transfer_key()} != {transfer.key}")
            if frame.body != transfer.body:
                raise DocDecodeError(f"chunk {desc.chunk} of {ident[1]} repeats a different body")
            if frame.envelope != transfer.envelope:
                diff = sorted(k for k in ENVELOPE_KEYS if frame.envelope[k] != transfer.envelope[k])
                raise DocDecodeError(f"chunk {desc.chunk} of {ident[1]} has a different envelope ({diff})")
        if desc.chunk in transfer.have:
            self.duplicates += 1
            return None
        transfer.buffer[desc.chunk_start:desc.chunk_end] = frame.data
        transfer.have.add(desc.chunk)
        transfer.last_progress = now
        if len(transfer.have) < desc.n_chunks:
            return None
        del self._transfers[ident]
        self._done(ident)
        return Tensor(transfer.envelope, transfer.body, desc.dtype, desc.shape, desc.nbytes, bytes(transfer.buffer))

    def _done(self, ident: tuple[str, str]) -> None:
        self._completed[ident] = None
        while len(self._completed) > self._remember:
            self._completed.popitem(last=False)


# --------------------------------------------------------------------------------------------------
# Topics (sections 5, 6, 7)
# --------------------------------------------------------------------------------------------------

_REQUEST_SCHEMAS = frozenset({"edgeswarm.probe", "edgeswarm.bench.start", "edgeswarm.bench.echo",
                              "edgeswarm.profile.request", "edgeswarm.plan.request", "edgeswarm.plan.replan_request",
                              "edgeswarm.checkpoint.commit", "edgeswarm.checkpoint.load", "edgeswarm.checkpoint.list",
                              "edgeswarm.stage.assign", "edgeswarm.stage.round", "edgeswarm.stage.save",
                              "edgeswarm.stage.abort", "edgeswarm.stage.send_state", "edgeswarm.stage.inventory",
                              "edgeswarm.job.submit", "edgeswarm.job.cancel", "edgeswarm.plan.serve_request",
                              "edgeswarm.serve.assign", "edgeswarm.serve.release", "edgeswarm.plan.hmp_request",
                              "edgeswarm.hmp.profile", "edgeswarm.hmp.assign", "edgeswarm.hmp.release",
                              "edgeswarm.hmp.admit", "edgeswarm.hmp.free",
                              "edgeswarm.splitfed.plan_request", "edgeswarm.splitfed.prepare",
                              "edgeswarm.splitfed.enrol",
                              "edgeswarm.splitfed.round_start", "edgeswarm.splitfed.release",
                              "edgeswarm.trace.request"})
_REPLY_SCHEMAS = frozenset({"edgeswarm.probe_reply", "edgeswarm.rejected", "edgeswarm.bench.ack",
                            "edgeswarm.bench.echo_reply",
                            "edgeswarm.profile.report", "edgeswarm.profile.failed", "edgeswarm.plan.reply",
                            "edgeswarm.plan.failed", "edgeswarm.checkpoint.saved", "edgeswarm.checkpoint.loaded",
                            "edgeswarm.checkpoint.missing", "edgeswarm.checkpoint.failed", "edgeswarm.stage.ready",
                            "edgeswarm.stage.round_done", "edgeswarm.stage.failed", "edgeswarm.stage.saved",
                            "edgeswarm.checkpoint.listing", "edgeswarm.job.accepted", "edgeswarm.job.rejected",
                            "edgeswarm.stage.state_sent", "edgeswarm.stage.held", "edgeswarm.plan.serve_reply",
                            "edgeswarm.serve.ready", "edgeswarm.infer.reply", "edgeswarm.infer.error",
                            "edgeswarm.plan.hmp_reply", "edgeswarm.hmp.profile_reply", "edgeswarm.hmp.ready",
                            "edgeswarm.hmp.admitted", "edgeswarm.hmp.reply", "edgeswarm.splitfed.plan_reply",
                            "edgeswarm.splitfed.enrolled", "edgeswarm.splitfed.prepared",
                            "edgeswarm.trace.reply"})
#: Section 5: the schemas on a service's data topic (tensors, and the requests that carry one).
_DATA_SCHEMAS = frozenset({"edgeswarm.bench.data", "edgeswarm.profile.link_probe", "edgeswarm.checkpoint.tensor",
                           "edgeswarm.stage.tensor", "edgeswarm.stage.state", "edgeswarm.collective.tensor",
                           "edgeswarm.serve.tensor", "edgeswarm.infer.request", "edgeswarm.hmp.pass",
                           "edgeswarm.hmp.result", "edgeswarm.hmp.request", "edgeswarm.splitfed.global",
                           "edgeswarm.splitfed.part", "edgeswarm.splitfed.tensor", "edgeswarm.splitfed.done",
                           "edgeswarm.splitfed.update"})


def schemas_for_topic(topic: str) -> frozenset[str] | None:
    """The schemas the document puts on ``topic``, or None for a topic it does not describe."""
    levels = topic.split("/")
    if levels[0] != "edgeswarm":
        return None
    if levels[1:] == ["cluster", "view"]:
        return frozenset({"edgeswarm.cluster_view"})
    if levels[1:] == ["cluster", "events"]:
        return frozenset({"edgeswarm.cluster_event"})
    if len(levels) == 4 and levels[1] == "job":
        return {"state": frozenset({"edgeswarm.job.state"}),
                "events": frozenset({"edgeswarm.job.event"})}.get(levels[3])
    if len(levels) == 6 and levels[1] == "reply":  # section 6: the reply address, then the replier's node
        return _REPLY_SCHEMAS
    if len(levels) == 6 and levels[1] == "node" and levels[4] in ("request", "data"):  # ... then the sender's node
        return _REQUEST_SCHEMAS if levels[4] == "request" else _DATA_SCHEMAS
    if len(levels) == 5 and levels[1] == "node":
        return {
            "status": frozenset({"edgeswarm.status"}),
            "heartbeat": frozenset({"edgeswarm.heartbeat"}),
            "metrics": frozenset({"edgeswarm.metrics"}),
            "spans": frozenset({"edgeswarm.spans"}),
            "progress": frozenset({"edgeswarm.profile.progress"}),
        }.get(levels[4])
    if len(levels) == 6 and levels[1] == "node" and levels[3:5] == ["profiler", "profile"]:
        return frozenset({"edgeswarm.profile.report"})
    return None


def writer_of(topic: str) -> str | None:
    """Section 6: the node a message on ``topic`` must come from, or None where the topic names none."""
    levels = topic.split("/")
    if len(levels) == 6 and levels[0] == "edgeswarm" and (levels[1] == "reply" or levels[4] in ("request", "data")):
        return levels[5]
    if len(levels) >= 5 and levels[0] == "edgeswarm" and levels[1] == "node":
        return levels[2]
    return None
