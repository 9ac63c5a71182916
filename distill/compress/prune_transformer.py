"""Structured pruning of diffusion transformers (SD3's ``SD3Transformer2DModel``, Flux's ``FluxTransformer2DModel``):
whole attention heads and MLP hidden channels are removed in every block. The residual width stays, so every
block reads and writes tokens of the teacher's width (feature distillation matches them without a regressor).

What a block loses together (one *unit*):

* a head of an attention: its head_dim rows of ``to_q``, ``to_k``, ``to_v`` and, in joint attention (SD3's joint
  blocks, Flux's double-stream blocks), of the context stream's ``add_q_proj``, ``add_k_proj``, ``add_v_proj`` (the two
  streams attend together, their q, k, v concatenated along the tokens per head, so they keep the same heads), and
  its head_dim input columns of ``to_out.0`` and ``to_add_out``. qk_norm (an RMSNorm over head_dim, shared by the
  heads) keeps its weights. SD3.5's second, image-only attention (``attn2``) has heads of its own. A Flux
  single-stream block's attention has no output projection: its heads are the first input columns of ``proj_out``,
  which reads the concatenation [attention, MLP].
* a hidden channel of an MLP: a row of ``FeedForward``'s first projection (``net.0.proj``) and a column of its
  second (``net.2``), the image stream's (``ff``) and the context stream's (``ff_context``) separately; in a Flux
  single-stream block a row of ``proj_mlp`` and its column of ``proj_out`` after the attention's.

A unit's importance is the sum over its channels of each channel's score averaged over the layers that hold it (as
torch-pruning's group importances average over a group's layers):

* ``magnitude``: the squared L2 norm of the channel's weights (a row with its bias, or a column);
* ``taylor``: Diff-Pruning's first-order score (Fang, Ma & Wang, NeurIPS 2023) |w * sum_t dL_t/dw| summed over the
  channel's weights, L_t the flow-matching loss (the velocity eps - x0 at x_t = (1 - t) x0 + t eps) at flow time t on
  calibration batches; times from low to high noise (default the midpoints of 8 equal bins of [0, 1]), the sum
  stopping after the first whose loss is below ``threshold`` times the largest so far, as the UNet's over timesteps.

``prune_transformer`` removes the same fraction f of every block's heads of each attention and channels of each MLP
(each rounded to whole units, at least one kept: a uniform width multiplier, as the UNet's ``per_block=True``),
the f whose network removes nearest ``ratio`` of the FLOPs (torch's flop counter, attention included) or parameters
(``distill.compress.prune.search_uniform_fraction``).

Why not torch-pruning: its dependency graph (1.6.0) does put both streams' q/k/v and output projections of a joint
attention in one group, but with them the four qk_norm RMSNorm weights (head_dim wide, shared by every head),
indexed by the pruned head's channels: pruning head 0 of a two-head SD3 block cuts those weights, pruning head 1
indexes past their end, and the pruned network fails at its next forward. A transformer block's couplings are few
and fixed (listed above), so the kept indices are selected here by hand.

``PrunedSD3Transformer2DModel`` and ``PrunedFluxTransformer2DModel`` are the exports: the stock class whose config
also records every block's kept heads and widths (``pruned_blocks``: block -> {"attn_heads": 2, "ff_inner_dim": 192,
...}), so that ``from_pretrained`` builds the narrowed blocks before it loads the weights; ``model_index.json`` names
this module as the transformer's library, so ``DiffusionPipeline.from_pretrained`` finds the class (and, in this
module's namespace, the ``ModelMixin`` it loads as).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from diffusers import FluxTransformer2DModel, ModelMixin, SD3Transformer2DModel  # noqa: F401
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock
from torch import nn

from distill.compress.prune import (
    PruneReport,
    _batches,
    _kept,
    _measure,
    _output,
    check_settings,
    search_uniform_fraction,
)
from distill.diffusion.losses import diffusion_loss

TRANSFORMERS = (SD3Transformer2DModel, FluxTransformer2DModel)
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")  # SD3's joint blocks; Flux's double, single
ATTENTIONS = ("attn", "attn2")
QKV = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")  # rows: a head's channels
OUTS = ("to_out.0", "to_add_out")  # columns: a head's channels
MLPS = ("ff", "ff_context")
FLOW_TIMES = 8  # Taylor importance's default flow times: the midpoints of this many equal bins of [0, 1]
FLUX_LATENT_SIZE = 128  # FluxPipeline's default_sample_size (latent pixels): the FLOPs counted by default


# ---------------------------------------------------------------- the units of a block


@dataclass(frozen=True)
class BlockUnits:
    """The prunable widths of one block, by unit key ("attn_heads", "attn2_heads", "ff_inner_dim",
    "ff_context_inner_dim", "mlp_hidden_dim"): the Linear layers whose output rows are its channels (``rows``), the
    channels of one unit (``unit``: head_dim for heads, 1 for an MLP), the attention whose ``heads`` it counts
    (``attention``), and for each Linear whose input columns are channels of units the unit keys in the order its
    input concatenates them (``cols``)."""

    rows: dict[str, tuple[str, ...]]
    unit: dict[str, int]
    attention: dict[str, str]
    cols: dict[str, tuple[str, ...]]


def _module(root: nn.Module, name: str) -> nn.Module | None:
    try:
        return root.get_submodule(name)
    except AttributeError:  # absent, or None (SD3's last block has no to_add_out, no ff_context)
        return None


def block_units(block: nn.Module) -> BlockUnits:
    """The units of an SD3 joint block, a Flux double- or single-stream block."""
    rows, unit, attention, cols = {}, {}, {}, {}
    for name in ATTENTIONS:
        attn = getattr(block, name, None)
        if attn is None:
            continue
        key = f"{name}_heads"
        rows[key] = tuple(f"{name}.{p}" for p in QKV if _module(attn, p) is not None)
        unit[key], attention[key] = attn.to_q.out_features // attn.heads, name
        cols.update({f"{name}.{p}": (key,) for p in OUTS if _module(attn, p) is not None})
    for name in MLPS:
        ff = getattr(block, name, None)
        if ff is None:
            continue
        if type(ff.net[0]).__name__ != "GELU":  # GEGLU's projection holds two halves per channel
            raise ValueError(f"{name} has a {type(ff.net[0]).__name__} activation; transformer pruning cuts GELU "
                             "MLPs (SD3's, Flux's) only")
        key = f"{name}_inner_dim"
        rows[key], unit[key], cols[f"{name}.net.2"] = (f"{name}.net.0.proj",), 1, (key,)
    if isinstance(block, FluxSingleTransformerBlock):
        rows["mlp_hidden_dim"], unit["mlp_hidden_dim"] = ("proj_mlp",), 1
        cols["proj_out"] = ("attn_heads", "mlp_hidden_dim")
    return BlockUnits(rows, unit, attention, cols)


def transformer_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Every block by its module name, in forward order."""
    return {f"{blocks}.{i}": b for blocks in BLOCK_LISTS for i, b in enumerate(getattr(model, blocks, ()))}


