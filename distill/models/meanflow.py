"""The MeanFlow network u(z, r, t): the teacher's network with a second time embedding, of the interval t - r.

Choice (MeanFlow, Geng et al. 2025, conditions its DiT on (t, t - r) through summed embeddings): the second time is
the interval t - r in the first's units (1000 (t - r)), embedded and added to the first time's embedding, starting at
zero, so that a student copied from the teacher starts as u(z, r, t) = v(z, t), the teacher's instantaneous velocity,
which is the average velocity at r = t. Every weight of the teacher keeps its name.

- SD3 and Flux transformers (``MeanFlowSD3Transformer2DModel``, ``MeanFlowFluxTransformer2DModel``): its own
  ``TimestepEmbedding`` (``interval_embedder.*``) on the same sinusoidal projection, added to the time-and-text (Flux:
  time-guidance-and-text) embedding that every block's adaptive norm reads (``IntervalInput``).
- SD UNet: the UNet's own ``timestep_cond`` input (``time_cond_proj_dim``, a copy student's zero-initialised
  ``time_embedding.cond_proj``, LCM's guidance input): the interval's sinusoidal embedding, projected and added to the
  time projection before the time MLP (``interval_condition``).
"""

from __future__ import annotations

import torch
from diffusers import (  # noqa: F401  (diffusers' loader finds the base class here)
    FluxTransformer2DModel,
    ModelMixin,
    SD3Transformer2DModel,
    UNet2DConditionModel,
)
from diffusers.models.embeddings import TimestepEmbedding, get_timestep_embedding

from distill.models.moe_transformer import _accepting_config_keys


class IntervalInput:
    """Mixed in before a stock transformer class with a ``time_text_embed`` whose first input is the timestep on
    its sinusoidal ``time_proj``'s scale (SD3's, Flux's): a keyword ``interval`` = 1000 (t - r) (N,), embedded by
    ``interval_embedder`` (zero-initialised) and added to that embedding; ``interval`` None is r = t."""

    stock: type  # the stock transformer class it extends

    def _add_interval_embedder(self) -> None:
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
    def from_transformer(cls, transformer: torch.nn.Module) -> IntervalInput:
        """A copy of a stock transformer of ``cls.stock`` with the interval embedding added (starting at zero)."""
        model = cls.from_config(transformer.config)
        if model.dtype != transformer.dtype:
            model = model.to(transformer.dtype)
        missing, unexpected = model.load_state_dict(transformer.state_dict(), strict=False)
        if unexpected or any(not k.startswith("interval_embedder.") for k in missing):
            raise ValueError(f"{type(transformer).__name__} is not a stock {cls.stock.__name__} (unexpected "
                             f"{unexpected}, missing {missing}); MeanFlow adds its interval embedding to that class")
        return model.train(transformer.training)


class MeanFlowSD3Transformer2DModel(IntervalInput, SD3Transformer2DModel):
    """``SD3Transformer2DModel`` taking ``interval`` = 1000 (t - r) besides ``timestep`` = 1000 t: u(z, r, t)."""

    stock = SD3Transformer2DModel

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # the stock class registers its config
        self._add_interval_embedder()


class MeanFlowFluxTransformer2DModel(IntervalInput, FluxTransformer2DModel):
    """``FluxTransformer2DModel`` taking ``interval`` = 1000 (t - r) besides ``timestep`` = t (which it scales by 1000
    before its ``time_proj``, the interval's scale): u(z, r, t)."""

    stock = FluxTransformer2DModel

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._add_interval_embedder()


MEANFLOW_TRANSFORMERS = {cls.stock: cls for cls in (MeanFlowSD3Transformer2DModel, MeanFlowFluxTransformer2DModel)}
for _cls in MEANFLOW_TRANSFORMERS.values():
    _accepting_config_keys(_cls, _cls.stock, {})


def meanflow_transformer(transformer: torch.nn.Module) -> IntervalInput:
    """The two-time copy of a stock SD3 or Flux transformer (``from_transformer``); another class is refused."""
    cls = MEANFLOW_TRANSFORMERS.get(type(transformer))
    if cls is None:
        raise ValueError(f"the student is a {type(transformer).__name__}: MeanFlow adds its interval input to a stock "
                         f"{' or '.join(c.__name__ for c in MEANFLOW_TRANSFORMERS)}; use student=copy")
    return cls.from_transformer(transformer)


def interval_condition(network: torch.nn.Module, interval: torch.Tensor) -> dict:
    """The keyword arguments that give ``network`` the interval 1000 (t - r) (N,): ``interval`` for a two-time
    transformer (``IntervalInput``), ``timestep_cond`` (its sinusoidal embedding at the UNet's own frequency convention) for a UNet with
    ``time_cond_proj_dim``."""
    if isinstance(network, IntervalInput):
        return {"interval": interval}
    dim = getattr(network.config, "time_cond_proj_dim", None) if isinstance(network, UNet2DConditionModel) else None
    if dim is None:
        raise ValueError(f"{type(network).__name__} takes no second time: MeanFlow needs a MeanFlowSD3Transformer2DModel, "
                         "a MeanFlowFluxTransformer2DModel or a UNet2DConditionModel with time_cond_proj_dim (student=copy with student.time_cond_proj_dim"
                         "=256)")
    c = network.config
    embedding = get_timestep_embedding(interval, dim, flip_sin_to_cos=c.flip_sin_to_cos,
                                       downscale_freq_shift=c.freq_shift)
    return {"timestep_cond": embedding.to(network.dtype)}  # the UNet casts its time projection, not timestep_cond
