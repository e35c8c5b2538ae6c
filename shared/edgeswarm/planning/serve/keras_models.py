"""Pure-Python layer DAGs of four Keras ``applications`` models at their ImageNet defaults (no TensorFlow):
MobileNetV2 (224), EfficientNetB1 (240), ResNet50 (224) and InceptionResNetV2 (299).

Granularity is Keras's: Conv2D, BatchNormalization, Activation, Add, Concatenate, padding and pooling are
separate layers; shapes exclude the batch; parameter counts split trainable / non-trainable as Keras does
(BatchNormalization's moving mean and variance are non-trainable). Layer names follow Keras (explicit names
where the application names its layers, auto names ``conv2d_3`` etc. elsewhere) so the linearisation can be
compared with the reference's lists. Architectures written from the published papers / Keras docs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from edgeswarm.planning.serve.graph import Layer, LayerGraph

Shape = tuple[int, int, int]


@dataclass
class _T:
    """A tensor: the layer that produced it and its (H, W, C) shape."""

    name: str
    shape: Shape


@dataclass
class Builder:
    """Builds a LayerGraph layer by layer, with Keras's auto names for unnamed layers."""

    layers: list[Layer] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    def _name(self, base: str, name: str | None) -> str:
        if name is not None:
            return name
        n = self.counters.get(base, 0)
        self.counters[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def _add(self, base: str, name: str | None, inputs: list[_T], shape: Shape, trainable: int = 0,
             nontrainable: int = 0) -> _T:
        nm = self._name(base, name)
        numel = shape[0] * shape[1] * shape[2]
        self.layers.append(Layer(nm, tuple(t.name for t in inputs), numel, trainable, nontrainable, base))
        return _T(nm, shape)

    def input(self, shape: Shape) -> _T:
        return self._add("input", "input_1", [], shape)

    def conv(self, x: _T, filters: int, kernel: int | tuple[int, int], strides: int = 1, padding: str = "same",
             use_bias: bool = True, name: str | None = None, depthwise: bool = False) -> _T:
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        h, w, c = x.shape
        if padding == "same":
            oh, ow = math.ceil(h / strides), math.ceil(w / strides)
        else:
            oh, ow = (h - kh) // strides + 1, (w - kw) // strides + 1
        out = c if depthwise else filters
        params = kh * kw * c * (1 if depthwise else filters) + (out if use_bias else 0)
        return self._add("depthwise_conv2d" if depthwise else "conv2d", name, [x], (oh, ow, out), params)

    def bn(self, x: _T, name: str | None = None, scale: bool = True) -> _T:
        c = x.shape[2]
        return self._add("batch_normalization", name, [x], x.shape, (2 if scale else 1) * c, 2 * c)

    def act(self, x: _T, name: str | None = None) -> _T:
        return self._add("activation", name, [x], x.shape)

    def relu(self, x: _T, name: str | None = None) -> _T:
        return self._add("re_lu", name, [x], x.shape)

    def pad(self, x: _T, top: int, bottom: int, left: int, right: int, name: str | None = None) -> _T:
        h, w, c = x.shape
        return self._add("zero_padding2d", name, [x], (h + top + bottom, w + left + right, c))

    def pool(self, x: _T, size: int, strides: int, padding: str = "valid", kind: str = "max_pooling2d",
             name: str | None = None) -> _T:
        h, w, c = x.shape
        if padding == "same":
            shape = (math.ceil(h / strides), math.ceil(w / strides), c)
        else:
            shape = ((h - size) // strides + 1, (w - size) // strides + 1, c)
        return self._add(kind, name, [x], shape)

    def gap(self, x: _T, name: str | None = None) -> _T:
        return self._add("global_average_pooling2d", name, [x], (1, 1, x.shape[2]))

    def merge(self, xs: list[_T], kind: str, name: str | None = None) -> _T:
        h, w, _ = xs[0].shape
        c = sum(t.shape[2] for t in xs) if kind == "concatenate" else xs[0].shape[2]
        return self._add(kind, name, xs, (h, w, c))

    def simple(self, xs: list[_T], kind: str, name: str | None, shape: Shape | None = None,
               nontrainable: int = 0) -> _T:
        return self._add(kind, name, xs, shape or xs[0].shape, 0, nontrainable)

    def dense(self, x: _T, units: int, name: str | None = None) -> _T:
        return self._add("dense", name, [x], (1, 1, units), x.shape[2] * units + units)

    def graph(self) -> LayerGraph:
        return LayerGraph(tuple(self.layers))


def _correct_pad(size: int, kernel: int) -> tuple[int, int]:
    """Keras's correct_pad for a stride-2 'valid' conv: (before, after) padding of one spatial axis."""
    adjust = 1 - size % 2
    half = kernel // 2
    return half - adjust, half


def resnet50() -> LayerGraph:
    """Keras ResNet50 (v1, 224 x 224): 25,636,712 parameters."""
    b = Builder()
    x = b.input((224, 224, 3))
    x = b.pad(x, 3, 3, 3, 3, "conv1_pad")
    x = b.conv(x, 64, 7, 2, "valid", name="conv1_conv")
    x = b.bn(x, "conv1_bn")
    x = b.act(x, "conv1_relu")
    x = b.pad(x, 1, 1, 1, 1, "pool1_pad")
    x = b.pool(x, 3, 2, name="pool1_pool")

    def block(x: _T, filters: int, stride: int, shortcut_conv: bool, name: str) -> _T:
        if shortcut_conv:
            sc = b.conv(x, 4 * filters, 1, stride, name=f"{name}_0_conv")
            sc = b.bn(sc, f"{name}_0_bn")
        else:
            sc = x
        y = b.conv(x, filters, 1, stride, name=f"{name}_1_conv")
        y = b.bn(y, f"{name}_1_bn")
        y = b.act(y, f"{name}_1_relu")
        y = b.conv(y, filters, 3, 1, "same", name=f"{name}_2_conv")
        y = b.bn(y, f"{name}_2_bn")
        y = b.act(y, f"{name}_2_relu")
        y = b.conv(y, 4 * filters, 1, name=f"{name}_3_conv")
        y = b.bn(y, f"{name}_3_bn")
        y = b.merge([sc, y], "add", f"{name}_add")
        return b.act(y, f"{name}_out")

    for stack, (filters, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], 2):
        x = block(x, filters, stride, True, f"conv{stack}_block1")
        for i in range(2, blocks + 1):
            x = block(x, filters, 1, False, f"conv{stack}_block{i}")
    x = b.gap(x, "avg_pool")
    b.dense(x, 1000, "predictions")
    return b.graph()


def _divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def mobilenet_v2() -> LayerGraph:
    """Keras MobileNetV2 (alpha 1.0, 224 x 224): 3,538,984 parameters."""
    b = Builder()
    x = b.input((224, 224, 3))
    x = b.conv(x, 32, 3, 2, "same", use_bias=False, name="Conv1")
    x = b.bn(x, "bn_Conv1")
    x = b.relu(x, "Conv1_relu")
    cfg = [(16, 1, 1), (24, 2, 6), (24, 1, 6), (32, 2, 6), (32, 1, 6), (32, 1, 6), (64, 2, 6), (64, 1, 6),
           (64, 1, 6), (64, 1, 6), (96, 1, 6), (96, 1, 6), (96, 1, 6), (160, 2, 6), (160, 1, 6), (160, 1, 6),
           (320, 1, 6)]
    for block_id, (filters, stride, expansion) in enumerate(cfg):
        inp = x
        c_in = x.shape[2]
        out = _divisible(filters)
        if block_id:
            prefix = f"block_{block_id}_"
            x = b.conv(x, expansion * c_in, 1, use_bias=False, name=prefix + "expand")
            x = b.bn(x, prefix + "expand_BN")
            x = b.relu(x, prefix + "expand_relu")
        else:
            prefix = "expanded_conv_"
        if stride == 2:
            p0, p1 = _correct_pad(x.shape[0], 3)
            x = b.pad(x, p0, p1, p0, p1, prefix + "pad")
        x = b.conv(x, 0, 3, stride, "same" if stride == 1 else "valid", use_bias=False, name=prefix + "depthwise",
                   depthwise=True)
        x = b.bn(x, prefix + "depthwise_BN")
        x = b.relu(x, prefix + "depthwise_relu")
        x = b.conv(x, out, 1, use_bias=False, name=prefix + "project")
        x = b.bn(x, prefix + "project_BN")
        if c_in == out and stride == 1:
            x = b.merge([inp, x], "add", prefix + "add")
    x = b.conv(x, 1280, 1, use_bias=False, name="Conv_1")
    x = b.bn(x, "Conv_1_bn")
    x = b.relu(x, "out_relu")
    x = b.gap(x, "global_average_pooling2d")
    b.dense(x, 1000, "predictions")
    return b.graph()


def efficientnet_b1() -> LayerGraph:
    """Keras EfficientNetB1 (240 x 240, width 1.0, depth 1.1): 7,856,239 parameters (7 of them the input
    Normalization layer's mean, variance and count)."""
    b = Builder()
    x = b.input((240, 240, 3))
    x = b.simple([x], "rescaling", "rescaling")
    x = b.simple([x], "normalization", "normalization", nontrainable=7)
    p0, p1 = _correct_pad(240, 3)
    x = b.pad(x, p0, p1, p0, p1, "stem_conv_pad")
    x = b.conv(x, 32, 3, 2, "valid", use_bias=False, name="stem_conv")
    x = b.bn(x, "stem_bn")
    x = b.act(x, "stem_activation")
    args = [(3, 1, 32, 16, 1, 1), (3, 2, 16, 24, 6, 2), (5, 2, 24, 40, 6, 2), (3, 3, 40, 80, 6, 2),
            (5, 3, 80, 112, 6, 1), (5, 4, 112, 192, 6, 2), (3, 1, 192, 320, 6, 1)]
    blocks = sum(math.ceil(1.1 * a[1]) for a in args)
    drop_connect = 0.2
    count = 0
    for i, (kernel, repeats, f_in0, f_out, expand, stride0) in enumerate(args):
        for j in range(math.ceil(1.1 * repeats)):
            f_in = f_in0 if j == 0 else f_out
            stride = stride0 if j == 0 else 1
            name = f"block{i + 1}{chr(j + 97)}_"
            inp = x
            filters = f_in * expand
            if expand != 1:
                x = b.conv(x, filters, 1, use_bias=False, name=name + "expand_conv")
                x = b.bn(x, name + "expand_bn")
                x = b.act(x, name + "expand_activation")
            if stride == 2:
                p0, p1 = _correct_pad(x.shape[0], kernel)
                x = b.pad(x, p0, p1, p0, p1, name + "dwconv_pad")
            x = b.conv(x, 0, kernel, stride, "same" if stride == 1 else "valid", use_bias=False,
                       name=name + "dwconv", depthwise=True)
            x = b.bn(x, name + "bn")
            x = b.act(x, name + "activation")
            se_filters = max(1, int(f_in * 0.25))
            se = b.gap(x, name + "se_squeeze")
            se = b.simple([se], "reshape", name + "se_reshape")
            se = b.conv(se, se_filters, 1, name=name + "se_reduce")
            se = b.conv(se, filters, 1, name=name + "se_expand")
            x = b.merge([x, se], "multiply", name + "se_excite")
            x = b.conv(x, f_out, 1, use_bias=False, name=name + "project_conv")
            x = b.bn(x, name + "project_bn")
            if stride == 1 and f_in == f_out:
                if drop_connect * count / blocks > 0:
                    x = b.simple([x], "dropout", name + "drop")
                x = b.merge([x, inp], "add", name + "add")
            count += 1
    x = b.conv(x, 1280, 1, use_bias=False, name="top_conv")
    x = b.bn(x, "top_bn")
    x = b.act(x, "top_activation")
    x = b.gap(x, "avg_pool")
    x = b.simple([x], "dropout", "top_dropout")
    b.dense(x, 1000, "predictions")
    return b.graph()


def inception_resnet_v2() -> LayerGraph:
    """Keras InceptionResNetV2 (299 x 299): 55,873,736 parameters, 105 candidate points."""
    b = Builder()

    def cbn(x: _T, filters: int, kernel: int | tuple[int, int], strides: int = 1, padding: str = "same",
            activation: bool = True, use_bias: bool = False, name: str | None = None) -> _T:
        x = b.conv(x, filters, kernel, strides, padding, use_bias=use_bias, name=name)
        if not use_bias:
            x = b.bn(x, None if name is None else name + "_bn", scale=False)
        if activation:
            x = b.act(x, None if name is None else name + "_ac")
        return x

    x = b.input((299, 299, 3))
    x = cbn(x, 32, 3, 2, "valid")
    x = cbn(x, 32, 3, padding="valid")
    x = cbn(x, 64, 3)
    x = b.pool(x, 3, 2)
    x = cbn(x, 80, 1, padding="valid")
    x = cbn(x, 192, 3, padding="valid")
    x = b.pool(x, 3, 2)
    b0 = cbn(x, 96, 1)
    b1 = cbn(cbn(x, 48, 1), 64, 5)
    b2 = cbn(cbn(cbn(x, 64, 1), 96, 3), 96, 3)
    bp = cbn(b.pool(x, 3, 1, "same", kind="average_pooling2d"), 64, 1)
    x = b.merge([b0, b1, b2, bp], "concatenate", "mixed_5b")

    def block(x: _T, kind: str, idx: int, activation: bool = True) -> _T:
        if kind == "block35":
            branches = [cbn(x, 32, 1), cbn(cbn(x, 32, 1), 32, 3), cbn(cbn(cbn(x, 32, 1), 48, 3), 64, 3)]
        elif kind == "block17":
            branches = [cbn(x, 192, 1), cbn(cbn(cbn(x, 128, 1), 160, (1, 7)), 192, (7, 1))]
        else:
            branches = [cbn(x, 192, 1), cbn(cbn(cbn(x, 192, 1), 224, (1, 3)), 256, (3, 1))]
        name = f"{kind}_{idx}"
        mixed = b.merge(branches, "concatenate", name + "_mixed")
        up = cbn(mixed, x.shape[2], 1, activation=False, use_bias=True, name=name + "_conv")
        x = b.simple([x, up], "lambda", name)  # x + scale * up
        return b.act(x, name + "_ac") if activation else x

    for i in range(1, 11):
        x = block(x, "block35", i)
    b0 = cbn(x, 384, 3, 2, "valid")
    b1 = cbn(cbn(cbn(x, 256, 1), 256, 3), 384, 3, 2, "valid")
    bp = b.pool(x, 3, 2)
    x = b.merge([b0, b1, bp], "concatenate", "mixed_6a")
    for i in range(1, 21):
        x = block(x, "block17", i)
    b0 = cbn(cbn(x, 256, 1), 384, 3, 2, "valid")
    b1 = cbn(cbn(x, 256, 1), 288, 3, 2, "valid")
    b2 = cbn(cbn(cbn(x, 256, 1), 288, 3), 320, 3, 2, "valid")
    bp = b.pool(x, 3, 2)
    x = b.merge([b0, b1, b2, bp], "concatenate", "mixed_7a")
    for i in range(1, 10):
        x = block(x, "block8", i)
    x = block(x, "block8", 10, activation=False)
    x = cbn(x, 1536, 1, name="conv_7b")
    x = b.gap(x, "avg_pool")
    b.dense(x, 1000, "predictions")
    return b.graph()


MODELS: dict[str, Callable[[], LayerGraph]] = {
    "MobileNetV2": mobilenet_v2,
    "EfficientNetB1": efficientnet_b1,
    "ResNet50": resnet50,
    "InceptionResNetV2": inception_resnet_v2,
}
