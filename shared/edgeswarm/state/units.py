"""The training state of individual units of a layer sequence, moved between stages bit-exactly.

Fault-tolerant pipeline training re-partitions a model while it trains: a stage holding units [start, end) hands
a subrange [a, b) to a device whose new stage covers a different range, and training goes on exactly as if
nothing had moved. The state of one unit is what a step reads besides the data: its parameters, its persistent
buffers (BatchNorm running statistics and ``num_batches_tracked``, ...; a non-persistent one, such as position
ids, is a constant of the model that every stage module is built with) and the optimizer's per-parameter state
(``momentum_buffer`` for momentum SGD; ``step``, ``exp_avg`` and ``exp_avg_sq`` for Adam; nothing before the
first step or for plain SGD).

A unit's state is a flat ``{entry name: tensor}`` map (``UnitState``) with entry names

- ``param:<qualified name>`` for a parameter,
- ``buffer:<qualified name>`` for a persistent buffer,
- ``opt:<qualified name>:<field>`` for one tensor of the optimizer's state of a parameter,

where the qualified names are the full model's (a stage module built by ``LayerSequence.build_stage`` keeps
them), so the same entry means the same tensor whichever stage holds the unit. ``pack_units`` turns a state
into small ``StateEntry`` descriptors plus one flat ``uint8`` tensor of raw bytes for the wire, and
``unpack_units`` undoes it exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

import torch
from torch import nn

from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.training import StateEntry
from edgeswarm.models.sequence import LayerSequence

PARAM_PREFIX = "param:"
BUFFER_PREFIX = "buffer:"
OPT_PREFIX = "opt:"

MAX_ENTRY_NAME = 512  # StateEntry's limits, checked before a message would refuse them
MAX_ENTRY_DIMS = 16

# The torch dtype of every wire dtype a unit's state may hold (StateEntry.dtype).
STATE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}

UnitState = dict[str, torch.Tensor]
"""One unit's state: entry name ("param:...", "buffer:...", "opt:<param>:<field>") -> tensor."""


class UnitStateError(EdgeswarmError):
    """A unit's state cannot be extracted, loaded, packed or unpacked as asked: a unit the stage does not hold,
    a parameter or buffer no given unit covers, a shape or dtype that does not match, or packed bytes that do not
    match their entries."""


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _clone(t: torch.Tensor) -> torch.Tensor:
    # A contiguous copy with storage of its own: later training steps update the live tensor in place.
    return t.detach().clone(memory_format=torch.contiguous_format)


def _named_tensors(module: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    # remove_duplicate=False keeps every alias of a shared tensor, so the names do not depend on which alias
    # torch happens to meet first in a given stage.
    params = dict(module.named_parameters(remove_duplicate=False))
    # Persistent buffers only, as in the state dict: a non-persistent one (position ids) is a constant that every
    # freshly built stage already holds, and a checkpoint carrying it would not load into the model strictly.
    persistent = module.state_dict(keep_vars=True)
    buffers = {name: b for name, b in module.named_buffers(remove_duplicate=False) if name in persistent}
    return params, buffers


def unit_names(sequence: LayerSequence) -> list[frozenset[str]]:
    """For each unit u of ``sequence``, the qualified names of the parameters and persistent buffers unit u's
    computation uses: those of the single-unit stage [u, u+1). A name used by several units is listed in each.

    Pure (the result depends on the sequence only), so callers may compute it once per model and reuse it."""
    result: list[frozenset[str]] = []
    for u in range(len(sequence)):
        params, buffers = _named_tensors(sequence.build_stage(u, u + 1))
        result.append(frozenset(params) | frozenset(buffers))
    return result


def _optimizer_params(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, object]]:
    """id(parameter) -> its param group, for every parameter the optimizer trains."""
    return {id(p): group for group in optimizer.param_groups for p in group["params"]}


