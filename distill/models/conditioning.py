"""Conditioners turn a batch (labels, captions) into the keyword arguments of a UNet call.

``drop`` (N,) bool marks examples whose condition is replaced by the null condition
(classifier-free guidance dropout, Ho & Salimans 2022).
"""

from __future__ import annotations

import torch
from torch import nn


class ClassConditioner(nn.Module):
    """Class labels for ``UNet2DModel(num_class_embeds=num_classes + 1)``; index num_classes is null.

    Unlabelled examples (label -1, e.g. from an image folder) get the null class: unconditional training.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.num_classes = num_classes

    def forward(self, batch: dict, drop: torch.Tensor | None = None) -> dict:
        labels = torch.as_tensor(batch["label"]).long()
        if (labels < -1).any() or (labels >= self.num_classes).any():
            raise ValueError(f"labels must be in [0, {self.num_classes}) or -1 (unlabelled); got {labels.unique().tolist()}")
        labels = torch.where(labels < 0, torch.full_like(labels, self.num_classes), labels)
        if drop is not None:
            labels = torch.where(drop.to(labels.device), torch.full_like(labels, self.num_classes), labels)
        return {"class_labels": labels}

    def null(self, batch_size: int, device: torch.device | str = "cpu") -> dict:
        return {"class_labels": torch.full((batch_size,), self.num_classes, dtype=torch.long, device=device)}


def concat_conditions(a: dict, b: dict) -> dict:
    """Stack two condition dicts along the batch (one forward for conditional + unconditional)."""
    return {k: torch.cat([a[k], b[k]]) for k in a}


def take_conditions(cond: dict, index: torch.Tensor) -> dict:
    """The rows ``index`` of every entry of a condition dict."""
    return {k: v[index] for k, v in cond.items()}


class TextConditioner(nn.Module):
    """Captions -> ``encoder_hidden_states`` from a frozen CLIP text encoder, as in Stable Diffusion.

    The null condition is the empty prompt "". Embeddings are cached per distinct prompt, so the
    text encoder runs once per prompt rather than once per step (captions repeat across a data set).
    """

    def __init__(self, text_encoder: nn.Module, tokenizer, max_length: int | None = None, cache: bool = True):
        super().__init__()
        self.text_encoder = text_encoder.requires_grad_(False).eval()
        self.tokenizer = tokenizer
        self.max_length = max_length or tokenizer.model_max_length
        self.cache_enabled = cache
        self._cache: dict[str, torch.Tensor] = {}
        self.encoder_calls = 0  # prompts actually run through the encoder (the cache's misses)

    def train(self, mode: bool = True):
        super().train(mode)
        self.text_encoder.eval()  # frozen: dropout stays off whatever the method's mode
        return self

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        """(N, L, D) last hidden states for ``prompts``."""
        device = next(self.text_encoder.parameters()).device
        todo = [p for p in dict.fromkeys(prompts) if p not in self._cache] if self.cache_enabled else list(dict.fromkeys(prompts))
        fresh = {}
        if todo:
            tokens = self.tokenizer(todo, padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt")
            hidden = self.text_encoder(tokens.input_ids.to(device))[0]  # (M, L, D)
            self.encoder_calls += len(todo)
            fresh = dict(zip(todo, hidden))
            if self.cache_enabled:
                self._cache.update(fresh)
        table = self._cache if self.cache_enabled else fresh
        return torch.stack([table[p].to(device) for p in prompts])

    def forward(self, batch: dict, drop: torch.Tensor | None = None) -> dict:
        prompts = list(batch["caption"])
        if drop is not None:
            prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        return {"encoder_hidden_states": self.encode(prompts)}

    def null(self, batch_size: int, device: torch.device | str = "cpu") -> dict:
        return {"encoder_hidden_states": self.encode([""] * batch_size).to(device)}

    def _apply(self, fn, recurse=True):
        self._cache.clear()  # cached tensors live on the old device/dtype
        return super()._apply(fn, recurse)
