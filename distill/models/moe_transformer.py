"""Mixture-of-experts diffusion transformers made from a dense SD3 or Flux transformer (their builders:
``distill.students.moe``; the MoE layer, routing and losses: ``distill.models.moe``).

* Token-routed (``TokenMoESD3Transformer2DModel``, ``TokenMoEFluxTransformer2DModel``): every feed-forward of every
  block becomes a top-k ``MoEFeedForward`` (Switch Transformer, Fedus et al. 2022; GShard / Mixtral for k >= 2): the
  image stream's ``ff`` and the context stream's ``ff_context`` of SD3's joint and Flux's double-stream blocks (each
  stream its own router and experts; SD3's last block has no ``ff_context``), and the MLP of Flux's single-stream
  blocks. That MLP has no output layer of its own: ``proj_out`` reads the concatenation [attention, MLP], so
  ``proj_out(cat[a, m]) = W_a a + W_m m + b``; an expert is ``SingleStreamMLP`` (``proj_mlp``, tanh GELU, the
  ``W_m`` columns), ``proj_mlp`` becomes the MoE layer, ``act_mlp`` the identity and ``proj_out`` ``AttentionOut``
  (``W_a``, ``b``, plus the experts' sum). Each expert has the dense hidden width, so with ``top_k=1`` a token's
  active FLOPs are the dense network's plus the router's (2 D E per token and layer); top k runs k experts.
* Timestep-routed (``TimestepMoESD3Transformer2DModel``, ``TimestepMoEFluxTransformer2DModel``): K whole
  transformers, expert k owning the timesteps between hand-overs (eDiff-I, Balaji et al. 2022), on the pipeline's
  timestep scale 1000 t for flow time t (Flux's transformer takes t itself: ``timestep_scale``). The model itself is
  expert 0, ``later_experts`` hold the others; one expert runs per call at sampling time.

Each is the stock class with its routing settings in the config, so that ``from_pretrained`` builds the experts
before it loads the weights, and pipelines read the stock config keys they expect; ``model_index.json`` names this
module as the transformer's library (its namespace holds the ``ModelMixin`` diffusers loads it as).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from diffusers import FluxTransformer2DModel, ModelMixin, SD3Transformer2DModel  # noqa: F401
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
from torch import nn

from distill.models.moe import TokenRouted, _bin_load, records_routing

TRANSFORMERS = (SD3Transformer2DModel, FluxTransformer2DModel)
FFNS = ("ff", "ff_context")
TOKEN_MOE_CONFIG = {"num_experts": 4, "top_k": 1, "capacity_factor": 1.25, "eval_capacity_factor": None,
                    "load_balance_weight": 0.01, "z_loss_weight": 0.0}
BATCHED = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance")  # rows = samples


def _timestep(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The ``timestep`` argument of SD3's and Flux's forward (the fourth positional one)."""
    return kwargs.get("timestep", args[3] if len(args) > 3 else None)


def _scaled_timesteps(model: nn.Module, timestep, hidden_states: torch.Tensor) -> torch.Tensor:
    """(N,) timesteps on the 0..1000 scale (1000 t)."""
    t = torch.as_tensor(timestep, device=hidden_states.device).float() * model.timestep_scale
    return t.reshape(1).expand(hidden_states.shape[0]) if t.ndim == 0 else t


# ---------------------------------------------------------------- token-routed feed-forwards


