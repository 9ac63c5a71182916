"""Low-rank factorisation of ``nn.Linear`` and ``nn.Conv2d`` weights by truncated SVD, for inference.

A weight matrix W (out, in) -- a k x k convolution reshaped to (out, in*k*k) -- with SVD U S V^T is replaced
by its best rank-r approximation (Eckart-Young): two layers ``down = sqrt(S_r) V_r^T`` and ``up = U_r sqrt(S_r)``.
A Linear(in, out) becomes Linear(in, r, no bias) -> Linear(r, out, bias); a k x k Conv2d becomes a k x k
Conv2d(in, r) with the original stride, padding and dilation, then a 1x1 Conv2d(r, out) with the bias. The
relative Frobenius error of the weight is sqrt(sum_{i>r} s_i^2 / sum_i s_i^2), which the report predicts.

Ranks are chosen per layer by ``choose_ranks``: an explicit rank, an energy threshold (the smallest r keeping
at least ``energy`` of sum s_i^2), a global parameter budget, filled greedily by retained energy per
parameter (the sum of the layers' squared relative errors is what it minimises), or a FLOPs budget: the same
greedy fill with each layer's parameters weighted by the rows it multiplies per call (tokens of a linear layer,
output positions of a convolution: ``layer_rows``), a fraction of the whole call's FLOPs (attention and every
layer left dense counted, by ``distill.utils.flops``). A layer is factorised only
where that saves parameters: r * (in + out) < in * out for a linear
layer, r * (in*k*k + out) < out * in*k*k for a convolution.

``LowRankUNet2DConditionModel`` is a diffusers ``UNet2DConditionModel`` whose config records the ranks
(``lowrank_ranks``), so that ``from_pretrained`` rebuilds the factorised structure before loading the
weights; a pipeline saved with it as ``unet`` loads with ``DiffusionPipeline.from_pretrained`` once this
module is imported (``model_index.json`` names it as the UNet's library). It is a pruned UNet's export too
(``distill.compress.prune``): a pruned UNet factorised keeps its ``layer_shapes``, which are rebuilt first.
"""

from __future__ import annotations

import heapq
import inspect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch

import torch
from diffusers import ModelMixin, UNet2DConditionModel  # noqa: F401
from torch import nn

from distill.compress.prune import PrunedUNet2DConditionModel

# DiffusionPipeline.from_pretrained looks the loadable base classes (ModelMixin) up in the namespace of the
# library that model_index.json names for a component -- this module -- hence the import above.

# The layers Stable-Diffusion-style UNets keep dense: the image-space input and output convolutions (few
# channels, so no rank saves much, and every error lands on the sample) and the timestep embedding MLP.
UNET_KEEP_DENSE = ("conv_in", "conv_out", "time_embedding.*")
LAYER_KINDS = ("linear", "conv")
BUDGET_TARGETS = ("params", "flops")  # what a budget keeps a fraction of: the factorisable weights, or a call's FLOPs


