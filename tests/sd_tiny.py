"""A tiny randomly initialised Stable-Diffusion-format world written to a folder (tests only)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

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


def write_tiny_sd(folder: Path, hidden: int = 32, seed: int = 0) -> Path:
    """vae/ (32x32x1 -> 4x8x8), text_encoder/, tokenizer/, unet/, scheduler/ + model_index.json."""
    torch.manual_seed(seed)
    folder = Path(folder)
    tokenizer = tiny_tokenizer(folder / "_vocab")
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    vae = AutoencoderKL(
        in_channels=1, out_channels=1, block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=4, norm_num_groups=4, sample_size=32,
        scaling_factor=0.5,
    )
    unet = build_text_unet(8, 4, size="debug", cross_attention_dim=hidden)
    scheduler = DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    ).save_pretrained(folder)
    return folder
