"""``edgeswarm bench llm``'s measurements: a GGUF language model of a published shape (random weights, Q8_0 or
Q4_0) served split over emulated devices, and the same file against llama.cpp itself.

* **split**: decode time per token and its network share (what a token waits beyond its slowest rank's compute)
  with every rank in a thread of this process over the in-memory ring, each rank reading only its part of the file,
  its compute stretched to its device class's speed (``Recorder``'s rule), the links emulated (bandwidth and
  latency); the head and column shares from Galaxy's planner over the devices' synthetic profiles. Also each rank's
  weight memory beside its share of the quantized file.
* **llamacpp**: one process, native, the same file: prefill and decode tokens per second of ours (one device) and of
  llama.cpp (``llama-cpp-python``, built from its source distribution into a virtual environment of its own: no
  prebuilt binary), and their agreement over teacher-forced positions (per-position logits cosine, next-token
  agreement).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.devices.catalogue import device_class
from edgeswarm.devices.cluster import ClusterSpec, DeviceEntry, NetworkDefaults
from edgeswarm.devices.compute import resolve_compute
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import ConfigError
from edgeswarm.hmp.layer import HmpRank, RequestCache
from edgeswarm.hmp.loopback import Loopback
from edgeswarm.models.text import reference
from edgeswarm.models.text.gguf_file import GgufModel
from edgeswarm.models.text.gguf_writer import filler_vocabulary, write_gguf
from edgeswarm.planning.hmp.plan import plan_galaxy
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.planning.hmp.synthetic import synthetic_cluster
from edgeswarm.planning.hmp.types import HmpOptions
from edgeswarm.settings import Settings
from edgeswarm.values.text_model import PRESETS

log = logging.getLogger(__name__)

LLAMA_SDIST = "llama-cpp-python"
STEP_TIMEOUT_S = 600.0


class LlmBenchConfig(BaseModel):
    """What ``bench llm`` runs: ``preset``'s shape (``layers`` of them: None, all) in ggml type ``kind``; ``sets``
    of device classes for the split runs (label -> classes), their links; ``positions`` teacher-forced positions and
    ``decode`` generated tokens; where files go (``out``) and which Python runs llama.cpp (None: a virtual
    environment under ``out`` it builds on first use)."""

    model_config = ConfigDict(frozen=True)

    preset: str = "llama-3.2-1b"
    kind: str = "Q8_0"
    layers: int | None = None
    sections: tuple[str, ...] = ("split", "batch", "llamacpp")
    streams: int = 8
    sets: dict[str, tuple[str, ...]] = Field(default_factory=lambda: {
        "4 Nano": ("jetson-nano-l",) * 4, "3 Nano": ("jetson-nano-l",) * 3,
        "mixed": ("jetson-nano-l", "jetson-tx2", "rpi4", "jetson-nx")})
    bandwidth_mbps: float = 1000.0
    latency_ms: float = 0.2
    prompt: int = 32
    positions: int = 256
    decode: int = 8
    out: Path = Path("out/llm")
    llama_python: Path | None = None
    seed: int = 0


class SplitRow(BaseModel):
    """One split run: per-token decode seconds (median of the steps), the network share of it, and each rank's
    weight bytes beside its share of the quantized layers plus the replicated tensors."""

    label: str
    devices: list[str]
    heads: list[int]
    columns: list[int]
    token_s: float
    network_share: float
    weight_bytes: list[int]
    share_bytes: list[int]


class BatchRow(BaseModel):
    """One stream against ``streams`` decoding together (continuous batching) on the same devices: total generated
    tokens per second of each, and their ratio."""

    label: str
    streams: int
    one_tps: float
    many_tps: float

    @property
    def ratio(self) -> float:
        return self.many_tps / self.one_tps


class PeerRow(BaseModel):
    """Ours and llama.cpp on one device, the same file: tokens per second and agreement."""

    ours_prefill_tps: float
    ours_decode_tps: float
    llama_prefill_tps: float | None = None
    llama_decode_tps: float | None = None
    cosine_min: float | None = None
    cosine_mean: float | None = None
    agreement: float | None = None
    error: str | None = None


class LlmReport(BaseModel):
    config: LlmBenchConfig
    file: str
    file_bytes: int
    split: list[SplitRow] = Field(default_factory=list)
    batch: BatchRow | None = None
    peer: PeerRow | None = None


def model_file(config: LlmBenchConfig) -> Path:
    """The benchmark's GGUF file, written once (random weights drawn from ``seed``, a filler vocabulary) and kept
    under ``out`` for the next run."""
    if config.preset not in PRESETS or PRESETS[config.preset].family != "llama":
        raise ConfigError(f"--model: {config.preset!r} is not a llama-family preset "
                          f"({', '.join(n for n, c in PRESETS.items() if c.family == 'llama')})")
    cfg = PRESETS[config.preset].model_copy(update={"max_positions": 4096, "layers": config.layers or
                                                    PRESETS[config.preset].layers})
    path = config.out / f"{config.preset}-{cfg.layers}L-{config.kind.lower()}-s{config.seed}.gguf"
    if not path.is_file():
        config.out.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        log.info("writing %s (random weights; minutes for a billion parameters)", path)
        write_gguf(part, cfg, lambda n: reference.init_weights(cfg, config.seed, names={n})[n], matrices=config.kind,
                   embed=config.kind, metadata=filler_vocabulary(cfg.vocab))
        part.rename(path)
    return path


def _tokens(count: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run_ranks(ranks: list[HmpRank], config: LlmBenchConfig, prompts: list[list[int]], steps: int
               ) -> list[tuple[float, float]]:
    """Each prompt's prefill (a pass each), then ``steps`` greedy decode steps of all of them together (one pass a
    step, every request a row: continuous batching's decode), on every rank (one thread each) over an in-memory ring
    with ``config``'s links: per decode step, its wall seconds and the slowest rank's compute seconds."""
    n, count = len(ranks), len(prompts)
    loop = Loopback(n, bandwidth_bps=config.bandwidth_mbps * 1e6, latency_s=config.latency_ms / 1000)
    caches = [[r.new_cache() for _ in prompts] for r in ranks]
    chosen = [0] * count
    out: list[tuple[float, float]] = []
    computed = [0.0] * n
    barrier = threading.Barrier(n, timeout=STEP_TIMEOUT_S)
    errors: list[BaseException] = []

    def run(r: int, scope: int, ids: list[int], batch: list[tuple[RequestCache, int]], first: int) -> None:
        result = ranks[r].forward(ids, loop.ring(r, scope), batch=batch)
        for k, logits in ranks[r].segment_logits(result).items():
            chosen[first + k] = int(logits.argmax())

    def body(r: int) -> None:
        try:
            for j, prompt in enumerate(prompts):
                run(r, j, prompt, [(caches[r][j], len(prompt))], j)
                barrier.wait()
            for step in range(steps):
                barrier.wait()
                started = time.perf_counter()
                ranks[r].recorder.reset()
                run(r, count + step, list(chosen), [(c, 1) for c in caches[r]], 0)
                computed[r] = sum(t.compute_s for t in ranks[r].recorder.times())
                barrier.wait()
                if r == 0:
                    out.append((time.perf_counter() - started, max(computed)))
                barrier.wait()  # every rank has read ``chosen`` before the next step writes it
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"llm-rank-{r}") for r in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=STEP_TIMEOUT_S * (steps + count + 1))
    finally:
        loop.close()
    if errors:
        raise errors[0]
    return out


def _compute(device_class: str | None) -> torch.device:
    """Where a rank of ``device_class`` (None: this machine as it is) computes: EDGESWARM_COMPUTE's device, as a
    worker's (an emulated class: the CPU, its slow-down scaling CPU time)."""
    settings = Settings(device_class=device_class) if device_class is not None else Settings()
    return resolve_compute(settings.compute, DeviceProfile.from_settings(settings))


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _ranks_on(model: GgufModel, label: str, classes: tuple[str, ...], config: LlmBenchConfig
              ) -> tuple[HmpShares, list[HmpRank]]:
    """Galaxy's plan of the file's model over ``classes`` (on ``config``'s links) and a rank for each device (its
    part read from the file, its compute stretched to its class)."""
    cfg = model.config
    spec = ClusterSpec(name=label.replace(" ", "-"), network=NetworkDefaults(
        bandwidth_mbps=config.bandwidth_mbps, latency_ms=config.latency_ms), devices=tuple(
        DeviceEntry(id=f"d{i}", **{"class": c}) for i, c in enumerate(classes)))
    shares = plan_galaxy(synthetic_cluster(spec, cfg, config.prompt), HmpOptions(prune=False)).shares
    ranks = [HmpRank.from_reader(cfg, shares, r, model.read_slice, _compute(classes[int(d[1:])]), spans=False,
                                 slowdown=device_class(classes[int(d[1:])]).compute_slowdown)
             for r, d in enumerate(shares.devices)]
    return shares, ranks