def _opt_value(name: str, field: str, value: object) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return _clone(value)
    # Older optimizers (and some third-party ones) keep scalars such as "step" as Python numbers. They are
    # carried as 0-dim tensors wide enough to hold them exactly, and come back as tensors.
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    raise UnitStateError(f"the optimizer state {field!r} of parameter {name!r} is a {type(value).__name__}, "
                         "which a unit state cannot carry (only tensors, ints and floats); use an optimizer whose "
                         "state is tensors (SGD, momentum SGD, Adam)")


def _check_range(names: list[frozenset[str]], start: int, end: int) -> None:
    count = len(names)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)) or not 0 <= start < end <= count:
        raise UnitStateError(f"unit range [{start!r}, {end!r}) is invalid: need integers with "
                             f"0 <= start < end <= {count} (the number of units in names)")


def extract_units(module: nn.Module, optimizer: torch.optim.Optimizer | None, names: list[frozenset[str]],
                  start: int, end: int) -> dict[int, UnitState]:
    """The state of every unit in [start, end) of ``module``, a stage module holding (at least) those units, and
    of ``optimizer``, the optimizer training it (None: parameters and buffers only). ``names`` is
    ``unit_names`` of the model's sequence.

    Every tensor is a contiguous clone on the device it lives on, sharing no memory with the module or the
    optimizer, so training on afterwards does not change what was extracted. A tensor used by several units is
    cloned into each of them. Optimizer state holds whatever ``optimizer.state[param]`` holds for the unit's
    trainable parameters (nothing for a parameter not stepped yet); Python ints and floats there become 0-dim
    int64 and float64 tensors.

    Raises UnitStateError for an invalid range, a unit whose parameter or buffer the module lacks (it does not
    hold that unit), or optimizer state that is neither a tensor nor a number."""
    _check_range(names, start, end)
    params, buffers = _named_tensors(module)
    trained = _optimizer_params(optimizer) if optimizer is not None else {}
    result: dict[int, UnitState] = {}
    for u in range(start, end):
        state: UnitState = {}
        for name in sorted(names[u]):
            if name in params:
                param = params[name]
                state[PARAM_PREFIX + name] = _clone(param)
                if optimizer is not None and id(param) in trained and param in optimizer.state:
                    for field, value in optimizer.state[param].items():
                        state[f"{OPT_PREFIX}{name}:{field}"] = _opt_value(name, str(field), value)
            elif name in buffers:
                state[BUFFER_PREFIX + name] = _clone(buffers[name])
            else:
                raise UnitStateError(f"the stage module has no parameter or buffer {name!r}, which unit {u} uses: "
                                     f"it does not hold unit {u}; extract only units of the range it was built "
                                     "for, with the names of the same model")
        result[u] = state
    return result


def checkpoint_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """What a stage saves as one checkpoint version: its parameters and persistent buffers under their qualified
    names (the stages' checkpoints together make exactly the state dict of the whole model) and, as
    ``opt:<name>:<field>``, the optimizer's state of every parameter it has stepped, so training can go on from
    the checkpoint exactly.
    Parameters and buffers are the live tensors (detached): save them before the next step changes them."""
    params, buffers = _named_tensors(module)
    tensors = {name: t.detach() for name, t in {**params, **buffers}.items()}
    if optimizer is not None:
        trained = _optimizer_params(optimizer)
        for name, param in params.items():
            if id(param) in trained and param in optimizer.state:
                for field, value in optimizer.state[param].items():
                    tensors[f"{OPT_PREFIX}{name}:{field}"] = _opt_value(name, str(field), value)
    return tensors


T = TypeVar("T")


def model_state(tensors: Mapping[str, T]) -> dict[str, T]:
    """The model's state dict in a checkpoint's tensors (see ``checkpoint_tensors``): all but the optimizer's."""
    return {name: t for name, t in tensors.items() if not name.startswith(OPT_PREFIX)}


