"""Structured pruning of a diffusers ``UNet2DConditionModel``: whole channels and attention heads are removed,
so the network gets smaller and faster, not just sparser.

Coupled layers are found by torch-pruning's dependency graph (DepGraph, Fang et al., CVPR 2023): a residual add,
a skip concatenation or a GroupNorm ties the channels of several layers into one *group* that is pruned
together. Channel importance is either

* ``magnitude``: squared L2 norm of each channel's weights, averaged over the group's layers
  (torch-pruning's ``GroupMagnitudeImportance``), or
* ``taylor``: Diff-Pruning's timestep-aggregated first-order Taylor score (Fang, Ma & Wang, NeurIPS 2023):
  |w * sum_t dL_t/dw| summed over each channel's weights, L_t the denoising loss at timestep t on
  calibration batches. Timesteps run from low to high noise and the sum stops after the first step whose
  loss falls below ``threshold`` times the largest loss so far (that step included, as in the reference
  code): the late, high-noise steps, which carry little structural information, are left out. The defaults
  follow the reference (``ddpm_prune.py``: ``for step_k in range(1000)``): threshold 0.05 over every training
  timestep, one forward and backward pass per calibration batch and step until the threshold stops it (a
  trained UNet's loss falls slowly: most of the schedule); pass ``timesteps`` to thin them.

``per_block=True`` (the default) is a uniform width multiplier: every group loses the same fraction f of its
channels, rounded to the nearest whole unit (a unit is one position in each GroupNorm group -- 8 channels of a
32-wide layer with 8 groups -- or a GEGLU channel pair), and every attention layer the same fraction of its
heads; channels are ranked once, on the unpruned UNet, and f is bisected for the FLOPs (or parameters) nearest
``ratio``. Where units are coarse the nearest f can miss ``ratio`` by a few percent (a UNet of 32- and 64-wide
stages with 8 GroupNorm groups, asked for 50% of its FLOPs, lost 52.1%: every 32-wide layer kept 24 channels,
every 64-wide GroupNorm-coupled one 40), but no stage is cut deeper than the rounding. ``per_block=False`` ranks all channels together (torch-pruning's
global pruning, each group's scores divided by their mean), iteratively (``iterative_steps``: step k removes
the fraction 0.9 k / steps of all channels, scores recomputed after each); the step that reaches ``ratio`` is
redone group by group, in torch-pruning's order, and the result stops at the group nearest ``ratio``.

What keeps its shape: ``conv_out`` (its output is the prediction) and the time embedding's guidance-scale
projection ``cond_proj`` (added to the sinusoidal features) are excluded explicitly; ``conv_in``'s input,
the time embedding's input (the sinusoidal width) and the key/value inputs of cross-attention (the text
encoder's width) read model inputs or parameter-free ops, so no group reaches them. GroupNorm: torch-pruning
removes the same channel positions from every normalisation group, so widths stay multiples of
``num_groups`` (and where one layer feeds the norm, each group keeps its members); its ``round_to`` option
is not offered: combined with that grouping, torch-pruning 1.6.1 left every GroupNorm-coupled layer unpruned. Attention: whole heads are
removed (q, k, v and the output projection together), never head dimensions: diffusers' attention
processors take the head width from the tensors and scale scores by 1/sqrt(head_dim), so narrower heads
would also change every remaining head's softmax temperature. Every attention layer keeps
round((1 - f) * heads) of its heads at fraction f, at least one, the least important (group score
averaged over the head's channels) going first; torch-pruning's own head pruning is not used, as its
per-layer rounding (ceil of the fraction of the heads left) removes the last head of a two-head layer.

``PrunedUNet2DConditionModel`` is the export: a ``UNet2DConditionModel`` whose config records the pruned
layers' shapes (``layer_shapes``), so ``from_pretrained`` rebuilds them before loading the weights; a
pipeline saved with it as ``unet`` loads with ``DiffusionPipeline.from_pretrained`` once this module is
imported (``model_index.json`` names it as the UNet's library).

``sparsify_unet`` offers unstructured magnitude sparsity (``torch.nn.utils.prune``) for comparison: same
shapes and FLOPs, zeros in dense tensors, which dense CPU kernels do not skip.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch_pruning as tp
from diffusers import ModelMixin, UNet2DConditionModel  # noqa: F401
from diffusers.models.attention_processor import Attention
from diffusers.models.downsampling import Downsample2D
from diffusers.models.upsampling import Upsample2D
from torch import nn

from distill.diffusion.losses import diffusion_loss
from distill.diffusion.schedules import DiscreteVPSchedule
from distill.utils.flops import count_flops

# DiffusionPipeline.from_pretrained looks the loadable base classes (ModelMixin) up in the namespace of the
# library that model_index.json names for a component -- this module -- hence the import above.

TARGETS = ("flops", "params")
IMPORTANCES = ("magnitude", "taylor")
MAX_CHANNEL_RATIO = 0.9  # no group loses more than 90% of its channels (the uniform fraction and the global schedule end here)
TEXT_LEN = 77  # tokens of the example text input (Stable Diffusion's CLIP length) when none is given

# The constructor dimensions that pruning changes, per layer type; everything else is kept from the base UNet.
SHAPE_ATTRS: dict[type, tuple[str, ...]] = {
    nn.Conv2d: ("in_channels", "out_channels"),
    nn.Linear: ("in_features", "out_features"),
    nn.GroupNorm: ("num_groups", "num_channels"),
    nn.LayerNorm: ("normalized_shape",),
    nn.Embedding: ("num_embeddings", "embedding_dim"),
    Attention: ("heads",),
    Downsample2D: ("channels", "out_channels"),  # their forward asserts the input width
    Upsample2D: ("channels", "out_channels"),
}


# ---------------------------------------------------------------- layer shapes and the diffusers export


def _shape(module: nn.Module) -> dict | None:
    attrs = SHAPE_ATTRS.get(type(module))
    if attrs is None:
        return None
    return {a: list(v) if isinstance(v := getattr(module, a), tuple) else v for a in attrs}


def layer_shapes(model: nn.Module) -> dict[str, dict]:
    """{module name: its pruning-relevant dimensions} for every layer of a ``SHAPE_ATTRS`` type."""
    return {name: s for name, m in model.named_modules() if (s := _shape(m)) is not None}


def _resized(module: nn.Module, shape: Mapping) -> nn.Module:
    """A fresh layer like ``module`` with the recorded dimensions (weights are loaded afterwards)."""
    if isinstance(module, nn.Conv2d):
        return nn.Conv2d(shape["in_channels"], shape["out_channels"], module.kernel_size, module.stride,
                         module.padding, module.dilation, module.groups, module.bias is not None, module.padding_mode)
    if isinstance(module, nn.Linear):
        return nn.Linear(shape["in_features"], shape["out_features"], bias=module.bias is not None)
    if isinstance(module, nn.GroupNorm):
        return nn.GroupNorm(shape["num_groups"], shape["num_channels"], module.eps, module.affine)
    if isinstance(module, nn.LayerNorm):
        return nn.LayerNorm(shape["normalized_shape"], module.eps, module.elementwise_affine,
                            bias=module.bias is not None)
    if isinstance(module, nn.Embedding):
        return nn.Embedding(shape["num_embeddings"], shape["embedding_dim"], module.padding_idx)
    if isinstance(module, Attention):
        head_dim = module.inner_dim // module.heads
        module.heads = shape["heads"]
        module.inner_dim = module.inner_kv_dim = shape["heads"] * head_dim
        return module
    if isinstance(module, (Downsample2D, Upsample2D)):
        module.channels, module.out_channels = shape["channels"], shape["out_channels"]
        return module
    raise ValueError(f"layer_shapes names a {type(module).__name__}, which has no recorded shape")


def resize_layers(model: nn.Module, shapes: Mapping[str, Mapping]) -> nn.Module:
    """Replace (in place) each named layer of ``model`` by one of the recorded shape."""
    for name, shape in shapes.items():
        module = model.get_submodule(name)
        new = _resized(module, shape)
        if new is not module:
            model.set_submodule(name, new)
    return model


class PrunedUNet2DConditionModel(UNet2DConditionModel):
    """A ``UNet2DConditionModel`` whose layers named in ``layer_shapes`` ({module name: dimensions}) are
    narrower than the base config says. The shapes are part of the config, so ``from_pretrained`` builds
    the pruned structure and then loads the weights."""

    def __init__(self, *args, layer_shapes: Mapping[str, Mapping] | None = None, **kwargs):
        super().__init__(*args, **kwargs)  # registers the base UNet's config
        self.register_to_config(layer_shapes={k: dict(v) for k, v in (layer_shapes or {}).items()})
        resize_layers(self, self.config.layer_shapes)

    @classmethod
    def from_pruned(cls, pruned: UNet2DConditionModel, base_config: Mapping,
                    shapes: Mapping[str, Mapping]) -> PrunedUNet2DConditionModel:
        """The export of ``pruned`` (a UNet narrowed in place): ``base_config`` plus ``shapes``, its weights."""
        config = {k: v for k, v in base_config.items() if k != "layer_shapes"}
        model = cls.from_config(config, layer_shapes=shapes)
        model.load_state_dict(pruned.state_dict())
        if model.dtype != pruned.dtype or model.device != pruned.device:
            model.to(device=pruned.device, dtype=pruned.dtype)
        return model


# ConfigMixin.from_config passes the config keys that __init__'s signature names: the base UNet's and the shapes.
PrunedUNet2DConditionModel.__init__.__signature__ = inspect.signature(UNet2DConditionModel.__init__).replace(
    parameters=[*inspect.signature(UNet2DConditionModel.__init__).parameters.values(),
                inspect.Parameter("layer_shapes", inspect.Parameter.KEYWORD_ONLY, default=None)])


# ---------------------------------------------------------------- checks


def _check_ratio(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{key}={value!r} must be a fraction strictly between 0 and 1 (the share to remove), "
                         f"e.g. {key}=0.5")
    return float(value)


def check_settings(ratio, target: str, importance: str, threshold: float, calibrated: bool, needs: str) -> float:
    """The settings every pruner takes, refused naming the key and the fix (Taylor importance without what it
    ``needs``: ``calibrated`` False); returns the ratio."""
    ratio = _check_ratio("student.ratio", ratio)
    if target not in TARGETS:
        raise ValueError(f"student.target={target!r} is not one of {list(TARGETS)}")
    if importance not in IMPORTANCES:
        raise ValueError(f"student.importance={importance!r} is not one of {list(IMPORTANCES)}")
    if importance == "taylor" and not calibrated:
        raise ValueError(f"student.importance='taylor' needs {needs}; use importance='magnitude' to prune without data")
    if not 0 <= threshold < 1:
        raise ValueError(f"student.threshold={threshold!r} must be in [0, 1): 0 keeps every given time")
    return ratio


def _check_prunable(unet: nn.Module) -> None:
    """Only dense diffusers UNets: others are refused with what to do instead."""
    from distill.models.moe import MoEFeedForward, TimestepMoEUNet, TokenMoEUNet

    name = type(unet).__name__
    if isinstance(unet, (TimestepMoEUNet, TokenMoEUNet)) or any(isinstance(m, MoEFeedForward) for m in unet.modules()):
        raise ValueError(
            f"student {name} is a mixture of experts, which structured pruning does not support (its experts "
            "are separate networks saved under one dense config). Prune the dense UNet instead -- "
            "prune_unet(teacher.denoiser, ratio) -- and distil the pruned UNet as a dense student; fewer experts "
            "(student.num_experts) shrink a MoE student's parameters, not its per-step FLOPs, which are "
            "already one dense UNet's.")
    if getattr(unet, "peft_config", None):
        raise ValueError(f"student {name} carries LoRA adapters; merge them first (unet.fuse_lora(); "
                         "unet.unload_lora()) and prune the merged UNet.")
    if type(unet) not in (UNet2DConditionModel, PrunedUNet2DConditionModel):
        raise ValueError(f"student {name} is not a UNet2DConditionModel; prune_unet prunes dense "
                         "UNet2DConditionModel students (prune before other transforms such as low-rank "
                         "factorisation).")
    if unet.config.resnet_time_scale_shift != "default":
        # the timestep projection's (scale, shift) halves reach GroupNorm-coupled channels through a chunk,
        # which torch-pruning 1.6.1 prunes to widths GroupNorm rejects
        raise ValueError(f"student {name} has resnet_time_scale_shift={unet.config.resnet_time_scale_shift!r}; "
                         "prune_unet supports the Stable Diffusion resnets ('default') only")


# ---------------------------------------------------------------- importance


def _batches(calib) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = list(calib() if callable(calib) else calib)
    if not batches:
        raise ValueError("student.calib is empty: give (latents, encoder_hidden_states) batches")
    return batches


def accumulate_taylor_gradients(unet: nn.Module, calib, noise_scheduler, timesteps: Iterable[int] | None = None,
                                threshold: float = 0.0, seed: int = 0) -> tuple[list[int], list[float]]:
    """Leave sum_t dL_t/dw in every parameter's ``.grad`` (Diff-Pruning, Fang, Ma & Wang, NeurIPS 2023).

    L_t = mean over the calibration batches (x0 latents (N, C, H, W), text states (N, L, D)) of the
    denoising MSE at timestep t, x_t = alpha_t x0 + sigma_t eps with eps fixed per batch (seeded) and the
    regression target of the scheduler's ``prediction_type``. Timesteps (default: every training timestep, as
    Diff-Pruning's reference) are taken in ascending order; the
    sum stops after the first one whose loss is below ``threshold`` times the largest loss so far (included).
    Returns the timesteps used and their losses."""
    batches = _batches(calib)
    schedule = DiscreteVPSchedule.from_scheduler(noise_scheduler)
    T = schedule.num_train_timesteps
    timesteps = sorted(int(t) for t in (range(T) if timesteps is None else timesteps))
    if not timesteps or not 0 <= timesteps[0] <= timesteps[-1] < T:
        raise ValueError(f"student.timesteps={timesteps} must be a non-empty set of training timesteps in [0, {T})")
    params = list(unet.parameters())
    frozen = [p for p in params if not p.requires_grad]  # a frozen teacher: gradients only for the scores
    for p in frozen:
        p.requires_grad_(True)
    device = next(unet.parameters()).device
    noises = [torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed + i)) for i, (x0, _) in
              enumerate(batches)]
    unet.zero_grad(set_to_none=True)
    used, losses = [], []
    with torch.enable_grad():
        for t in timesteps:
            grads = [torch.zeros_like(p) for p in params]
            loss_t = 0.0
            for (x0, cond), eps in zip(batches, noises):
                x0, cond, eps = x0.to(device), cond.to(device), eps.to(device)
                t_n = torch.full((x0.shape[0],), t, device=device)
                pred = unet(schedule.add_noise(x0, eps, t_n), t_n, cond).sample
                loss = diffusion_loss(pred, schedule.prediction_target(x0, eps, t_n)) / len(batches)
                for g, dg in zip(grads, torch.autograd.grad(loss, params, allow_unused=True)):
                    if dg is not None:
                        g += dg
                loss_t += float(loss.detach())
            for p, g in zip(params, grads):
                p.grad = g if p.grad is None else p.grad + g
            used.append(t)
            losses.append(loss_t)
            if loss_t < threshold * max(losses):
                break
    for p in frozen:
        p.requires_grad_(False)
    return used, losses


# ---------------------------------------------------------------- pruning


@dataclass
class PruneReport:
    """What ``prune_unet`` did. FLOPs are those of one forward on the example inputs (torch's flop counter:
    matmuls, attention and convolutions). ``per_block``: ``channel_fraction`` is the fraction f removed from
    every group's channels and every layer's heads (each rounded to its unit), ``search`` the (f, fraction of
    the target removed) pairs evaluated. Global ranking: ``trajectory[k]`` is the fraction of the target removed
    after k whole iterative steps, up to the first that reached ``ratio``; ``last_step[j]`` the fraction after
    the first j pruning groups of that step; the model returned is the entry of ``last_step`` nearest ``ratio``
    (``groups_kept`` groups of the last step)."""

    target: str
    ratio: float
    achieved: float
    params_before: int
    params_after: int
    flops_before: int
    flops_after: int
    importance: str
    per_block: bool
    trajectory: list[float] = field(default_factory=list)
    last_step: list[float] = field(default_factory=list)
    groups_kept: int = 0
    channel_fraction: float | None = None
    search: list[tuple[float, float]] = field(default_factory=list)
    timesteps: list[int] = field(default_factory=list)
    flow_times: list[float] = field(default_factory=list)  # the flow times a transformer's Taylor score summed over
    losses: list[float] = field(default_factory=list)
    layer_shapes: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        return (f"{self.target} target {self.ratio:.0%}: removed {self.achieved:.1%} of {self.target} | "
                f"params {self.params_before / 1e6:.3f}M -> {self.params_after / 1e6:.3f}M | "
                f"GFLOPs {self.flops_before / 1e9:.4f} -> {self.flops_after / 1e9:.4f} | "
                f"{len(self.layer_shapes)} layers resized")


def unet_example_inputs(unet: UNet2DConditionModel, batch_size: int = 1, text_len: int = TEXT_LEN) -> dict:
    """UNet keyword inputs of the config's shapes (seeded), for tracing and FLOP counting."""
    c = unet.config
    if c.addition_embed_type is not None:
        raise ValueError(f"the UNet's addition_embed_type={c.addition_embed_type!r} needs added_cond_kwargs: "
                         "pass example_inputs={...} with them to prune_unet")
    width = c.encoder_hid_dim if c.encoder_hid_dim_type is not None else c.cross_attention_dim
    if not isinstance(width, int):
        raise ValueError(f"cross_attention_dim={width!r} is not one width: pass example_inputs to prune_unet")
    h, w = (c.sample_size, c.sample_size) if isinstance(c.sample_size, int) else c.sample_size
    g = torch.Generator().manual_seed(0)
    inputs = {"sample": torch.randn(batch_size, c.in_channels, h, w, generator=g),
              "timestep": torch.full((batch_size,), 500),
              "encoder_hidden_states": torch.randn(batch_size, text_len, width, generator=g)}
    if c.time_cond_proj_dim is not None:
        inputs["timestep_cond"] = torch.randn(batch_size, c.time_cond_proj_dim, generator=g)
    if c.class_embed_type is not None or c.num_class_embeds is not None:
        inputs["class_labels"] = torch.zeros(batch_size, dtype=torch.long)
    return {k: v.to(unet.device, unet.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}


def _output(out):
    return out.sample if hasattr(out, "sample") else out[0]


def _measure(model: nn.Module, inputs: Mapping, target: str) -> int:
    if target == "params":
        return sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        return count_flops(lambda: model(**inputs))


def _head_dims(model: nn.Module) -> dict[str, int]:
    return {n: m.to_q.out_features // m.heads for n, m in model.named_modules() if isinstance(m, Attention)}


def _sync(model: nn.Module, head_dims: Mapping[str, int]) -> None:
    """Attributes torch-pruning does not know: head counts, and the widths Down/Upsample2D assert."""
    for name, m in model.named_modules():
        if isinstance(m, Attention):
            m.heads = m.to_q.out_features // head_dims[name]
            m.inner_dim, m.inner_kv_dim = m.to_q.out_features, m.to_k.out_features
        elif isinstance(m, (Downsample2D, Upsample2D)) and getattr(m, "conv", None) is not None:
            m.channels, m.out_channels = m.conv.in_channels, m.conv.out_channels


def _refresh_split_offsets(graph: tp.DependencyGraph) -> None:
    """torch-pruning 1.6.1 shrinks a split's sizes when pruning through it but leaves its offsets (the
    SplitPruner stores them on itself), so a later step maps GEGLU's chunk indices past the end; reset them."""
    for node in graph.module2node.values():
        if node.type == tp.ops.OPTYPE.SPLIT and node.module.split_sizes is not None:
            node.module.offsets = [0, *itertools.accumulate(node.module.split_sizes)]


def _kept(units: int, fraction: float) -> int:
    """Units (heads, or channel positions of a group) left when ``fraction`` of ``units`` is removed: the nearest
    whole number, at least one."""
    return max(1, round(units * (1 - fraction)))


def _prune_heads(graph: tp.DependencyGraph, model: nn.Module, scorer, heads_before: Mapping[str, int],
                 head_dims: Mapping[str, int], fraction: float) -> None:
    """Remove whole heads until each attention layer keeps round((1 - fraction) * its original heads), at
    least one: the heads of least importance (the group score of their channels, averaged) go first.
    Pruning the output projection's input channels prunes q, k and v with it (one dependency group)."""
    for name, dim in head_dims.items():
        out = model.get_submodule(name).to_out[0]
        heads = out.in_features // dim
        keep = _kept(heads_before[name], fraction)
        if heads <= keep:
            continue
        group = graph.get_pruning_group(out, tp.prune_linear_in_channels, list(range(out.in_features)))
        per_head = scorer(group).view(heads, dim).mean(1)
        drop = per_head.argsort()[: heads - keep].tolist()
        graph.get_pruning_group(out, tp.prune_linear_in_channels, [h * dim + i for h in drop for i in range(dim)]).prune()


class _Pruning:
    """One pruning run: a working copy of the UNet (it holds the Taylor gradients) and fresh copies to prune;
    for global ranking also torch-pruning's iterative pruner on the working copy, its history of pruned groups,
    and replays of a prefix of that history on a fresh copy."""

    def __init__(self, unet: UNet2DConditionModel, inputs: Mapping, scorer, target: str, per_block: bool,
                 prune_heads: bool, iterative_steps: int):
        self.original, self.inputs, self.scorer, self.target = unet, inputs, scorer, target
        self.prune_heads, self.iterative_steps = prune_heads, iterative_steps
        self.model = self.fresh_copy()
        self.head_dims = _head_dims(self.model)
        self.heads_before = {n: self.model.get_submodule(n).heads for n in self.head_dims}
        self.start = _measure(self.model, inputs, target)
        attention = [self.model.get_submodule(n) for n in self.head_dims]
        # conv_out's output is the prediction; a guidance-scale projection adds onto the parameter-free sinusoidal
        # timestep features; an encoder_hid_proj's output is the config's cross-attention width. q/k/v widths
        # are left to _prune_heads, which removes whole heads.
        m = self.model
        ignored = [x for x in (m.conv_out, m.time_embedding.cond_proj, getattr(m, "encoder_hid_proj", None)) if x]
        ignored += [p for a in attention for p in (a.to_q, a.to_k, a.to_v)]
        self.ignored = ignored
        self.pruner = None if per_block else tp.pruner.BasePruner(
            m, inputs, scorer, global_pruning=True, pruning_ratio=MAX_CHANNEL_RATIO,
            max_pruning_ratio=MAX_CHANNEL_RATIO, iterative_steps=iterative_steps, ignored_layers=ignored,
            output_transform=_output)

    def fresh_copy(self) -> UNet2DConditionModel:
        # torch-pruning traces the dependency graph through autograd's grad_fn, which a frozen UNet (a loaded
        # teacher) does not record; the export gets the original's flags back (_export)
        model = copy.deepcopy(self.original).eval().requires_grad_(True)
        if model.is_gradient_checkpointing:
            model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        return model

    def removed(self, model: nn.Module) -> float:
        return 1 - _measure(model, self.inputs, self.target) / self.start

    def step(self, k: int) -> float:
        """Whole step k of the schedule; the fraction removed after it."""
        self.pruner.step()
        _refresh_split_offsets(self.pruner.DG)
        if self.prune_heads:
            _prune_heads(self.pruner.DG, self.model, self.scorer, self.heads_before, self.head_dims,
                         MAX_CHANNEL_RATIO * k / self.iterative_steps)
        _sync(self.model, self.head_dims)
        return self.removed(self.model)

    @property
    def history(self) -> list:
        return self.pruner.pruning_history()

    def graph(self, model: nn.Module) -> tp.DependencyGraph:
        return tp.DependencyGraph().build_dependency(model, self.inputs, output_transform=_output)

    def replay(self, n: int) -> tuple[UNet2DConditionModel, tp.DependencyGraph]:
        """A fresh copy with the first ``n`` pruned groups of the history pruned again."""
        model = self.fresh_copy()
        graph = self.graph(model)
        for entry in self.history[:n]:
            self.apply(graph, model, entry)
        return model, graph

    def apply(self, graph: tp.DependencyGraph, model: nn.Module, entry) -> None:
        graph.load_pruning_history([entry])
        _refresh_split_offsets(graph)
        _sync(model, self.head_dims)


def _prune_to_ratio(run: _Pruning, ratio: float) -> tuple[UNet2DConditionModel, list[float], list[float], int]:
    """Whole steps until ``ratio`` is reached, then the last step again group by group, in the order the pruner
    pruned them: the result is the prefix nearest ``ratio``. Returns it, both trajectories and that prefix."""
    trajectory, ends = [0.0], [0]
    for k in range(1, run.iterative_steps + 1):
        trajectory.append(run.step(k))
        ends.append(len(run.history))
        if trajectory[-1] >= ratio:
            break
    else:
        raise ValueError(f"student.ratio={ratio} of {run.target} is out of reach: the schedule's end ({MAX_CHANNEL_RATIO:.0%} "
                         f"of the channels) removed {trajectory[-1]:.1%}; ask for less (global ranking, "
                         "student.per_block=false, leaves GroupNorm-coupled widths longest: per_block=true goes further)")
    first = ends[-2]
    model, graph = run.replay(first)
    last_step = [trajectory[-2]]
    for entry in run.history[first:ends[-1]]:
        run.apply(graph, model, entry)
        last_step.append(run.removed(model))
        if last_step[-1] >= ratio:
            break
    kept = min(range(len(last_step)), key=lambda j: abs(last_step[j] - ratio))
    if kept < len(last_step) - 1:
        model, _ = run.replay(first + kept)
    return model, trajectory, last_step, kept


@dataclass(frozen=True)
class _RankedGroup:
    """One coupled group, ranked once on the unpruned UNet: pruning unit u of its root layer's outputs removes
    the channels u + k * units for k < copies (the same position in each GroupNorm group, or both halves of
    a GEGLU projection); ``order`` lists the units least important first."""

    root: str
    units: int
    copies: int
    order: tuple[int, ...]


def _channel_groups(graph: tp.DependencyGraph, group) -> int:
    """The most channel groups a member layer of ``group`` imposes (a GroupNorm's ``num_groups``), as
    torch-pruning's pruners count them: the group's channels are pruned at the same positions in each."""
    counts = [1]
    for dep, _ in group:
        module, pruner = dep.target.module, graph.get_pruner_of_module(dep.target.module)
        if pruner is not None:
            out = graph.is_out_channel_pruning_fn(dep.handler)
            counts.append(pruner.get_out_channel_groups(module) if out else pruner.get_in_channel_groups(module))
    return max(counts)


def _rank_groups(run: _Pruning) -> tuple[list[_RankedGroup], dict[str, list[int]]]:
    """Every channel group of the working copy with its units ranked (importance averaged over a unit's
    channels, as torch-pruning averages over GroupNorm groups), and each attention layer's heads ranked."""
    model = run.model
    graph = run.graph(model)
    names = {m: n for n, m in model.named_modules()}
    ranked = []
    for group in graph.get_all_groups(ignored_layers=run.ignored, root_module_types=(nn.Conv2d, nn.Linear)):
        root = group[0].dep.target.module
        scores = run.scorer(group)
        if scores is None:
            continue
        norm_groups = _channel_groups(graph, group)
        # a split (GEGLU's chunk) ties channel 0 to its partners: pruning one removes them all
        tied = len(graph.get_pruning_group(root, group[0].dep.handler, [0])[0].idxs)
        if norm_groups > 1 and tied > 1:
            raise ValueError(f"{names[root]} feeds both a GroupNorm and a split, which per_block pruning does not "
                             "support; use student.per_block=false")
        copies = max(norm_groups, tied)
        units = len(scores) // copies
        order = scores.view(copies, units).mean(0).argsort().tolist()
        ranked.append(_RankedGroup(names[root], units, copies, tuple(order)))
    heads = {}
    if run.prune_heads:
        for name, dim in run.head_dims.items():
            out = model.get_submodule(name).to_out[0]
            group = graph.get_pruning_group(out, tp.prune_linear_in_channels, list(range(out.in_features)))
            heads[name] = run.scorer(group).view(-1, dim).mean(1).argsort().tolist()
    return ranked, heads


def _uniform_cut(run: _Pruning, ranked: Sequence[_RankedGroup], heads: Mapping[str, list[int]],
                 fraction: float) -> UNet2DConditionModel:
    """A fresh copy with ``fraction`` of every group's units and of every attention layer's heads removed
    (``_kept`` of each left), the least important ones."""
    model = run.fresh_copy()
    graph = run.graph(model)
    for g in ranked:
        drop = g.order[: g.units - _kept(g.units, fraction)]
        if drop:
            root = model.get_submodule(g.root)
            idxs = [u + k * g.units for k in range(g.copies) for u in drop]
            graph.get_pruning_group(root, graph.get_pruner_of_module(root).prune_out_channels, idxs).prune()
    for name, order in heads.items():
        out, dim = model.get_submodule(name).to_out[0], run.head_dims[name]
        drop = order[: run.heads_before[name] - _kept(run.heads_before[name], fraction)]
        if drop:
            idxs = [h * dim + i for h in drop for i in range(dim)]
            graph.get_pruning_group(out, tp.prune_linear_in_channels, idxs).prune()
    _sync(model, run.head_dims)
    return model


def _prune_uniform(run: _Pruning, ratio: float) -> tuple[UNet2DConditionModel, float, list[tuple[float, float]]]:
    """The same fraction f of every group's units (and heads) removed, rounded per group (``_kept``), the f whose
    result removes nearest ``ratio`` (``search_uniform_fraction``)."""
    ranked, heads = _rank_groups(run)
    sizes = {g.units for g in ranked} | set(run.heads_before.values() if heads else ())

    def cut(fraction: float) -> tuple[nn.Module, float]:
        model = _uniform_cut(run, ranked, heads, fraction)
        return model, run.removed(model)

    return search_uniform_fraction(sizes, cut, run.fresh_copy(), ratio, run.target)


def search_uniform_fraction(sizes: Iterable[int], cut: Callable[[float], tuple[nn.Module, float]],
                            unpruned: nn.Module, ratio: float, target: str
                            ) -> tuple[nn.Module, float, list[tuple[float, float]]]:
    """Of all fractions f up to ``MAX_CHANNEL_RATIO`` removed from every group of ``sizes`` units (each rounded,
    ``_kept``), the one whose network (``cut(f)``: it and the fraction of ``target`` removed) removes nearest
    ``ratio``. The removed share only grows with f and changes only where some group's rounded count does, so one f
    per interval between those points is bisected. Returns the network, its f and the (f, removed share) evaluated."""
    sizes = set(sizes)
    edges = sorted({0.0, MAX_CHANNEL_RATIO} | {1 - (k + 0.5) / n for n in sizes for k in range(n)
                                               if 0 < 1 - (k + 0.5) / n < MAX_CHANNEL_RATIO})
    fractions = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    cuts = {0: (unpruned, 0.0)}  # below the first breakpoint every count rounds to all its units

    def removed(i: int) -> float:
        if i not in cuts:
            cuts[i] = cut(fractions[i])
        return cuts[i][1]

    lo, hi = 0, len(fractions) - 1  # the first fraction reaching the ratio is in (lo, hi] if any is
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if removed(mid) >= ratio else (mid, hi)
    if removed(hi) < ratio:
        raise ValueError(f"student.ratio={ratio} of {target} is out of reach: removing {MAX_CHANNEL_RATIO:.0%} "
                         f"of every group's channels removed {removed(hi):.1%}; ask for less")
    best = min((lo, hi), key=lambda i: abs(removed(i) - ratio))
    return cuts[best][0], fractions[best], sorted((fractions[i], share) for i, (_, share) in cuts.items())


def prune_unet(unet: UNet2DConditionModel, ratio: float, *, target: str = "flops", importance: str = "magnitude",
               calib: Sequence | Callable[[], Iterable] | None = None, noise_scheduler=None,
               timesteps: Iterable[int] | None = None, threshold: float = 0.05, per_block: bool = True,
               prune_heads: bool = True, iterative_steps: int = 50, example_inputs: Mapping | None = None,
               seed: int = 0) -> tuple[PrunedUNet2DConditionModel, PruneReport]:
    """Remove ``ratio`` of the UNet's FLOPs (``target="flops"``) or parameters (``"params"``) by structured
    pruning; ``unet`` is left unchanged.

    ``importance="taylor"`` needs ``calib`` ((latents, encoder_hidden_states) batches, or a callable returning
    them) and the ``noise_scheduler`` the UNet was trained with; ``timesteps`` (default: every training timestep) and
    ``threshold`` select Diff-Pruning's steps. ``per_block=True`` removes the same fraction of channels from
    every coupled group and of heads from every attention layer, each rounded to its unit (a uniform width
    multiplier), the fraction whose result is nearest ``ratio``; ``False`` ranks channels over the whole network
    (torch-pruning's global pruning, scores normalised by their group's mean): step k of ``iterative_steps``
    removes the fraction 0.9 k / ``iterative_steps`` (heads: the same fraction in every attention layer), the
    FLOPs (params) are measured after each, and the last step is redone group by group to stop at the group
    nearest ``ratio``. ``prune_heads=False`` keeps the attention widths.
    ``example_inputs`` (UNet keyword inputs) set the traced shapes and the counted FLOPs; by default batch 1
    at the config's sample size with a 77-token text input."""
    ratio = check_settings(ratio, target, importance, threshold, calib is not None and noise_scheduler is not None,
                           "calibration batches (student.calib) and the teacher's noise_scheduler")
    if iterative_steps < 1:
        raise ValueError(f"student.iterative_steps={iterative_steps!r} must be >= 1")
    _check_prunable(unet)

    inputs = dict(example_inputs) if example_inputs is not None else unet_example_inputs(unet)
    scorer = tp.importance.GroupTaylorImportance() if importance == "taylor" else \
        tp.importance.GroupMagnitudeImportance(p=2)
    run = _Pruning(unet, inputs, scorer, target, per_block, prune_heads, iterative_steps)
    before_shapes = layer_shapes(run.model)
    params_before, flops_before = _measure(run.model, inputs, "params"), _measure(run.model, inputs, "flops")
    used, losses = [], []
    if importance == "taylor":
        used, losses = accumulate_taylor_gradients(run.model, calib, noise_scheduler, timesteps, threshold, seed)

    if per_block:
        model, fraction, search = _prune_uniform(run, ratio)
        trajectory, last_step, kept = [], [], 0
    else:
        model, trajectory, last_step, kept = _prune_to_ratio(run, ratio)
        fraction, search = None, []
    changed = {n: s for n, s in layer_shapes(model).items() if s != before_shapes.get(n)}
    export = _export(unet, model, changed, inputs)
    params_after, flops_after = _measure(export, inputs, "params"), _measure(export, inputs, "flops")
    after, start = (params_after, params_before) if target == "params" else (flops_after, flops_before)
    report = PruneReport(target=target, ratio=ratio, achieved=1 - after / start, params_before=params_before,
                         params_after=params_after, flops_before=flops_before, flops_after=flops_after,
                         importance=importance, per_block=per_block, trajectory=trajectory, last_step=last_step,
                         groups_kept=kept, channel_fraction=fraction, search=search, timesteps=used, losses=losses,
                         layer_shapes=changed)
    return export, report


def _export(unet: UNet2DConditionModel, model: UNet2DConditionModel, changed: Mapping[str, dict],
            inputs: Mapping) -> PrunedUNet2DConditionModel:
    """The diffusers export of the pruned working copy, checked to compute what it computes."""
    shapes = {**dict(unet.config.get("layer_shapes", {})), **changed}  # a pruned UNet pruned again
    export = PrunedUNet2DConditionModel.from_pruned(model, unet.config, shapes).eval()
    with torch.no_grad():
        if not torch.allclose(_output(export(**inputs)), _output(model(**inputs)), atol=1e-5, rtol=1e-4):
            raise RuntimeError("the pruned export does not reproduce the pruned network; a layer type changed "
                               f"by pruning is missing from SHAPE_ATTRS ({sorted(t.__name__ for t in SHAPE_ATTRS)})")
    frozen = {name for name, p in unet.named_parameters() if not p.requires_grad}
    for name, p in export.named_parameters():
        p.requires_grad_(name not in frozen)
    return export.train(unet.training)


# ---------------------------------------------------------------- unstructured sparsity


def sparsify_unet(unet: nn.Module, sparsity: float) -> tuple[nn.Module, dict]:
    """Zero the ``sparsity`` fraction of smallest-magnitude weights over all Conv2d/Linear layers together
    (global L1 unstructured pruning, ``torch.nn.utils.prune``), made permanent. Shapes and FLOPs are
    unchanged, and dense kernels do the same work on zeros: this does not reduce CPU latency."""
    from torch.nn.utils import prune

    sparsity = _check_ratio("student.sparsity", sparsity)
    model = copy.deepcopy(unet)
    weights = [(m, "weight") for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    prune.global_unstructured(weights, pruning_method=prune.L1Unstructured, amount=sparsity)
    for m, name in weights:
        prune.remove(m, name)
    total = sum(m.weight.numel() for m, _ in weights)
    zeros = sum(int((m.weight == 0).sum()) for m, _ in weights)
    return model, {"sparsity": zeros / total, "weights": total, "zeros": zeros}