class LowRankLinear(nn.Module):
    """Linear(in, rank, no bias) -> Linear(rank, out, bias): a rank-``rank`` ``nn.Linear(in, out)``."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)

    @classmethod
    def like(cls, dense: nn.Linear, rank: int) -> LowRankLinear:
        """The factorised structure of ``dense`` at ``rank``, weights uninitialised from it."""
        w = dense.weight
        return cls(dense.in_features, dense.out_features, rank, dense.bias is not None, w.device, w.dtype)

    @classmethod
    def from_dense(cls, dense: nn.Linear, rank: int) -> LowRankLinear:
        """The best rank-``rank`` approximation of ``dense`` (truncated SVD)."""
        low = cls.like(dense, rank)
        down, up = svd_factors(dense.weight, rank)
        with torch.no_grad():
            low.down.weight.copy_(down)
            low.up.weight.copy_(up)
            if dense.bias is not None:
                low.up.bias.copy_(dense.bias)
        return low

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class LowRankConv2d(nn.Module):
    """k x k Conv2d(in, rank, no bias) -> 1x1 Conv2d(rank, out, bias): a rank-``rank`` ``nn.Conv2d``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, rank: int, stride=1, padding=0,
                 dilation=1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None):
        super().__init__()
        self.in_channels, self.out_channels, self.rank = in_channels, out_channels, rank
        self.down = nn.Conv2d(in_channels, rank, kernel_size, stride, padding, dilation, bias=False,
                              padding_mode=padding_mode, device=device, dtype=dtype)
        self.up = nn.Conv2d(rank, out_channels, 1, bias=bias, device=device, dtype=dtype)

    @classmethod
    def like(cls, dense: nn.Conv2d, rank: int) -> LowRankConv2d:
        w = dense.weight
        return cls(dense.in_channels, dense.out_channels, dense.kernel_size, rank, dense.stride, dense.padding,
                   dense.dilation, dense.bias is not None, dense.padding_mode, w.device, w.dtype)

    @classmethod
    def from_dense(cls, dense: nn.Conv2d, rank: int) -> LowRankConv2d:
        """The best rank-``rank`` approximation of ``dense``'s weight reshaped to (out, in*k*k)."""
        low = cls.like(dense, rank)
        down, up = svd_factors(dense.weight, rank)
        with torch.no_grad():
            low.down.weight.copy_(down.reshape(low.down.weight.shape))  # (r, in, k, k)
            low.up.weight.copy_(up[:, :, None, None])  # (out, r, 1, 1)
            if dense.bias is not None:
                low.up.bias.copy_(dense.bias)
        return low

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


LOWRANK_TYPES = (LowRankLinear, LowRankConv2d)


def weight_matrix(weight: torch.Tensor) -> torch.Tensor:
    """The matrix that is factorised: (out, in) for a linear weight, (out, in*k*k) for a convolution's."""
    return weight.detach().reshape(weight.shape[0], -1)


def svd_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(down (r, in*k*k), up (out, r)) with up @ down the best rank-r approximation of ``weight_matrix(weight)``;
    the singular values are split as sqrt(s) into both. The SVD runs in float64, the factors take the weight's dtype."""
    u, s, vh = torch.linalg.svd(weight_matrix(weight).double(), full_matrices=False)
    root = s[:rank].sqrt()
    return (root[:, None] * vh[:rank]).to(weight.dtype), (u[:, :rank] * root).to(weight.dtype)


def _kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Conv2d):
        return "conv"
    return None


def _dims(module: nn.Linear | nn.Conv2d) -> tuple[int, int]:
    """(out, in*k*k) of the weight matrix."""
    w = module.weight
    return w.shape[0], w[0].numel()


def _factorised_weight_params(out: int, inner: int, rank: int) -> int:
    return rank * (inner + out)


# ---------------------------------------------------------------- the report


@dataclass(frozen=True)
class LayerRank:
    """One linear/conv layer of a model: its weight matrix, the rank chosen, and what it costs and loses."""

    name: str
    kind: str  # "linear" | "conv"
    shape: tuple[int, int]  # (out, in*k*k) of the weight matrix
    dense_params: int  # weight + bias of the dense layer
    rank: int | None  # None: kept dense
    params: int  # after factorisation (dense_params where kept dense)
    discarded_energy: float  # sum_{i>r} s_i^2 / sum_i s_i^2; 0 where kept dense
    note: str = ""  # why a layer is kept dense

    @property
    def factorised(self) -> bool:
        return self.rank is not None

    @property
    def retained_energy(self) -> float:
        return 1.0 - self.discarded_energy

    @property
    def predicted_error(self) -> float:
        """Relative Frobenius error of the weight, ||W - W_r||_F / ||W||_F (Eckart-Young)."""
        return math.sqrt(max(self.discarded_energy, 0.0))