def checkpoint_units(tensors: Mapping[str, torch.Tensor], module: nn.Module, names: list[frozenset[str]],
                     start: int, end: int) -> dict[int, UnitState]:
    """The state of units [start, end) in checkpoint ``tensors`` (``checkpoint_tensors`` of the stages holding
    them, merged), as ``extract_units`` gives it, for ``load_units`` into ``module``, a stage module of those units
    (it tells parameters from buffers). Raises UnitStateError naming a tensor the checkpoint lacks."""
    _check_range(names, start, end)
    params, _ = _named_tensors(module)
    optimizer_entries: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith(OPT_PREFIX):
            _, name, _field = _split_entry(key)
            optimizer_entries.setdefault(name, {})[key] = value
    result: dict[int, UnitState] = {}
    for u in range(start, end):
        state: UnitState = {}
        for name in sorted(names[u]):
            if name not in tensors:
                raise UnitStateError(f"the checkpoint has no tensor {name!r}, which unit {u} uses: it was saved from "
                                     f"another model, or a stage holding unit {u} is missing from it")
            if name in params:
                state[PARAM_PREFIX + name] = tensors[name]
                state.update(optimizer_entries.get(name, {}))
            else:
                state[BUFFER_PREFIX + name] = tensors[name]
        result[u] = state
    return result


def _split_entry(key: str) -> tuple[str, str, str]:
    """(kind, qualified name, optimizer field or "") of an entry name; raises UnitStateError if malformed."""
    for prefix in (PARAM_PREFIX, BUFFER_PREFIX):
        if key.startswith(prefix) and len(key) > len(prefix):
            return prefix, key[len(prefix):], ""
    if key.startswith(OPT_PREFIX):
        # Qualified names hold dots, not colons, and field names are plain identifiers: the last colon splits.
        name, sep, field = key[len(OPT_PREFIX):].rpartition(":")
        if sep and name and field:
            return OPT_PREFIX, name, field
    raise UnitStateError(f"malformed state entry name {key!r}: expected 'param:<name>', 'buffer:<name>' or "
                         "'opt:<name>:<field>'")


def _check_like(key: str, value: torch.Tensor, target: torch.Tensor) -> None:
    if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
        raise UnitStateError(f"state entry {key!r} is {_dtype_name(value)}{list(value.shape)} but the stage module "
                             f"holds {_dtype_name(target)}{list(target.shape)}: the state comes from a different "
                             "model or configuration")


def _users(names: list[frozenset[str]], name: str) -> list[int]:
    return [u for u, unit in enumerate(names) if name in unit]


