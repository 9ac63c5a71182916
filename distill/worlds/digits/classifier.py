"""The digits world's classifier: the ``student=digit_classifier`` option, an ``ImageClassifier``
(``distill.models.classifier``; its defaults: 1 channel, 10 classes, 32x32) whose penultimate layer is the world's
FID feature space (Inception features of 32x32 grey digits say little about them)."""

from __future__ import annotations

from distill.models.classifier import ImageClassifier
from distill.students import STUDENTS


@STUDENTS.register("digit_classifier", kwargs_of=ImageClassifier, convert="all")  # plain lists: config.json
def build_digit_classifier(gradient_checkpointing: bool = False, **sizes) -> ImageClassifier:
    """The ``student`` group's entry: an ``ImageClassifier``, with gradient checkpointing if asked (kept out of
    the init arguments, which the hub mixin writes to config.json)."""
    model = ImageClassifier(**sizes)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model
