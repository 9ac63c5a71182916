"""Stable Diffusion 1.x / 2.x: a ``UNet2DConditionModel`` on the last hidden states of one CLIP text encoder,
eps or v prediction on a discrete VP schedule, ``AutoencoderKL`` latents (Rombach et al. 2022)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from distill.diffusion.parametrization import PREDICTION_TYPES
from distill.families.base import FAMILIES, TEACHER_KEY, ModelFamily
from distill.inference.pipelines import DistillTextToImagePipeline
from distill.models.conditioning import TextConditioner
from distill.models.teacher import REQUIRED, Teacher, check_pipeline_folder, is_flow_matching

SDXL_SIGNS = ("text_encoder_2",)


@FAMILIES.register("sd")
class StableDiffusionFamily(ModelFamily):
    """SD-1.x/2.x text-to-image latent diffusion; conditioning ``{"encoder_hidden_states": (N, L, D)}``, the null
    condition the empty prompt's states; exported as a ``DistillTextToImagePipeline`` (a StableDiffusionPipeline)."""

    conditioner_type = TextConditioner
    pipeline_class = DistillTextToImagePipeline
    denoiser_component = "unet"
    call_inputs = {"encoder_hidden_states": "prompt_embeds"}

    @classmethod
    def detect(cls, configs: dict[str, dict]) -> bool:
        """Every SD component, one text encoder, a UNet without SDXL's micro-conditioning, a DDPM-family schedule."""
        pipeline, unet = configs["pipeline"], configs["unet"]
        return (all(k in pipeline for k in REQUIRED) and not any(k in pipeline for k in SDXL_SIGNS)
                and unet.get("_class_name", "UNet2DConditionModel") == "UNet2DConditionModel"
                and unet.get("addition_embed_type") is None and not is_flow_matching(configs["scheduler"]))

    @classmethod
    def check_components(cls, name_or_path, configs: dict[str, dict], key: str = TEACHER_KEY) -> None:
        """A local folder has every component's folder and a supported prediction type (``check_pipeline_folder``)."""
        if Path(name_or_path).exists():
            check_pipeline_folder(name_or_path)

    @classmethod
    def load(cls, pretrained_model_name_or_path: str, revision: str | None = None, variant: str | None = None,
             torch_dtype: str | None = None) -> Teacher:
        """``StableDiffusionPipeline.from_pretrained`` without its safety checker (training never runs it; an
        export loads it again, ``load_safety_components``), every network frozen."""
        from diffusers import StableDiffusionPipeline

        if Path(pretrained_model_name_or_path).exists():  # every component folder, a supported prediction type
            check_pipeline_folder(pretrained_model_name_or_path)
        dtype = getattr(torch, torch_dtype) if torch_dtype else None
        pipe = StableDiffusionPipeline.from_pretrained(
            pretrained_model_name_or_path, revision=revision, variant=variant, torch_dtype=dtype,
            safety_checker=None, requires_safety_checker=False,
        )
        if pipe.scheduler.config.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"teacher prediction_type={pipe.scheduler.config.prediction_type!r} is not supported")
        for module in (pipe.unet, pipe.vae, pipe.text_encoder):
            module.requires_grad_(False).eval()
        family = cls.from_pipeline(pipe)
        return Teacher(pipe.unet, pipe.vae, pipe.scheduler, str(pretrained_model_name_or_path),
                       {"revision": revision, "variant": variant, "torch_dtype": dtype},
                       family=family)

    @classmethod
    def conditioner_of(cls, pipe, cache_prompts: bool = True) -> TextConditioner:
        return TextConditioner(pipe.text_encoder, pipe.tokenizer, cache=cache_prompts)

    def copy(self, cache_prompts: bool = True) -> StableDiffusionFamily:
        """A new instance on the same frozen parts with its own prompt cache (``cache_prompts``: embeddings kept
        per distinct prompt, ``TextConditioner``)."""
        conditioner = TextConditioner(self.conditioner.text_encoder, self.conditioner.tokenizer, cache=cache_prompts)
        return type(self)(self.scheduler, self.vae, conditioner)

    def example_inputs(self, network: nn.Module, n: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
        c = network.config
        size = c.sample_size if isinstance(c.sample_size, int) else c.sample_size[0]
        return (torch.zeros(n, c.in_channels, size, size), torch.zeros(n, dtype=torch.long),
                {"encoder_hidden_states": torch.zeros(n, 1, c.cross_attention_dim)})

    def pipeline(self, network: nn.Module, scheduler, **call_defaults) -> DistillTextToImagePipeline:
        pipe = DistillTextToImagePipeline(
            vae=self.vae, text_encoder=self.conditioner.text_encoder, tokenizer=self.conditioner.tokenizer,
            unet=network, scheduler=scheduler, safety_checker=None, feature_extractor=None,
            requires_safety_checker=False, **call_defaults,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @classmethod
    def matches(cls, pipe) -> bool:
        """Any StableDiffusionPipeline (a distill export or diffusers' own), or its img2img and inpainting
        siblings (the same components)."""
        from diffusers import StableDiffusionImg2ImgPipeline as Img2Img
        from diffusers import StableDiffusionInpaintPipeline as Inpaint
        from diffusers import StableDiffusionPipeline

        return isinstance(pipe, (StableDiffusionPipeline, Img2Img, Inpaint))
