"""A tiny randomly initialised StableDiffusion3Pipeline (tests only): SD3Transformer2DModel at reduced width with
SD3.5's ``qk_norm`` and a dual-attention layer, CLIP-L and CLIP-G stand-ins (``CLIPTextModelWithProjection``), no
T5 (SD3 pads zero context tokens then), an AutoencoderKL with a ``shift_factor``, FlowMatchEulerDiscreteScheduler
with SD3's shift 3.0. The images are 32x32 with ``image_channels`` channels (1: the digits world's)."""

from __future__ import annotations

from pathlib import Path

import torch

SD3_SHIFT = 3.0  # stabilityai/stable-diffusion-3-medium's scheduler config
JOINT_DIM = 48  # the transformer's joint_attention_dim: both CLIP widths (16 + 24) are padded to it


def clip_with_projection(vocab: int, hidden: int, projection: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, projection_dim=projection,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=1,
        pad_token_id=1)).eval()


def tiny_sd3_pipeline(vocab_folder: Path, image_channels: int = 1, scheduler=None, seed: int = 0):
    """The in-memory StableDiffusion3Pipeline (tokenizers written under ``vocab_folder``)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    from tests.sd_tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer(Path(vocab_folder))
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=JOINT_DIM, caption_projection_dim=16, pooled_projection_dim=16,
        pos_embed_max_size=8, qk_norm="rms_norm", dual_attention_layers=(0,)).eval()
    vae = AutoencoderKL(in_channels=image_channels, out_channels=image_channels, block_out_channels=(8, 16, 16),
                        latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, norm_num_groups=4, sample_size=32,
                        scaling_factor=1.5305, shift_factor=0.0609)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler or FlowMatchEulerDiscreteScheduler(shift=SD3_SHIFT), vae=vae,
        text_encoder=clip_with_projection(len(tokenizer), 16, 8, seed + 1), tokenizer=tokenizer,
        text_encoder_2=clip_with_projection(len(tokenizer), 24, 8, seed + 2), tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None)


def write_tiny_sd3(folder: Path, image_channels: int = 1, seed: int = 0) -> Path:
    """The pipeline saved by ``save_pretrained``: transformer/, vae/, text_encoder{,_2}/, tokenizer{,_2}/,
    scheduler/ and model_index.json (text_encoder_3 and tokenizer_3 recorded as absent)."""
    folder = Path(folder)
    pipe = tiny_sd3_pipeline(folder / "_vocab", image_channels, seed=seed)
    pipe.save_pretrained(folder)
    return folder
