"""The class-conditional UNet: a ``UNet2DModel(num_class_embeds=num_classes + 1)`` (the last class is the null
condition of classifier-free guidance), in pixel space or on a VAE's latents, trained from scratch by plain
diffusion training (``method=diffusion``)."""

from __future__ import annotations

import torch
from torch import nn

from distill.families.base import FAMILIES, ModelFamily
from distill.inference.pipelines import DistillClassPipeline
from distill.models.conditioning import ClassConditioner


@FAMILIES.register("class_unet")
class ClassUNetFamily(ModelFamily):
    """Conditioning ``{"class_labels": (N,) long}``, the null condition class ``num_classes``; exported as a
    ``DistillClassPipeline``."""

    conditioner_type = ClassConditioner
    pipeline_class = DistillClassPipeline
    denoiser_component = "unet"

    @classmethod
    def detect(cls, configs: dict[str, dict]) -> bool:
        """A distill class pipeline, or a ``UNet2DModel`` with class embeddings."""
        unet = configs["unet"]
        return (configs["pipeline"].get("_class_name") == DistillClassPipeline.__name__
                or (unet.get("_class_name") == "UNet2DModel" and unet.get("num_class_embeds") is not None))

    @classmethod
    def conditioner_of(cls, pipe, cache_prompts: bool = True) -> ClassConditioner:
        return ClassConditioner(pipe.num_classes)

    def example_inputs(self, network: nn.Module, n: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
        c = network.config
        size = c.sample_size if isinstance(c.sample_size, int) else c.sample_size[0]
        return (torch.zeros(n, c.in_channels, size, size), torch.zeros(n, dtype=torch.long),
                self.null_condition(n))

    def pipeline(self, network: nn.Module, scheduler, **call_defaults) -> DistillClassPipeline:
        pipe = DistillClassPipeline(network, scheduler, self.vae, **call_defaults)
        pipe.set_progress_bar_config(disable=True)
        return pipe