def split_run(model: GgufModel, label: str, classes: tuple[str, ...], config: LlmBenchConfig) -> SplitRow:
    """Decode on ``classes`` (see the module's docstring)."""
    shares, ranks = _ranks_on(model, label, classes, config)
    cfg = model.config
    try:
        steps = _run_ranks(ranks, config, [_tokens(config.prompt, cfg.vocab, config.seed)], config.decode)
        weights = [r.weight_bytes() for r in ranks]
    finally:
        for r in ranks:
            r.close()
    token_s = _median([w for w, _ in steps])
    share = float(np.median([max(0.0, 1.0 - c / w) for w, c in steps]))
    return SplitRow(label=label, devices=[classes[int(d[1:])] for d in shares.devices], heads=shares.heads,
                    columns=shares.columns, token_s=token_s, network_share=share, weight_bytes=weights,
                    share_bytes=file_shares(model, shares))


def batch_run(model: GgufModel, label: str, classes: tuple[str, ...], config: LlmBenchConfig) -> BatchRow:
    """Total decode tokens per second of one stream and of ``config.streams`` decoding together on ``classes``
    (the medians of ``config.decode`` steps each, measured in one run)."""
    _, ranks = _ranks_on(model, label, classes, config)
    vocab = model.config.vocab
    try:
        rates = []
        for count in (1, config.streams):
            prompts = [_tokens(config.prompt, vocab, config.seed + k) for k in range(count)]
            rates.append(count / _median([w for w, _ in _run_ranks(ranks, config, prompts, config.decode)]))
    finally:
        for r in ranks:
            r.close()
    return BatchRow(label=label, streams=config.streams, one_tps=rates[0], many_tps=rates[1])


