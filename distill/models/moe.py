"""Mixture-of-experts networks made from a dense teacher UNet (their builders: ``distill.students.moe``).

* ``TimestepMoEUNet``: an ensemble of expert denoisers, each owning a range of noise levels
  (eDiff-I, Balaji et al. 2022). Routing is a deterministic function of the timestep, so one expert
  runs per call and the cost of one network evaluation equals the dense UNet's.
* ``TokenMoEUNet``: the dense UNet with the feed-forward layer of every transformer block replaced by a
  sparse top-k mixture of experts (Shazeer et al. 2017; Switch Transformer, Fedus et al. 2022): a
  linear router whose probability gates the chosen expert (top-1, Switch) or whose top-k
  probabilities are renormalised over the chosen experts (k >= 2, GShard / Mixtral), a per-expert
  capacity, the load-balancing auxiliary loss and the optional router z-loss (ST-MoE, Zoph et al.
  2022), summed over the MoE layers. Only the chosen experts run.

Every forward replaces the routing record (auxiliary loss, router statistics) except one run inside
``no_routing_record``: the caller marks a stop-gradient target pass through the student itself (latent
consistency distillation with ``ema_decay=0``), which leaves the record of the pass that trains. The mark is
explicit because no-grad mode does not tell the two apart: a reentrant checkpoint runs the student's own
forward without gradients too.

Both are diffusers ``ModelMixin`` models: ``save_pretrained`` / ``from_pretrained`` work, and a
``StableDiffusionPipeline`` saved with one as its ``unet`` loads back with diffusers' own
``from_pretrained`` (``model_index.json`` names this module as the UNet's library).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin, UNet2DConditionModel
from diffusers.configuration_utils import register_to_config
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput
from torch import nn

SPLITS = ("equal_step", "equal_snr")
NOISE_BINS = 4  # router statistics are also reported per quarter of the timestep range


def _pipeline_config(unet_config: dict) -> dict:
    """The dense UNet's config keys that pipelines read from ``unet.config``."""
    keys = ("sample_size", "in_channels", "out_channels", "time_cond_proj_dim", "cross_attention_dim",
            "addition_embed_type", "addition_time_embed_dim", "num_train_timesteps")
    return {k: unet_config.get(k) for k in keys}


