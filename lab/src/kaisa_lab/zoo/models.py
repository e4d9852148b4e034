"""ResNet-50 (He et al. 2016, as in torchvision) and BERT-Large (Devlin et al.
2019, through transformers), the two models of the SC'21 KAISA paper."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (stride here, as torchvision's v1.5), 1×1 expand ×4."""

    def __init__(self, inplanes: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * 4
        self.body = nn.Sequential(
            nn.Conv2d(inplanes, planes, 1, bias=False),
            nn.BatchNorm2d(planes),
            nn.ReLU(inplace=True),
            nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(planes),
            nn.ReLU(inplace=True),
            nn.Conv2d(planes, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.down: nn.Module = nn.Identity()
        if stride != 1 or inplanes != out:
            self.down = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.down(x))


def resnet50_model(num_classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    inplanes = 64
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
            inplanes = planes * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, num_classes)]
    return nn.Sequential(*layers)


def resnet50() -> tuple[nn.Module, tuple[Any, ...]]:
    """ImageNet ResNet-50 (25.6 M parameters) and one 224×224 image."""
    return resnet50_model(), (torch.randn(1, 3, 224, 224),)


def bert_large(sequence: int = 512) -> tuple[nn.Module, tuple[Any, ...]]:
    """BERT-Large for pre-training (24 layers, hidden 1024, 16 heads, 335 M
    parameters; needs ``transformers``) and one sequence of ``sequence`` tokens
    (phase 2 of the paper's pre-training uses 512)."""
    try:
        from transformers import BertConfig, BertForPreTraining
    except ImportError as exc:  # pragma: no cover - the extra is installed in dev
        raise ImportError(
            "kaisa_lab.zoo.bert_large needs transformers (pip install -e './lab[transformers]')"
        ) from exc
    config = BertConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=512,
    )
    model = BertForPreTraining(config)
    ids = torch.randint(0, config.vocab_size, (1, sequence))
    return model, (ids,)
