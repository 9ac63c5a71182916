"""A tiny randomly initialised FluxPipeline (tests only): FluxTransformer2DModel at reduced width with double- and
single-stream blocks and FLUX.1-dev's guidance embedding (``guidance_embeds=False``: FLUX.1-schnell's), a CLIP-L
stand-in (``CLIPTextModel``, its pooled output), a T5 stand-in (``T5EncoderModel`` with a ``T5TokenizerFast`` whose
unigram vocabulary is built here from the digit captions' words: no download), an AutoencoderKL with FLUX.1's
``scaling_factor`` and ``shift_factor``, FlowMatchEulerDiscreteScheduler with FLUX.1-dev's resolution-dependent
shift.

FluxPipeline samples at ``default_sample_size`` = 128 latent pixels (fixed in its ``__init__``), so the VAE here
does not downsample (factor 1, no mid-block attention): the native image is 128x128, 64x64 = 4096 packed tokens,
FLUX.1's count at 1024x1024."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.sd_tiny import WORDS, tiny_clip, tiny_tokenizer

FLUX_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)  # black-forest-labs/FLUX.1-dev's
FLUX_SCALING_FACTOR, FLUX_SHIFT_FACTOR = 0.3611, 0.1159  # FLUX.1's VAE config
T5_DIM, CLIP_DIM, LATENT_CHANNELS = 16, 16, 4


def tiny_t5_tokenizer():
    """A T5TokenizerFast over the caption words (a unigram model, as T5's sentencepiece one), letters as fallback."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    pieces += [("\u2581" + w, -1.0) for w in dict.fromkeys(WORDS)] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5TokenizerFast(vocab=pieces, extra_ids=0)


def tiny_flux_pipeline(vocab_folder: Path, guidance_embeds: bool = True, seed: int = 0, num_layers: int = 1,
                       num_single_layers: int = 1):
    """The in-memory FluxPipeline (the CLIP tokenizer written under ``vocab_folder``), its transformer of
    ``num_layers`` double- and ``num_single_layers`` single-stream blocks."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = tiny_tokenizer(Path(vocab_folder)), tiny_t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=T5_DIM, pooled_projection_dim=CLIP_DIM,
        guidance_embeds=guidance_embeds, axes_dims_rope=(2, 2, 4)).eval()
    vae = AutoencoderKL(in_channels=1, out_channels=1, block_out_channels=(8,), latent_channels=LATENT_CHANNELS,
                        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                        norm_num_groups=4, sample_size=128, mid_block_add_attention=False,
                        scaling_factor=FLUX_SCALING_FACTOR, shift_factor=FLUX_SHIFT_FACTOR).eval()
    torch.manual_seed(seed + 1)
    text_encoder = tiny_clip(tokenizer, CLIP_DIM, layers=2).eval()
    torch.manual_seed(seed + 2)
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=T5_DIM, d_kv=8, d_ff=32,
                                             num_layers=1, num_heads=2)).eval()
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), vae=vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                        tokenizer_2=tokenizer_2, transformer=transformer)


def write_tiny_flux(folder: Path, guidance_embeds: bool = True, seed: int = 0, num_layers: int = 1,
                    num_single_layers: int = 1) -> Path:
    """The pipeline saved by ``save_pretrained``: transformer/, vae/, text_encoder{,_2}/, tokenizer{,_2}/,
    scheduler/ and model_index.json."""
    folder = Path(folder)
    tiny_flux_pipeline(folder / "_vocab", guidance_embeds, seed, num_layers, num_single_layers).save_pretrained(folder)
    return folder