class SingleStreamMLP(nn.Module):
    """A Flux single-stream block's MLP as one feed-forward: ``proj_mlp``, tanh GELU, and ``proj_out``'s MLP columns
    (no bias: the block's ``proj_out`` bias stays in ``AttentionOut``)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_mlp = nn.Linear(dim, hidden)
        self.act_mlp = nn.GELU(approximate="tanh")
        self.proj_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.act_mlp(self.proj_mlp(x)))


class AttentionOut(nn.Module):
    """A single-stream block's ``proj_out`` when its MLP branch arrives already projected (the experts' sum y, D
    wide): ``proj_out(cat[a, y]) = W_a a + b + y``."""

    def __init__(self, attention_dim: int, dim: int):
        super().__init__()
        self.attention_dim = attention_dim
        self.proj = nn.Linear(attention_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x[..., :self.attention_dim]) + x[..., self.attention_dim:]


def route_feed_forwards(model: nn.Module, **moe) -> None:
    """Replace (in place) every block's feed-forwards of an SD3 or Flux transformer by ``MoEFeedForward`` layers of
    ``moe`` settings (``TOKEN_MOE_CONFIG``), each expert a copy of the feed-forward it replaces."""
    from distill.models.moe import MoEFeedForward

    for block in model.transformer_blocks:
        for name in FFNS:
            ff = getattr(block, name, None)
            if ff is not None:
                setattr(block, name, MoEFeedForward(ff, ff.net[0].proj.in_features, **moe))
    for block in getattr(model, "single_transformer_blocks", ()):
        dim, hidden = block.proj_out.out_features, block.proj_mlp.out_features
        block.proj_mlp = MoEFeedForward(SingleStreamMLP(dim, hidden), dim, **moe)
        block.act_mlp = nn.Identity()
        block.proj_out = AttentionOut(block.proj_out.in_features - hidden, dim)


def expert_state_dict(dense: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The dense transformer's weights in ``model``'s (a token-routed one's) names: every expert of a feed-forward
    gets the dense feed-forward's weights; a single-stream block's ``proj_out`` is split into ``AttentionOut`` (its
    attention columns and bias) and each expert's MLP columns. The routers are left out."""
    state = dict(dense)
    for name, block in model.named_modules():
        if isinstance(block, FluxSingleTransformerBlock):
            weight = state.pop(f"{name}.proj_out.weight")
            state[f"{name}.proj_out.proj.bias"] = state.pop(f"{name}.proj_out.bias")
            split = block.proj_out.attention_dim
            state[f"{name}.proj_out.proj.weight"] = weight[:, :split]
            expert = {"proj_mlp.weight": state.pop(f"{name}.proj_mlp.weight"),
                      "proj_mlp.bias": state.pop(f"{name}.proj_mlp.bias"), "proj_out.weight": weight[:, split:]}
            for e in range(block.proj_mlp.num_experts):
                state.update({f"{name}.proj_mlp.experts.{e}.{k}": v for k, v in expert.items()})
            continue
        for ff in FFNS:
            layer = getattr(block, ff, None)
            if name.startswith("transformer_blocks.") and name.count(".") == 1 and layer is not None:
                prefix = f"{name}.{ff}."
                for key in [k for k in state if k.startswith(prefix) and ".experts." not in k]:
                    value = state.pop(key)
                    for e in range(layer.num_experts):
                        state[f"{prefix}experts.{e}.{key[len(prefix):]}"] = value
    return state


class _TokenMoETransformer(TokenRouted):
    """The stock transformer with ``route_feed_forwards`` applied; the routing settings are config keys."""

    timestep_scale = 1.0

    def __init__(self, *args, num_experts: int = 4, top_k: int = 1, capacity_factor: float | None = 1.25,
                 eval_capacity_factor: float | None = None, load_balance_weight: float = 0.01,
                 z_loss_weight: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)  # the stock class registers its config
        moe = {"num_experts": num_experts, "top_k": top_k, "capacity_factor": capacity_factor,
               "eval_capacity_factor": eval_capacity_factor, "load_balance_weight": load_balance_weight,
               "z_loss_weight": z_loss_weight}
        self.register_to_config(**moe)
        route_feed_forwards(self, **moe)
        self.last_timesteps = None

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """The stock forward (``hidden_states`` named: ``NFECounter`` reads the first named input)."""
        if records_routing(self):
            self.last_timesteps = _scaled_timesteps(self, _timestep((hidden_states, *args), kwargs),
                                                    hidden_states).detach()
        return super().forward(hidden_states, *args, **kwargs)


class TokenMoESD3Transformer2DModel(_TokenMoETransformer, SD3Transformer2DModel):
    """An ``SD3Transformer2DModel`` whose ``ff`` and ``ff_context`` are token-routed experts."""


class TokenMoEFluxTransformer2DModel(_TokenMoETransformer, FluxTransformer2DModel):
    """A ``FluxTransformer2DModel`` whose double-stream ``ff``, ``ff_context`` and single-stream MLPs are
    token-routed experts; its timestep input is flow time t (x 1000 for the router statistics' bins)."""

    timestep_scale = 1000.0


# ---------------------------------------------------------------- timestep-routed whole transformers


