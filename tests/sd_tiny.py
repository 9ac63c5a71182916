"""Tiny randomly initialised Stable-Diffusion-format worlds written to a folder (tests only): SD-1.x layout
(``write_tiny_sd``) and SDXL layout (``write_tiny_sdxl``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from distill.students.sized import build_text_unet

WORDS = "a handwritten digit zero one two three four five six seven eight nine".split()


def tiny_tokenizer(folder: Path) -> CLIPTokenizer:
    """Whole-word vocabulary of the digit captions plus single letters (byte-level fallback of sorts)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges = []
    for word in sorted(set(WORDS)):
        # left-to-right merges that build each word from its letters
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merges.append(f"{pieces[0]} {pieces[1]}")
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
            vocab.setdefault(pieces[0], len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=8, pad_token="<|endoftext|>")


def tiny_clip(tokenizer: CLIPTokenizer, hidden: int, cls: type = CLIPTextModel, layers: int = 1, **config):
    """A random CLIP text tower of ``cls`` over ``tokenizer``'s vocabulary and length."""
    return cls(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=tokenizer.model_max_length, bos_token_id=0, eos_token_id=1,
        pad_token_id=1, **config,
    ))


def tiny_vae() -> AutoencoderKL:
    """32x32x1 images -> 4x8x8 latents."""
    return AutoencoderKL(
        in_channels=1, out_channels=1, block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=4, norm_num_groups=4, sample_size=32,
        scaling_factor=0.5,
    )


def write_tiny_sd(folder: Path, hidden: int = 32, seed: int = 0) -> Path:
    """vae/ (32x32x1 -> 4x8x8), text_encoder/, tokenizer/, unet/, scheduler/ + model_index.json."""
    torch.manual_seed(seed)
    folder = Path(folder)
    tokenizer = tiny_tokenizer(folder / "_vocab")
    text_encoder = tiny_clip(tokenizer, hidden)
    vae = tiny_vae()
    unet = build_text_unet(8, 4, size="debug", cross_attention_dim=hidden)
    scheduler = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    ).save_pretrained(folder)
    return folder


def tiny_sdxl_unet(cross_attention_dim: int, projection_dim: int, time_embed_dim: int = 8) -> UNet2DConditionModel:
    """SDXL's UNet at reduced width on 4x8x8 latents: its block types (no attention at the highest resolution,
    more transformer layers deeper), linear projections, and the ``text_time`` added embedding of the pooled
    CLIP-G projection and six size/crop ids (``projection_class_embeddings_input_dim = 6 * time_embed_dim +
    projection_dim``, as 2816 = 6 * 256 + 1280 in SDXL-base)."""
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 1, 2),
        attention_head_dim=(2, 4, 4), norm_num_groups=8, cross_attention_dim=cross_attention_dim,
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=6 * time_embed_dim + projection_dim,
    )


def write_tiny_sdxl(folder: Path, hidden: tuple[int, int] = (16, 32), projection_dim: int = 24, seed: int = 0,
                    prediction_type: str = "epsilon", force_zeros_for_empty_prompt: bool = True) -> Path:
    """An SDXL-format folder saved by ``StableDiffusionXLPipeline.save_pretrained``: text_encoder/ (CLIP-L stand-in,
    a ``CLIPTextModel`` of width ``hidden[0]``), text_encoder_2/ (CLIP-G stand-in, a ``CLIPTextModelWithProjection``
    of width ``hidden[1]`` projecting to ``projection_dim``), both tokenizers, the ``text_time`` UNet on their
    concatenated penultimate states, SDXL-base's Euler scheduler, the 32x32x1 VAE."""
    torch.manual_seed(seed)
    folder = Path(folder)
    tokenizer = tiny_tokenizer(folder / "_vocab")
    text_encoder = tiny_clip(tokenizer, hidden[0], layers=2)
    text_encoder_2 = tiny_clip(tokenizer, hidden[1], CLIPTextModelWithProjection, layers=2, projection_dim=projection_dim)
    unet = tiny_sdxl_unet(sum(hidden), projection_dim)
    scheduler = EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                       steps_offset=1, timestep_spacing="leading", prediction_type=prediction_type)
    StableDiffusionXLPipeline(
        vae=tiny_vae(), text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer, unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
        add_watermarker=False,
    ).save_pretrained(folder)
    return folder
