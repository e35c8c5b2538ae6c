"""Unit state: extracting, moving, packing and loading the training state of single units bit-exactly."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from edgeswarm.hpp.compute import classification_loss
from edgeswarm.hpp.spec import make_optimizer
from edgeswarm.models.sequence import LayerSequence, layer_sequence
from edgeswarm.models.zoo import build_model, example_input, example_target
from edgeswarm.state.units import (
    StateEntry,
    UnitState,
    UnitStateError,
    checkpoint_tensors,
    checkpoint_units,
    extract_units,
    load_units,
    model_state,
    pack_units,
    state_nbytes,
    unit_names,
    unpack_units,
)
from edgeswarm.values.profiles import ModelSpec
from edgeswarm.values.specs import OptimizerSpec

LENET = ModelSpec(name="lenet5", config={"in_channels": 1, "image_size": 16, "width": 0.5, "seed": 1})
MOBILENET = ModelSpec(name="mobilenetv2", config={"width": 0.25, "image_size": 8, "num_classes": 4, "seed": 2})
GPT2 = ModelSpec(name="gpt2", config={"vocab_size": 32, "seq_len": 8, "n_layer": 2, "n_embd": 16, "n_head": 2,
                                      "seed": 3})
BERT = ModelSpec(name="bert-small", config={"vocab_size": 32, "seq_len": 8, "layers": 2, "hidden": 16, "heads": 2,
                                            "seed": 4})
MOMENTUM = OptimizerSpec(name="momentum", lr=0.05, momentum=0.9, weight_decay=1e-4)
ADAM = OptimizerSpec(name="adam", lr=1e-3)

Split = tuple[list[nn.Module], list[torch.optim.Optimizer]]


def split(spec: ModelSpec, seq: LayerSequence, bounds: list[int], opt: OptimizerSpec) -> Split:
    """Stages [bounds[i], bounds[i+1]) of ``seq``, each with its own optimizer over its trainable parameters."""
    stages: list[nn.Module] = [seq.build_stage(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
    optimizers = [make_optimizer(opt, (p for p in s.parameters() if p.requires_grad)) for s in stages]
    return stages, optimizers


def train_step(pipeline: Split, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step: forward through the chained stages, summed cross-entropy, backward through all, every step."""
    stages, optimizers = pipeline
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    out = x
    for stage in stages:
        out = stage(out)
    classification_loss(out, y).backward()
    for opt in optimizers:
        opt.step()


