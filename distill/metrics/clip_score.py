"""CLIP score (Hessel et al. 2021) and zero-shot digit accuracy of a CLIP model.

``clip_score`` is CLIPScore with w = 100, as torchmetrics reports it: 100 * max(cos(E_I, E_C), 0)
per image. Images are (N, C, H, W) in [-1, 1]; any CLIPModel + CLIPTokenizer pair works, the
shipped digits CLIP (``distill.assets.asset_path("clip")``) or a hub one.
"""

from __future__ import annotations

import torch
from transformers import CLIPModel, CLIPTokenizer

from distill.data.digits import caption_for
from distill.models.clip import encode_images, encode_text


@torch.no_grad()
def clip_score(model: CLIPModel, tokenizer: CLIPTokenizer, images: torch.Tensor, captions: list[str]) -> torch.Tensor:
    """(N,) CLIPScore of each image against its caption: 100 * max(cos(image, caption), 0)."""
    if len(captions) != len(images):
        raise ValueError(f"got {len(images)} images but {len(captions)} captions; give one caption per image")
    cos = (encode_images(model, images) * encode_text(model, tokenizer, captions)).sum(-1)
    return 100.0 * cos.clamp(min=0.0)


@torch.no_grad()
def clip_zeroshot_logits(model: CLIPModel, tokenizer: CLIPTokenizer, images: torch.Tensor) -> torch.Tensor:
    """(N, 10) cosine similarities of each image to the ten captions "a handwritten digit <word>"."""
    class_text = encode_text(model, tokenizer, [caption_for(label) for label in range(10)])  # (10, D)
    return encode_images(model, images) @ class_text.T


def clip_zeroshot_accuracy(model: CLIPModel, tokenizer: CLIPTokenizer, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of images whose most similar digit caption is their own (Radford et al. 2021, zero-shot)."""
    predicted = clip_zeroshot_logits(model, tokenizer, images).argmax(-1).cpu()
    return (predicted == torch.as_tensor(labels).cpu()).float().mean().item()
