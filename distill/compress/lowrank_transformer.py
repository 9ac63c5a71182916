"""Low-rank factorisation of diffusion transformers (SD3's ``SD3Transformer2DModel``, Flux's
``FluxTransformer2DModel``): the truncated SVD of ``distill.compress.lowrank`` applied to the linear layers of every
block -- q, k, v and the output projection of both streams of a joint attention (``to_q/k/v``, ``add_q/k/v_proj``,
``to_out.0``, ``to_add_out``), SD3.5's second attention, the image and context MLPs (``ff``, ``ff_context``) and a Flux
single-stream block's ``proj_mlp`` and ``proj_out`` -- by rank, energy, or a budget of parameters or FLOPs
(``choose_ranks``; FLOPs counted with attention).

Left dense by default (``TRANSFORMER_KEEP_DENSE``), as the UNet keeps its image-space convolutions and time MLP: the
patch embedding and the final projection (few channels, every error lands on the sample), the timestep, pooled-text
and context embedders, and the adaLN modulation linears (``norm1``, ``norm1_context``, a single block's ``norm``,
``norm_out``), which hold many parameters but multiply one row per sample, so factorising them saves no FLOPs.

``LowRankSD3Transformer2DModel`` and ``LowRankFluxTransformer2DModel`` are the exports: the pruned export class (so a
pruned transformer factorised keeps its ``pruned_blocks``) whose config also records the ranks (``lowrank_ranks``),
so that ``from_pretrained`` builds the factors before it loads them; ``model_index.json`` names this module as the
transformer's library, which ``DiffusionPipeline.from_pretrained`` imports (``distill.inference.pipelines`` imports
it too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from diffusers import FluxTransformer2DModel, ModelMixin, SD3Transformer2DModel  # noqa: F401
from torch import nn

from distill.compress.lowrank import (
    LAYER_KINDS,
    LOWRANK_TYPES,
    LowRankReport,
    add_config_keyword,
    call_flops,
    choose_ranks,
    factorise_to_config,
    factorised_export,
)
from distill.compress.prune_transformer import (
    TRANSFORMERS,
    PrunedFluxTransformer2DModel,
    PrunedSD3Transformer2DModel,
    transformer_example_inputs,
)

# DiffusionPipeline.from_pretrained looks the loadable base classes (ModelMixin) up in the namespace of the library
# that model_index.json names for a component -- this module -- hence ModelMixin among the imports above.

TRANSFORMER_KEEP_DENSE = (
    "pos_embed.*", "x_embedder", "proj_out", "norm_out.*",  # the patch embedding, the final projection and its adaLN
    "time_text_embed.*", "context_embedder",  # timestep, pooled-text and guidance embedders; the text tokens' input
    "*.norm1.*", "*.norm1_context.*", "*.norm.linear",  # the blocks' adaLN modulations: one row per sample
)


class LowRankSD3Transformer2DModel(PrunedSD3Transformer2DModel):
    """An ``SD3Transformer2DModel`` (narrowed to ``pruned_blocks``, if pruned) with the layers named in
    ``lowrank_ranks`` ({module name: rank}) factorised; both are part of its config, so ``from_pretrained`` builds
    the structure before it loads the weights."""

    def __init__(self, *args, lowrank_ranks: Mapping[str, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)  # registers the stock config and narrows the pruned blocks
        factorise_to_config(self, lowrank_ranks)


class LowRankFluxTransformer2DModel(PrunedFluxTransformer2DModel):
    """A ``FluxTransformer2DModel`` (narrowed to ``pruned_blocks``, if pruned) with the layers named in
    ``lowrank_ranks`` ({module name: rank}) factorised; both are part of its config, so ``from_pretrained`` builds
    the structure before it loads the weights."""

    def __init__(self, *args, lowrank_ranks: Mapping[str, int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        factorise_to_config(self, lowrank_ranks)


EXPORTS = {SD3Transformer2DModel: LowRankSD3Transformer2DModel, FluxTransformer2DModel: LowRankFluxTransformer2DModel}
for _export_class in EXPORTS.values():
    add_config_keyword(_export_class, _export_class.__base__, "lowrank_ranks")


def check_factorisable(transformer: nn.Module) -> None:
    """Refuse what the factorisation cannot take: another denoiser, LoRA adapters, fused or factorised projections."""
    name = type(transformer).__name__
    if not isinstance(transformer, TRANSFORMERS):
        raise ValueError(f"lowrank_transformer factorises SD3 and Flux transformers; got a {name} (a UNet: "
                         "distill.compress.lowrank.lowrank_unet)")
    if getattr(transformer, "peft_config", None):
        raise ValueError(f"{name} carries LoRA adapters; merge them first (fuse_lora(); unload_lora()) and factorise "
                         "the merged transformer")
    if fused := [n for n, m in transformer.named_modules() if getattr(m, "fused_projections", False)]:
        raise ValueError(f"{fused[0]} has fused QKV projections; factorise the unfused transformer "
                         "(unfuse_qkv_projections()), whose to_q, to_k, to_v are the layers")
    if factorised := [n for n, m in transformer.named_modules() if isinstance(m, LOWRANK_TYPES)]:
        raise ValueError(f"{name} is factorised already ({factorised[0]}, ...); factorise its dense original")


def lowrank_transformer(transformer: nn.Module, *, rank: int | Mapping[str, int] | None = None,
                        energy: float | Mapping[str, float] | None = None, budget: float | None = None,
                        target: str = "params", keep_dense: Iterable[str] = TRANSFORMER_KEEP_DENSE,
                        layer_kinds: Iterable[str] = LAYER_KINDS, example_inputs: Mapping | None = None,
                        only_if_smaller: bool = True) -> tuple[nn.Module, LowRankReport]:
    """An SD3 or Flux transformer (left unchanged; pruned or not) with its linear layers factorised by ``choose_ranks``
    (exactly one of ``rank``, ``energy``, ``budget``: of the parameters or, ``target="flops"``, of a call's FLOPs).
    Returns the export (``LowRankSD3Transformer2DModel`` / ``LowRankFluxTransformer2DModel``) and the report, with
    the FLOPs of one call before and after counted on ``example_inputs`` (default ``transformer_example_inputs``:
    the config's sample size, one text token)."""
    check_factorisable(transformer)
    inputs = dict(example_inputs) if example_inputs is not None else transformer_example_inputs(transformer)
    report = choose_ranks(transformer, rank=rank, energy=energy, budget=budget, target=target,
                          example_inputs=inputs, keep_dense=keep_dense, layer_kinds=layer_kinds,
                          only_if_smaller=only_if_smaller)
    export = factorised_export(EXPORTS[_stock_class(transformer)], transformer, report.ranks)
    report.flops, report.flops_after = call_flops(transformer, inputs), call_flops(export, inputs)
    return export, report


def _stock_class(transformer: nn.Module) -> type:
    return next(cls for cls in TRANSFORMERS if isinstance(transformer, cls))
