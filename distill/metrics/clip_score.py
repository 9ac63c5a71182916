"""CLIP score (Hessel et al. 2021) of images against their captions.

``clip_score`` is CLIPScore with w = 100, as torchmetrics reports it: 100 * max(cos(E_I, E_C), 0)
per image. Images are (N, C, H, W) in [-1, 1]; any CLIPModel + CLIPTokenizer pair works (the evaluation
set's ``eval.clip``, a local folder or hub id).
"""

from __future__ import annotations

import torch
from transformers import CLIPModel, CLIPTokenizer

from distill.models.clip import encode_images, encode_text


@torch.no_grad()
def clip_score(model: CLIPModel, tokenizer: CLIPTokenizer, images: torch.Tensor, captions: list[str]) -> torch.Tensor:
    """(N,) CLIPScore of each image against its caption: 100 * max(cos(image, caption), 0)."""
    if len(captions) != len(images):
        raise ValueError(f"got {len(images)} images but {len(captions)} captions; give one caption per image")
    cos = (encode_images(model, images) * encode_text(model, tokenizer, captions)).sum(-1)
    return 100.0 * cos.clamp(min=0.0)
