"""A noise-aware classifier p(y | x_t, t) on diffusion latents, the guide of classifier guidance (Dhariwal &
Nichol 2021, Sec. 4): residual conv stages whose normalised features are shifted and scaled by the timestep's
embedding (diffusers' sinusoidal ``Timesteps`` and ``TimestepEmbedding``), global average pooling, logits."""

from __future__ import annotations

import torch
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from huggingface_hub import PyTorchModelHubMixin
from torch import nn


class _TimeResBlock(nn.Module):
    """GroupNorm -> FiLM by the time embedding -> SiLU -> conv, twice, with a (1x1 where needed) skip."""

    def __init__(self, c_in: int, c_out: int, time_dim: int, groups: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(groups, c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.film = nn.Linear(time_dim, 2 * c_out)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.act(self.norm1(x)))
        scale, shift = self.film(self.act(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.conv2(self.act(self.norm2(h) * (1 + scale) + shift))
        return self.skip(x) + h


class NoisyLatentClassifier(nn.Module, PyTorchModelHubMixin):
    """Logits (N, num_classes) of noisy latents (N, in_channels, sample_size, sample_size) at timesteps (N,) or ().

    ``save_pretrained`` / ``from_pretrained`` come from the hub mixin (config.json + model.safetensors)."""

    def __init__(self, in_channels: int = 4, sample_size: int = 8, channels: tuple[int, ...] | list[int] = (64, 128),
                 time_dim: int = 128, num_classes: int = 10, groups: int = 8):
        super().__init__()
        self.in_channels, self.sample_size, self.num_classes = in_channels, sample_size, num_classes
        self.time_proj = Timesteps(channels[0], flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedding = TimestepEmbedding(channels[0], time_dim)
        self.conv_in = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        blocks, c = [], channels[0]
        for c_out in channels:
            blocks.append(_TimeResBlock(c, c_out, time_dim, groups))
            c = c_out
        self.blocks = nn.ModuleList(blocks)
        self.down = nn.AvgPool2d(2)
        self.norm_out = nn.GroupNorm(groups, c)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor | int) -> torch.Tensor:
        t = torch.as_tensor(timesteps, device=x.device).reshape(-1).expand(x.shape[0])
        emb = self.time_embedding(self.time_proj(t).to(x.dtype))
        h = self.conv_in(x)
        for i, block in enumerate(self.blocks):
            h = block(h, emb)
            if i < len(self.blocks) - 1:
                h = self.down(h)
        h = torch.nn.functional.silu(self.norm_out(h)).mean(dim=(2, 3))
        return self.head(h)