class _TimestepMoETransformer:
    """Expert 0 is the model itself (the stock class's modules), experts 1.. are ``later_experts``; a sample goes to
    expert ``bucketize(1000 t, handover_timesteps)``."""

    timestep_scale = 1.0

    def __init__(self, *args, handover_timesteps: list[int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        handover = list(handover_timesteps or [])
        if handover != sorted(handover) or len(set(handover)) != len(handover):
            raise ValueError(f"student boundaries {handover} must be strictly increasing timesteps")
        stock = {k: v for k, v in self.config.items() if not k.startswith("_") and k != "handover_timesteps"}
        self.register_to_config(handover_timesteps=handover)
        self.later_experts = nn.ModuleList(self.stock_class.from_config(stock) for _ in handover)
        self.register_buffer("handover", torch.tensor(handover, dtype=torch.float32), persistent=False)
        self.last_load: torch.Tensor | None = None
        self.last_timesteps: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return len(self.later_experts) + 1

    def expert_of(self, timesteps: torch.Tensor) -> torch.Tensor:
        """(N,) expert indices of timesteps on the 0..1000 scale."""
        return torch.bucketize(timesteps.float(), self.handover.to(timesteps.device), right=True)

    def active_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters()) // self.num_experts

    def _run(self, expert: int, kwargs: dict):
        return (super().forward(**kwargs) if expert == 0 else self.later_experts[expert - 1](**kwargs))[0]

    def forward(self, hidden_states: torch.Tensor, *args, return_dict: bool = True, **kwargs):
        names = list(inspect.signature(self.stock_class.forward).parameters)[1:]
        kwargs.update(zip(names, (hidden_states, *args)))
        kwargs["return_dict"] = False
        t = _scaled_timesteps(self, kwargs["timestep"], kwargs["hidden_states"])
        route = self.expert_of(t)
        if records_routing(self):
            self.last_timesteps, self.last_load = t.detach(), F.one_hot(route, self.num_experts).float()
        chosen = route.unique().tolist()
        if len(chosen) == 1:  # the usual case at sampling time: one expert runs
            out = self._run(chosen[0], kwargs)
        else:  # a training batch mixes noise levels: each expert runs on its own samples
            n = len(route)
            out = None
            for e in chosen:
                rows = (route == e).nonzero(as_tuple=True)[0]
                part = {k: v[rows] if k in BATCHED and torch.is_tensor(v) and v.ndim and len(v) == n else v
                        for k, v in kwargs.items()}
                y = self._run(e, part)
                out = y.new_empty((n, *y.shape[1:])) if out is None else out
                out[rows] = y
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

    def aux_loss(self) -> torch.Tensor | None:
        return None  # routing is fixed: nothing to balance

    def router_stats(self, prefix: str = "router/") -> dict[str, float]:
        return {} if self.last_load is None else _bin_load(self.last_load, self.last_timesteps, 1000, prefix)


class TimestepMoESD3Transformer2DModel(_TimestepMoETransformer, SD3Transformer2DModel):
    """K ``SD3Transformer2DModel`` experts, each owning a range of timesteps (``handover_timesteps``)."""

    stock_class = SD3Transformer2DModel


class TimestepMoEFluxTransformer2DModel(_TimestepMoETransformer, FluxTransformer2DModel):
    """K ``FluxTransformer2DModel`` experts, each owning a range of timesteps (``handover_timesteps``, on 1000 t; the
    transformer's input is t)."""

    stock_class = FluxTransformer2DModel
    timestep_scale = 1000.0


TOKEN_EXPORTS = {SD3Transformer2DModel: TokenMoESD3Transformer2DModel,
                 FluxTransformer2DModel: TokenMoEFluxTransformer2DModel}
TIMESTEP_EXPORTS = {SD3Transformer2DModel: TimestepMoESD3Transformer2DModel,
                    FluxTransformer2DModel: TimestepMoEFluxTransformer2DModel}



def _accepting_config_keys(cls: type, base: type, extra: Mapping[str, object]) -> None:
    """Give ``cls`` an ``__init__`` whose signature is the stock ``base``'s plus the ``extra`` keys (with defaults):
    ``ConfigMixin.from_config`` passes the config keys that ``__init__``'s signature names."""
    mixin_init = cls.__init__

    def __init__(self, *args, **kwargs):
        mixin_init(self, *args, **kwargs)

    params = list(inspect.signature(base.__init__).parameters.values())
    __init__.__signature__ = inspect.signature(base.__init__).replace(parameters=[
        *params, *(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in extra.items())])
    cls.__init__ = __init__


for _exports, _extra in ((TOKEN_EXPORTS, TOKEN_MOE_CONFIG), (TIMESTEP_EXPORTS, {"handover_timesteps": None})):
    for _base, _cls in _exports.items():
        _accepting_config_keys(_cls, _base, _extra)


def dense_class(transformer: nn.Module) -> type:
    """The stock diffusers class a transformer is (SD3's or Flux's); anything else is refused, naming the fix."""
    for base in TRANSFORMERS:
        if isinstance(transformer, base):
            if transformer.config.get("pruned_blocks"):
                raise ValueError(f"the teacher's {type(transformer).__name__} has pruned blocks; a MoE student is "
                                 "made from a dense transformer (load the unpruned teacher)")
            return base
    raise ValueError(f"{type(transformer).__name__} is neither an SD3Transformer2DModel nor a FluxTransformer2DModel")


def flow_alphas_cumprod(num_train_timesteps: int = 1000) -> torch.Tensor:
    """The VP-equivalent abar of each timestep i of a flow x_t = (1 - t) x0 + t eps at t = i / T: the same
    signal-to-noise ratio SNR = ((1 - t) / t)^2 = abar / (1 - abar), t clipped to [1 / T, 1 - 1 / T] so that both
    ends are finite (``expert_boundaries``' ``equal_snr`` split then works on flow time)."""
    T = num_train_timesteps
    t = (torch.arange(T, dtype=torch.float64) / T).clamp(1 / T, 1 - 1 / T)
    snr = ((1 - t) / t) ** 2
    return snr / (1 + snr)