def unit_counts(model: nn.Module) -> dict[str, dict[str, int]]:
    """Block -> unit key -> its units (heads of an attention, hidden channels of an MLP): what an export records."""
    counts = {}
    for name, block in transformer_blocks(model).items():
        units = block_units(block)
        counts[name] = {key: block.get_submodule(layers[0]).out_features // units.unit[key]
                        for key, layers in units.rows.items()}
    return counts


# ---------------------------------------------------------------- narrowing


def _sliced(layer: nn.Linear, rows: Sequence[int] | None = None, cols: Sequence[int] | None = None) -> nn.Linear:
    """A Linear holding ``layer``'s weights at the given output rows and input columns (all where None)."""
    weight, bias = layer.weight, layer.bias
    if rows is not None:
        rows = torch.as_tensor(list(rows), dtype=torch.long, device=weight.device)
        weight, bias = weight[rows], bias[rows] if bias is not None else None
    if cols is not None:
        weight = weight[:, torch.as_tensor(list(cols), dtype=torch.long, device=weight.device)]
    new = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    new.weight = nn.Parameter(weight.detach().clone(), requires_grad=layer.weight.requires_grad)
    if bias is not None:
        new.bias = nn.Parameter(bias.detach().clone(), requires_grad=layer.bias.requires_grad)
    return new


