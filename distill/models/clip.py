"""CLIP helpers: unit-norm image and text embeddings of a transformers ``CLIPModel``, the space of the CLIP
score and of CLIP guidance. Any CLIP folder works (``CLIPModel`` / ``CLIPTokenizer.from_pretrained``); the
embedded default world ships a small one (its builder lives with that world).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import CLIPModel, CLIPTokenizer


def encode_images(model: CLIPModel, images: torch.Tensor) -> torch.Tensor:
    """Unit-norm image embeddings (N, D) of images (N, C, H, W) in [-1, 1].

    Images of another size or channel count (a 16x16 student, grey replicated to RGB) are resized
    bilinearly and converted, so that any generator can be scored by the same model.
    """
    vision = model.config.vision_config
    images = images.to(model.device, model.dtype)
    if images.shape[1] != vision.num_channels:
        images = images.mean(1, keepdim=True).expand(-1, vision.num_channels, -1, -1)
    if images.shape[-1] != vision.image_size or images.shape[-2] != vision.image_size:
        images = F.interpolate(images, size=(vision.image_size, vision.image_size), mode="bilinear", align_corners=False)
    return F.normalize(_pooled(model.get_image_features(pixel_values=images)), dim=-1)


def encode_text(model: CLIPModel, tokenizer: CLIPTokenizer, captions: list[str]) -> torch.Tensor:
    """Unit-norm text embeddings (N, D), captions padded to the tokenizer's length as Stable Diffusion does."""
    tokens = tokenizer(captions, padding="max_length", truncation=True, return_tensors="pt").to(model.device)
    return F.normalize(_pooled(model.get_text_features(**tokens)), dim=-1)


def _pooled(features) -> torch.Tensor:
    # transformers 4 returns the projected embeddings; 5 returns an output whose pooler_output holds them.
    return features if isinstance(features, torch.Tensor) else features.pooler_output