@dataclass
class LowRankReport:
    """Every linear/conv layer of a model with its chosen rank; ``ranks`` is what ``factorise`` takes."""

    layers: list[LayerRank]
    model_params: int  # all parameters of the dense model
    rule: str = ""  # how the ranks were chosen, e.g. "energy=0.9"
    budget_params: int | None = field(default=None)  # the weight parameters a budget allowed
    flops: int | None = field(default=None)  # FLOPs of one call of the dense model (a FLOPs budget, or measured)
    flops_after: int | None = field(default=None)  # of the factorised model

    @property
    def ranks(self) -> dict[str, int]:
        return {layer.name: layer.rank for layer in self.layers if layer.rank is not None}

    @property
    def dense_params(self) -> int:
        """Parameters of the listed layers, dense."""
        return sum(layer.dense_params for layer in self.layers)

    @property
    def params(self) -> int:
        """Parameters of the listed layers after factorisation."""
        return sum(layer.params for layer in self.layers)

    @property
    def model_params_after(self) -> int:
        return self.model_params - self.dense_params + self.params

    def table(self) -> str:
        """One line per layer and the totals, for logs and model cards."""
        width = max([len(layer.name) for layer in self.layers] + [5])
        lines = [f"low-rank factorisation ({self.rule})",
                 f"{'layer':<{width}} {'kind':<6} {'shape':>12} {'rank':>5} {'dense':>9} {'after':>9} "
                 f"{'energy':>8} {'pred.err':>8}  note"]
        for lr in self.layers:
            lines.append(f"{lr.name:<{width}} {lr.kind:<6} {f'{lr.shape[0]}x{lr.shape[1]}':>12} "
                         f"{lr.rank if lr.rank is not None else '-':>5} {lr.dense_params:>9} {lr.params:>9} "
                         f"{lr.retained_energy:>8.4f} {lr.predicted_error:>8.4f}  {lr.note}")
        lines.append(f"layers: {self.dense_params} -> {self.params} parameters "
                     f"({self.params / max(self.dense_params, 1):.3f}); model: {self.model_params} -> "
                     f"{self.model_params_after} ({self.model_params_after / max(self.model_params, 1):.3f}); "
                     f"{len(self.ranks)} of {len(self.layers)} layers factorised")
        if self.flops and self.flops_after is not None:
            lines.append(f"FLOPs of one call: {self.flops / 1e9:.4f} -> {self.flops_after / 1e9:.4f} G "
                         f"({self.flops_after / self.flops:.3f})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"rule": self.rule, "model_params": self.model_params, "model_params_after": self.model_params_after,
                "flops": self.flops, "flops_after": self.flops_after,
                "layers": [{"name": lr.name, "kind": lr.kind, "shape": list(lr.shape), "rank": lr.rank,
                            "dense_params": lr.dense_params, "params": lr.params,
                            "retained_energy": lr.retained_energy, "predicted_error": lr.predicted_error,
                            "note": lr.note} for lr in self.layers]}


# ---------------------------------------------------------------- choosing ranks


def _check_fraction(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{key}={value!r} must be a fraction in (0, 1]: the share of the singular-value energy "
                         "(energy) or of the factorisable weight parameters (budget) to keep")
    return float(value)


def _check_rank(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key}={value!r} must be a positive integer rank (1 <= rank <= min(out, in*k*k))")
    return value


def _rules(arg: str, value, check) -> list[tuple[str, float | int, str]]:
    """A scalar or a {key: value} mapping as ordered (key, value, label for errors) rules; a scalar applies to
    every layer."""
    if isinstance(value, Mapping):
        return [(key, check(f"{arg}[{key!r}]", v), f"{arg}[{key!r}]") for key, v in value.items()]
    return [("*", check(arg, value), arg)]


def _matches(key: str, name: str, kind: str) -> bool:
    """A rule key is a layer kind ("linear", "conv") or an fnmatch pattern of module names."""
    return key == kind if key in LAYER_KINDS else fnmatch(name, key)