def file_shares(model: GgufModel, shares: HmpShares) -> list[int]:
    """Each rank's share of the file's bytes, from the file's own tensor sizes: a layer's attention matrices in
    proportion to its heads, its MLP matrices to its columns, everything else whole (replicated)."""
    heads = {"attn_q", "attn_k", "attn_v", "attn_output"}
    columns = {"ffn_up", "ffn_gate", "ffn_down"}
    cfg = model.config
    tensors = {name: size for name, size in model.stored_bytes().items() if name != "rope_freqs.weight"}
    out = []
    for r in range(len(shares.devices)):
        total = 0.0
        for name, size in tensors.items():
            part = name.split(".")
            role = part[2] if part[0] == "blk" and part[-1] == "weight" else ""
            total += size * (shares.heads[r] / cfg.heads if role in heads else
                             shares.columns[r] / cfg.ffn if role in columns else 1.0)
        out.append(int(total))
    return out


def ours_local(path: Path, tokens: list[int], decode: int) -> tuple[float, float, np.ndarray]:
    """Our one-device run of the file: prefill tokens per second over ``tokens``, decode tokens per second over
    ``decode`` greedy steps after them, and the prefill's logits [positions, vocab]."""
    compute = _compute(None)
    model = GgufModel(path, device=compute)
    cfg, w = model.config, model.load()
    with torch.inference_mode():
        cache = reference.ModelCache(cfg.layers)
        started = time.perf_counter()
        hidden = reference.forward(cfg, w, torch.tensor(tokens, device=compute), cache=cache)
        logits = reference.logits(w, hidden)
        token = int(logits[-1].argmax())  # a host read: the prefill's kernels have finished
        prefill = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(decode):
            hidden = reference.forward(cfg, w, torch.tensor([token], device=compute), cache=cache)
            token = int(reference.logits(w, hidden[-1:])[0].argmax())
        spent = time.perf_counter() - started
    return len(tokens) / prefill, decode / spent, logits.float().cpu().numpy()


# Run by llama.cpp's Python: the file's logits over the tokens, then the decode speed. Only llama_cpp and numpy.
_LLAMA_SCRIPT = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, tokens_file, out, decode, threads = sys.argv[1:6]
tokens = json.load(open(tokens_file))
llm = Llama(model_path=path, n_ctx=len(tokens) + int(decode) + 8, n_batch=len(tokens), logits_all=True,
            n_threads=int(threads), verbose=False)
