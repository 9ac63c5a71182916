"""Contrastive image-caption training of a CLIP model (Radford et al. 2021) on labelled captions."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import CLIPModel, CLIPTokenizer

from distill.methods import METHODS
from distill.methods.base import DistillMethod
from distill.models.clip import encode_images, encode_text
from distill.worlds.digits.clip import CAPTION_TEMPLATES, fill_template, save_clip
from distill.worlds.digits.metrics import clip_zeroshot_logits


def positive_pairs(labels: torch.Tensor, captions: list[str]) -> torch.Tensor:
    """(N, N) bool: image i and caption j match when they share a label (both labelled) or a caption.

    With ten classes a batch holds many matching pairs besides the diagonal; calling them negatives
    would push apart embeddings that should coincide.
    """
    labelled = labels >= 0
    same_label = (labels[:, None] == labels[None, :]) & labelled[:, None] & labelled[None, :]
    same_caption = torch.tensor([[a == b for b in captions] for a in captions], device=labels.device)
    return same_label | same_caption


def contrastive_loss(image_embeds: torch.Tensor, text_embeds: torch.Tensor, logit_scale: torch.Tensor,
                     positives: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE (Radford et al. 2021, Fig. 3) with the target spread evenly over all positives.

    image_embeds, text_embeds: (N, D) unit vectors; positives: (N, N) bool with a true diagonal.
    """
    logits = logit_scale * image_embeds @ text_embeds.T  # (N, N): image i vs caption j
    targets = positives.float()
    image_to_text = F.cross_entropy(logits, targets / targets.sum(1, keepdim=True))
    text_to_image = F.cross_entropy(logits.T, targets.T / targets.T.sum(1, keepdim=True))
    return 0.5 * (image_to_text + text_to_image)


def random_shift(images: torch.Tensor, max_shift: int, background: float = -1.0) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels in x and y, filling with the background."""
    n, _, h, w = images.shape
    padded = F.pad(images, [max_shift] * 4, value=background)
    dx, dy = torch.randint(0, 2 * max_shift + 1, (2, n)).tolist()
    return torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])


@METHODS.register("clip")
class CLIPTraining(DistillMethod):
    """Trains ``student`` (a ``CLIPModel``) to match digit images with captions from several templates.

    Each labelled example keeps its data caption (the teacher's "a handwritten digit seven") with
    probability ``keep_caption_prob``, otherwise it gets a random template of ``CAPTION_TEMPLATES``,
    so the text tower learns the teacher's wording best and still generalises over phrasings.
    """

    def __init__(
        self,
        student: CLIPModel,
        tokenizer: CLIPTokenizer,
        optimizer: Callable,
        lr_scheduler: Callable | None = None,
        keep_caption_prob: float = 0.5,  # the data caption ("a handwritten digit seven"); else a random template
        max_shift: int = 2,  # random translation in pixels (augmentation)
        max_logit_scale: float = 100.0,
        sampling: dict | None = None,
    ):
        super().__init__(optimizer, lr_scheduler)
        self.save_hyperparameters(ignore=["student", "tokenizer", "optimizer", "lr_scheduler", "sampling"])
        if len(tokenizer) != student.config.text_config.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the student's text_config.vocab_size is "
                f"{student.config.text_config.vocab_size}; build both with the same student.model_max_length"
            )
        if not 0.0 <= keep_caption_prob <= 1.0:
            raise ValueError(f"method.keep_caption_prob={keep_caption_prob} must be in [0, 1]")
        self.student, self.tokenizer = student, tokenizer
        self.keep_caption_prob, self.max_shift = keep_caption_prob, max_shift
        # CLIP clips the learned temperature at 100 so that training stays stable.
        self.max_log_scale = math.log(max_logit_scale)

    def captions(self, batch: dict) -> list[str]:
        """The data caption or, with probability 1 - keep_caption_prob, a random template per example."""
        labels = torch.as_tensor(batch["label"]).tolist()
        replace = (torch.rand(len(labels)) >= self.keep_caption_prob).tolist()
        templates = torch.randint(0, len(CAPTION_TEMPLATES), (len(labels),)).tolist()
        return [
            fill_template(CAPTION_TEMPLATES[k], label) if swap and label >= 0 else caption
            for caption, label, swap, k in zip(batch["caption"], labels, replace, templates)
        ]

    def loss(self, images: torch.Tensor, labels: torch.Tensor, captions: list[str]) -> torch.Tensor:
        image_embeds = encode_images(self.student, images)  # (N, D)
        text_embeds = encode_text(self.student, self.tokenizer, captions)  # (N, D)
        logit_scale = self.student.logit_scale.clamp(max=self.max_log_scale).exp()
        return contrastive_loss(image_embeds, text_embeds, logit_scale, positive_pairs(labels, captions))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        images = batch["pixel_values"]
        if self.max_shift > 0:
            images = random_shift(images, self.max_shift)
        labels = torch.as_tensor(batch["label"], device=self.device)
        loss = self.loss(images, labels, self.captions(batch))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(labels))
        self.log("train/logit_scale", self.student.logit_scale.exp(), batch_size=len(labels))
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        images, labels = batch["pixel_values"], torch.as_tensor(batch["label"], device=self.device)
        n = len(labels)
        # Held-out loss on the data captions only: comparable across steps and runs.
        self.log("val/loss", self.loss(images, labels, list(batch["caption"])), batch_size=n, sync_dist=True)
        accuracy = (clip_zeroshot_logits(self.student, self.tokenizer, images).argmax(-1) == labels).float().mean()
        self.log("val/zeroshot_acc", accuracy, prog_bar=True, batch_size=n, sync_dist=True)

    def export(self, out_dir: str | Path) -> Path:
        """A transformers folder: ``CLIPModel``, ``CLIPTextModel``, ``CLIPTokenizer`` and the image processor."""
        return save_clip(self.student, self.tokenizer, out_dir)
