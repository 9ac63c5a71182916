"""Kernel fusion for inference: Conv2d+BatchNorm2d(+ReLU) folding, fused QKV projections (UNets, SD3 and Flux
transformers), channels-last memory (UNets) and ``torch.compile``.

In eval mode a BatchNorm is the affine map y = gamma (x - mu) / sqrt(var + eps) + beta with its running
statistics, so it folds into the preceding convolution's weight and bias (W' = W gamma / sqrt(var + eps),
b' = (b - mu) gamma / sqrt(var + eps) + beta): one kernel instead of two, exact up to rounding. The folding
and the Conv+ReLU pairing are ``torch.ao.quantization.fuse_modules``'s (which calls
``torch.nn.utils.fusion.fuse_conv_bn_eval``); this module finds the chains and refuses training mode, where
BatchNorm normalises with batch statistics and folding would change the network. ``torch.fx``'s
``optimization.fuse`` is not used: it needs a symbolically traceable forward, which input checks such as the
image classifier's resize defeat.

Fused QKV of an SD3 transformer concatenates the projections with diffusers' ``Attention.fuse_projections`` but
computes with ``FusedJointQKNormAttnProcessor``: diffusers' ``FusedJointAttnProcessor2_0`` (0.42) skips qk_norm (the
RMSNorm of q and k, which SD3.5 applies: qk_norm="rms_norm") and fails on SD3.5's image-only second attention. Flux's
own attention processor reads its fused projections and applies the norms, so ``fuse_qkv_projections`` serves it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
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


def _factorised_skip(attentions: list[nn.Module], projections) -> str | None:
    """Why QKV fusion is skipped, where some attention's ``projections(attention)`` are factorised (low-rank)."""
    factorised = [a for a in attentions if not all(isinstance(p, nn.Linear) for p in projections(a))]
    if factorised:
        return (f"qkv: skipped, {len(factorised)} attention layers have factorised (low-rank) projections that "
                "cannot be concatenated")
    return None


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
        if skipped := _factorised_skip(attentions, _qkv_projections):
            applied.append(skipped)
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


class FusedJointQKNormAttnProcessor:
    """SD3's joint attention (``JointAttnProcessor2_0``) with one ``to_qkv`` matmul for the image stream and one
    ``to_added_qkv`` for the context stream, applying qk_norm; an attention without context (SD3.5's ``attn2``) is
    image tokens only."""

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        batch, tokens = hidden_states.shape[:2]  # (N, T, D)

        def heads(x: torch.Tensor) -> torch.Tensor:  # (N, L, H * d) -> (N, H, L, d)
            return x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        def normed(x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
            return x if norm is None else norm(x)

        q, k, v = map(heads, attn.to_qkv(hidden_states).chunk(3, dim=-1))
        q, k = normed(q, attn.norm_q), normed(k, attn.norm_k)
        if encoder_hidden_states is not None:
            cq, ck, cv = map(heads, attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1))
            q = torch.cat([q, normed(cq, attn.norm_added_q)], dim=2)  # image tokens first, then context
            k = torch.cat([k, normed(ck, attn.norm_added_k)], dim=2)
            v = torch.cat([v, cv], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2).to(q.dtype)  # (N, L, H * d)
        image = attn.to_out[1](attn.to_out[0](out[:, :tokens]))
        if encoder_hidden_states is None:
            return image
        context = out[:, tokens:]
        return image, context if attn.context_pre_only else attn.to_add_out(context)


def _joint_projections(attn: nn.Module) -> list[nn.Module]:
    """The projections a joint attention's fusion concatenates: q, k, v of the image and (where present) the context
    stream."""
    names = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
    return [getattr(attn, n) for n in names if getattr(attn, n, None) is not None]


def _fuse_sd3_qkv(transformer: SD3Transformer2DModel) -> None:
    for module in transformer.modules():
        if isinstance(module, Attention):
            module.fuse_projections()
            module.set_processor(FusedJointQKNormAttnProcessor())


def fuse_transformer(transformer: nn.Module, qkv: bool = True, compile: bool = False) -> tuple[nn.Module, list[str]]:
    """Inference fusions of an SD3 or Flux transformer, in place: fused QKV projections (one to_qkv matmul per
    attention's image stream, one to_added_qkv per context stream; see the module's docstring for SD3) and
    ``torch.compile`` (inductor, compiled on the first call). Returns (transformer, what was applied or skipped and
    why). The fused projections are added next to to_q/to_k/to_v, so save the transformer before fusing."""
    if not isinstance(transformer, (SD3Transformer2DModel, FluxTransformer2DModel)):
        raise ValueError(f"fuse_transformer fuses SD3 and Flux transformers; got a {type(transformer).__name__}")
    applied = []
    if qkv:
        attentions = [m for m in transformer.modules() if hasattr(m, "fuse_projections") and hasattr(m, "to_q")]
        if skipped := _factorised_skip(attentions, _joint_projections):
            applied.append(skipped)
        elif attentions:
            with torch.no_grad():
                if isinstance(transformer, SD3Transformer2DModel):
                    _fuse_sd3_qkv(transformer)
                else:
                    transformer.fuse_qkv_projections()
            joint = sum(getattr(a, "add_q_proj", None) is not None for a in attentions)
            applied.append(f"qkv: to_qkv in {len(attentions)} attention layers, to_added_qkv in {joint} of them")
    if compile:
        transformer.compile()
        applied.append("torch.compile: inductor, on the first call")
    return transformer, applied


def check_fusions(denoiser: str, channels_last: bool) -> None:
    """Refuse a fusion the pipeline's denoiser (its component name, "unet" or "transformer": known from
    model_index.json before any weights load) cannot take."""
    if channels_last and denoiser == "transformer":
        raise ValueError("channels_last=true lays out a UNet's convolution feature maps; the pipeline's denoiser is a "
                         "transformer, whose tokens are (N, T, D) rows: set channels_last=false (fuse_qkv and compile "
                         "apply to it)")


def fuse_denoiser(denoiser: nn.Module, qkv: bool = True, channels_last: bool = False,
                  compile: bool = False) -> tuple[nn.Module, list[str]]:
    """``fuse_unet`` or ``fuse_transformer``, by the denoiser's family; refuses channels_last on a transformer."""
    transformer = isinstance(denoiser, (SD3Transformer2DModel, FluxTransformer2DModel))
    check_fusions("transformer" if transformer else "unet", channels_last)
    if transformer:
        return fuse_transformer(denoiser, qkv=qkv, compile=compile)
    return fuse_unet(denoiser, qkv=qkv, channels_last=channels_last, compile=compile)
