"""Prompt adherence on the digits world: the share of samples the digit classifier reads as the prompted digit."""

from __future__ import annotations

import torch

from distill.data.digits import caption_for


@torch.no_grad()
def generate_digits(pipe, num_per_digit: int, num_inference_steps: int, guidance_scale: float, seed: int = 0,
                    batch_size: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (10 * n, C, H, W) in [-1, 1] from a StableDiffusionPipeline and their prompted labels."""
    labels = torch.arange(10).repeat_interleave(num_per_digit)
    generator = torch.Generator().manual_seed(seed)
    size = pipe.unet.config.sample_size * pipe.vae_scale_factor
    images = []
    for start in range(0, len(labels), batch_size):
        prompts = [caption_for(int(i)) for i in labels[start:start + batch_size]]
        out = pipe(prompts, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                   height=size, width=size, generator=generator, output_type="pt").images  # [0, 1]
        images.append(out * 2.0 - 1.0)
    return torch.cat(images), labels


@torch.no_grad()
def prompted_digit_accuracy(images: torch.Tensor, labels: torch.Tensor, classifier) -> float:
    """Fraction of ``images`` (N, 1, H, W) in [-1, 1] that ``classifier`` assigns to ``labels``."""
    logits = torch.cat([classifier(chunk) for chunk in images.split(256)])
    return (logits.argmax(1) == labels.to(logits.device)).float().mean().item()
