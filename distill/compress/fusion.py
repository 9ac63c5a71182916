"""Kernel fusion for inference: Conv2d+BatchNorm2d(+ReLU) folding, fused QKV projections, channels-last
memory and ``torch.compile``.

In eval mode a BatchNorm is the affine map y = gamma (x - mu) / sqrt(var + eps) + beta with its running
statistics, so it folds into the preceding convolution's weight and bias (W' = W gamma / sqrt(var + eps),
b' = (b - mu) gamma / sqrt(var + eps) + beta): one kernel instead of two, exact up to rounding. The folding
and the Conv+ReLU pairing are ``torch.ao.quantization.fuse_modules``'s (which calls
``torch.nn.utils.fusion.fuse_conv_bn_eval``); this module finds the chains and refuses training mode, where
BatchNorm normalises with batch statistics and folding would change the network. ``torch.fx``'s
``optimization.fuse`` is not used: it needs a symbolically traceable forward, which input checks such as the
image classifier's resize defeat.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers.models.attention_processor import Attention
from torch import nn
from torch.ao.quantization import fuse_modules


def _foldable_bn(conv: nn.Module, bn: nn.Module) -> bool:
    return (isinstance(bn, nn.BatchNorm2d) and bn.track_running_stats and bn.running_mean is not None
            and bn.num_features == conv.out_channels)


def find_conv_bn_relu_chains(model: nn.Module) -> list[list[str]]:
    """Names of every Conv2d, BatchNorm2d?, ReLU? run (at least two modules) of consecutive children of an
    ``nn.Sequential`` in ``model``, as ``fuse_modules`` takes them."""
    chains = []
    for prefix, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        names = [f"{prefix}.{n}" if prefix else n for n, _ in seq.named_children()]
        children = list(seq.children())
        i = 0
        while i < len(children):
            if not isinstance(children[i], nn.Conv2d):
                i += 1
                continue
            chain = [names[i]]
            j = i + 1
            if j < len(children) and _foldable_bn(children[i], children[j]):
                chain.append(names[j])
                j += 1
            if j < len(children) and isinstance(children[j], nn.ReLU):
                chain.append(names[j])
                j += 1
            if len(chain) > 1:
                chains.append(chain)
            i = j
    return chains


def _check_chain(model: nn.Module, chain: Sequence[str]) -> None:
    modules = [model.get_submodule(name) for name in chain]
    kinds = tuple(type(m) for m in modules)
    allowed = ((nn.Conv2d, nn.BatchNorm2d), (nn.Conv2d, nn.BatchNorm2d, nn.ReLU), (nn.Conv2d, nn.ReLU))
    if not any(len(kinds) == len(a) and all(issubclass(k, t) for k, t in zip(kinds, a)) for a in allowed):
        raise ValueError(f"chain {list(chain)} is {[k.__name__ for k in kinds]}; give Conv2d, BatchNorm2d, "
                         "ReLU or Conv2d, BatchNorm2d or Conv2d, ReLU")
    if isinstance(modules[1], nn.BatchNorm2d) and not _foldable_bn(modules[0], modules[1]):
        raise ValueError(f"chain {list(chain)}: {chain[1]} has no running statistics for "
                         f"{modules[0].out_channels} channels to fold")
    if training := [name for name, m in zip(chain, modules) if m.training]:
        raise RuntimeError(f"cannot fuse {list(chain)}: {training} in training mode, where BatchNorm normalises "
                           "with batch statistics; call model.eval() first (fusion is for inference)")


def fuse_conv_bn(model: nn.Module, chains: Sequence[Sequence[str]] | None = None,
                 inplace: bool = False) -> tuple[nn.Module, list[str]]:
    """Fold each Conv2d(+BatchNorm2d)(+ReLU) chain into one conv; eval mode only. Returns (model, applied).

    ``chains`` names the modules of each chain (``[["conv1", "bn1", "relu"], ...]``); by default every chain
    of consecutive children of an ``nn.Sequential`` is found. A Conv+BN chain becomes the folded ``nn.Conv2d``,
    one with a ReLU a ``ConvReLU2d`` (the folded conv, then the ReLU); the BN and ReLU slots become
    ``nn.Identity``. A ReLU module that the forward also calls elsewhere must not be named in a chain."""
    chains = find_conv_bn_relu_chains(model) if chains is None else [list(c) for c in chains]
    for chain in chains:
        _check_chain(model, chain)
    fused = fuse_modules(model, chains, inplace=inplace) if chains else model
    applied = [f"{' + '.join(chain)} -> {type(fused.get_submodule(chain[0])).__name__}" for chain in chains]
    return fused, applied


def _qkv_projections(attn: Attention) -> list[nn.Module]:
    return [attn.to_k, attn.to_v] + ([] if attn.is_cross_attention else [attn.to_q])


def fuse_unet(unet: nn.Module, qkv: bool = True, channels_last: bool = False,
              compile: bool = False) -> tuple[nn.Module, list[str]]:
    """Inference fusions of a diffusers UNet, in place: fused QKV projections (diffusers'
    ``fuse_qkv_projections``: one to_qkv matmul per self-attention, one to_kv per cross-attention),
    channels-last memory format, and ``torch.compile`` (inductor, compiled on the first call). Returns
    (unet, what was applied or skipped and why).

    The fused projections are added next to to_q/to_k/to_v, so save the UNet before fusing, not after."""
    applied = []
    if qkv:
        attentions = [m for m in unet.modules() if isinstance(m, Attention)]
        factorised = [a for a in attentions if not all(isinstance(p, nn.Linear) for p in _qkv_projections(a))]
        if factorised:
            applied.append(f"qkv: skipped, {len(factorised)} attention layers have factorised (low-rank) "
                           "projections that cannot be concatenated")
        elif attentions:
            with torch.no_grad():
                unet.fuse_qkv_projections()
            cross = sum(a.is_cross_attention for a in attentions)
            applied.append(f"qkv: to_qkv in {len(attentions) - cross} self-attention, to_kv in {cross} "
                           "cross-attention layers")
    if channels_last:
        unet.to(memory_format=torch.channels_last)
        applied.append("channels_last: 4-d weights")
    if compile:
        unet.compile()
        applied.append("torch.compile: inductor, on the first call")
    return unet, applied
