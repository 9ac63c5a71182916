"""The MeanFlow network u(z, r, t) on a flow transformer: SD3's transformer with a second time embedding.

Choice (MeanFlow, Geng et al. 2025, conditions its DiT on two times through summed embeddings): the second time is the
interval t - r, in the first's units (timestep 1000 (t - r)), embedded by its own ``TimestepEmbedding`` on the same
sinusoidal projection and added to the first time's embedding (SD3's time-and-text embedding, which every block's
adaptive norm reads). Its output layer starts at zero, so a student copied from the teacher starts as u(z, r, t) =
v(z, t), the teacher's instantaneous velocity, which is the average velocity at r = t. Every weight of the teacher keeps
its name; the new ones are ``interval_embedder.*``.
"""

from __future__ import annotations

import torch
from diffusers import ModelMixin, SD3Transformer2DModel  # noqa: F401  (diffusers' loader finds the base class here)
from diffusers.models.embeddings import TimestepEmbedding

from distill.models.moe_transformer import _accepting_config_keys


class MeanFlowSD3Transformer2DModel(SD3Transformer2DModel):
    """``SD3Transformer2DModel`` taking ``interval`` = 1000 (t - r) (N,) besides ``timestep`` = 1000 t: the average
    velocity u(z, r, t) of MeanFlow; ``interval`` None is r = t."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # the stock class registers its config
        width = self.config.num_attention_heads * self.config.attention_head_dim
        self.interval_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=width)
        torch.nn.init.zeros_(self.interval_embedder.linear_2.weight)
        torch.nn.init.zeros_(self.interval_embedder.linear_2.bias)
        self._interval: torch.Tensor | None = None
        self.time_text_embed.register_forward_hook(self._add_interval)

    def _add_interval(self, module, args, embedding: torch.Tensor) -> torch.Tensor:
        timestep = args[0]
        interval = torch.zeros_like(timestep) if self._interval is None else self._interval
        proj = module.time_proj(interval.expand(len(embedding)) if interval.ndim == 0 else interval)
        return embedding + self.interval_embedder(proj.to(embedding.dtype))

    def forward(self, hidden_states: torch.Tensor, *args, interval: torch.Tensor | None = None, **kwargs):
        """The stock forward, the interval's embedding added to the time embedding (``hidden_states`` named:
        ``NFECounter`` reads the first named input)."""
        self._interval = interval
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self._interval = None

    @classmethod
    def from_transformer(cls, transformer: SD3Transformer2DModel) -> MeanFlowSD3Transformer2DModel:
        """A copy of a stock SD3 transformer with the interval embedding added (starting at zero)."""
        model = cls.from_config(transformer.config)
        if model.dtype != transformer.dtype:
            model = model.to(transformer.dtype)
        missing, unexpected = model.load_state_dict(transformer.state_dict(), strict=False)
        if unexpected or any(not k.startswith("interval_embedder.") for k in missing):
            raise ValueError(f"{type(transformer).__name__} is not a stock SD3 transformer (unexpected {unexpected}, "
                             f"missing {missing}); MeanFlow adds its interval embedding to SD3Transformer2DModel")
        return model.train(transformer.training)


_accepting_config_keys(MeanFlowSD3Transformer2DModel, SD3Transformer2DModel, {})
