"""Depth pruning of diffusion transformers: whole blocks removed by importance (SD3's joint blocks, Flux's double- and
single-stream blocks), the network kept as its stock diffusers class with fewer blocks (``num_layers``,
``num_single_layers``), so an export loads with diffusers alone.

A block's importance is its effect on the network's output over calibration points, measured once on the unpruned
network: block b of a list is skipped alone (its output replaced by its input, the identity on both streams) and

    I_b = sum_{t, batches} || v(x_t) - v_{-b}(x_t) ||^2  /  sum_{t, batches} || v(x_t) ||^2,

the relative squared change of the velocity, summed over flow times t (default the midpoints of 8 equal bins of
[0, 1]) and calibration batches: x_t = (1 - t) x0 + t eps on the noising trajectories of training latents x0 with
their prompts, eps seeded per batch. In each list the blocks with the largest I_b are kept, in their order.

This is BK-SDM's criterion (Kim et al. 2023, sec. 3.1: the blocks whose removal alone hurts least go) with the output
change on calibration data in place of a sampled FID. TinyFusion (Fang et al., CVPR 2025) learns the kept blocks
instead, since such one-shot importance predicts how well the shallower network *recovers* only loosely; here the
removal is one shot and recovery is feature distillation (``method=feature_distillation``), each kept block matched to
itself in the teacher: the pruned network carries its blocks' original indices (``KEPT_BLOCKS``), which
``distill.families.base.evenly_spaced_block_pairs`` uses as the block map.

SD3's last joint block is always kept: the stock class builds its last block without the context stream's output
(``context_pre_only``), whose weights no other block has. SD3.5's ``dual_attention_layers`` follow their blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from torch import nn

from distill.compress.prune import _batches, _measure
from distill.compress.prune_transformer import (
    _check_prunable,
    calibration_times,
    transformer_example_inputs,
)
from distill.families.base import KEPT_BLOCKS
from distill.families.flux import FLUX_BLOCK_LISTS
from distill.families.sd3 import SD3_BLOCK_LISTS


def block_lists(transformer: nn.Module) -> dict[str, str]:
    """The block lists depth pruning thins, in forward order, each with the config key of its length."""
    for cls, lists in ((SD3Transformer2DModel, SD3_BLOCK_LISTS), (FluxTransformer2DModel, FLUX_BLOCK_LISTS)):
        if isinstance(transformer, cls):
            return dict(lists)
    raise ValueError(f"depth pruning removes blocks of an SD3 or Flux transformer; got a {type(transformer).__name__} "
                     "(a UNet: student=pruned or lowrank)")


def _fixed_blocks(transformer: nn.Module) -> dict[str, set[int]]:
    """Blocks that stay whatever their importance: SD3's last (context_pre_only) joint block."""
    if isinstance(transformer, SD3Transformer2DModel):
        return {"transformer_blocks": {len(transformer.transformer_blocks) - 1}}
    return {}


@contextlib.contextmanager
def skipped(block: nn.Module) -> Iterator[None]:
    """``block`` returns its inputs (encoder_hidden_states, hidden_states) unchanged while inside: the network runs as
    if the block were removed. Every SD3 and Flux block takes (hidden_states, encoder_hidden_states, ...) and returns
    (encoder_hidden_states, hidden_states)."""
    def identity(hidden_states, encoder_hidden_states=None, *args, **kwargs):
        return encoder_hidden_states, hidden_states

    own = vars(block).get("forward")  # a forward set on the instance before (another wrapper's) comes back after
    block.forward = identity
    try:
        yield
    finally:
        if own is None:
            del block.forward
        else:
            block.forward = own


@torch.no_grad()
def block_importance(transformer: nn.Module, family, calib, flow_times: Sequence[float] | None = None,
                     seed: int = 0) -> dict[str, list[float]]:
    """List -> I_b of each of its blocks (module docstring): the relative squared change of ``family.denoise``'s
    velocity when block b alone is skipped, over ``calib`` ((latents in the family's layout, conditioning dict)
    batches) at ``flow_times``, eps seeded ``seed + i`` for batch i."""
    times = calibration_times(flow_times)
    lists = block_lists(transformer)
    batches = _batches(calib)
    device = next(transformer.parameters()).device
    change = {name: torch.zeros(len(getattr(transformer, name)), dtype=torch.float64) for name in lists}
    total = 0.0
    for i, (x0, cond) in enumerate(batches):
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed + i)).to(device)
        x0, cond = x0.to(device), {k: v.to(device) for k, v in cond.items()}
        for t in times:
            t_n = torch.full((x0.shape[0],), t, device=device)
            x_t = family.schedule.add_noise(x0, eps, t_n)
            v = family.denoise(transformer, x_t, t_n, cond).double()
            total += float(v.pow(2).sum())
            for name in lists:
                for b, block in enumerate(getattr(transformer, name)):
                    with skipped(block):
                        v_b = family.denoise(transformer, x_t, t_n, cond).double()
                    change[name][b] += float((v - v_b).pow(2).sum())
    return {name: (c / total).tolist() for name, c in change.items()}


