"""Digits-world checks of the shipped assets: zero-shot digit accuracy of a CLIP model (Radford et al. 2021) and
the share of images the digit classifier reads as the prompted digit. Generic metrics live in distill.metrics."""

from __future__ import annotations

import torch
from transformers import CLIPModel, CLIPTokenizer

from distill.models.clip import encode_images, encode_text
from distill.worlds.digits.data import caption_for


@torch.no_grad()
def clip_zeroshot_logits(model: CLIPModel, tokenizer: CLIPTokenizer, images: torch.Tensor) -> torch.Tensor:
    """(N, 10) cosine similarities of each image to the ten captions "a handwritten digit <word>"."""
    class_text = encode_text(model, tokenizer, [caption_for(label) for label in range(10)])  # (10, D)
    return encode_images(model, images) @ class_text.T


def clip_zeroshot_accuracy(model: CLIPModel, tokenizer: CLIPTokenizer, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of images whose most similar digit caption is their own."""
    predicted = clip_zeroshot_logits(model, tokenizer, images).argmax(-1).cpu()
    return (predicted == torch.as_tensor(labels).cpu()).float().mean().item()


@torch.no_grad()
def prompted_digit_accuracy(images: torch.Tensor, labels: torch.Tensor, classifier) -> float:
    """Fraction of ``images`` (N, 1, H, W) in [-1, 1] that ``classifier`` assigns to ``labels``."""
    logits = torch.cat([classifier(chunk) for chunk in images.split(256)])
    return (logits.argmax(1) == labels.to(logits.device)).float().mean().item()
