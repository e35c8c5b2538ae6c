"""The model zoo: build any supported model from a ModelSpec, with deterministic weights and a stable fingerprint.

Models and their config keys (defaults in ``DEFAULTS``; every model also takes ``seed``, default 0):

- "mlp": in_channels 1, image_size 28, hidden 256, layers 2 (hidden layers), num_classes 10, width 1.0.
- "lenet5": in_channels 1, image_size 32 (>= 16), num_classes 10, width 1.0.
- "vgg11", "vgg16": CIFAR-style with BatchNorm; in_channels 3, image_size 32 (a multiple of 32), num_classes 10,
  width 1.0, batch_norm True.
- "resnet18", "resnet50": in_channels 3, image_size 32, num_classes 10, width 1.0, stem "auto". The stem is
  "cifar" (3x3 stride 1, no pooling) or "imagenet" (7x7 stride 2 + max pool); "auto" picks "cifar" below 96
  pixels, so image_size 32 gives the CIFAR ResNet and 224 the ImageNet one.
- "mobilenetv2", "efficientnet-b0", "efficientnet-b1": in_channels 3, image_size 32, num_classes 10, width 1.0,
  stem "auto" (the CIFAR stem drops the first stride). EfficientNet-B1 is B0 with depth x1.1 (width x1.0).
- "bert-small": vocab_size 30522, seq_len 128, layers 4, hidden 512, heads 8, intermediate_size 0 (means
  4 x hidden), num_classes 2 (Asteroid's Bert-small dimensions).
- "gpt2": vocab_size 50257, seq_len 128, n_layer 12, n_embd 768, n_head 12 (GPT-2 small; the context is
  shortened to 128 tokens for edge training).

``width`` multiplies channel or hidden widths so tests can build tiny versions. Image models take float32 NCHW
images; token models take int64 ids of shape (batch, seq_len). Targets are class labels of shape (batch,),
except "gpt2": next-token labels of shape (batch, seq_len).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from edgeswarm.errors import BatchSizeError, ConfigError
from edgeswarm.models import cnn, mobile, transformer
from edgeswarm.models.sequence import LayerSequence, layer_sequence
from edgeswarm.values.profiles import ModelSpec

# Bump whenever an architecture, an initialisation or a default changes: profiles keyed by the old
# fingerprints then stop matching instead of silently describing a different model.
ZOO_VERSION = "1"

ConfigValue = int | float | str | bool
Config = dict[str, ConfigValue]


@dataclass(frozen=True)
class _Entry:
    """How to build one zoo model: its defaults, builder, input kind, and ``finish``, which validates a
    merged config and fills in derived values in place."""

    defaults: Config
    build: Callable[[Config], nn.Module]
    tokens: bool = False
    finish: Callable[[Config], None] = lambda cfg: None
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_image(min_size: int, multiple: int = 1) -> Callable[[Config], None]:
    def check(cfg: Config) -> None:
        size = int(cfg["image_size"])
        _require(size >= min_size and size % multiple == 0,
                 f"image_size {size} is not supported: use at least {min_size}"
                 + (f" and a multiple of {multiple}" if multiple > 1 else ""))

    return check


def _check_resnet(cfg: Config) -> None:
    # The ImageNet stem and four stages reduce the image 32x; the CIFAR stem 8x.
    _check_image(8 if cnn.uses_cifar_stem(cfg) else 32)(cfg)


def _check_bert(cfg: Config) -> None:
    _require(int(cfg["hidden"]) % int(cfg["heads"]) == 0,
             f"hidden ({cfg['hidden']}) must be a multiple of heads ({cfg['heads']})")
    if int(cfg["intermediate_size"]) == 0:
        cfg["intermediate_size"] = 4 * int(cfg["hidden"])


def _check_gpt2(cfg: Config) -> None:
    _require(int(cfg["n_embd"]) % int(cfg["n_head"]) == 0,
             f"n_embd ({cfg['n_embd']}) must be a multiple of n_head ({cfg['n_head']})")


_IMAGE: Config = {"in_channels": 3, "image_size": 32, "num_classes": 10, "width": 1.0, "seed": 0}
_STEM = {"stem": ("auto", "cifar", "imagenet")}

_ENTRIES: dict[str, _Entry] = {
    "mlp": _Entry({**_IMAGE, "in_channels": 1, "image_size": 28, "hidden": 256, "layers": 2}, cnn.build_mlp),
    "lenet5": _Entry({**_IMAGE, "in_channels": 1}, cnn.LeNet5, finish=_check_image(16)),
    "vgg11": _Entry({**_IMAGE, "batch_norm": True}, lambda c: cnn.VGG(cnn.VGG_LAYOUTS["vgg11"], c),
                    finish=_check_image(32, 32)),
    "vgg16": _Entry({**_IMAGE, "batch_norm": True}, lambda c: cnn.VGG(cnn.VGG_LAYOUTS["vgg16"], c),
                    finish=_check_image(32, 32)),
    "resnet18": _Entry({**_IMAGE, "stem": "auto"}, lambda c: cnn.ResNet(cnn.BasicBlock, [2, 2, 2, 2], c),
                       finish=_check_resnet, choices=_STEM),
    "resnet50": _Entry({**_IMAGE, "stem": "auto"}, lambda c: cnn.ResNet(cnn.Bottleneck, [3, 4, 6, 3], c),
                       finish=_check_resnet, choices=_STEM),
    "mobilenetv2": _Entry({**_IMAGE, "stem": "auto"}, mobile.MobileNetV2, finish=_check_image(8), choices=_STEM),
    "efficientnet-b0": _Entry({**_IMAGE, "stem": "auto"}, lambda c: mobile.EfficientNet("efficientnet-b0", c),
                              finish=_check_image(8), choices=_STEM),
    "efficientnet-b1": _Entry({**_IMAGE, "stem": "auto"}, lambda c: mobile.EfficientNet("efficientnet-b1", c),
                              finish=_check_image(8), choices=_STEM),
    "bert-small": _Entry({"vocab_size": 30522, "seq_len": 128, "layers": 4, "hidden": 512, "heads": 8,
                          "intermediate_size": 0, "num_classes": 2, "seed": 0},
                         transformer.BertClassifier, tokens=True, finish=_check_bert),
    "gpt2": _Entry({"vocab_size": 50257, "seq_len": 128, "n_layer": 12, "n_embd": 768, "n_head": 12, "seed": 0},
                   transformer.GPT2, tokens=True, finish=_check_gpt2),
}

MODEL_NAMES: tuple[str, ...] = tuple(_ENTRIES)

# Keys that may be 0 (everything else numeric must be positive).
_MAY_BE_ZERO = {"seed", "layers", "intermediate_size", "n_layer"}


def _entry(name: str) -> _Entry:
    try:
        return _ENTRIES[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; the zoo has: {', '.join(MODEL_NAMES)}") from None


def _coerce(name: str, key: str, value: object, default: ConfigValue, choices: tuple[str, ...] | None) -> ConfigValue:
    where = f"model {name!r} config key {key!r}"
    if isinstance(default, bool):
        _require(isinstance(value, bool), f"{where} must be true or false, not {value!r}")
        return bool(value)
    if isinstance(default, int):
        _require(isinstance(value, int) and not isinstance(value, bool), f"{where} must be an integer, not {value!r}")
        assert isinstance(value, int)
        _require(value > 0 or (key in _MAY_BE_ZERO and value == 0),
                 f"{where} must be {'>= 0' if key in _MAY_BE_ZERO else '>= 1'}, not {value}")
        return value
    if isinstance(default, float):
        # Ints are accepted and stored as floats so that {"width": 1} and {"width": 1.0} fingerprint alike.
        _require(isinstance(value, int | float) and not isinstance(value, bool) and float(value) > 0,
                 f"{where} must be a positive number, not {value!r}")
        assert isinstance(value, int | float)
        return float(value)
    _require(isinstance(value, str), f"{where} must be a string, not {value!r}")
    assert isinstance(value, str)
    if choices is not None:
        _require(value in choices, f"{where} must be one of {', '.join(choices)}, not {value!r}")
    return value


def resolved_config(spec: ModelSpec) -> Config:
    """The spec's config with every default filled in, types normalised and derived values resolved.

    Raises ConfigError for an unknown model, an unknown key (listing the valid ones) or a bad value.
    """
    entry = _entry(spec.name)
    unknown = sorted(set(spec.config) - set(entry.defaults))
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(unknown)} for model {spec.name!r}; "
                          f"valid keys: {', '.join(sorted(entry.defaults))}")
    cfg = dict(entry.defaults)
    for key, value in spec.config.items():
        cfg[key] = _coerce(spec.name, key, value, entry.defaults[key], entry.choices.get(key))
    entry.finish(cfg)
    return cfg


def build_model(spec: ModelSpec) -> nn.Module:
    """A freshly initialised model (train mode, float32, CPU). The same spec gives bit-identical weights in
    every process: initialisation is seeded from config "seed" and the global RNG is left untouched.

    Raises ConfigError for an unknown model name or a bad config.
    """
    cfg = resolved_config(spec)
    # Only the CPU generator is forked and seeded: CUDA generators must not be disturbed either.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(cfg["seed"]))
        model = _entry(spec.name).build(cfg)
    return model.train()


@contextmanager
def without_weights() -> Iterator[None]:
    """Build models and stages inside on torch's meta device: shapes, dtypes and byte counts without allocating a
    weight, and every random number generator left as it was, so a real build that follows is initialised exactly
    as without this one."""
    # build_model forks the CPU generator around its seeded initialisation; this fork also covers tracing and
    # stage building, so nothing a meta build does can shift a later draw.
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        yield


def unit_count(spec: ModelSpec) -> int:
    """How many units the zoo model's layer sequence has (a trace of the model, no weight allocated). Raises
    ConfigError for a bad spec, ModelTraceError when the model cannot be traced."""
    with without_weights():
        return len(layer_sequence(build_model(spec)))


def model_fingerprint(spec: ModelSpec) -> str:
    """Hex SHA-256 of the zoo version, the model name and the fully resolved config: the same in every process
    and on every machine for the same model, different when anything that changes the model changes."""
    canonical = json.dumps({"zoo": ZOO_VERSION, "name": spec.name, "config": resolved_config(spec)},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _check_batch(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BatchSizeError(f"batch size must be an integer >= 1, not {batch_size!r}")


def _tokens(cfg: Config, batch_size: int, seed: int) -> torch.Tensor:
    # One extra token so that a language model's next-token labels continue its inputs.
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, int(cfg["vocab_size"]), (batch_size, int(cfg["seq_len"]) + 1), generator=gen)


def example_input(spec: ModelSpec, batch_size: int, seed: int = 0) -> torch.Tensor:
    """A deterministic synthetic input batch: float32 N(0,1) images of shape (batch, C, H, W), or int64 token
    ids of shape (batch, seq_len). Raises BatchSizeError for a batch size below 1."""
    _check_batch(batch_size)
    cfg = resolved_config(spec)
    if _entry(spec.name).tokens:
        return _tokens(cfg, batch_size, seed)[:, :-1].contiguous()
    gen = torch.Generator().manual_seed(seed)
    side = int(cfg["image_size"])
    return torch.randn((batch_size, int(cfg["in_channels"]), side, side), generator=gen, dtype=torch.float32)


def example_stage_input(spec: ModelSpec, sequence: LayerSequence, start: int, batch_size: int) -> torch.Tensor:
    """``example_input`` as it enters unit ``start`` of ``sequence`` (the model's layer sequence): run through units
    [0, start) without gradients, in evaluation mode so BatchNorm statistics stay untouched (the units' training
    flags are restored after)."""
    x = example_input(spec, batch_size)
    if start > 0:
        before = sequence.build_stage(0, start)
        with torch.no_grad():
            before.eval()
            x = before(x)
            before.train()
    return x


def example_target(spec: ModelSpec, batch_size: int, seed: int = 0) -> torch.Tensor:
    """Deterministic int64 labels for ``example_input(spec, batch_size, seed)``: class indices of shape (batch,),
    or for "gpt2" the next-token labels (the inputs shifted by one) of shape (batch, seq_len)."""
    _check_batch(batch_size)
    cfg = resolved_config(spec)
    if spec.name == "gpt2":
        return _tokens(cfg, batch_size, seed)[:, 1:].contiguous()
    # A different stream from the inputs' so that labels are independent of the images.
    gen = torch.Generator().manual_seed(seed + 0x5EED)
    return torch.randint(0, int(cfg["num_classes"]), (batch_size,), generator=gen)