def batch(spec: ModelSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return example_input(spec, 6, seed=100 + step), example_target(spec, 6, seed=100 + step)


def named_state(pipeline: Split) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer tensor of a split, by qualified name: what must match bit for bit."""
    result: dict[str, torch.Tensor] = {}
    for stage, opt in zip(*pipeline, strict=True):
        for name, p in stage.named_parameters():
            result[f"param:{name}"] = p.detach()
            for field, value in opt.state.get(p, {}).items():
                result[f"opt:{name}:{field}"] = value
        for name, b in stage.named_buffers():
            result[f"buffer:{name}"] = b
    return result


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("spec", [LENET, MOBILENET], ids=["lenet5", "mobilenetv2"])
@pytest.mark.parametrize("opt", [MOMENTUM, ADAM], ids=["momentum", "adam"])
@pytest.mark.parametrize("shift", [1, -1])
def test_units_moved_to_a_different_split_train_on_bit_identically(spec: ModelSpec, opt: OptimizerSpec,
                                                                   shift: int) -> None:
    torch.manual_seed(0)
    seq = layer_sequence(build_model(spec))
    names = unit_names(seq)
    count = len(seq)
    k = count // 2
    original = split(spec, seq, [0, k, count], opt)
    for step in range(2):
        train_step(original, *batch(spec, step))

    # Extract every unit from the stage that holds it, and round-trip it through the wire form on the way.
    states: dict[int, UnitState] = {}
    for (a, b), stage, optimizer in zip([(0, k), (k, count)], *original, strict=True):
        for u, state in extract_units(stage, optimizer, names, a, b).items():
            entries, flat = pack_units(state)
            states[u] = unpack_units(entries, flat)
    if opt is ADAM:
        assert any(key.endswith(":exp_avg_sq") for state in states.values() for key in state)
    else:
        assert any(key.endswith(":momentum_buffer") for state in states.values() for key in state)

    # A fresh model (different initial weights) split elsewhere; each stage loads only the units it holds.
    fresh_spec = spec.model_copy(update={"config": {**spec.config, "seed": 99}})
    fresh_seq = layer_sequence(build_model(fresh_spec))
    cut = k + shift
    moved = split(fresh_spec, fresh_seq, [0, cut, count], opt)
    for (a, b), stage, optimizer in zip([(0, cut), (cut, count)], *moved, strict=True):
        load_units(stage, optimizer, {u: states[u] for u in range(a, b)}, names)
    assert_bit_identical(named_state(original), named_state(moved))

    train_step(original, *batch(spec, 2))
    train_step(moved, *batch(spec, 2))
    after = named_state(original)
    assert_bit_identical(after, named_state(moved))
    # The step changed the state, so the comparison above is not one between untouched copies.
    assert any(not torch.equal(after[key], value) for state in states.values() for key, value in state.items())


@pytest.mark.parametrize("opt", [MOMENTUM, ADAM], ids=["momentum", "adam"])
def test_a_checkpoint_of_two_stages_restores_a_different_split_bit_identically(opt: OptimizerSpec) -> None:
    """What the stages save (checkpoint_tensors) is the model's state dict plus the optimizer's state; a stage cut
    elsewhere loads its units from the merged checkpoint and trains on as if nothing had happened."""
    seq = layer_sequence(build_model(MOBILENET))
    names = unit_names(seq)
    count, k = len(seq), len(seq) // 2
    original = split(MOBILENET, seq, [0, k, count], opt)
    for step in range(2):
        train_step(original, *batch(MOBILENET, step))
    saved: dict[str, torch.Tensor] = {}
    for stage, optimizer in zip(*original, strict=True):
        saved.update({key: t.clone() for key, t in checkpoint_tensors(stage, optimizer).items()})
    whole = build_model(MOBILENET)
    whole.load_state_dict(model_state(saved), strict=True)  # the weights alone are a state dict of the model

    fresh_seq = layer_sequence(build_model(MOBILENET.model_copy(update={"config": {**MOBILENET.config, "seed": 9}})))
    moved = split(MOBILENET, fresh_seq, [0, k - 3, count], opt)
    for (a, b), stage, optimizer in zip([(0, k - 3), (k - 3, count)], *moved, strict=True):
        load_units(stage, optimizer, checkpoint_units(saved, stage, names, a, b), names)
    train_step(original, *batch(MOBILENET, 2))
    train_step(moved, *batch(MOBILENET, 2))
    assert_bit_identical(named_state(original), named_state(moved))

    missing = {key: t for key, t in saved.items() if key != "features.0.weight"}
    with pytest.raises(UnitStateError, match="no tensor 'features.0.weight'"):
        checkpoint_units(missing, moved[0][0], names, 0, k - 3)


@pytest.mark.parametrize("spec", [GPT2, BERT], ids=["gpt2", "bert-small"])
def test_non_persistent_buffers_stay_out_of_unit_states_and_checkpoints(spec: ModelSpec) -> None:
    """The transformers' position ids are a non-persistent buffer: no stage's state dict, unit state or
    checkpoint holds them, the merged checkpoint loads strictly into the model, and units moved through
    extract/pack/load or through the checkpoint train on bit-identically (every stage is built with the ids)."""
    model = build_model(spec)
    seq = layer_sequence(model)
    names = unit_names(seq)
    count, k = len(seq), len(seq) // 2
    assert "embed.position_ids" in dict(model.named_buffers())
    assert frozenset().union(*names) == set(model.state_dict())
    original = split(spec, seq, [0, k, count], ADAM)
    assert set().union(*(stage.state_dict() for stage in original[0])) == set(model.state_dict())
    for step in range(2):
        train_step(original, *batch(spec, step))

    saved: dict[str, torch.Tensor] = {}
    states: dict[int, UnitState] = {}
    for (a, b), stage, optimizer in zip([(0, k), (k, count)], *original, strict=True):
        saved.update({key: t.clone() for key, t in checkpoint_tensors(stage, optimizer).items()})
        states.update({u: unpack_units(*pack_units(state))
                       for u, state in extract_units(stage, optimizer, names, a, b).items()})
    assert set(model_state(saved)) == set(model.state_dict())
    build_model(spec).load_state_dict(model_state(saved), strict=True)
    assert not any("position_ids" in key for state in states.values() for key in state)

    fresh = spec.model_copy(update={"config": {**spec.config, "seed": 99}})
    bounds = [(0, k - 1), (k - 1, count)]
    from_units = split(fresh, layer_sequence(build_model(fresh)), [0, k - 1, count], ADAM)
    from_checkpoint = split(fresh, layer_sequence(build_model(fresh)), [0, k - 1, count], ADAM)
    for (a, b), stage, optimizer in zip(bounds, *from_units, strict=True):
        load_units(stage, optimizer, {u: states[u] for u in range(a, b)}, names)
    for (a, b), stage, optimizer in zip(bounds, *from_checkpoint, strict=True):
        load_units(stage, optimizer, checkpoint_units(saved, stage, names, a, b), names)
    for moved in (from_units, from_checkpoint):
        train_step(moved, *batch(spec, 2))
    train_step(original, *batch(spec, 2))
    assert_bit_identical(named_state(original), named_state(from_units))
    assert_bit_identical(named_state(original), named_state(from_checkpoint))


def test_unit_names_are_the_units_own_parameters_and_buffers() -> None:
    model = build_model(MOBILENET)
    seq = layer_sequence(model)
    names = unit_names(seq)
    assert len(names) == len(seq)
    assert names[0] == {"features.0.weight"}
    assert names[1] == {"features.1.weight", "features.1.bias", "features.1.running_mean", "features.1.running_var",
                        "features.1.num_batches_tracked"}
    everything = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert frozenset().union(*names) == everything
    assert unit_names(seq) == names


def _pack_case() -> UnitState:
    gen = torch.Generator().manual_seed(7)
    bn = nn.BatchNorm2d(3)
    bn.num_batches_tracked.fill_(2**40 + 3)  # beyond float precision: any float detour would show
    return {
        "param:w": torch.randn(3, 4, generator=gen),
        "param:half": torch.randn(5, generator=gen).to(torch.float16),
        "param:bf": torch.randn(2, 3, generator=gen).to(torch.bfloat16),
        "opt:w:step": torch.tensor(3.0),
        "opt:w:exp_avg": torch.randn(3, 4, generator=gen).t(),  # not contiguous
        "buffer:bn.num_batches_tracked": bn.num_batches_tracked,
        "buffer:count": torch.tensor([-(2**62), 5, 2**62], dtype=torch.int64),
        "buffer:i32": torch.tensor(-7, dtype=torch.int32),
        "buffer:f64": torch.tensor([1.0 / 3.0, float("inf"), -0.0], dtype=torch.float64),
        "buffer:empty": torch.zeros(0, 3),
        "buffer:nan": torch.tensor([float("nan")]),
    }


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_pack_and_unpack_round_trip_exactly() -> None:
    state = _pack_case()
    entries, flat = pack_units(state)
    assert [e.name for e in entries] == sorted(state)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert flat.numel() == state_nbytes(state) == sum(e.nbytes for e in entries)
    assert pack_units(state)[0] == entries and torch.equal(pack_units(state)[1], flat)

    back = unpack_units(entries, flat)
    assert back.keys() == state.keys()
    for key, value in state.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape, key
        assert torch.equal(_raw(back[key]), _raw(value)), key  # raw bytes: exact for NaN and -0.0 too
    assert back["buffer:bn.num_batches_tracked"].dim() == 0
    assert int(back["buffer:bn.num_batches_tracked"]) == 2**40 + 3

    # The unpacked tensors own their memory: changing the bytes afterwards changes none of them.
    flat.fill_(0)
    assert torch.equal(back["param:w"], state["param:w"])
    assert back["buffer:count"].tolist() == [-(2**62), 5, 2**62]


def test_entries_serialise_for_messages_and_unpack_checks_byte_count() -> None:
    state = _pack_case()
    entries, flat = pack_units(state)
    wire = [StateEntry.model_validate_json(e.model_dump_json()) for e in entries]
    assert wire == entries
    with pytest.raises(UnitStateError, match="bytes"):
        unpack_units(entries, flat[:-1])
    with pytest.raises(UnitStateError, match="bytes"):
        unpack_units(entries, torch.cat([flat, torch.zeros(4, dtype=torch.uint8)]))
    with pytest.raises(UnitStateError, match="uint8"):
        unpack_units(entries, flat.view(torch.int8))
    with pytest.raises(UnitStateError, match="twice"):
        unpack_units(entries + entries[:1], flat)
    assert unpack_units([], torch.empty(0, dtype=torch.uint8)) == {}


def test_state_entry_is_validated() -> None:
    with pytest.raises(ValidationError):
        StateEntry(name="x" * 513, dtype="float32", shape=[1])
    with pytest.raises(ValidationError):
        StateEntry(name="param:x", dtype="complex64", shape=[1])
    with pytest.raises(ValidationError):
        StateEntry(name="param:x", dtype="float32", shape=[-1])
    with pytest.raises(ValidationError):
        StateEntry(name="param:x", dtype="float32", shape=[1] * 17)
    with pytest.raises(UnitStateError, match="bool"):
        pack_units({"buffer:mask": torch.ones(2, dtype=torch.bool)})


def _trained_lenet() -> tuple[LayerSequence, list[frozenset[str]], nn.Module, torch.optim.Optimizer]:
    seq = layer_sequence(build_model(LENET))
    names = unit_names(seq)
    stage = seq.build_stage(0, len(seq))
    optimizer = make_optimizer(MOMENTUM, stage.parameters())
    train_step(([stage], [optimizer]), *batch(LENET, 0))
    return seq, names, stage, optimizer


def test_load_refuses_missing_units_and_mismatches_without_changing_anything() -> None:
    seq, names, stage, optimizer = _trained_lenet()
    count = len(seq)
    states = extract_units(stage, optimizer, names, 0, count)
    dropped = next(u for u in range(count) if any(k.startswith("param:") for k in states[u]))
    dropped_param = next(k.removeprefix("param:") for k in sorted(states[dropped]) if k.startswith("param:"))

    fresh = layer_sequence(build_model(LENET.model_copy(update={"config": {**LENET.config, "seed": 5}})))
    target = fresh.build_stage(0, count)
    target_opt = make_optimizer(MOMENTUM, target.parameters())
    before = {n: p.detach().clone() for n, p in target.named_parameters()}

    partial = {u: s for u, s in states.items() if u != dropped}
    with pytest.raises(UnitStateError, match=dropped_param.replace(".", r"\.")):
        load_units(target, target_opt, partial, names)

    bad_shape = {u: dict(s) for u, s in states.items()}
    key = f"param:{dropped_param}"
    bad_shape[dropped][key] = torch.zeros(*bad_shape[dropped][key].shape, 2)
    with pytest.raises(UnitStateError, match=key.replace(".", r"\.")):
        load_units(target, target_opt, bad_shape, names)

    bad_dtype = {u: dict(s) for u, s in states.items()}
    bad_dtype[dropped][key] = bad_dtype[dropped][key].double()
    with pytest.raises(UnitStateError, match="float64"):
        load_units(target, target_opt, bad_dtype, names)

    bad_momentum = {u: dict(s) for u, s in states.items()}
    opt_key = f"opt:{dropped_param}:momentum_buffer"
    bad_momentum[dropped][opt_key] = torch.zeros(*bad_momentum[dropped][opt_key].shape, 2)
    with pytest.raises(UnitStateError, match=opt_key.replace(".", r"\.")):
        load_units(target, target_opt, bad_momentum, names)

    # Failed loads changed nothing; the good one then loads everything.
    assert all(torch.equal(before[n], p) for n, p in target.named_parameters())
    assert not target_opt.state
    load_units(target, target_opt, states, names)
    assert all(torch.equal(p, s) for p, s in zip(target.parameters(), stage.parameters(), strict=True))


def test_load_refuses_units_the_stage_does_not_hold() -> None:
    seq, names, stage, optimizer = _trained_lenet()
    states = extract_units(stage, optimizer, names, 0, len(seq))
    first = seq.build_stage(0, 2)
    with pytest.raises(UnitStateError, match="does not hold unit"):
        load_units(first, make_optimizer(MOMENTUM, first.parameters()), states, names)
    with pytest.raises(UnitStateError, match="does not hold unit"):
        extract_units(first, None, names, 0, len(seq))
    with pytest.raises(UnitStateError, match="range"):
        extract_units(stage, optimizer, names, 3, 3)


def test_extracted_state_is_a_clone() -> None:
    seq, names, stage, optimizer = _trained_lenet()
    states = extract_units(stage, optimizer, names, 0, len(seq))
    snapshot = {u: {k: v.clone() for k, v in s.items()} for u, s in states.items()}
    live = {t.data_ptr() for t in stage.parameters()} | {t.data_ptr() for t in stage.buffers()}
    live |= {v.data_ptr() for s in optimizer.state.values() for v in s.values()}
    assert not live & {v.data_ptr() for s in states.values() for v in s.values()}

    train_step(([stage], [optimizer]), *batch(LENET, 1))
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(1.0)
    for state in optimizer.state.values():
        state["momentum_buffer"].mul_(3.0)
    for u, state in states.items():
        for key, value in state.items():
            assert torch.equal(value, snapshot[u][key]), key


def test_state_nbytes_counts_parameters_buffers_and_optimizer_state() -> None:
    seq = layer_sequence(build_model(MOBILENET))
    names = unit_names(seq)
    stage = seq.build_stage(0, 4)
    optimizer = make_optimizer(ADAM, stage.parameters())
    train_step(([stage, seq.build_stage(4, len(seq))], [optimizer]), *batch(MOBILENET, 0))
    states = extract_units(stage, optimizer, names, 0, 4)

    unit = states[1]  # conv + BatchNorm: float32 weights, float32 running stats, an int64 counter, Adam state
    bn = stage.get_submodule("features.1")
    assert isinstance(bn, nn.BatchNorm2d)
    params = [bn.weight, bn.bias]
    buffers = [bn.running_mean, bn.running_var, bn.num_batches_tracked]
    opt_tensors = [v for p in params for v in optimizer.state[p].values()]
    assert len(opt_tensors) == 6  # step, exp_avg, exp_avg_sq for each of weight and bias
    expected = sum(t.numel() * t.element_size() for t in [*params, *buffers, *opt_tensors])
    assert state_nbytes(unit) == expected
    assert state_nbytes(unit) == pack_units(unit)[1].numel()
    assert state_nbytes(states[2]) == 0  # the activation has no state
    assert set(unit) == {
        "param:features.1.weight", "param:features.1.bias", "buffer:features.1.running_mean",
        "buffer:features.1.running_var", "buffer:features.1.num_batches_tracked",
        *(f"opt:features.1.{p}:{f}" for p in ("weight", "bias") for f in ("step", "exp_avg", "exp_avg_sq")),
    }


def test_number_valued_optimizer_state_is_carried_as_tensors() -> None:
    layer = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    optimizer.state[layer.weight] = {"count": 3, "scale": 0.1, "bad": "text"}
    names = [frozenset({"weight", "bias"})]
    with pytest.raises(UnitStateError, match="str"):
        extract_units(layer, optimizer, names, 0, 1)
    del optimizer.state[layer.weight]["bad"]
    state = extract_units(layer, optimizer, names, 0, 1)[0]
    assert state["opt:weight:count"].dtype == torch.int64 and int(state["opt:weight:count"]) == 3
    assert state["opt:weight:scale"].dtype == torch.float64 and float(state["opt:weight:scale"]) == 0.1