def _validate(module_params: dict[str, nn.Parameter], module_buffers: dict[str, torch.Tensor],
              states: dict[int, UnitState], names: list[frozenset[str]]) -> None:
    """Every check of ``load_units`` that does not need the optimizer, done before anything is changed."""
    for u, state in sorted(states.items()):
        if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < len(names):
            raise UnitStateError(f"unit {u!r} is not a unit of this model, which has {len(names)} units")
        for name in sorted(names[u]):
            if name in module_params:
                key = PARAM_PREFIX + name
            elif name in module_buffers:
                key = BUFFER_PREFIX + name
            else:
                raise UnitStateError(f"the stage module has no parameter or buffer {name!r}, which unit {u} uses: it "
                                     f"does not hold unit {u}; load only the units of the range it was built for")
            if key not in state:
                raise UnitStateError(f"the state of unit {u} lacks entry {key!r}; extract it again with the "
                                     "same model's unit names")
        for key, value in state.items():
            kind, name, field = _split_entry(key)
            if name not in names[u]:
                raise UnitStateError(f"the state of unit {u} has entry {key!r}, but unit {u} does not use {name!r}: "
                                     "the state and the unit names come from different models")
            if not isinstance(value, torch.Tensor):
                raise UnitStateError(f"state entry {key!r} of unit {u} is a {type(value).__name__}, not a tensor")
            if kind == PARAM_PREFIX:
                if name not in module_params:
                    raise UnitStateError(f"state entry {key!r} of unit {u} names a parameter, but {name!r} is a "
                                         "buffer of the stage module")
                _check_like(key, value, module_params[name])
            elif kind == BUFFER_PREFIX:
                if name not in module_buffers:
                    raise UnitStateError(f"state entry {key!r} of unit {u} names a buffer, but {name!r} is a "
                                         "parameter of the stage module")
                _check_like(key, value, module_buffers[name])
            else:
                if name not in module_params:
                    raise UnitStateError(f"optimizer state entry {key!r} of unit {u} belongs to {name!r}, which is "
                                         "not a parameter of the stage module")
                # Per-element states (momentum_buffer, exp_avg, ...) mirror their parameter; scalars (Adam's
                # step) are 0-dim and checked by the optimizer itself.
                if value.dim() > 0:
                    _check_like(key, value, module_params[name])
    covered = frozenset().union(*(names[u] for u in states))
    missing = sorted((set(module_params) | set(module_buffers)) - covered)
    if missing:
        shown = ", ".join(f"{n!r} (used by unit(s) {_users(names, n) or 'none'})" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise UnitStateError(f"no given unit covers parameter(s)/buffer(s) {shown}{more} of the stage module; "
                             "pass the state of every unit the stage holds")


def _opt_entries(state: UnitState, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    prefix = f"{OPT_PREFIX}{name}:"
    for key, value in state.items():
        if key.startswith(prefix) and ":" not in key[len(prefix):]:
            yield key[len(prefix):], value


def load_units(module: nn.Module, optimizer: torch.optim.Optimizer | None, states: dict[int, UnitState],
               names: list[frozenset[str]]) -> None:
    """Copy unit ``states`` (as ``extract_units`` or ``unpack_units`` gives them) into ``module``, a freshly built
    stage module, and ``optimizer``, its freshly built optimizer (``make_optimizer`` over the module's trainable
    parameters). ``names`` is ``unit_names`` of the model's sequence.

    Parameters and buffers are copied in place (no gradient is recorded). For every parameter the optimizer
    trains, ``optimizer.state[param]`` becomes exactly the given optimizer entries (copies, per-element ones on the
    parameter's device, 0-dim ones such as Adam's step on the CPU unless the group is capturable or fused), or is
    cleared where the units carry none. With ``optimizer`` None the optimizer entries are ignored (an
    inference-only load). A tensor that several given units carry is taken from the lowest-numbered one. A
    further training step then gives bit-identical results to the same step where the states were extracted.

    Everything is checked before anything changes; raises UnitStateError, leaving module and optimizer untouched,
    when a parameter or buffer of the module is covered by no given unit (naming it and the units that use it), a
    given unit is not held by the module, a unit's entry is missing or malformed, a shape or dtype does not match
    (naming the entry), or optimizer state belongs to a parameter the optimizer does not train."""
    module_params, module_buffers = _named_tensors(module)
    _validate(module_params, module_buffers, states, names)
    trained = _optimizer_params(optimizer) if optimizer is not None else {}
    owner: dict[str, int] = {}
    for u in sorted(states):
        for name in names[u]:
            owner.setdefault(name, u)
    if optimizer is not None:
        for name, u in owner.items():
            param = module_params.get(name)
            if param is not None and id(param) not in trained and any(True for _ in _opt_entries(states[u], name)):
                raise UnitStateError(f"unit {u} carries optimizer state for {name!r}, which the optimizer does not "
                                     "train; build the optimizer over the stage's trainable parameters "
                                     "(make_optimizer)")
    with torch.no_grad():
        for name, u in owner.items():
            if name in module_params:
                param = module_params[name]
                param.copy_(states[u][PARAM_PREFIX + name])
                if optimizer is None or id(param) not in trained:
                    continue
                group = trained[id(param)]
                # Scalars stay where torch keeps them: on the CPU unless the group runs on-device (capturable or
                # fused), where a CPU step would fail or be copied every step.
                on_device = bool(group.get("capturable")) or bool(group.get("fused"))
                opt_state = {
                    field: value.detach().to(device=param.device if value.dim() > 0 or on_device else "cpu",
                                             copy=True)
                    for field, value in _opt_entries(states[u], name)
                }
                if opt_state:
                    optimizer.state[param] = opt_state
                else:
                    optimizer.state.pop(param, None)
            else:
                module_buffers[name].copy_(states[u][BUFFER_PREFIX + name])


def pack_units(state: UnitState) -> tuple[list[StateEntry], torch.Tensor]:
    """``state`` as descriptors sorted by entry name and ONE flat CPU ``torch.uint8`` tensor holding every entry's
    raw bytes back to back in that order: exact for every dtype, 0-dim and empty tensors included.

    Raises UnitStateError for an entry name longer than 512 characters, a tensor of more than 16 dimensions or a
    dtype other than float32, float16, bfloat16, float64, int64 and int32."""
    entries: list[StateEntry] = []
    parts: list[torch.Tensor] = []
    for name in sorted(state):
        t = state[name].detach()
        dtype = _dtype_name(t)
        if dtype not in STATE_DTYPES:
            raise UnitStateError(f"state entry {name!r} has dtype {dtype}, which a packed unit state cannot carry; "
                                 f"supported: {', '.join(STATE_DTYPES)}")
        if not 0 < len(name) <= MAX_ENTRY_NAME or t.dim() > MAX_ENTRY_DIMS:
            raise UnitStateError(f"state entry {name[:80]!r} cannot be packed: names need 1 to {MAX_ENTRY_NAME} "
                                 f"characters and tensors at most {MAX_ENTRY_DIMS} dimensions (it has {t.dim()})")
        entries.append(StateEntry(name=name, dtype=dtype, shape=list(t.shape)))
        # Flattening first lets 0-dim tensors be viewed as bytes (a dtype view needs a dimension to rescale).
        parts.append(t.to("cpu").contiguous().reshape(-1).view(torch.uint8))
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return entries, flat


def unpack_units(entries: list[StateEntry], flat: torch.Tensor) -> UnitState:
    """The state that ``pack_units`` packed into ``entries`` and ``flat``. Every returned tensor owns its memory
    (no view into ``flat``) and lives on ``flat``'s device.

    Raises UnitStateError when ``flat`` is not a 1-dim uint8 tensor, two entries share a name, or ``flat`` does
    not hold exactly the bytes the entries describe (checked before anything is allocated)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise UnitStateError(f"packed unit state bytes must be a 1-dim uint8 tensor, not "
                             f"{_dtype_name(flat)}{list(flat.shape)}")
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise UnitStateError(f"packed unit state has entry {entry.name!r} twice")
        seen.add(entry.name)
    expected = sum(entry.nbytes for entry in entries)
    if expected != flat.numel():
        raise UnitStateError(f"packed unit state has {flat.numel()} bytes but its {len(entries)} entries describe "
                             f"{expected}; the transfer is incomplete or the entries belong to other bytes")
    state: UnitState = {}
    offset = 0
    for entry in entries:
        size = entry.nbytes
        # Clone before the dtype view: the copy starts at offset 0 of its own storage, so the view is aligned. With
        # contiguous strides explicitly: an empty tensor from the wire can have stride 0, and the dtype view of that
        # raised RuntimeError (a zero-size entry, with nothing to read, must still unpack).
        raw = flat[offset:offset + size].clone(memory_format=torch.contiguous_format)
        state[entry.name] = raw.view(STATE_DTYPES[entry.dtype]).reshape(entry.shape)
        offset += size
    return state


def state_nbytes(state: UnitState) -> int:
    """Total bytes of the state's tensors (what ``pack_units`` puts in its flat tensor)."""
    return sum(t.numel() * t.element_size() for t in state.values())