def _candidates(model: nn.Module, keep_dense: Iterable[str],
                layer_kinds: tuple[str, ...]) -> tuple[list, list[LayerRank]]:
    """([(name, module, kind)] that may be factorised, [LayerRank] of the linear/conv layers that may not)."""
    keep_dense = tuple(keep_dense)
    candidates, kept = [], []
    for name, module in model.named_modules():
        kind = _kind(module)
        if kind is None:
            continue
        pattern = next((p for p in keep_dense if fnmatch(name, p)), None)
        if pattern is not None:
            note = f"keep_dense {pattern!r}"
        elif kind == "conv" and module.groups != 1:
            note = f"groups={module.groups}"
        elif kind not in layer_kinds:
            note = f"{kind} not in layer_kinds"
        else:
            candidates.append((name, module, kind))
            continue
        kept.append(LayerRank(name, kind, _dims(module), _numel(module), None, _numel(module), 0.0, note))
    return candidates, kept


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _energies(module: nn.Module) -> torch.Tensor:
    """Normalised squared singular values s_i^2 / sum s^2 (float64, descending) of the weight matrix."""
    s2 = torch.linalg.svdvals(weight_matrix(module.weight).double()).square()
    return s2 / s2.sum().clamp(min=torch.finfo(torch.float64).tiny)


def energy_rank(energies: torch.Tensor, energy: float) -> int:
    """The smallest r with sum_{i<=r} s_i^2 >= energy * sum_i s_i^2."""
    cumulative = energies.cumsum(0)
    return min(int((cumulative < energy * cumulative[-1]).sum()) + 1, len(energies))


def _layer(name: str, module: nn.Module, kind: str, energies: torch.Tensor, rank: int | None,
           only_if_smaller: bool, note: str = "") -> LayerRank:
    out, inner = _dims(module)
    dense = _numel(module)
    if rank is not None:
        saved = out * inner - _factorised_weight_params(out, inner, rank)
        if only_if_smaller and saved <= 0:
            note, rank = f"rank {rank} saves no parameters (needs < {math.ceil(out * inner / (out + inner))})", None
    if rank is None:
        return LayerRank(name, kind, (out, inner), dense, None, dense, 0.0, note)
    return LayerRank(name, kind, (out, inner), dense, rank, dense - saved, float(energies[rank:].sum()), note)


def layer_rows(model: nn.Module, inputs: Mapping) -> dict[str, int]:
    """Rows every ``nn.Linear`` and ``nn.Conv2d`` of ``model`` multiplies in one call ``model(**inputs)``: a linear
    layer's input rows (batch times tokens), a convolution's output positions, summed over its calls (0 where the
    call skips it). One weight parameter costs 2 FLOPs per row, dense or factorised."""
    rows, hooks = {}, []

    def recorder(name: str, linear: bool):
        def record(module, args, output):
            rows[name] += output.numel() // output.shape[-1 if linear else 1]
        return record

    for name, module in model.named_modules():
        if (kind := _kind(module)) is not None:
            rows[name] = 0
            hooks.append(module.register_forward_hook(recorder(name, kind == "linear")))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return rows


def call_flops(model: nn.Module, inputs: Mapping) -> int:
    """FLOPs of one call ``model(**inputs)`` (``distill.utils.flops``: matmuls, convolutions and attention)."""
    from distill.utils.flops import count_flops

    with torch.no_grad():
        return count_flops(lambda: model(**inputs))