def _channels(units: Iterable[int], size: int) -> list[int]:
    return [u * size + i for u in units for i in range(size)]


def narrow(model: nn.Module, kept: Mapping[str, Mapping[str, Sequence[int]]]) -> nn.Module:
    """Keep (in place) the listed units of each block (block name -> unit key -> kept unit indices, in order); a unit
    key left out keeps all its units. Attention head counts and Flux's ``mlp_hidden_dim`` follow the new widths."""
    for block_name, keep in kept.items():
        block = model.get_submodule(block_name)
        units = block_units(block)
        widths = {key: block.get_submodule(layers[0]).out_features for key, layers in units.rows.items()}
        channels = {key: _channels(keep[key], units.unit[key]) for key in keep
                    if len(keep[key]) * units.unit[key] != widths[key]}
        for key in channels:
            for name in units.rows[key]:
                block.set_submodule(name, _sliced(block.get_submodule(name), rows=channels[key]))
        for name, keys in units.cols.items():
            if any(key in channels for key in keys):
                cols, offset = [], 0
                for key in keys:  # the layer's input concatenates these units' channels
                    cols += [offset + c for c in channels.get(key, range(widths[key]))]
                    offset += widths[key]
                block.set_submodule(name, _sliced(block.get_submodule(name), cols=cols))
        for key, name in units.attention.items():
            attn = block.get_submodule(name)
            attn.heads, attn.inner_dim = attn.to_q.out_features // units.unit[key], attn.to_q.out_features
            if hasattr(attn, "inner_kv_dim"):
                attn.inner_kv_dim = attn.to_k.out_features
        if isinstance(block, FluxSingleTransformerBlock):
            block.mlp_hidden_dim = block.proj_mlp.out_features
            block.proj_out._tp_packed_row_blocks = [block.attn.to_q.out_features, block.mlp_hidden_dim]
    return model


# ---------------------------------------------------------------- the exports


def _narrow_to_config(model: nn.Module, pruned_blocks: Mapping[str, Mapping[str, int]] | None) -> None:
    """Record ``pruned_blocks`` in the config and narrow the blocks to them (the first units: weights load after)."""
    model.register_to_config(pruned_blocks={b: dict(c) for b, c in (pruned_blocks or {}).items()})
    narrow(model, {b: {k: range(n) for k, n in c.items()} for b, c in model.config.pruned_blocks.items()})