def most_important(importance: Sequence[float], n: int, fixed: set[int] = frozenset()) -> list[int]:
    """The ``n`` blocks with the largest importance (``fixed`` ones first, whatever theirs), in forward order."""
    if not max(1, len(fixed)) <= n <= len(importance):
        raise ValueError(f"keep {n} of {len(importance)} blocks: give 1 to {len(importance)}"
                         + (" (the last is always kept)" if fixed else ""))
    rest = sorted((b for b in range(len(importance)) if b not in fixed), key=lambda b: -importance[b])
    return sorted([*fixed, *rest[:n - len(fixed)]])


def keep_blocks(transformer: nn.Module, kept: Mapping[str, Sequence[int]]) -> nn.Module:
    """A new network of ``transformer``'s stock class with only the ``kept`` blocks of each list (list -> original
    indices, ascending; a list not named keeps every block), their weights the original's, everything else
    unchanged; it records ``kept`` (every list) as ``KEPT_BLOCKS``, the block map of feature distillation."""
    lists = block_lists(transformer)
    unknown = set(kept) - set(lists)
    if unknown:
        raise ValueError(f"a {type(transformer).__name__} has no block list(s) {sorted(unknown)} (its lists: "
                         f"{list(lists)})")
    config, renamed, record = dict(transformer.config), {}, {}
    for blocks, key in lists.items():
        total = len(getattr(transformer, blocks))
        indices = list(kept.get(blocks, range(total)))
        if indices != sorted(set(indices)) or not indices or not 0 <= indices[0] <= indices[-1] < total:
            raise ValueError(f"kept {blocks} {indices}: give ascending, distinct indices of its {total} blocks")
        config[key] = len(indices)
        if blocks == "transformer_blocks" and "dual_attention_layers" in config:  # SD3.5's, by block index
            dual = set(config["dual_attention_layers"] or ())
            config["dual_attention_layers"] = tuple(j for j, i in enumerate(indices) if i in dual)
        renamed.update({f"{blocks}.{i}.": f"{blocks}.{j}." for j, i in enumerate(indices)})
        record[blocks] = indices
    state = {}
    for key, value in transformer.state_dict().items():
        if key.split(".")[0] not in lists:
            state[key] = value
            continue
        prefix = ".".join(key.split(".")[:2]) + "."
        if prefix in renamed:
            state[renamed[prefix] + key[len(prefix):]] = value
    model = type(transformer).from_config(config)
    model.load_state_dict(state, strict=True)
    setattr(model, KEPT_BLOCKS, record)
    return model


@dataclass
class DepthReport:
    """What ``depth_prune`` did: per list the importance of every block and the kept indices; parameters and FLOPs
    (torch's counter, attention included) of one call on the example inputs, before and after."""

    importance: dict[str, list[float]]
    kept: dict[str, list[int]]
    params_before: int
    params_after: int
    flops_before: int
    flops_after: int

    def table(self) -> str:
        lists = "; ".join(f"{name} kept {idx} of {len(self.importance[name])} (importance "
                          f"{', '.join(f'{v:.3g}' for v in self.importance[name])})" for name, idx in self.kept.items())
        return (f"{lists} | params {self.params_before / 1e6:.3f}M -> {self.params_after / 1e6:.3f}M | GFLOPs "
                f"{self.flops_before / 1e9:.4f} -> {self.flops_after / 1e9:.4f} "
                f"(removed {100 * (1 - self.flops_after / self.flops_before):.1f}% of flops)")


def depth_prune(transformer: nn.Module, num_blocks: Mapping[str, int], family, calib,
                flow_times: Sequence[float] | None = None, example_inputs: Mapping | None = None,
                seed: int = 0) -> tuple[nn.Module, DepthReport]:
    """Keep ``num_blocks[list]`` blocks of each named list of an SD3 or Flux transformer, those of largest importance
    (``block_importance`` on ``calib`` through the teacher's ``family``); ``transformer`` is left unchanged. Returns
    the stock-class network (``keep_blocks``) and the report, FLOPs counted on ``example_inputs`` (default
    ``transformer_example_inputs``)."""
    _check_prunable(transformer)
    lists, fixed = block_lists(transformer), _fixed_blocks(transformer)
    unknown = set(num_blocks) - set(lists)
    if unknown:
        raise ValueError(f"a {type(transformer).__name__} has no block list(s) {sorted(unknown)} (its lists: "
                         f"{list(lists)})")
    for name, n in num_blocks.items():
        most_important([0.0] * len(getattr(transformer, name)), n, fixed.get(name, set()))  # counts before compute
    importance = block_importance(transformer, family, calib, flow_times, seed)
    kept = {name: most_important(importance[name], n, fixed.get(name, set())) for name, n in num_blocks.items()}
    model = keep_blocks(transformer, kept)
    inputs = dict(example_inputs) if example_inputs is not None else transformer_example_inputs(transformer)
    report = DepthReport(importance=importance, kept=getattr(model, KEPT_BLOCKS),
                         params_before=_measure(transformer, inputs, "params"), params_after=_measure(model, inputs, "params"),
                         flops_before=_measure(transformer, inputs, "flops"), flops_after=_measure(model, inputs, "flops"))
    return model, report
