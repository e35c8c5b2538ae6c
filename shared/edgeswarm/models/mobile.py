"""Mobile image classifiers in plain torch: MobileNetV2 and EfficientNet-B0/B1 (MBConv with squeeze-excitation).

Both follow the published layouts. For small images (``stem`` "cifar", or "auto" below 96 pixels) the first
strides are removed so that a 32x32 input is not reduced to nothing, as CIFAR ports of these models do.
No dropout or stochastic depth: a pipeline-trained model must match single-process training bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from edgeswarm.models.cnn import Config, uses_cifar_stem


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a channel count to the nearest multiple of ``divisor``, never dropping below 90% of ``value``."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def conv_bn_act(
    cin: int, cout: int, kernel: int, stride: int, act: type[nn.Module], groups: int = 1
) -> list[nn.Module]:
    """Bias-free convolution with "same" padding, BatchNorm and an activation (pass nn.Identity for none)."""
    mods: list[nn.Module] = [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    ]
    if act is not nn.Identity:
        mods.append(act())
    return mods


# --- MobileNetV2 -----------------------------------------------------------------------------------------

# (expansion t, output channels c, repeats n, first stride s), from the MobileNetV2 paper's Table 2.
MOBILENETV2_LAYOUT = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                      (6, 160, 3, 2), (6, 320, 1, 1)]


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear projection; identity shortcut when shapes match."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        mods: list[nn.Module] = []
        if expansion != 1:
            mods += conv_bn_act(cin, hidden, 1, 1, nn.ReLU6)
        mods += conv_bn_act(hidden, hidden, 3, stride, nn.ReLU6, groups=hidden)
        mods += conv_bn_act(hidden, cout, 1, 1, nn.Identity)
        self.body = nn.Sequential(*mods)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return x + out if self.residual else out


class MobileNetV2(nn.Module):
    """MobileNetV2 with width multiplier; 1280-channel head (wider when the width multiplier exceeds 1)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        w = float(cfg["width"])
        cifar = uses_cifar_stem(cfg)
        cin = make_divisible(32 * w)
        mods: list[nn.Module] = conv_bn_act(int(cfg["in_channels"]), cin, 3, 1 if cifar else 2, nn.ReLU6)
        for i, (t, c, n, s) in enumerate(MOBILENETV2_LAYOUT):
            cout = make_divisible(c * w)
            # The CIFAR port keeps full resolution through the first downsampling stage too.
            first_stride = 1 if cifar and i == 1 else s
            for j in range(n):
                mods.append(InvertedResidual(cin, cout, first_stride if j == 0 else 1, t))
                cin = cout
        last = make_divisible(1280 * max(1.0, w))
        mods += conv_bn_act(cin, last, 1, 1, nn.ReLU6)
        self.features = nn.Sequential(*mods)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.classifier = nn.Linear(last, int(cfg["num_classes"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.pool(self.features(x))))


# --- EfficientNet ----------------------------------------------------------------------------------------

# (expansion, kernel, first stride, output channels, repeats) of EfficientNet-B0 (Tan & Le 2019, Table 1).
EFFICIENTNET_B0_LAYOUT = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
                          (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]

# (width coefficient, depth coefficient) of the compound scaling.
EFFICIENTNET_SCALING = {"efficientnet-b0": (1.0, 1.0), "efficientnet-b1": (1.0, 1.1)}


class SqueezeExcite(nn.Module):
    """Channel attention: global average pool, 1x1 reduce + SiLU, 1x1 expand + sigmoid, rescale the input."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.act = nn.SiLU()
        self.expand = nn.Conv2d(squeezed, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.expand(self.act(self.reduce(self.pool(x)))))


class MBConv(nn.Module):
    """EfficientNet block: optional 1x1 expand, kxk depthwise, squeeze-excitation (ratio 0.25 of the block's
    input channels), 1x1 projection; identity shortcut when shapes match."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        self.expand = nn.Sequential(*conv_bn_act(cin, hidden, 1, 1, nn.SiLU)) if expansion != 1 else None
        self.depthwise = nn.Sequential(*conv_bn_act(hidden, hidden, kernel, stride, nn.SiLU, groups=hidden))
        self.se = SqueezeExcite(hidden, max(1, cin // 4))
        self.project = nn.Sequential(*conv_bn_act(hidden, cout, 1, 1, nn.Identity))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x if self.expand is None else self.expand(x)
        out = self.project(self.se(self.depthwise(out)))
        return x + out if self.residual else out


class EfficientNet(nn.Module):
    """EfficientNet-B0/B1 by compound scaling of the B0 layout; ``width`` multiplies the variant's width."""

    def __init__(self, variant: str, cfg: Config) -> None:
        super().__init__()
        width_coef, depth_coef = EFFICIENTNET_SCALING[variant]
        w = width_coef * float(cfg["width"])
        cin = make_divisible(32 * w)
        stem_stride = 1 if uses_cifar_stem(cfg) else 2
        self.stem = nn.Sequential(*conv_bn_act(int(cfg["in_channels"]), cin, 3, stem_stride, nn.SiLU))
        blocks: list[nn.Module] = []
        for expansion, kernel, stride, channels, repeats in EFFICIENTNET_B0_LAYOUT:
            cout = make_divisible(channels * w)
            for j in range(math.ceil(repeats * depth_coef)):
                blocks.append(MBConv(cin, cout, kernel, stride if j == 0 else 1, expansion))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        head = make_divisible(1280 * w)
        self.head = nn.Sequential(*conv_bn_act(cin, head, 1, 1, nn.SiLU))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.classifier = nn.Linear(head, int(cfg["num_classes"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.classifier(self.flatten(self.pool(x)))
