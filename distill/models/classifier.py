"""A small image classifier CNN whose penultimate layer can serve as a domain's FID feature space.

For small grey images a domain classifier replaces Inception-v3 as the FID feature network (e.g. the
"MNIST FID" of many GAN papers): Inception features of 32x32 grey images say little about them. The embedded
default world trains one (its FID features, prompt accuracy and the guide of ``mode=x0`` classifier guidance).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn
from torch.utils.checkpoint import checkpoint


def _conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


@contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """Leaves ``module``'s buffers as they were on entry: the backward pass's recomputation of a checkpointed
    stage must not add the batch to the BatchNorm running statistics a second time."""
    saved = [b.clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(module.buffers(), saved):
                b.copy_(s)


def _stage_contexts(stage: nn.Module) -> tuple:
    """``checkpoint``'s context_fn: the forward as is, the recomputation with the BatchNorm buffers kept."""
    return nullcontext(), _buffers_kept(stage)


class ImageClassifier(nn.Module, PyTorchModelHubMixin):
    """Conv-BN-ReLU stages with max pooling, global average pooling, a feature layer, then logits.

    Input: (N, C, H, W) in [-1, 1]; any other H, W is resized to ``resolution`` first, so that the
    same network scores 16x16 and 32x32 samples. ``save_pretrained`` / ``from_pretrained`` come from
    the hub mixin (config.json + model.safetensors).
    """

    gradient_checkpointing = False  # a training-time switch (enable_gradient_checkpointing), not saved in config.json

    def __init__(
        self,
        in_channels: int = 1,
        channels: tuple[int, ...] | list[int] = (32, 64, 64),
        feature_dim: int = 128,
        num_classes: int = 10,
        resolution: int = 32,
        dropout: float = 0.2,
    ):
        super().__init__()
        self.in_channels, self.resolution = in_channels, resolution
        self.feature_dim, self.num_classes = feature_dim, num_classes
        layers: list[nn.Module] = []
        c_prev = in_channels
        for i, c in enumerate(channels):
            layers.append(_conv_block(c_prev, c))
            if i > 0:  # a second conv per stage after the first: more depth where the maps are small
                layers.append(_conv_block(c, c))
            layers.append(nn.MaxPool2d(2))
            c_prev = c
        self.body = nn.Sequential(*layers)
        self.feature = nn.Sequential(nn.Linear(c_prev, feature_dim), nn.ReLU(inplace=True))
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(feature_dim, num_classes))

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.in_channels:
            if self.in_channels == 1:  # RGB samples for a grey classifier: score their luminance
                x = x.mean(dim=1, keepdim=True)
            else:
                raise ValueError(f"expected {self.in_channels} channels, got {x.shape[1]}")
        if x.shape[-2:] != (self.resolution, self.resolution):
            x = F.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear", align_corners=False)
        return x

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each stage of the body in the backward pass instead of keeping its activations
        (non-reentrant ``torch.utils.checkpoint``); only in training mode with gradients enabled."""
        self.gradient_checkpointing = True

    def _stages(self) -> list[nn.Sequential]:
        """The body cut after each pooling: the units that gradient checkpointing recomputes."""
        stages, layers = [], []
        for layer in self.body:
            layers.append(layer)
            if isinstance(layer, nn.MaxPool2d):
                stages.append(nn.Sequential(*layers))
                layers = []
        return stages

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.gradient_checkpointing and self.training and torch.is_grad_enabled()):
            return self.body(x)
        for stage in self._stages():
            x = checkpoint(stage, x, use_reentrant=False, context_fn=partial(_stage_contexts, stage))
        return x

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate-layer features (N, feature_dim), the space in which FID is measured."""
        h = self._body(self._prepare(x))
        return self.feature(h.mean(dim=(2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits (N, num_classes)."""
        return self.head(self.features(x))
