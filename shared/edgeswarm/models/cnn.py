"""Classic image classifiers in plain torch: MLP, LeNet-5, VGG-11/16 and ResNet-18/50.

Every ``forward`` is torch.fx traceable: Python branches depend only on the architecture, never on data.
Builders take an already resolved and validated config (edgeswarm.models.zoo does that).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Config = dict[str, Any]


def scaled(channels: int, width: float) -> int:
    """``channels`` times the width multiplier, rounded, and at least 1."""
    return max(1, round(channels * width))


def uses_cifar_stem(cfg: Config, threshold: int = 96) -> bool:
    """Whether to use the small-image stem: ``stem`` "cifar", or "auto" with an image under ``threshold`` pixels."""
    if cfg["stem"] == "auto":
        return int(cfg["image_size"]) < threshold
    return cfg["stem"] == "cifar"


# --- MLP -------------------------------------------------------------------------------------------------


def build_mlp(cfg: Config) -> nn.Module:
    """A flatten followed by ``layers`` hidden Linear+ReLU pairs and a Linear classifier."""
    in_features = int(cfg["in_channels"]) * int(cfg["image_size"]) ** 2
    hidden = scaled(int(cfg["hidden"]), float(cfg["width"]))
    mods: list[nn.Module] = [nn.Flatten()]
    for _ in range(int(cfg["layers"])):
        mods += [nn.Linear(in_features, hidden), nn.ReLU()]
        in_features = hidden
    mods.append(nn.Linear(in_features, int(cfg["num_classes"])))
    return nn.Sequential(*mods)


# --- LeNet-5 ---------------------------------------------------------------------------------------------


class LeNet5(nn.Module):
    """LeNet-5 with ReLU and max pooling (the usual modern reading), for 1x32x32 inputs by default."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        w = float(cfg["width"])
        c1, c2 = scaled(6, w), scaled(16, w)
        side = ((int(cfg["image_size"]) - 4) // 2 - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(int(cfg["in_channels"]), c1, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Linear(c2 * side * side, scaled(120, w)), nn.ReLU(),
            nn.Linear(scaled(120, w), scaled(84, w)), nn.ReLU(),
            nn.Linear(scaled(84, w), int(cfg["num_classes"])),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.features(x)))


# --- VGG -------------------------------------------------------------------------------------------------

VGG_LAYOUTS: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}


class VGG(nn.Module):
    """CIFAR-style VGG: 3x3 convolutions (+BatchNorm) and five max pools, then one Linear classifier."""

    def __init__(self, layout: list[int | str], cfg: Config) -> None:
        super().__init__()
        w = float(cfg["width"])
        mods: list[nn.Module] = []
        channels = int(cfg["in_channels"])
        for item in layout:
            if item == "M":
                mods.append(nn.MaxPool2d(2))
                continue
            out = scaled(int(item), w)
            mods.append(nn.Conv2d(channels, out, 3, padding=1))
            if cfg["batch_norm"]:
                mods.append(nn.BatchNorm2d(out))
            mods.append(nn.ReLU())
            channels = out
        self.features = nn.Sequential(*mods)
        self.flatten = nn.Flatten()
        side = int(cfg["image_size"]) // 32
        self.classifier = nn.Linear(channels * side * side, int(cfg["num_classes"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flatten(self.features(x)))


# --- ResNet ----------------------------------------------------------------------------------------------


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    """A bias-free convolution with "same" padding followed by BatchNorm."""
    return [nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """ResNet-18/34 block: two 3x3 convolutions and a shortcut (1x1 projection when the shape changes)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = conv_bn(cin, planes, 3, stride)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = conv_bn(planes, planes, 3)
        self.downsample = projection(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        shortcut = x if self.downsample is None else self.downsample(x)
        # Functional so that every submodule of the block sits in the block's unit; the activation after
        # the sum is a candidate cut point of its own.
        return F.relu(out + shortcut)


class Bottleneck(nn.Module):
    """ResNet-50 block (v1.5: stride on the 3x3 convolution): 1x1 reduce, 3x3, 1x1 expand by 4, shortcut."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = conv_bn(cin, planes, 1)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = conv_bn(planes, planes, 3, stride)
        self.relu2 = nn.ReLU()
        self.conv3, self.bn3 = conv_bn(planes, planes * 4, 1)
        self.downsample = projection(cin, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


def projection(cin: int, cout: int, stride: int) -> nn.Module | None:
    """The shortcut's 1x1 projection, or None when the identity fits."""
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(*conv_bn(cin, cout, 1, stride))


class ResNet(nn.Module):
    """ResNet with a CIFAR stem (3x3, stride 1, no pooling) or an ImageNet stem (7x7 stride 2 + max pool)."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], depths: list[int], cfg: Config) -> None:
        super().__init__()
        w = float(cfg["width"])
        base = scaled(64, w)
        if uses_cifar_stem(cfg):
            stem = [*conv_bn(int(cfg["in_channels"]), base, 3), nn.ReLU()]
        else:
            stem = [*conv_bn(int(cfg["in_channels"]), base, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1)]
        self.stem = nn.Sequential(*stem)
        cin = base
        stages: list[nn.Module] = []
        for i, depth in enumerate(depths):
            planes = scaled(64 * 2**i, w)
            blocks: list[nn.Module] = []
            for j in range(depth):
                blocks.append(block(cin, planes, 2 if i > 0 and j == 0 else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(cin, int(cfg["num_classes"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.fc(self.flatten(self.avgpool(x)))
