"""What every method shares: optimizers from partials, sampling, export."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warm-up to the base LR, then cosine decay to ``min_ratio`` of it at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Images (N, C, H, W) -> a sample of the VAE posterior times ``scaling_factor`` (Rombach et al. 2022)."""
    dist = vae.encode(pixels).latent_dist
    noise = torch.randn(dist.mean.shape, generator=generator).to(dist.mean)
    return (dist.mean + dist.std * noise) * vae.config.scaling_factor


def text_to_image_pipeline(vae, conditioner, unet, scheduler, **call_defaults):
    """A frozen VAE and text encoder plus ``unet`` as an in-memory StableDiffusionPipeline whose call defaults
    (``default_num_inference_steps``, ``default_guidance_scale``, ``guidance_distilled``) are ``call_defaults``."""
    from distill.inference.pipelines import DistillTextToImagePipeline

    pipe = DistillTextToImagePipeline(
        vae=vae, text_encoder=conditioner.text_encoder, tokenizer=conditioner.tokenizer, unet=unet,
        scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        **call_defaults,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def pipeline_images(pipe, captions: list[str], generator: torch.Generator, num_inference_steps: int | None = None,
                    guidance_scale: float | None = None) -> torch.Tensor:
    """Images (N, C, H, W) in [-1, 1] from a text-to-image pipeline at its UNet's native size, in eval mode
    (``None``: the pipeline's default step count or guidance)."""
    was_training = pipe.unet.training
    pipe.unet.eval()
    size = pipe.unet.config.sample_size * pipe.vae_scale_factor
    images = pipe(list(captions), num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                  height=size, width=size, generator=generator, output_type="pt").images
    pipe.unet.train(was_training)
    return images * 2.0 - 1.0


class DistillMethod(L.LightningModule):
    """Base of every method: ``self.student`` is what trains; ``optimizer``/``lr_scheduler`` are partials."""

    def __init__(self, optimizer: Callable, lr_scheduler: Callable | None = None):
        super().__init__()
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler

    def add_student_aux_loss(self, loss: torch.Tensor, batch_size: int) -> torch.Tensor:
        """``loss`` plus the auxiliary loss of a mixture-of-experts student's last own forward (router load
        balancing, z-loss; a stop-gradient target pass does not replace it), whose router statistics
        (expert load overall and per noise level) are logged."""
        from distill.models.moe import moe_aux_and_stats

        aux, stats = moe_aux_and_stats(self.student)
        if stats:
            self.log_dict(stats, batch_size=batch_size)
        if aux is None:
            return loss
        self.log("train/aux_loss", aux, batch_size=batch_size)
        return loss + aux

    def trainable_parameters(self):
        return [p for p in self.student.parameters() if p.requires_grad]

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.trainable_parameters())
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def generate(self, batch: dict, generator: torch.Generator) -> torch.Tensor:
        """Images (N, C, H, W) in [-1, 1] for the conditions in ``batch``; each method defines how."""
        raise NotImplementedError

    def export(self, out_dir: str | Path) -> Path:
        """Save the student in an ecosystem format (a diffusers folder); each method defines which."""
        raise NotImplementedError
