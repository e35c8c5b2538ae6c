"""The model zoo and the layer sequence: deterministic builds, fingerprints, candidate cut points, and stages
that chain to exactly the whole model (outputs and gradients, eval and train mode)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from edgeswarm.errors import BatchSizeError, ConfigError, ModelTraceError, StageRangeError
from edgeswarm.models import sequence
from edgeswarm.models.sequence import LayerSequence, layer_sequence
from edgeswarm.models.zoo import (
    MODEL_NAMES,
    build_model,
    example_input,
    example_target,
    model_fingerprint,
    resolved_config,
)
from edgeswarm.values.profiles import ModelSpec

TINY: dict[str, dict[str, int | float | str | bool]] = {
    "mlp": {"image_size": 8, "hidden": 16},
    "lenet5": {"width": 0.5},
    "vgg11": {"width": 0.0625},
    "vgg16": {"width": 0.0625},
    "resnet18": {"width": 0.125},
    "resnet50": {"width": 0.0625},
    "mobilenetv2": {"width": 0.25},
    "efficientnet-b0": {"width": 0.25},
    "efficientnet-b1": {"width": 0.25},
    "bert-small": {"vocab_size": 50, "seq_len": 8, "hidden": 32, "heads": 4, "layers": 2},
    "gpt2": {"vocab_size": 50, "seq_len": 8, "n_embd": 32, "n_head": 4, "n_layer": 2},
}


def tiny(name: str, **extra: int | float | str | bool) -> ModelSpec:
    return ModelSpec(name=name, config={**TINY[name], **extra})


def random_partitions(length: int, rng: random.Random, count: int = 3) -> list[list[int]]:
    """``count`` random boundaries [0, c1, ..., L] cutting [0, L) into 2 to 4 stages."""
    result = []
    for _ in range(count):
        stages = rng.randint(2, min(4, length))
        result.append([0, *sorted(rng.sample(range(1, length), stages - 1)), length])
    return result


def chain(seq: LayerSequence, bounds: list[int], x: torch.Tensor) -> torch.Tensor:
    """The stages ``bounds`` cut ``seq`` into, run one after the other on ``x``: what a pipeline computes."""
    for a, b in zip(bounds, bounds[1:], strict=False):
        x = seq.build_stage(a, b)(x)
    return x


def test_the_zoo_has_every_model() -> None:
    assert set(MODEL_NAMES) == {"mlp", "lenet5", "vgg11", "vgg16", "resnet18", "resnet50", "mobilenetv2",
                                "efficientnet-b0", "efficientnet-b1", "bert-small", "gpt2"}
    assert set(TINY) == set(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_builds_are_deterministic_and_leave_the_global_rng_alone(name: str) -> None:
    spec = tiny(name)
    before = torch.get_rng_state()
    a, b = build_model(spec), build_model(spec)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    other = build_model(tiny(name, seed=1)).state_dict()
    assert any(not torch.equal(sa[k], other[k]) for k in sa if sa[k].is_floating_point())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fingerprint_is_stable_and_tracks_the_config(name: str) -> None:
    spec = tiny(name)
    fp = model_fingerprint(spec)
    assert fp == model_fingerprint(tiny(name)) and len(fp) == 64 and int(fp, 16) >= 0
    # Spelling out a default changes nothing; changing a value changes the fingerprint.
    explicit = ModelSpec(name=name, config=resolved_config(spec))
    assert model_fingerprint(explicit) == fp
    assert model_fingerprint(tiny(name, seed=7)) != fp
    assert model_fingerprint(ModelSpec(name=name)) != fp


def test_fingerprint_is_a_known_constant_across_processes() -> None:
    # A literal, so that a change in hashing or in defaults shows up here (bump ZOO_VERSION when it does).
    assert model_fingerprint(ModelSpec(name="lenet5")) == model_fingerprint(
        ModelSpec(name="lenet5", config={"width": 1, "num_classes": 10}))
    fp = model_fingerprint(ModelSpec(name="lenet5"))
    assert fp == "806c2720ab7ac59a05bb8d622c6a5f859857b9bd389f1e6b961a4dc828d0a433"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_random_partitions_chain_to_the_whole_model(name: str) -> None:
    spec = tiny(name)
    model = build_model(spec)
    seq = layer_sequence(model)
    assert len(seq) >= 4
    x = example_input(spec, 3)
    rng = random.Random(name)
    for mode in ("eval", "train"):
        model.train(mode == "train")
        with torch.no_grad():
            whole = model(x)
            for bounds in random_partitions(len(seq), rng):
                assert torch.equal(chain(seq, bounds, x), whole), (mode, bounds)
    every = list(range(len(seq) + 1))
    with torch.no_grad():
        assert torch.equal(chain(seq, every, x), model(x))


@pytest.mark.parametrize("name", ["resnet18", "efficientnet-b0", "bert-small", "gpt2"])
def test_gradients_through_the_chain_equal_the_whole_model(name: str) -> None:
    spec = tiny(name)
    model = build_model(spec).train()
    seq = layer_sequence(model)
    x, y = example_input(spec, 4), example_target(spec, 4)

    def grads(forward: object) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = forward(x)  # type: ignore[operator]
        F.cross_entropy(out.flatten(0, -2), y.flatten()).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    whole = grads(model)
    assert len(whole) == len(list(model.parameters()))
    for bounds in random_partitions(len(seq), random.Random(name), count=2):
        chained = grads(lambda t, b=bounds: chain(seq, b, t))
        assert chained.keys() == whole.keys()
        assert all(torch.equal(chained[k], whole[k]) for k in whole), bounds


def test_every_resnet50_bottleneck_is_one_unit() -> None:
    model = build_model(tiny("resnet50"))
    seq = layer_sequence(model)
    blocks = [f"layer{i + 1}.{j}" for i, depth in enumerate([3, 4, 6, 3]) for j in range(depth)]
    for block in blocks:
        owners = {u.index for u in seq.units for m in u.modules if m.startswith(block + ".")}
        assert len(owners) == 1, (block, owners)
        unit = seq.units[owners.pop()]
        assert unit.name == block
        assert {"conv1", "conv3", "bn3"} <= {m.removeprefix(block + ".") for m in unit.modules}
    # Stem conv, bn, relu; each block and the activation after its sum; pool, flatten, fc.
    assert len(seq) == 3 + 2 * len(blocks) + 3


@pytest.mark.parametrize("name", ["lenet5", "vgg11", "mlp"])
def test_plain_chains_keep_every_layer_as_a_unit(name: str) -> None:
    model = build_model(tiny(name))
    seq = layer_sequence(model)
    calls = [n for n in fx.symbolic_trace(model).graph.nodes if n.op == "call_module"]
    assert len(seq) == len(calls)
    assert [u.modules for u in seq.units] == [(str(n.target),) for n in calls]
    assert seq.units[0].ops in ("conv2d", "flatten")
    assert [u.index for u in seq.units] == list(range(len(seq)))


def test_squeeze_excitation_and_inverted_residuals_stay_whole() -> None:
    seq = layer_sequence(build_model(ModelSpec(name="efficientnet-b0")))
    se_units = [u for u in seq.units if any(".se." in m for m in u.modules)]
    for unit in se_units:
        paths = {m.rsplit(".se.", 1)[0] for m in unit.modules if ".se." in m}
        # Either the SE block alone (a non-residual MBConv) or the whole residual block.
        assert len(paths) == 1
        assert {"mul"} <= set(unit.ops.split(","))


class Skip(nn.Module):
    """x -> a1 -> a2 -> a3 -> add <- b1 <- x: a2 is a singleton level that the short branch bypasses."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.a1, self.a2, self.a3, self.b1 = (nn.Linear(4, 4) for _ in range(4))
        self.post = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        return self.post(self.a3(self.a2(self.a1(x))) + self.b1(x))