class PrunedSD3Transformer2DModel(SD3Transformer2DModel):
    """An ``SD3Transformer2DModel`` whose blocks keep the heads and MLP widths of ``pruned_blocks`` (block ->
    unit key -> count), part of its config, so that ``from_pretrained`` builds them before loading the weights."""

    def __init__(self, *args, pruned_blocks: Mapping[str, Mapping[str, int]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)  # registers the stock config
        _narrow_to_config(self, pruned_blocks)


class PrunedFluxTransformer2DModel(FluxTransformer2DModel):
    """A ``FluxTransformer2DModel`` whose blocks keep the heads and MLP widths of ``pruned_blocks`` (block ->
    unit key -> count), part of its config, so that ``from_pretrained`` builds them before loading the weights."""

    def __init__(self, *args, pruned_blocks: Mapping[str, Mapping[str, int]] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        _narrow_to_config(self, pruned_blocks)


EXPORTS = {SD3Transformer2DModel: PrunedSD3Transformer2DModel, FluxTransformer2DModel: PrunedFluxTransformer2DModel}
# ConfigMixin.from_config passes the config keys that __init__'s signature names: the stock class's and the blocks'.
for _base, _export_class in EXPORTS.items():
    _params = inspect.signature(_base.__init__).parameters.values()
    _export_class.__init__.__signature__ = inspect.signature(_base.__init__).replace(parameters=[
        *_params, inspect.Parameter("pruned_blocks", inspect.Parameter.KEYWORD_ONLY, default=None)])


def export_class(transformer: nn.Module) -> type:
    for base, export in EXPORTS.items():
        if isinstance(transformer, base):
            return export
    raise ValueError(f"{type(transformer).__name__} is neither an SD3Transformer2DModel nor a FluxTransformer2DModel")


def export_pruned(pruned: nn.Module, base_config: Mapping) -> nn.Module:
    """The diffusers export of ``pruned`` (a transformer narrowed in place): the stock ``base_config``, its blocks'
    unit counts and its weights."""
    config = {k: v for k, v in base_config.items() if k != "pruned_blocks"}
    model = export_class(pruned).from_config(config, pruned_blocks=unit_counts(pruned))
    model.load_state_dict(pruned.state_dict())
    if model.dtype != pruned.dtype or model.device != pruned.device:
        model.to(device=pruned.device, dtype=pruned.dtype)
    return model


# ---------------------------------------------------------------- inputs and importance


def transformer_example_inputs(transformer: nn.Module, batch_size: int = 1, text_len: int = 1,
                               latent_size: int | None = None) -> dict:
    """Keyword inputs of the transformer's forward (seeded), for FLOP counting: a ``latent_size`` latent (default
    SD3's ``sample_size``, Flux's ``FLUX_LATENT_SIZE``), ``text_len`` context tokens, Flux's packed latents with
    their ids and, where the transformer embeds it, guidance 3.5."""
    from distill.diffusion.packing import latent_image_ids, pack_latents

    c, g = transformer.config, torch.Generator().manual_seed(0)
    states = torch.randn(batch_size, text_len, c.joint_attention_dim, generator=g)
    pooled = torch.randn(batch_size, c.pooled_projection_dim, generator=g)
    if isinstance(transformer, FluxTransformer2DModel):
        size = latent_size or FLUX_LATENT_SIZE
        x = torch.randn(batch_size, c.in_channels // 4, size, size, generator=g)
        inputs = {"hidden_states": pack_latents(x), "timestep": torch.full((batch_size,), 0.5),
                  "img_ids": latent_image_ids(size, size), "txt_ids": torch.zeros(text_len, 3),
                  "guidance": torch.full((batch_size,), 3.5) if c.guidance_embeds else None}
    else:
        size = latent_size or c.sample_size
        inputs = {"hidden_states": torch.randn(batch_size, c.in_channels, size, size, generator=g),
                  "timestep": torch.full((batch_size,), 500.0)}
    inputs.update(encoder_hidden_states=states, pooled_projections=pooled)
    return {k: v.to(transformer.device, transformer.dtype if v.is_floating_point() else v.dtype)
            if v is not None else None for k, v in inputs.items()}


def calibration_times(flow_times: Iterable[float] | None) -> list[float]:
    """The flow times of a calibration, ascending (default the midpoints of ``FLOW_TIMES`` equal bins of [0, 1]),
    refused unless a non-empty list in [0, 1]."""
    times = sorted(float(t) for t in (flow_times if flow_times is not None else
                                      [(k + 0.5) / FLOW_TIMES for k in range(FLOW_TIMES)]))
    if not times or not 0 <= times[0] <= times[-1] <= 1:
        raise ValueError(f"student.flow_times={times} must be a non-empty list of flow times in [0, 1]")
    return times


def accumulate_flow_taylor_gradients(model: nn.Module, family, calib, flow_times: Iterable[float] | None = None,
                                     threshold: float = 0.0, seed: int = 0) -> tuple[list[float], list[float]]:
    """Leave sum_t dL_t/dw in every parameter's ``.grad`` (Diff-Pruning over flow times): L_t the mean over the
    calibration batches (latents (N, C, H, W) in the family's layout, the network's conditioning dict) of the MSE
    between ``family.denoise`` at x_t = (1 - t) x0 + t eps (eps seeded per batch) and the velocity eps - x0. Times
    ascend; the sum stops after the first whose loss is below ``threshold`` times the largest so far. Returns the
    times used and their losses."""
    times = calibration_times(flow_times)
    batches = _batches(calib)
    device = next(model.parameters()).device
    noises = [torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed + i)) for i, (x0, _) in
              enumerate(batches)]
    model.zero_grad(set_to_none=True)
    used, losses = [], []
    with torch.enable_grad():
        for t in times:
            loss_t = 0.0
            for (x0, cond), eps in zip(batches, noises):
                x0, eps = x0.to(device), eps.to(device)
                cond = {k: v.to(device) for k, v in cond.items()}
                t_n = torch.full((x0.shape[0],), t, device=device)
                pred = family.denoise(model, family.schedule.add_noise(x0, eps, t_n), t_n, cond)
                loss = diffusion_loss(pred.float(), family.schedule.prediction_target(x0, eps, t_n)) / len(batches)
                loss.backward()
                loss_t += float(loss.detach())
            used.append(t)
            losses.append(loss_t)
            if loss_t < threshold * max(losses):
                break
    return used, losses


def _score(param: torch.Tensor, importance: str, dim: int | None) -> torch.Tensor:
    """Per channel along the kept axis (``dim`` summed; None: a bias): w^2 or |w * dL/dw|."""
    if importance == "magnitude":
        value = param.detach().pow(2)
    else:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        value = (param.detach() * grad).abs()
    return value if dim is None else value.sum(dim)


def rank_units(model: nn.Module, importance: str) -> dict[str, dict[str, list[int]]]:
    """Block -> unit key -> its units, least important first (the sum of a unit's channel scores, each channel's
    averaged over the layers that hold it)."""
    ranked = {}
    for block_name, block in transformer_blocks(model).items():
        units = block_units(block)
        widths = {key: block.get_submodule(layers[0]).out_features for key, layers in units.rows.items()}
        scores: dict[str, list[torch.Tensor]] = {key: [] for key in units.rows}
        for key, layers in units.rows.items():
            for name in layers:
                layer = block.get_submodule(name)
                s = _score(layer.weight, importance, 1)
                scores[key].append(s if layer.bias is None else s + _score(layer.bias, importance, None))
        for name, keys in units.cols.items():
            s, offset = _score(block.get_submodule(name).weight, importance, 0), 0
            for key in keys:
                scores[key].append(s[offset:offset + widths[key]])
                offset += widths[key]
        ranked[block_name] = {key: torch.stack(s).mean(0).view(-1, units.unit[key]).sum(1).argsort().tolist()
                              for key, s in scores.items()}
    return ranked


# ---------------------------------------------------------------- pruning


def _check_prunable(transformer: nn.Module) -> None:
    name = type(transformer).__name__
    if not isinstance(transformer, TRANSFORMERS):
        raise ValueError(f"prune_transformer prunes SD3 and Flux transformers; got a {name} (a UNet: prune_unet)")
    if getattr(transformer, "peft_config", None):
        raise ValueError(f"student {name} carries LoRA adapters; merge them first (fuse_lora(); unload_lora()) and "
                         "prune the merged transformer")
    fused = [n for n, m in transformer.named_modules() if getattr(m, "fused_projections", False)]
    if fused:
        raise ValueError(f"{fused[0]} has fused QKV projections; prune the unfused transformer "
                         "(unfuse_qkv_projections()) and fuse afterwards")


def _fresh_copy(transformer: nn.Module) -> nn.Module:
    model = copy.deepcopy(transformer).eval().requires_grad_(True)  # a frozen teacher records no gradients
    if model.is_gradient_checkpointing:
        model.disable_gradient_checkpointing()
    model.zero_grad(set_to_none=True)
    return model


def prune_transformer(transformer: nn.Module, ratio: float, *, target: str = "flops", importance: str = "magnitude",
                      family=None, calib: Sequence | Callable[[], Iterable] | None = None,
                      flow_times: Iterable[float] | None = None, threshold: float = 0.05, prune_heads: bool = True,
                      example_inputs: Mapping | None = None, seed: int = 0) -> tuple[nn.Module, PruneReport]:
    """Remove ``ratio`` of an SD3 or Flux transformer's FLOPs (``target="flops"``, counted on ``example_inputs``,
    default ``transformer_example_inputs``) or parameters (``"params"``) by removing the same fraction of every
    block's attention heads and MLP hidden channels (``prune_heads=False``: MLP channels only); ``transformer`` is
    left unchanged. ``importance="taylor"`` needs ``calib`` ((latents, conditioning dict) batches, or a callable
    returning them) and the teacher's ``family`` (its ``denoise`` and flow schedule); ``flow_times`` and ``threshold``
    select the times (``accumulate_flow_taylor_gradients``). Returns the export
    (``PrunedSD3Transformer2DModel`` / ``PrunedFluxTransformer2DModel``) and the report."""
    ratio = check_settings(ratio, target, importance, threshold, calib is not None and family is not None,
                           "calibration batches (student.calib_data) and the teacher's family")
    _check_prunable(transformer)
    inputs = dict(example_inputs) if example_inputs is not None else transformer_example_inputs(transformer)
    work = _fresh_copy(transformer)
    params_before, flops_before = _measure(work, inputs, "params"), _measure(work, inputs, "flops")
    start = flops_before if target == "flops" else params_before
    used, losses = [], []
    if importance == "taylor":
        used, losses = accumulate_flow_taylor_gradients(work, family, calib, flow_times, threshold, seed)
    ranked = rank_units(work, importance)
    if not prune_heads:
        ranked = {b: {k: order for k, order in units.items() if not k.endswith("_heads")} for b, units in ranked.items()}
    del work

    def cut(fraction: float) -> tuple[nn.Module, float]:
        model = narrow(_fresh_copy(transformer), {
            b: {k: sorted(order[len(order) - _kept(len(order), fraction):]) for k, order in units.items()}
            for b, units in ranked.items()})
        return model, 1 - _measure(model, inputs, target) / start

    sizes = {len(order) for units in ranked.values() for order in units.values()}
    model, fraction, search = search_uniform_fraction(sizes, cut, _fresh_copy(transformer), ratio, target)
    export = _export(transformer, model, inputs)
    params_after, flops_after = _measure(export, inputs, "params"), _measure(export, inputs, "flops")
    after = flops_after if target == "flops" else params_after
    report = PruneReport(target=target, ratio=ratio, achieved=1 - after / start, params_before=params_before,
                         params_after=params_after, flops_before=flops_before, flops_after=flops_after,
                         importance=importance, per_block=True, channel_fraction=fraction, search=search,
                         flow_times=used, losses=losses, layer_shapes=export.config.pruned_blocks)
    return export, report


def _export(transformer: nn.Module, model: nn.Module, inputs: Mapping) -> nn.Module:
    """The diffusers export of the pruned copy, checked to compute what it computes, with the original's flags."""
    export = export_pruned(model, transformer.config).eval()
    with torch.no_grad():
        if not torch.allclose(_output(export(**inputs)), _output(model(**inputs)), atol=1e-5, rtol=1e-4):
            raise RuntimeError("the pruned export does not reproduce the pruned network (pruned_blocks misses a width)")
    frozen = {name for name, p in transformer.named_parameters() if not p.requires_grad}
    for name, p in export.named_parameters():
        p.requires_grad_(name not in frozen)
    return export.train(transformer.training)