def _timesteps_like(timestep, sample: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(timestep, device=sample.device)
    return t.reshape(1).expand(sample.shape[0]) if t.ndim == 0 else t


def records_routing(module: nn.Module) -> bool:
    """Whether this forward of ``module`` replaces its routing record: any forward outside ``no_routing_record``."""
    return getattr(module, "records_routing", True)


@contextlib.contextmanager
def no_routing_record(module: nn.Module) -> Iterator[None]:
    """Forwards of ``module`` inside keep the MoE routing records of its earlier forward: a stop-gradient target
    pass through the student itself, whose routing no loss trains. A no-op for modules without MoE layers."""
    routed = [m for m in module.modules() if isinstance(m, MoEFeedForward) or hasattr(m, "router_stats")]
    previous = [records_routing(m) for m in routed]
    for m in routed:
        m.records_routing = False
    try:
        yield
    finally:
        for m, value in zip(routed, previous):
            m.records_routing = value


def _bin_load(load: torch.Tensor, t: torch.Tensor, num_train_timesteps: int, prefix: str) -> dict[str, float]:
    """Fractions of routed work per expert, overall and per noise-level bin; ``load`` is (N, E) per sample."""
    stats = {}
    total = load.sum()
    for e, value in enumerate((load.sum(0) / total.clamp(min=1e-12)).tolist()):
        stats[f"{prefix}load/e{e}"] = value
    width = num_train_timesteps // NOISE_BINS
    bins = (t.long() // width).clamp(max=NOISE_BINS - 1)
    for b in range(NOISE_BINS):
        rows = load[bins == b]
        if rows.numel():
            for e, value in enumerate((rows.sum(0) / rows.sum().clamp(min=1e-12)).tolist()):
                stats[f"{prefix}load_t{b * width}-{(b + 1) * width - 1}/e{e}"] = value
    return stats


# ---------------------------------------------------------------- timestep-routed ensemble


def expert_boundaries(num_experts: int, split: str = "equal_step", alphas_cumprod: torch.Tensor | None = None,
                      num_train_timesteps: int = 1000) -> list[int]:
    """Timesteps where expert k hands over to k + 1 (ascending; expert 0 owns the lowest noise).

    ``equal_step`` gives each expert the same number of training timesteps; ``equal_snr`` the same
    span of log-SNR, log(abar / (1 - abar)), between the ends of the schedule."""
    if num_experts < 1:
        raise ValueError(f"student.num_experts={num_experts} must be >= 1")
    if split == "equal_step":
        return [round(k * num_train_timesteps / num_experts) for k in range(1, num_experts)]
    if split == "equal_snr":
        if alphas_cumprod is None:
            raise ValueError("an equal_snr split needs the teacher's noise schedule (alphas_cumprod)")
        abar = alphas_cumprod.double()
        logsnr = torch.log(abar / (1 - abar))  # decreasing in t
        levels = torch.linspace(float(logsnr[0]), float(logsnr[-1]), num_experts + 1, dtype=torch.float64)[1:-1]
        # first timestep whose log-SNR is at or below each level
        return [int(torch.searchsorted(-logsnr, -lv).item()) for lv in levels]
    raise ValueError(f"student.split={split!r} is not one of {list(SPLITS)}")


class TimestepMoEUNet(ModelMixin, ConfigMixin):
    """K expert UNets; a sample at timestep t goes to expert ``bucketize(t, boundaries)``.

    ``shared_layers`` names submodules (e.g. ``conv_in``, ``time_embedding``, ``down_blocks.0``) that
    all experts share: one set of weights, stored once in checkpoints and exports."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, unet_config: dict, boundaries: list[int], shared_layers: list[str] | tuple = (),
                 sample_size=None, in_channels=None, out_channels=None, time_cond_proj_dim=None,
                 cross_attention_dim=None, addition_embed_type=None, addition_time_embed_dim=None,
                 num_train_timesteps=None):
        super().__init__()
        if list(boundaries) != sorted(boundaries) or len(set(boundaries)) != len(boundaries):
            raise ValueError(f"student boundaries {list(boundaries)} must be strictly increasing timesteps")
        unet_config = {k: v for k, v in dict(unet_config).items() if not k.startswith("_")}
        self.experts = nn.ModuleList(UNet2DConditionModel.from_config(unet_config)
                                     for _ in range(len(boundaries) + 1))
        for name in shared_layers:
            module = self.experts[0].get_submodule(name)
            for expert in self.experts[1:]:
                expert.set_submodule(name, module)
        self.register_buffer("handover_timesteps", torch.tensor(list(boundaries), dtype=torch.long), persistent=False)
        self.register_to_config(**_pipeline_config(unet_config))
        self._aliases = self._alias_map()
        self._register_load_state_dict_pre_hook(self._fill_aliases)
        self.last_load: torch.Tensor | None = None
        self.last_timesteps: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def _alias_map(self) -> dict[str, str]:
        """Parameter/buffer names under a later expert that alias an earlier (canonical) name."""
        canonical, aliases = {}, {}
        for name, tensor in [*self.named_parameters(remove_duplicate=False), *self.named_buffers(remove_duplicate=False)]:
            key = id(tensor)
            if key in canonical and canonical[key] != name:
                aliases[name] = canonical[key]
            else:
                canonical.setdefault(key, name)
        return aliases

    def _fill_aliases(self, state_dict, prefix, *args, **kwargs):
        for alias, source in self._aliases.items():
            if prefix + source in state_dict and prefix + alias not in state_dict:
                state_dict[prefix + alias] = state_dict[prefix + source]

    def state_dict(self, *args, **kwargs):
        destination = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for alias in self._aliases:  # shared weights are stored once
            destination.pop(prefix + alias, None)
        return destination

    def expert_of(self, timestep: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(timestep.long(), self.handover_timesteps.to(timestep.device), right=True)

    def active_parameters(self) -> int:
        """Parameters one network evaluation uses: one expert (shared layers counted once)."""
        return sum(p.numel() for p in self.experts[0].parameters())

    def forward(self, sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor,
                timestep_cond: torch.Tensor | None = None, return_dict: bool = True, **kwargs):
        t = _timesteps_like(timestep, sample)
        route = self.expert_of(t)
        if records_routing(self):
            self.last_timesteps = t.detach()
            self.last_load = F.one_hot(route, self.num_experts).float()
        chosen = route.unique()
        if chosen.numel() == 1:  # the usual case at sampling time: one expert runs
            out = self.experts[int(chosen)](sample, timestep, encoder_hidden_states, timestep_cond=timestep_cond,
                                            return_dict=False, **kwargs)[0]
        else:  # a training batch mixes noise levels: each expert runs on its own samples
            out = torch.empty_like(sample)
            for e in chosen.tolist():
                rows = (route == e).nonzero(as_tuple=True)[0]
                cond = None if timestep_cond is None else timestep_cond[rows]
                out[rows] = self.experts[e](sample[rows], t[rows], encoder_hidden_states[rows], timestep_cond=cond,
                                            return_dict=False, **kwargs)[0].to(out.dtype)
        return UNet2DConditionOutput(sample=out) if return_dict else (out,)

    def aux_loss(self) -> torch.Tensor | None:
        return None  # routing is fixed: nothing to balance

    def router_stats(self, prefix: str = "router/") -> dict[str, float]:
        if self.last_load is None:
            return {}
        return _bin_load(self.last_load, self.last_timesteps, self.config.num_train_timesteps or 1000, prefix)


# ---------------------------------------------------------------- token-routed FFN experts


class MoEFeedForward(nn.Module):
    """Top-k routed experts in place of one feed-forward layer; tokens are (..., dim)."""

    def __init__(self, dense: nn.Module, dim: int, num_experts: int, top_k: int = 1,
                 capacity_factor: float | None = 1.25, eval_capacity_factor: float | None = None,
                 load_balance_weight: float = 0.01, z_loss_weight: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"student.top_k={top_k} must be between 1 and student.num_experts={num_experts}")
        self.experts = nn.ModuleList(copy.deepcopy(dense) for _ in range(num_experts))
        self.router = nn.Linear(dim, num_experts, bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.load_balance_weight, self.z_loss_weight = load_balance_weight, z_loss_weight
        self.aux: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}

    def __getstate__(self) -> dict:
        """Copies (deepcopy, pickling) leave out the last forward's loss and statistics (graph tensors)."""
        state = dict(super().__getstate__())
        state["aux"], state["stats"] = None, {}
        return state

    def capacity(self, tokens: int) -> int | None:
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return None if factor is None else max(1, math.ceil(factor * tokens * self.top_k / self.num_experts))

    def route(self, x: torch.Tensor):
        """Router logits, probabilities, chosen experts and gates (T, k), and which choices fit (T, k)."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # the router in float32 under mixed precision (Switch §2.4)
            logits = F.linear(x.to(dtype), self.router.weight.to(dtype))
        probs = logits.softmax(-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        gates = self.gates(top)
        capacity = self.capacity(x.shape[0])
        if capacity is None:
            kept = torch.ones_like(chosen, dtype=torch.bool)
        else:  # first choices of all tokens take places before second choices (Switch / GShard order)
            onehot = F.one_hot(chosen, self.num_experts).transpose(0, 1).reshape(-1, self.num_experts)
            position = (onehot.cumsum(0) - 1)[onehot.bool()].reshape(self.top_k, -1).transpose(0, 1)
            kept = position < capacity
        return logits, probs, chosen, gates, kept

    @staticmethod
    def gates(top: torch.Tensor) -> torch.Tensor:
        """Gates of the chosen experts from their router probabilities (T, k): top-1 keeps p_i(x)
        (Switch Transformer, Fedus et al. 2022, eq. 2: y = p_i(x) E_i(x)), so the task loss trains the
        router; k >= 2 renormalises, p_i / sum_j p_j (GShard top-2, Lepikhin et al. 2020, Algorithm 1:
        g1 / (g1 + g2); Mixtral, Jiang et al. 2024, sec. 2.1: Softmax(TopK(x W_g)))."""
        return top if top.shape[-1] == 1 else top / top.sum(-1, keepdim=True)

    @staticmethod
    def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
        """E * sum_i f_i P_i: f_i the fraction of routing choices that pick expert i, P_i its mean probability."""
        f = F.one_hot(chosen, num_experts).float().sum((0, 1)) / chosen.numel()
        return num_experts * (f * probs.mean(0)).sum()

    @staticmethod
    def z_loss(logits: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(logits, -1).pow(2).mean()

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits, probs, chosen, gates, kept = self.route(x)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = ((chosen == e) & kept).nonzero(as_tuple=True)
            if token.numel():
                y = self.experts[e](x[token])
                out = out.index_add(0, token, y * gates[token, slot, None].to(y.dtype))
        if records_routing(self):
            self.record(logits, probs, chosen, kept, shape[0] if len(shape) > 2 else 1)
        return out.reshape(*shape[:-1], out.shape[-1])

    def record(self, logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor, kept: torch.Tensor,
               samples: int) -> None:
        """Keep this forward's weighted auxiliary loss (with its graph) and router statistics; tokens are
        ``samples`` equal runs of rows."""
        lb = self.load_balancing_loss(probs, chosen, self.num_experts)
        z = self.z_loss(logits)
        self.aux = self.load_balance_weight * lb + (self.z_loss_weight * z if self.z_loss_weight else 0.0)
        tokens, device = chosen.shape[0], chosen.device
        load = torch.zeros(samples, self.num_experts, device=device)
        sample_of = torch.arange(tokens, device=device) // (tokens // samples)
        load.index_put_((sample_of[:, None].expand_as(chosen)[kept], chosen[kept]),
                        torch.ones((), device=device), accumulate=True)
        self.stats = {"lb": lb.detach(), "z": z.detach(), "load": load,
                      "dropped": 1.0 - kept.float().mean().detach()}


class TokenRouted:
    """What a network with ``MoEFeedForward`` layers reports (``TokenMoEUNet``, the token-routed transformers of
    ``distill.models.moe_transformer``): its MoE layers, active parameters, auxiliary loss and router statistics.
    ``last_timesteps`` (N,) are the last own forward's timesteps on a 0..``num_train_timesteps`` scale."""

    last_timesteps: torch.Tensor | None = None

    def moe_layers(self) -> list[MoEFeedForward]:
        return [m for m in self.modules() if isinstance(m, MoEFeedForward)]

    def active_parameters(self) -> int:
        """Parameters one token meets: everything except the experts it is not routed to."""
        total = sum(p.numel() for p in self.parameters())
        for layer in self.moe_layers():
            per_expert = sum(p.numel() for p in layer.experts[0].parameters())
            total -= (layer.num_experts - layer.top_k) * per_expert
        return total

    def aux_loss(self) -> torch.Tensor | None:
        """The weighted load-balancing (+ z) loss of the student's last own forward, summed over the MoE layers
        (Switch Transformer, Fedus et al. 2022, sec. 2.2: each switch layer's auxiliary loss joins the total)."""
        terms = [layer.aux for layer in self.moe_layers() if layer.aux is not None]
        return torch.stack([torch.as_tensor(a) for a in terms]).sum() if terms else None

    def router_stats(self, prefix: str = "router/") -> dict[str, float]:
        layers = [layer for layer in self.moe_layers() if layer.stats]
        if not layers or self.last_timesteps is None:
            return {}
        load = sum(layer.stats["load"] for layer in layers)
        stats = _bin_load(load, self.last_timesteps, self.config.get("num_train_timesteps") or 1000, prefix)
        stats[f"{prefix}load_balance_loss"] = float(torch.stack([m.stats["lb"] for m in layers]).mean())
        stats[f"{prefix}z_loss"] = float(torch.stack([m.stats["z"] for m in layers]).mean())
        stats[f"{prefix}dropped_fraction"] = float(torch.stack([m.stats["dropped"] for m in layers]).mean())
        return stats


class TokenMoEUNet(TokenRouted, ModelMixin, ConfigMixin):
    """The dense UNet with every transformer block's feed-forward layer replaced by ``MoEFeedForward``."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, unet_config: dict, num_experts: int = 4, top_k: int = 1, capacity_factor: float | None = 1.25,
                 eval_capacity_factor: float | None = None, load_balance_weight: float = 0.01,
                 z_loss_weight: float = 0.0, sample_size=None, in_channels=None, out_channels=None,
                 time_cond_proj_dim=None, cross_attention_dim=None, addition_embed_type=None,
                 addition_time_embed_dim=None, num_train_timesteps=None):
        super().__init__()
        unet_config = {k: v for k, v in dict(unet_config).items() if not k.startswith("_")}
        self.unet = UNet2DConditionModel.from_config(unet_config)
        blocks = [m for m in self.unet.modules() if isinstance(m, BasicTransformerBlock) and m.ff is not None]
        if not blocks:
            raise ValueError("the teacher UNet has no transformer feed-forward layers to turn into experts")
        for block in blocks:
            block.ff = MoEFeedForward(block.ff, block.norm3.normalized_shape[0], num_experts, top_k,
                                      capacity_factor, eval_capacity_factor, load_balance_weight, z_loss_weight)
        self.register_to_config(**_pipeline_config(unet_config))
        self.last_timesteps: torch.Tensor | None = None

    def forward(self, sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor,
                timestep_cond: torch.Tensor | None = None, return_dict: bool = True, **kwargs):
        if records_routing(self):
            self.last_timesteps = _timesteps_like(timestep, sample).detach()
        out = self.unet(sample, timestep, encoder_hidden_states, timestep_cond=timestep_cond, return_dict=False,
                        **kwargs)[0]
        return UNet2DConditionOutput(sample=out) if return_dict else (out,)


def moe_aux_and_stats(module: nn.Module, prefix: str = "router/",
                      with_stats: bool = True) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The auxiliary loss and (``with_stats``) router statistics of a MoE student's last forward; (None, {}) for
    dense ones."""
    if not hasattr(module, "router_stats"):
        return None, {}
    return module.aux_loss(), module.router_stats(prefix) if with_stats else {}