def test_singletons_bypassed_by_a_skip_are_not_cut_points() -> None:
    seq = layer_sequence(Skip())
    assert [u.modules for u in seq.units] == [("pre",), ("a1", "a2", "a3", "b1"), ("post",)]
    assert seq.units[1].output == "add" and "add" in seq.units[1].ops


def test_a_cut_crossed_by_two_tensors_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ignore AP: every singleton becomes a cut, including a2, which the short branch b1 bypasses.
    def every_singleton(source: fx.Node, depth: dict[fx.Node, int]) -> list[fx.Node]:
        levels: dict[int, list[fx.Node]] = {}
        for node, d in depth.items():
            levels.setdefault(d, []).append(node)
        return [nodes[0] for _, nodes in sorted(levels.items()) if len(nodes) == 1]

    monkeypatch.setattr(sequence, "candidate_points", every_singleton)
    with pytest.raises(ModelTraceError, match="2 values cross the cut"):
        layer_sequence(Skip())


class Branches(nn.Module):
    """Two parallel branches joined by a concatenation, with a constant added after the join."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(4, 3), nn.Linear(4, 3)
        self.register_buffer("offset", torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.cat([self.left(x), self.right(x)], dim=1) + self.offset * 2)


def test_parallel_branches_form_one_unit_and_constants_follow_their_consumer() -> None:
    model = Branches()
    seq = layer_sequence(model)
    assert [u.modules for u in seq.units] == [("left", "right"), (), ()]
    x = torch.randn(5, 4)
    assert torch.equal(seq.build_stage(1, 3)(seq.build_stage(0, 1)(x)), model(x))


def test_stages_share_parameters_with_the_model() -> None:
    spec = tiny("lenet5")
    model = build_model(spec).eval()
    seq = layer_sequence(model)
    stage = seq.build_stage(0, len(seq))
    x = example_input(spec, 2)
    before = stage(x)
    fresh = build_model(tiny("lenet5", seed=3)).state_dict()
    model.load_state_dict(fresh)
    assert not torch.equal(stage(x), before)
    assert torch.equal(stage(x), model(x))
    assert stage.get_submodule("features.0").weight is model.get_submodule("features.0").weight


def test_unit_names_are_unique_and_readable() -> None:
    seq = layer_sequence(build_model(tiny("bert-small")))
    names = [u.name for u in seq.units]
    assert len(set(names)) == len(names)
    assert names[0] == "embed.tokens" and names[-1] == "classifier"
    assert all(u.ops for u in seq.units)


@pytest.mark.parametrize("bounds", [(0, 0), (3, 2), (-1, 2), (0, 99), (1.0, 2)])
def test_bad_stage_ranges_are_rejected(bounds: tuple[int, int]) -> None:
    seq = layer_sequence(build_model(tiny("mlp")))
    with pytest.raises(StageRangeError, match="0 <= start < end <="):
        seq.build_stage(*bounds)


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x


class TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class TwoOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


class Constant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * 2


@pytest.mark.parametrize(("model", "message"), [
    (DataDependent(), "cannot trace"),
    (TwoInputs(), "2 inputs"),
    (TwoOutputs(), "one tensor output"),
    (Constant(), "does not depend on its input"),
])
def test_untraceable_models_raise_model_trace_error(model: nn.Module, message: str) -> None:
    with pytest.raises(ModelTraceError, match=message):
        layer_sequence(model)


def test_unknown_models_and_config_keys_list_what_is_valid() -> None:
    with pytest.raises(ConfigError, match="resnet50"):
        build_model(ModelSpec(name="resnet51"))
    with pytest.raises(ConfigError, match="valid keys: .*width"):
        build_model(ModelSpec(name="resnet50", config={"widht": 0.5}))
    with pytest.raises(ConfigError, match="integer"):
        resolved_config(ModelSpec(name="lenet5", config={"num_classes": 2.5}))
    with pytest.raises(ConfigError, match="one of auto, cifar, imagenet"):
        resolved_config(ModelSpec(name="resnet18", config={"stem": "tiny"}))
    with pytest.raises(ConfigError, match="multiple of heads"):
        resolved_config(ModelSpec(name="bert-small", config={"hidden": 30}))
    with pytest.raises(ConfigError, match="multiple of 32"):
        resolved_config(ModelSpec(name="vgg11", config={"image_size": 48}))
    with pytest.raises(BatchSizeError):
        example_input(ModelSpec(name="mlp"), 0)


def test_resolved_config_fills_defaults_and_derived_values() -> None:
    cfg = resolved_config(ModelSpec(name="bert-small", config={"hidden": 64}))
    assert cfg["intermediate_size"] == 256 and cfg["layers"] == 4 and cfg["seed"] == 0
    assert resolved_config(ModelSpec(name="resnet50", config={"width": 1}))["width"] == 1.0


def test_imagenet_stem_for_large_images() -> None:
    spec = ModelSpec(name="resnet50", config={"image_size": 64, "stem": "imagenet", "width": 0.0625})
    model = build_model(spec).eval()
    assert model(example_input(spec, 2)).shape == (2, 10)
    assert isinstance(model.stem[-1], nn.MaxPool2d)
    assert not isinstance(build_model(tiny("resnet50")).stem[-1], nn.MaxPool2d)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_example_inputs_and_targets_fit_the_model(name: str) -> None:
    spec = tiny(name)
    x, y = example_input(spec, 3, seed=5), example_target(spec, 3, seed=5)
    assert torch.equal(x, example_input(spec, 3, seed=5))
    assert not torch.equal(x, example_input(spec, 3, seed=6))
    with torch.no_grad():
        out = build_model(spec).eval()(x)
    if name in ("bert-small", "gpt2"):
        assert x.dtype == torch.int64 and x.shape == (3, 8)
    else:
        assert x.dtype == torch.float32 and x.dim() == 4
    if name == "gpt2":
        assert y.shape == (3, 8) and torch.equal(y[:, :-1], x[:, 1:])
        assert out.shape == (3, 8, 50)
    else:
        assert y.shape == (3,) and y.dtype == torch.int64
        assert out.shape == (3, resolved_config(spec)["num_classes"])


# --- stage footprints on the meta device (edgeswarm.models.footprint) ---------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_a_stage_footprint_measured_on_meta_equals_the_real_stage(name: str) -> None:
    from edgeswarm.models.footprint import module_footprint, stage_footprint

    spec = tiny(name)
    seq = layer_sequence(build_model(spec))
    n = len(seq)
    for start, end in [(0, n), (0, 1), (n // 2, n), (1, max(2, n // 2))]:
        assert stage_footprint(spec, start, end) == module_footprint(seq.build_stage(start, end)), (start, end)


def test_measuring_a_footprint_leaves_the_rng_and_the_next_build_alone() -> None:
    from edgeswarm.models.footprint import stage_footprint

    spec = tiny("vgg11")
    expected = build_model(spec).state_dict()
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    stage_footprint(spec, 0, 5)
    assert torch.equal(torch.get_rng_state(), state), "the global generator moved"
    after = build_model(spec).state_dict()
    assert all(torch.equal(after[k], expected[k]) for k in expected)


def test_a_footprint_of_terabytes_is_measured_without_allocating_it() -> None:
    """A stage whose weights would be 4 TiB: allocating them would fail (or exhaust) any machine this runs on, so
    measuring it at all shows that nothing was allocated; static bytes follow Eq. 3 (Adam: weights, gradients and
    two moments)."""
    from edgeswarm.models.footprint import stage_footprint

    hidden = 2 ** 20
    spec = ModelSpec(name="mlp", config={"image_size": 1, "hidden": hidden, "layers": 2})
    footprint = stage_footprint(spec, 0, 6)
    weights = 4 * (hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10)
    assert footprint.weights_bytes == weights and footprint.buffers_bytes == 0
    assert footprint.static_bytes("sgd") == 2 * weights and footprint.static_bytes("adam") == 4 * weights


def test_a_footprint_of_a_bad_range_raises_like_building_it() -> None:
    from edgeswarm.models.footprint import stage_footprint

    with pytest.raises(StageRangeError):
        stage_footprint(tiny("mlp"), 3, 99)
    with pytest.raises(ConfigError):
        stage_footprint(ModelSpec(name="mlp", config={"depth": 3}), 0, 1)