def choose_ranks(model: nn.Module, *, rank: int | Mapping[str, int] | None = None,
                 energy: float | Mapping[str, float] | None = None, budget: float | None = None,
                 target: str = "params", example_inputs: Mapping | None = None,
                 keep_dense: Iterable[str] = (), layer_kinds: Iterable[str] = LAYER_KINDS,
                 only_if_smaller: bool = True) -> LowRankReport:
    """Pick a rank for every ``nn.Linear`` and ``nn.Conv2d`` (groups=1) of ``model``; exactly one rule:

    * ``rank``: a fixed rank;
    * ``energy``: the smallest rank keeping that fraction of sum s_i^2;
    * ``budget`` (``target="params"``): keep that fraction of the weight parameters of the factorisable layers.
      Every layer starts at rank 1; then, greedily, the step with the most retained energy (s_i^2 / sum s^2,
      relative to its own layer) per parameter is taken -- one more rank, or going back to dense where the next
      rank would save nothing -- while it fits. The result is within one rank step (in*k*k + out parameters of one
      layer) under the budget. This greedily minimises the sum over layers of the squared predicted errors, each
      layer counting alike, so small layers fill up first and large ones may be left at a low rank.
    * ``budget`` with ``target="flops"``: keep that fraction of the FLOPs of one call ``model(**example_inputs)``,
      everything counted (attention, layers left dense): the same greedy fill, each parameter costing the rows its
      layer multiplies (``layer_rows``), so a layer called on one row per sample (an adaLN modulation) goes dense
      first. Refused where even rank 1 everywhere costs more.

    ``rank`` and ``energy`` take a scalar or a mapping whose keys are a layer kind ("linear", "conv") or fnmatch
    patterns of module names, the first matching key winning; layers no key matches stay dense. Layers matching
    a ``keep_dense`` pattern or not of ``layer_kinds`` stay dense. With ``only_if_smaller`` (the default) a layer
    is factorised only where the factors have fewer parameters than the dense weight; ``False`` factorises at any
    rank (a full-rank factorisation checks exactness).
    """
    given = [k for k, v in (("rank", rank), ("energy", energy), ("budget", budget)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of rank, energy, budget to choose ranks (got {given or 'none'})")
    if target not in BUDGET_TARGETS:
        raise ValueError(f"target={target!r} is not one of {list(BUDGET_TARGETS)} (what a budget keeps a fraction of)")
    layer_kinds = tuple(layer_kinds)
    if unknown := set(layer_kinds) - set(LAYER_KINDS):
        raise ValueError(f"layer_kinds={list(layer_kinds)}: {sorted(unknown)} not among {list(LAYER_KINDS)}")
    candidates, layers = _candidates(model, keep_dense, layer_kinds)
    if budget is not None and target == "params":
        budget = _check_fraction("budget", budget)
        pool, chosen = _budget_pool(candidates)
        dense = sum(p[1] for p in pool)
        allowed = int(budget * dense)
        if pool and (least := sum(p[2] for p in pool)) > allowed:
            raise ValueError(f"budget={budget} is below rank 1 in every factorisable layer ({least / dense:.4f} of "
                             f"their weights); raise budget to >= {least / dense:.4f}, or keep layers dense with "
                             "keep_dense")
        chosen.update(_budget_ranks(pool, allowed))
        report = LowRankReport([], _numel(model), f"budget={budget}", allowed)
    elif budget is not None:
        budget = _check_fraction("budget", budget)
        if example_inputs is None:
            raise ValueError("target='flops' counts the FLOPs of one call: give example_inputs (the forward's keyword "
                             "arguments)")
        flops = call_flops(model, example_inputs)
        pool, chosen = _budget_pool(candidates, layer_rows(model, example_inputs))
        fixed = flops - 2 * sum(p[1] for p in pool)  # attention, norms and the layers that stay dense
        allowed = (budget * flops - fixed) / 2  # multiply-adds of the pool's layers
        if pool and (least := sum(p[2] for p in pool)) > allowed:
            floor = (fixed + 2 * least) / flops
            raise ValueError(f"budget={budget} of the FLOPs is below what rank 1 in every factorisable layer costs "
                             f"({floor:.4f} of a call's FLOPs, attention and the dense layers included); raise "
                             f"budget to >= {floor:.4f}, or keep layers dense with keep_dense")
        ranks = _budget_ranks(pool, allowed)
        chosen.update(ranks)
        after = fixed + 2 * sum(dense if ranks[name][0] is None else ranks[name][0] * step
                                for name, dense, step, _ in pool)
        report = LowRankReport([], _numel(model), f"budget={budget} of the FLOPs", flops=flops, flops_after=after)
    else:
        arg, value = ("rank", rank) if rank is not None else ("energy", energy)
        chosen = _rule_ranks(candidates, arg, value)
        report = LowRankReport([], _numel(model), f"{arg}={value}")
    for name, module, kind in candidates:
        r, energies, note = chosen[name]
        layers.append(_layer(name, module, kind, energies, r, only_if_smaller or rank is None and energy is None,
                             note))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    report.layers = sorted(layers, key=lambda layer: order[layer.name])
    return report


def _rule_ranks(candidates: list, arg: str, value) -> dict:
    """{name: (rank or None, energies, note)} by a ``rank`` or ``energy`` rule; see ``choose_ranks``."""
    rules = _rules(arg, value, _check_rank if arg == "rank" else _check_fraction)
    chosen, used = {}, set()
    for name, module, kind in candidates:
        key, v, label = next((rule for rule in rules if _matches(rule[0], name, kind)), (None, None, None))
        if key is None:
            chosen[name] = (None, None, f"no {arg} rule matches")
            continue
        used.add(key)
        energies = _energies(module)
        out, inner = _dims(module)
        if arg == "rank" and v > min(out, inner):
            raise ValueError(f"{label}={v} exceeds the full rank {min(out, inner)} of {name} ({kind}, weight "
                             f"matrix {out}x{inner}); lower it, or leave the layer dense with keep_dense")
        chosen[name] = (v if arg == "rank" else energy_rank(energies, v), energies, "")
    if isinstance(value, Mapping) and (unused := [k for k in value if k not in used]):
        raise ValueError(f"{arg} keys {unused} match no factorisable layer; check the module names "
                         "(model.named_modules()) or remove them")
    return chosen


def _budget_pool(candidates: list, rows: Mapping[str, int] | None = None) -> tuple[list, dict]:
    """([(name, dense cost, cost of one rank, energies)] of the layers a budget fills, {name: (None, None, note)} of
    those it leaves dense). A cost counts weight parameters, each weighted by its layer's ``rows`` where given."""
    pool, dense_layers = [], {}
    for name, module, _ in candidates:
        out, inner = _dims(module)
        weight = 1 if rows is None else rows[name]
        if out + inner >= out * inner:  # not even rank 1 saves parameters
            dense_layers[name] = (None, None, "no rank saves parameters")
        elif weight == 0:
            dense_layers[name] = (None, None, "not called on the example inputs")
        else:
            pool.append((name, weight * out * inner, weight * (out + inner), _energies(module)))
    return pool, dense_layers


def _budget_ranks(pool: list, allowed: float) -> dict:
    """{name: (rank or None, energies, note)}: greedy ranks of the ``pool`` layers whose total cost stays within
    ``allowed`` (at least rank 1 each); see ``choose_ranks``."""
    ranks = {name: 1 for name, *_ in pool}
    used = sum(step for _, _, step, _ in pool)

    def next_step(i: int) -> tuple[float, int, int] | None:
        """(-gain per cost, layer index, cost) of layer i's next step, or None when it is dense."""
        name, dense, step, energies = pool[i]
        r = ranks[name]
        if r is None:
            return None
        if (r + 1) * step < dense:  # one more rank still saves parameters
            return -float(energies[r]) / step, i, step
        return -float(energies[r:].sum()) / (dense - r * step), i, dense - r * step  # back to dense

    heap = [s for i in range(len(pool)) if (s := next_step(i)) is not None]
    heapq.heapify(heap)
    while heap:
        _, i, cost = heapq.heappop(heap)
        if used + cost > allowed:
            continue  # this layer is closed: its next step never fits, as used only grows
        used += cost
        name, dense, step, _ = pool[i]
        ranks[name] = ranks[name] + 1 if ranks[name] * step + cost < dense else None
        if (s := next_step(i)) is not None:
            heapq.heappush(heap, s)
    return {name: (ranks[name], energies, "" if ranks[name] else "budget keeps it dense")
            for name, _, _, energies in pool}


# ---------------------------------------------------------------- applying ranks


def _check_layer(model: nn.Module, name: str, rank) -> nn.Linear | nn.Conv2d:
    try:
        module = model.get_submodule(name)
    except AttributeError as err:
        raise ValueError(f"ranks[{name!r}]: no such module in {type(model).__name__}") from err
    kind = _kind(module)
    if kind is None or (kind == "conv" and module.groups != 1):
        raise ValueError(f"ranks[{name!r}]: {type(module).__name__} is not an nn.Linear or a groups=1 nn.Conv2d")
    out, inner = _dims(module)
    _check_rank(f"ranks[{name!r}]", rank)
    if rank > min(out, inner):
        raise ValueError(f"ranks[{name!r}]={rank} exceeds the full rank {min(out, inner)} of its {out}x{inner} "
                         "weight matrix; lower it")
    return module


def factorise(model: nn.Module, ranks: Mapping[str, int], *, init: bool = True) -> nn.Module:
    """Replace each named layer of ``model`` (in place) by its rank-r factorisation; returns ``model``.

    ``init=False`` builds the factorised structure only, for weights that are loaded next."""
    for name, rank in ranks.items():
        dense = _check_layer(model, name, rank)
        low_cls = LowRankLinear if isinstance(dense, nn.Linear) else LowRankConv2d
        model.set_submodule(name, low_cls.from_dense(dense, rank) if init else low_cls.like(dense, rank))
    return model


# ---------------------------------------------------------------- the diffusers export


class LowRankUNet2DConditionModel(PrunedUNet2DConditionModel):
    """A ``UNet2DConditionModel`` with the layers named in ``lowrank_ranks`` ({module name: rank}) factorised,
    after those named in ``layer_shapes`` (a pruned UNet's, empty for a dense one) are resized.

    The ranks are part of the config, so ``from_pretrained`` builds the factorised structure and then loads
    the factors; ``from_unet`` factorises a trained dense or pruned UNet."""

    def __init__(self, *args, lowrank_ranks: Mapping[str, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)  # registers the UNet's config and resizes its pruned layers
        factorise_to_config(self, lowrank_ranks)

    @classmethod
    def from_unet(cls, unet: UNet2DConditionModel, ranks: Mapping[str, int]) -> LowRankUNet2DConditionModel:
        """``unet`` (left unchanged) with the named layers replaced by their truncated SVD."""
        return factorised_export(cls, unet, ranks)


def factorise_to_config(model: ModelMixin, lowrank_ranks: Mapping[str, int] | None) -> None:
    """Record ``lowrank_ranks`` in ``model``'s config and build those layers' factors (weights load after): what a
    low-rank export's ``__init__`` does once its base class has built the dense (or pruned) network."""
    model.register_to_config(lowrank_ranks=dict(lowrank_ranks or {}))
    factorise(model, model.config.lowrank_ranks, init=False)


def factorised_export(cls: type[ModelMixin], model: ModelMixin, ranks: Mapping[str, int]) -> ModelMixin:
    """The low-rank export ``cls`` of ``model`` (left unchanged; its config, weights, dtype, device and mode) with
    the named layers replaced by their truncated SVD."""
    config = {k: v for k, v in model.config.items() if k != "lowrank_ranks"}
    export = cls.from_config(config, lowrank_ranks={})
    export.load_state_dict(model.state_dict())
    factorise(export, ranks)
    export.register_to_config(lowrank_ranks=dict(ranks))
    if export.dtype != model.dtype or export.device != model.device:
        export.to(device=model.device, dtype=model.dtype)
    return export.train(model.training)


def add_config_keyword(cls: type, base: type, name: str) -> None:
    """Give ``cls.__init__`` the signature of ``base.__init__`` plus the keyword ``name`` (default None):
    ``ConfigMixin.from_config`` passes the config keys that ``__init__``'s signature names."""
    signature = inspect.signature(base.__init__)
    cls.__init__.__signature__ = signature.replace(parameters=[
        *signature.parameters.values(), inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)])


# the pruned UNet's keys (the dense UNet's and layer_shapes), and the ranks
add_config_keyword(LowRankUNet2DConditionModel, PrunedUNet2DConditionModel, "lowrank_ranks")


def lowrank_unet(unet: UNet2DConditionModel, *, rank: int | Mapping[str, int] | None = None,
                 energy: float | Mapping[str, float] | None = None, budget: float | None = None,
                 keep_dense: Iterable[str] = UNET_KEEP_DENSE, **choose) -> tuple[LowRankUNet2DConditionModel,
                                                                                  LowRankReport]:
    """``choose_ranks`` then ``LowRankUNet2DConditionModel.from_unet``: the factorised UNet and its report."""
    report = choose_ranks(unet, rank=rank, energy=energy, budget=budget, keep_dense=keep_dense, **choose)
    return LowRankUNet2DConditionModel.from_unet(unet, report.ranks), report