started = time.perf_counter()
llm.eval(tokens)
prefill = time.perf_counter() - started
scores = np.array(llm.scores[:len(tokens)], dtype=np.float32)
token = int(scores[-1].argmax())
started = time.perf_counter()
for _ in range(int(decode)):
    llm.eval([token])
    token = int(np.asarray(llm.scores[llm.n_tokens - 1]).argmax())
spent = time.perf_counter() - started
np.save(out + ".npy", scores)
json.dump({"prefill_tps": len(tokens) / prefill, "decode_tps": int(decode) / spent}, open(out + ".json", "w"))
"""


def llama_python(config: LlmBenchConfig, say: Callable[[str], None]) -> Path:
    """A Python that imports ``llama_cpp``: the one given, or a virtual environment under ``out`` where
    llama-cpp-python is built from its source distribution on first use (pip, no prebuilt binary; minutes).
    Raises ConfigError saying what failed."""
    if config.llama_python is not None:
        return config.llama_python
    venv = config.out / "llama-cpp-venv"
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import llama_cpp"],
                                           capture_output=True).returncode == 0:
        return python
    say(f"building {LLAMA_SDIST} from its source distribution into {venv} (minutes, once)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    built = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-binary", LLAMA_SDIST, LLAMA_SDIST,
                            "numpy"], capture_output=True, text=True)
    if built.returncode != 0:
        raise ConfigError(f"{LLAMA_SDIST} did not build (a C++ compiler and cmake are needed): "
                          f"{built.stderr.strip()[-400:]}")
    return python


def peer_run(path: Path, config: LlmBenchConfig, say: Callable[[str], None]) -> PeerRow:
    """Ours and llama.cpp on the same file, one process each, with this machine's cores."""
    cfg = GgufModel(path).config
    tokens = _tokens(config.positions, cfg.vocab, config.seed + 1)
    ours_prefill, ours_decode, ours = ours_local(path, tokens, config.decode)
    row = PeerRow(ours_prefill_tps=ours_prefill, ours_decode_tps=ours_decode)
    try:
        python = llama_python(config, say)
    except (ConfigError, OSError, subprocess.CalledProcessError) as exc:
        return row.model_copy(update={"error": str(exc)})
    with tempfile.TemporaryDirectory() as tmp:
        tokens_file, out = Path(tmp) / "tokens.json", str(Path(tmp) / "llama")
        tokens_file.write_text(json.dumps(tokens))
        ran = subprocess.run([str(python), "-c", _LLAMA_SCRIPT, str(path), str(tokens_file), out, str(config.decode),
                              str(os.cpu_count() or 1)], capture_output=True, text=True, timeout=3600)
        if ran.returncode != 0:
            return row.model_copy(update={"error": f"llama.cpp failed: {ran.stderr.strip()[-400:]}"})
        theirs = np.load(out + ".npy")
        speeds = json.loads(Path(out + ".json").read_text())
    dot = (ours * theirs).sum(-1)
    cosine = dot / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))
    return row.model_copy(update={
        "llama_prefill_tps": speeds["prefill_tps"], "llama_decode_tps": speeds["decode_tps"],
        "cosine_min": float(cosine.min()), "cosine_mean": float(cosine.mean()),
        "agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean())})


def run_llm_bench(config: LlmBenchConfig, say: Callable[[str], None], json_path: Path | None = None) -> LlmReport:
    """Every section of ``config`` (see the module's docstring); the report also written to ``json_path``."""
    path = model_file(config)
    report = LlmReport(config=config, file=str(path), file_bytes=path.stat().st_size)
    if {"split", "batch"} & set(config.sections):
        # Opened once: ggml's reader takes seconds to parse a file's tokenizer vocabulary.
        with GgufModel(path) as model:
            if "split" in config.sections:
                for label, classes in config.sets.items():
                    say(f"split: {label} ({', '.join(classes)})")
                    report.split.append(split_run(model, label, classes, config))
            if "batch" in config.sections:
                label, classes = next(iter(config.sets.items()))
                say(f"batch: 1 stream, then {config.streams} together on {label}")
                report.batch = batch_run(model, label, classes, config)
    if "llamacpp" in config.sections:
        say("one device: ours and llama.cpp on the same file")
        report.peer = peer_run(path, config, say)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(report.model_dump_json(indent=2))
    return report
