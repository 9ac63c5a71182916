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
        self._cache: dict[str, tuple[torch.Tensor, ...]] = {}
        self.encoder_calls = 0  # prompts actually run through the encoder (the cache's misses)

    def train(self, mode: bool = True):
        super().train(mode)
        self.text_encoder.eval()  # frozen: dropout stays off whatever the method's mode
        return self

    def run_encoder(self, prompts: list[str]) -> tuple[torch.Tensor, ...]:
        """The encoder's outputs for distinct ``prompts``, each (M, ...) with a row per prompt: here the last hidden
        states (M, L, D); a conditioner with several outputs a prompt returns them all (one cache entry each)."""
        device = next(self.text_encoder.parameters()).device
        tokens = self.tokenizer(prompts, padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt")
        return (self.text_encoder(tokens.input_ids.to(device))[0],)

    @torch.no_grad()
    def encode_all(self, prompts: list[str]) -> tuple[torch.Tensor, ...]:
        """Every output of ``run_encoder`` for ``prompts`` (N rows each), from the cache where it has them."""
        device = next(self.text_encoder.parameters()).device
        todo = [p for p in dict.fromkeys(prompts) if p not in self._cache] if self.cache_enabled else list(dict.fromkeys(prompts))
        fresh = {}
        if todo:
            outputs = self.run_encoder(todo)
            self.encoder_calls += len(todo)
            fresh = {p: tuple(out[i] for out in outputs) for i, p in enumerate(todo)}
            if self.cache_enabled:
                self._cache.update(fresh)
        table = self._cache if self.cache_enabled else fresh
        return tuple(torch.stack([table[p][k].to(device) for p in prompts]) for k in range(len(table[prompts[0]])))

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """(N, L, D) last hidden states for ``prompts``."""
        return self.encode_all(prompts)[0]

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
