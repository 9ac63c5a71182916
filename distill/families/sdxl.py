"""Stable Diffusion XL (Podell et al. 2023): a ``UNet2DConditionModel`` with ``addition_embed_type="text_time"`` on the
concatenated penultimate hidden states of two CLIP text encoders (CLIP-L, then CLIP-G, a
``CLIPTextModelWithProjection`` whose pooled projection enters the time embedding), plus six micro-conditioning
ids (original size, crop top-left, target size); eps or v prediction on a discrete VP schedule, ``AutoencoderKL``
latents.

Conditioning is flat, ``{"encoder_hidden_states", "text_embeds", "time_ids"}``, so that stacking and indexing
conditions (``concat_conditions``, ``take_conditions``) stays one tensor op per key; ``denoise`` alone rebuilds the
UNet's nested ``added_cond_kwargs``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from distill.diffusion.parametrization import PREDICTION_TYPES
from distill.families.base import FAMILIES, TEACHER_KEY, ModelFamily
from distill.inference.pipelines import DistillStableDiffusionXLPipeline
from distill.models.conditioning import TextConditioner
from distill.models.teacher import Teacher, check_pipeline_folder, is_flow_matching

TIME_IDS = 6  # original (h, w), crop top-left (y, x), target (h, w)


class SDXLConditioner(TextConditioner):
    """Captions -> SDXL's conditioning, as ``StableDiffusionXLPipeline.encode_prompt`` computes it (no clip skip):
    ``encoder_hidden_states`` the penultimate hidden states of ``text_encoder`` and ``text_encoder_2`` concatenated
    along the features, ``text_embeds`` the pooled projection of ``text_encoder_2``, and ``time_ids`` the batch's
    image size as original and target size with no crop (0, 0), as ``_get_add_time_ids`` builds them.

    The null condition (classifier-free guidance) is what the pipeline pairs with a prompt when no negative prompt
    is given: zeros where ``force_zeros_for_empty_prompt`` (SDXL-base's setting), else the empty prompt's states;
    its time ids are those of the native image size ``native_size`` (the pipeline's default height and width), or,
    through the family's ``null_condition(like=cond)``, those of the condition it pairs with.
    Per-prompt embeddings are cached as ``TextConditioner``'s."""

    def __init__(self, text_encoder: nn.Module, tokenizer, text_encoder_2: nn.Module, tokenizer_2,
                 vae_scale_factor: int, native_size: int, force_zeros_for_empty_prompt: bool = True,
                 cache: bool = True):
        super().__init__(text_encoder, tokenizer, cache=cache)
        self.text_encoder_2 = text_encoder_2.requires_grad_(False).eval()
        self.tokenizer_2 = tokenizer_2
        self.vae_scale_factor, self.native_size = vae_scale_factor, native_size
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt

    def train(self, mode: bool = True):
        super().train(mode)
        self.text_encoder_2.eval()
        return self

    def run_encoder(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, L, D_L + D_G) penultimate states of both towers, (M, P) the pooled projection of the second."""
        states, pooled = [], None
        for tokenizer, encoder in ((self.tokenizer, self.text_encoder), (self.tokenizer_2, self.text_encoder_2)):
            ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                            return_tensors="pt").input_ids
            out = encoder(ids.to(next(encoder.parameters()).device), output_hidden_states=True)
            if pooled is None and out[0].ndim == 2:  # the first tower with a projection (encode_prompt's rule)
                pooled = out[0]
            states.append(out.hidden_states[-2])
        if pooled is None:
            raise ValueError(f"neither text encoder ({type(self.text_encoder).__name__}, "
                             f"{type(self.text_encoder_2).__name__}) returns a pooled projection: SDXL's text_encoder_2 "
                             "is a CLIPTextModelWithProjection")
        return torch.cat(states, dim=-1).to(self.text_encoder_2.dtype), pooled

    def time_ids(self, height: int, width: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """(n, 6) ids of an uncropped image of ``height`` x ``width``: original size, crop (0, 0), target size."""
        ids = torch.tensor([[height, width, 0, 0, height, width]], dtype=self.text_encoder_2.dtype, device=device)
        return ids.repeat(n, 1)

    def image_size(self, batch: dict) -> tuple[int, int]:
        """(height, width) in pixels of the batch's images, or of those its cached latents encode."""
        if "image_size" in batch:  # no images: the size to generate (a server's request)
            return tuple(batch["image_size"])
        if "pixel_values" in batch:
            return tuple(batch["pixel_values"].shape[-2:])
        if "latent_mean" in batch:
            h, w = batch["latent_mean"].shape[-2:]
            return h * self.vae_scale_factor, w * self.vae_scale_factor
        raise ValueError(f"SDXL's size ids come from the batch's images: it needs 'pixel_values', 'latent_mean' or "
                         "'image_size' (height, width); "
                         f"got keys {sorted(batch)}")

    def forward(self, batch: dict, drop: torch.Tensor | None = None) -> dict:
        prompts = list(batch["caption"])
        states, pooled = self.encode_all(prompts)
        cond = {"encoder_hidden_states": states, "text_embeds": pooled,
                "time_ids": self.time_ids(*self.image_size(batch), len(prompts), states.device)}
        if drop is not None and drop.any():
            null = self.null(len(prompts), states.device)
            keep = ~drop.to(states.device)
            for key in ("encoder_hidden_states", "text_embeds"):
                cond[key] = torch.where(keep.view(-1, *[1] * (cond[key].ndim - 1)), cond[key], null[key])
        return cond

    def null(self, batch_size: int, device: torch.device | str = "cpu") -> dict:
        states, pooled = self.encode_all([""] * batch_size)
        if self.force_zeros_for_empty_prompt:
            states, pooled = torch.zeros_like(states), torch.zeros_like(pooled)
        return {"encoder_hidden_states": states.to(device), "text_embeds": pooled.to(device),
                "time_ids": self.time_ids(self.native_size, self.native_size, batch_size, device)}


@FAMILIES.register("sdxl")
class StableDiffusionXLFamily(ModelFamily):
    """SDXL text-to-image latent diffusion (``SDXLConditioner``'s conditioning); exported as a
    ``DistillStableDiffusionXLPipeline`` (a StableDiffusionXLPipeline)."""

    conditioner_type = SDXLConditioner
    pipeline_class = DistillStableDiffusionXLPipeline
    denoiser_component = "unet"
    # the pipeline makes its own size ids from the call's height and width (original = target size, no crop)
    call_inputs = {"encoder_hidden_states": "prompt_embeds", "text_embeds": "pooled_prompt_embeds", "time_ids": None}

    @classmethod
    def detect(cls, configs: dict[str, dict]) -> bool:
        """A second text encoder in model_index.json or a ``text_time`` UNet, on a DDPM-family schedule."""
        pipeline, unet = configs["pipeline"], configs["unet"]
        return (("text_encoder_2" in pipeline or unet.get("addition_embed_type") == "text_time")
                and unet.get("_class_name", "UNet2DConditionModel") == "UNet2DConditionModel"
                and not is_flow_matching(configs["scheduler"]))

    @classmethod
    def check_components(cls, name_or_path, configs: dict[str, dict], key: str = TEACHER_KEY) -> None:
        """Both towers' folders and SD's (``check_pipeline_folder``), a supported prediction type."""
        if Path(name_or_path).exists():
            check_pipeline_folder(name_or_path)

    @classmethod
    def load(cls, pretrained_model_name_or_path: str, revision: str | None = None, variant: str | None = None,
             torch_dtype: str | None = None) -> Teacher:
        """``StableDiffusionXLPipeline.from_pretrained``, every network frozen; the refiner (no first text encoder,
        aesthetic-score ids) is refused."""
        from diffusers import StableDiffusionXLPipeline

        if Path(pretrained_model_name_or_path).exists():  # every component folder, a supported prediction type
            check_pipeline_folder(pretrained_model_name_or_path)
        dtype = getattr(torch, torch_dtype) if torch_dtype else None
        pipe = StableDiffusionXLPipeline.from_pretrained(pretrained_model_name_or_path, revision=revision,
                                                         variant=variant, torch_dtype=dtype)
        if pipe.text_encoder is None or pipe.text_encoder_2 is None or "requires_aesthetics_score" in pipe.config:
            raise ValueError(f"teacher {pretrained_model_name_or_path!r} is an SDXL pipeline without both text encoders "
                             "(the refiner's layout); give an SDXL base pipeline (text_encoder and text_encoder_2)")
        if pipe.scheduler.config.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"teacher prediction_type={pipe.scheduler.config.prediction_type!r} is not supported; "
                             f"supported: {list(PREDICTION_TYPES)}")
        for module in (pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2):
            module.requires_grad_(False).eval()
        return Teacher(pipe.unet, pipe.vae, pipe.scheduler, str(pretrained_model_name_or_path),
                       {"revision": revision, "variant": variant, "torch_dtype": dtype},
                       family=cls.from_pipeline(pipe))

    @classmethod
    def conditioner_of(cls, pipe, cache_prompts: bool = True) -> SDXLConditioner:
        return SDXLConditioner(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2,
                               pipe.vae_scale_factor, cls.native_size(pipe), pipe.config.force_zeros_for_empty_prompt,
                               cache=cache_prompts)

    def copy(self, cache_prompts: bool = True) -> StableDiffusionXLFamily:
        """A new instance on the same frozen parts with its own prompt cache (``cache_prompts``)."""
        c = self.conditioner
        conditioner = SDXLConditioner(c.text_encoder, c.tokenizer, c.text_encoder_2, c.tokenizer_2, c.vae_scale_factor,
                                      c.native_size, c.force_zeros_for_empty_prompt, cache=cache_prompts)
        return type(self)(self.scheduler, self.vae, conditioner)

    def null_condition(self, n: int, device: torch.device | str = "cpu", like: dict | None = None) -> dict:
        """The conditioner's null rows; paired with ``like``, they keep its size ids, as the pipeline's negative
        rows keep the prompt's (``negative_add_time_ids = add_time_ids``) at any image size."""
        null = self.conditioner.null(n, device)
        return null if like is None else {**null, "time_ids": like["time_ids"]}

    def denoise(self, network: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: dict, **extra) -> torch.Tensor:
        """``network(x, t, encoder_hidden_states=..., added_cond_kwargs={"text_embeds", "time_ids"})``, as the
        pipeline calls its UNet."""
        added = {"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]}
        return network(x, t, encoder_hidden_states=cond["encoder_hidden_states"], added_cond_kwargs=added,
                       **extra).sample

    def example_inputs(self, network: nn.Module, n: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
        c = network.config
        size = c.sample_size if isinstance(c.sample_size, int) else c.sample_size[0]
        pooled = c.projection_class_embeddings_input_dim - TIME_IDS * c.addition_time_embed_dim
        return (torch.zeros(n, c.in_channels, size, size), torch.zeros(n, dtype=torch.long),
                {"encoder_hidden_states": torch.zeros(n, 1, c.cross_attention_dim),
                 "text_embeds": torch.zeros(n, pooled), "time_ids": torch.zeros(n, TIME_IDS)})

    def pipeline(self, network: nn.Module, scheduler, **call_defaults) -> DistillStableDiffusionXLPipeline:
        c = self.conditioner
        pipe = DistillStableDiffusionXLPipeline(
            vae=self.vae, text_encoder=c.text_encoder, text_encoder_2=c.text_encoder_2, tokenizer=c.tokenizer,
            tokenizer_2=c.tokenizer_2, unet=network, scheduler=scheduler,
            force_zeros_for_empty_prompt=c.force_zeros_for_empty_prompt, **call_defaults,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @classmethod
    def matches(cls, pipe) -> bool:
        """Any StableDiffusionXLPipeline (a distill export or diffusers' own)."""
        from diffusers import StableDiffusionXLPipeline

        return isinstance(pipe, StableDiffusionXLPipeline)
