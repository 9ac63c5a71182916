"""The model family: one object that owns everything that differs between kinds of diffusion model, so that
methods, samplers and pipeline-level code talk to one interface (issue 32; k-diffusion wraps every outside
model once into one denoiser, torchtitan registers one package per model family).

A family class is registered in ``FAMILIES`` (``@FAMILIES.register("sd")``) and knows, from a pipeline's JSON
configs alone, whether a pipeline is one of its own (``detect``) and how to load it (``load``). A family
instance is bound to one model's frozen parts: its noise scheduler (``schedule``: a
``DiscreteVPSchedule``, or a ``FlowMatchingSchedule`` for a FlowMatch* scheduler), its VAE and its conditioner, and offers

- conditioning: ``condition(batch, drop)`` and ``null_condition(n, device)``, a dict of the network's keyword
  arguments (one or several encoders' states, pooled embeddings and extra ids all fit in it);
- latents: ``encode(pixels)``, ``decode(latents)`` and ``scale_latents`` with the VAE's ``scaling_factor`` and,
  where its config has one, ``shift_factor``;
- ``denoise(network, x, t, cond, **extra)``: the one call every method makes of a teacher or student network
  of the family (the student has the teacher's signature);
- export: ``pipeline(network, scheduler, **call_defaults)`` of ``pipeline_class``, ``default_scheduler()``, and
  ``lora_weights(network)``, a LoRA student's adapters as ``pipeline_class.save_lora_weights``' arguments;
- pipelines: ``denoiser_of(pipe)`` and ``set_denoiser(pipe, network)``, through the pipeline component named
  ``denoiser_component``; ``from_pipeline(pipe)``, an instance on an in-memory pipeline's parts (its
  ``conditioner_of``), for pipeline-level code (classifier guidance, the server), which also calls
  ``denoise_at`` (the network at a sampling scheduler's own timestep), ``unscale_latents`` and
  ``pipeline_call_inputs`` (a condition as the pipeline call's ``prompt_embeds``, ... keyword arguments);
- ``feature_blocks(network)``, the named blocks feature distillation and feature caching use; for feature
  distillation also ``block_feature`` (which element of a block's output is the feature),
  ``feature_block_pairs`` (which teacher block a student block matches) and ``feature_regressor``.

A family instance is a plain object, not a module: the method registers the same VAE, conditioner and schedule
under its own attribute names, so that they move with it and its checkpoint keys do not change.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from distill.diffusion import DiscreteVPSchedule, FlowMatchingSchedule
from distill.models.teacher import (
    Teacher,
    check_family,
    check_pipeline_folder,
    is_flow_matching,
    pipeline_configs,
)
from distill.utils.registry import Registry

FAMILIES = Registry("family", ("distill.families.sd", "distill.families.sdxl", "distill.families.class_unet",
                                "distill.families.sd3", "distill.families.flux"))
TEACHER_KEY = "teacher.pretrained_model_name_or_path"


class ModelFamily:
    """One model family bound to one model's frozen parts: ``scheduler`` (its noise schedule), ``vae`` (None:
    pixel space) and ``conditioner`` (a module mapping a batch to the network's conditioning keyword arguments,
    with ``null(n, device)``)."""

    conditioner_type: ClassVar[type] = nn.Module  # the conditioner this family conditions with
    pipeline_class: ClassVar[type | None] = None  # the diffusers pipeline class of its exports
    denoiser_component: ClassVar[str] = ""  # the pipeline component that is the denoiser ("unet", "transformer")
    methods: ClassVar[tuple[str, ...] | None] = None  # the training methods (METHODS names) that serve it; None: all
    flow_matching: ClassVar[bool] = False  # its network's time input is a flow scheduler's timestep (1000 t), not VP's
    components: ClassVar[tuple[str, ...]] = ()  # the pipeline components it cannot run without (check_components)
    component_notes: ClassVar[dict[str, str]] = {}  # component -> why it is required, where that is not obvious
    # condition key -> the pipeline call's keyword for it (prompt_embeds, ...); None: the pipeline derives it itself
    call_inputs: ClassVar[dict[str, str | None]] = {}
    # whether a guidance scale > 1 runs classifier-free guidance, a second (unconditional) network row per image; False
    # where the pipeline passes the scale to the network instead (Flux's distilled-guidance embedding, guidance_input)
    classifier_free_guidance: ClassVar[bool] = True
    # whether its pipeline shifts the sigmas by the call's resolution on a use_dynamic_shifting scheduler (Flux's
    # calculate_shift), and offers ``shift_mu``, ``inference_sigmas`` and ``resolution_defaults`` for it
    resolution_shift: ClassVar[bool] = False

    def __init__(self, scheduler, vae: nn.Module | None, conditioner: nn.Module):
        if not isinstance(conditioner, self.conditioner_type):
            raise TypeError(f"family {type(self).__name__} conditions with a {self.conditioner_type.__name__}; got "
                            f"{type(conditioner).__name__}")
        self.scheduler = scheduler
        self.scheduler_config = dict(scheduler.config)  # what every sampling scheduler is built from
        # FlowMatch* schedulers: t in [0, 1], the velocity (an in-memory scheduler's config has no _class_name yet)
        flow = is_flow_matching({"_class_name": type(scheduler).__name__, **scheduler.config})
        self.schedule = (FlowMatchingSchedule if flow else DiscreteVPSchedule).from_scheduler(scheduler)
        self.vae = vae.requires_grad_(False).eval() if vae is not None else None
        self.conditioner = conditioner

    # ------------------------------------------------------------------ detection and loading (from configs)

    @classmethod
    def detect(cls, configs: dict[str, dict]) -> bool:
        """Whether a pipeline is of this family, from ``pipeline_configs``' JSON alone (no weights)."""
        raise NotImplementedError

    @classmethod
    def load(cls, pretrained_model_name_or_path: str, revision: str | None = None, variant: str | None = None,
             torch_dtype: str | None = None) -> Teacher:
        """The pipeline folder or hub id as a frozen ``Teacher`` whose ``family`` is an instance of this class."""
        raise ValueError(f"a {cls.__name__} pipeline ({pretrained_model_name_or_path!r}) cannot be loaded as a "
                         "teacher: the distillation methods distil text-conditioned teachers; give a Stable-Diffusion-"
                         "format pipeline")

    @classmethod
    def check_components(cls, name_or_path: str | Path, configs: dict[str, dict], key: str = TEACHER_KEY) -> None:
        """Refuse, from ``pipeline_configs``' JSON alone (before any weights), a pipeline of this family that lacks
        one of its ``components`` (null or absent in model_index.json, or a local folder without its folder), naming
        them, why where ``component_notes`` says, and what to do."""
        index, local = configs["pipeline"], Path(name_or_path).exists()
        missing = [name for name in cls.components if (index.get(name) or [None])[0] is None
                   or (local and not (Path(name_or_path) / name).is_dir())]
        if missing:
            notes = "; ".join(dict.fromkeys(cls.component_notes[m] for m in missing if m in cls.component_notes))
            raise FileNotFoundError(
                f"{key}={str(name_or_path)!r} is a {FAMILIES.name_of(cls)!r} pipeline without "
                f"{', '.join(m + '/' for m in missing)}{f' ({notes})' if notes else ''}; copy those folders from the "
                "pipeline it was saved from, or load it, add them and save it again")

    @classmethod
    def teacher_of(cls, pipe, source: str, load_options: dict, **conditioner_options) -> Teacher:
        """A pipeline of this family just loaded from ``source`` as a frozen ``Teacher``: its denoiser and VAE frozen
        (the conditioner freezes the encoders), its family bound to its parts (``conditioner_of(pipe,
        **conditioner_options)``)."""
        denoiser = cls.denoiser_of(pipe)
        for module in (denoiser, pipe.vae):
            module.requires_grad_(False).eval()
        family = cls(pipe.scheduler, pipe.vae, cls.conditioner_of(pipe, **conditioner_options))
        return Teacher(denoiser, pipe.vae, pipe.scheduler, str(source), load_options, family=family)

    @classmethod
    def from_pipeline(cls, pipe, cache_prompts: bool = True) -> ModelFamily:
        """An instance bound to an in-memory pipeline of this family (its scheduler, VAE and conditioner), for
        pipeline-level code (guidance, serving); ``cache_prompts``: keep embeddings per distinct prompt (a server,
        which sees unboundedly many prompts, keeps none)."""
        return cls(pipe.scheduler, getattr(pipe, "vae", None), cls.conditioner_of(pipe, cache_prompts))

    @classmethod
    def conditioner_of(cls, pipe, cache_prompts: bool = True) -> nn.Module:
        """The family's conditioner (``conditioner_type``) on the encoders of an in-memory pipeline."""
        raise NotImplementedError(f"{cls.__name__} builds no conditioner from a pipeline; define conditioner_of")

    def copy(self, **options) -> ModelFamily:
        """A new instance on the same frozen parts with its own state; each method holds its own."""
        if options:
            raise TypeError(f"{type(self).__name__}.copy takes no options; got {sorted(options)}")
        return type(self)(self.scheduler, self.vae, self.conditioner)

    # ------------------------------------------------------------------ conditioning

    def condition(self, batch: dict, drop: torch.Tensor | None = None) -> dict:
        """The network's conditioning keyword arguments for ``batch``; rows where ``drop`` (N,) is True get the
        null condition (classifier-free guidance dropout, Ho & Salimans 2022)."""
        return self.conditioner(batch, drop)

    def null_condition(self, n: int, device: torch.device | str = "cpu", like: dict | None = None) -> dict:
        """The null condition (of classifier-free guidance) for ``n`` rows; ``like``: the condition they pair with,
        for a family whose null rows keep some of its entries (SDXL's size ids)."""
        return self.conditioner.null(n, device)

    # ------------------------------------------------------------------ latents

    def scale_latents(self, z: torch.Tensor) -> torch.Tensor:
        """A VAE posterior sample -> the diffusion space: (z - shift_factor) * scaling_factor (Rombach et al.
        2022; shift_factor only where the VAE's config has one)."""
        if self.vae is None:
            return z
        shift = self.vae.config.get("shift_factor")
        return (z if shift is None else z - shift) * self.vae.config.scaling_factor

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Images (N, C, H, W) in [-1, 1] -> the diffusion space: a VAE posterior sample, scaled, in float32 (the
        latents are the data); the images themselves in pixel space."""
        from distill.data.latents import posterior_sample

        if self.vae is None:
            return pixels
        return self.scale_latents(posterior_sample(self.vae, pixels, generator))

    def unscale_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The diffusion space -> the VAE's latents: ``scale_latents`` undone, latents / scaling_factor (+
        shift_factor); differentiable (classifier guidance decodes through it)."""
        if self.vae is None:
            return latents
        shift = self.vae.config.get("shift_factor")
        z = latents / self.vae.config.scaling_factor
        return z if shift is None else z + shift

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The diffusion space -> images (N, C, H, W) in [-1, 1]: ``scale_latents`` undone, then the VAE's decoder."""
        if self.vae is None:
            return latents
        return self.vae.decode(self.unscale_latents(latents)).sample

    # ------------------------------------------------------------------ schedule and denoiser

    @property
    def prediction_type(self) -> str:
        return self.schedule.prediction_type

    def denoise(self, network: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: dict, **extra) -> torch.Tensor:
        """The output of ``network`` (a teacher or student of this family) at (x, t) under ``cond``; ``extra``: more
        keyword arguments of the network (a guidance embedding's ``timestep_cond``)."""
        return network(x, t, **cond, **extra).sample

    def denoise_at(self, network: nn.Module, x: torch.Tensor, timestep: torch.Tensor, cond: dict, **extra
                   ) -> torch.Tensor:
        """``denoise`` at the network's own time input ``timestep`` (an entry of a sampling scheduler's
        ``timesteps``, as the pipeline's loop passes it); the same as ``denoise`` where t is that input (a discrete VP
        schedule's integer timesteps)."""
        return self.denoise(network, x, timestep, cond, **extra)

    def guidance_embedded(self, network: nn.Module) -> bool:
        """Whether ``network`` takes the guidance scale as an input (``guidance_input``: FLUX.1-dev's guidance
        embedding), its pipeline running no CFG pass; False where guidance is classifier-free."""
        return False

    def guidance_input(self, guidance_scale: torch.Tensor) -> dict:
        """The network's keyword arguments for a guidance scale per row (N,) that it takes as an input (FLUX.1-dev's
        ``guidance``), for ``denoise_at``; none where guidance is classifier-free (two rows) or distilled otherwise."""
        return {}

    def set_timesteps(self, scheduler, num_inference_steps: int, height: int, width: int,
                      device: torch.device | str | None = None) -> None:
        """Set ``scheduler``'s timesteps as the family's pipeline call does for a ``height`` x ``width`` latent
        (latent pixels): ``set_timesteps(num_inference_steps)``, which a resolution-dependent family overrides."""
        scheduler.set_timesteps(num_inference_steps, device=device)

    def latent_shape(self, network: nn.Module, n: int, height: int, width: int) -> tuple[int, ...]:
        """The shape of the initial noise of ``n`` images of a ``height`` x ``width`` latent (latent pixels), in the
        family's latent layout: (N, in_channels, H, W)."""
        return (n, network.config.in_channels, height, width)

    def call_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The latents a ``pipeline_class`` call returns with ``output_type="latent"`` (a ``height`` x ``width``
        latent) in the family's layout, what ``decode`` takes: the same tensor, unless the pipeline packs them."""
        return latents

    def pipeline_call_inputs(self, cond: dict, null: dict | None = None) -> dict:
        """The keyword arguments of a ``pipeline_class`` call on precomputed conditions: ``cond``'s entries under
        the call's names (``call_inputs``), ``null``'s (classifier-free guidance's unconditional rows) under their
        ``negative_`` names; an entry the pipeline derives itself (named None) is left out."""
        out = {}
        for prefix, part in (("", cond), ("negative_", null or {})):
            for key, value in part.items():
                if key not in self.call_inputs:
                    raise ValueError(f"{type(self).__name__}'s condition has {key!r}, which no argument of "
                                     f"{getattr(self.pipeline_class, '__name__', None)}'s call takes (call_inputs: "
                                     f"{self.call_inputs})")
                if self.call_inputs[key] is not None:
                    out[prefix + self.call_inputs[key]] = value
        return out

    def example_inputs(self, network: nn.Module, n: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Zero (x, t, cond) of ``network``'s native shapes, for a probe forward."""
        raise NotImplementedError

    @classmethod
    def feature_blocks(cls, network: nn.Module, mid_block: bool = False) -> dict[str, nn.Module]:
        """The named blocks whose outputs feature distillation matches and feature caching reuses: every down
        block and every up block of a UNet (BK-SDM, Kim et al. 2023), with ``mid_block`` its mid block too; a
        classmethod, so that pipeline-level code asks ``family_of(pipe).feature_blocks(denoiser_of(pipe))``."""
        groups = ("down_blocks", "up_blocks")
        if not all(hasattr(network, g) for g in groups):
            raise ValueError(f"{type(network).__name__} has no down_blocks/up_blocks to match features at; "
                             "set method.feature_weight=0 (output distillation only)")
        blocks = {f"down_blocks.{i}": b for i, b in enumerate(network.down_blocks)}
        if mid_block and getattr(network, "mid_block", None) is not None:
            blocks["mid_block"] = network.mid_block
        blocks.update({f"up_blocks.{i}": b for i, b in enumerate(network.up_blocks)})
        return blocks

    # the axis of a block feature that a narrower student's regressor maps: channels of a UNet's (N, C, H, W)
    feature_width_dim: ClassVar[int] = 1

    @staticmethod
    def block_feature(output) -> torch.Tensor:
        """The feature of a feature block's output that feature distillation matches: a down block's hidden states
        (its first element; the rest are skip tensors), an up or mid block's output as it is."""
        return output[0] if isinstance(output, tuple) else output

    @classmethod
    def feature_block_pairs(cls, teacher: nn.Module, student: nn.Module, mid_block: bool = False) -> dict[str, str]:
        """Student feature block -> the teacher block whose feature it matches, in the teacher's block order: the
        same name (a pruned or low-rank student keeps the teacher's blocks); a student lacking one is refused."""
        student_blocks = cls.feature_blocks(student, mid_block)
        missing = [name for name in cls.feature_blocks(teacher, mid_block) if name not in student_blocks]
        if missing:
            raise ValueError(f"the student ({type(student).__name__}) lacks the teacher's feature blocks {missing}: "
                             "feature distillation matches each block's output by name; use a student with the "
                             "teacher's block structure (student=pruned or lowrank) or set method.feature_weight=0")
        return {name: name for name in cls.feature_blocks(teacher, mid_block)}

    @staticmethod
    def feature_regressor(student_width: int, teacher_width: int) -> nn.Module:
        """FitNets' regressor (Romero et al. 2015) from a narrower student's feature to the teacher's width: a 1x1
        convolution over the channels of (N, C, H, W)."""
        return nn.Conv2d(student_width, teacher_width, 1)

    # ------------------------------------------------------------------ export and pipelines

    def pipeline(self, network: nn.Module, scheduler, **call_defaults):
        """``network`` with this family's frozen parts as an in-memory ``pipeline_class`` sampling with
        ``scheduler``, whose call defaults are ``call_defaults``; progress bar off."""
        raise NotImplementedError

    @classmethod
    def lora_weights(cls, network: nn.Module) -> dict:
        """``network``'s one peft LoRA adapter as the keyword arguments of ``pipeline_class.save_lora_weights``, so that
        the stock pipeline's ``load_lora_weights`` reads it back whole: peft's state dict, keys unconverted, under
        ``<denoiser_component>_lora_layers`` (``unet_lora_layers``, ``transformer_lora_layers``) and its ``LoraConfig``
        under ``<denoiser_component>_lora_adapter_metadata``, from which the loader rebuilds every targeted module at
        its rank and alpha (diffusers' older lora.down/up names cover only attention and carry no alpha)."""
        import inspect

        from peft.utils import get_peft_model_state_dict

        (adapter,) = network.peft_config
        component = cls._denoiser_component()
        layers, metadata = f"{component}_lora_layers", f"{component}_lora_adapter_metadata"
        takes = inspect.signature(getattr(cls.pipeline_class, "save_lora_weights", lambda: None)).parameters
        if not {layers, metadata} <= set(takes):
            raise ValueError(f"{getattr(cls.pipeline_class, '__name__', None)}.save_lora_weights takes no {layers} and "
                             f"{metadata}: a LoRA student of the {cls.__name__} cannot be saved for its pipeline's "
                             "load_lora_weights; use student=copy")
        return {layers: get_peft_model_state_dict(network, adapter_name=adapter),
                metadata: network.peft_config[adapter].to_dict()}

    def default_scheduler(self):
        """The scheduler an export samples with when its method names none: the model's own noise scheduler."""
        return type(self.scheduler).from_config(self.scheduler_config)

    @classmethod
    def matches(cls, pipe) -> bool:
        """Whether an in-memory pipeline is of this family."""
        return cls.pipeline_class is not None and isinstance(pipe, cls.pipeline_class)

    @classmethod
    def denoiser_of(cls, pipe) -> nn.Module:
        """The denoising network of a pipeline of this family (its ``denoiser_component``)."""
        return getattr(pipe, cls._denoiser_component())

    @classmethod
    def set_denoiser(cls, pipe, network: nn.Module) -> None:
        """Make ``network`` the denoiser of a pipeline of this family (a fused, compiled or LoRA-merged copy of
        it); the pipeline's config then names ``network``'s class and library (what ``model_index.json`` saves)."""
        pipe.register_modules(**{cls._denoiser_component(): network})

    @classmethod
    def _denoiser_component(cls) -> str:
        if not cls.denoiser_component:
            raise NotImplementedError(f"{cls.__name__} names no denoiser_component (the pipeline component that is "
                                      "its denoiser, e.g. \"unet\"); set it on the family class")
        return cls.denoiser_component

    @classmethod
    def native_size(cls, pipe) -> int:
        """The image side a pipeline of this family samples at natively (the network's sample size in pixels)."""
        size = cls.denoiser_of(pipe).config.sample_size
        return (size if isinstance(size, int) else size[0]) * pipe.vae_scale_factor

    @classmethod
    def size_multiple(cls, pipe) -> int:
        """What the image sides of a pipeline of this family must be a multiple of: the VAE's factor, times the
        transformer's patch size where it cuts latents in patches (SD3's ``patch_size``)."""
        return pipe.vae_scale_factor * getattr(pipe, "patch_size", 1)


class TransformerCallDefaults:
    """Mixed in before a stock pipeline class whose call takes T5's ``max_sequence_length`` (SD3's, Flux's): its call
    falls back to the registered ``default_num_inference_steps``, ``default_guidance_scale`` and
    ``default_max_sequence_length`` of the export's config (what ``model_index.json`` carries), not to the stock
    class's own defaults. With ``sigma_spacing="trailing"`` registered (a student trained on the grid t_i =
    shift(i / N): progressive distillation on a flow teacher) a call without ``sigmas`` or ``timesteps`` passes the
    unshifted sigmas linspace(1, 1 / N, N) (``trailing_sigmas``), as FluxPipeline does, instead of the scheduler's
    own N points from 1 to its smallest training sigma."""

    @torch.no_grad()
    def __call__(self, prompt=None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 max_sequence_length: int | None = None, **kwargs):
        steps = num_inference_steps or self.config.default_num_inference_steps
        if self.config.get("sigma_spacing") == "trailing" and kwargs.get("sigmas") is None \
                and kwargs.get("timesteps") is None:
            kwargs["sigmas"] = trailing_sigmas(steps)
        return super().__call__(
            prompt, num_inference_steps=steps,
            guidance_scale=self.config.default_guidance_scale if guidance_scale is None else guidance_scale,
            max_sequence_length=max_sequence_length or self.config.default_max_sequence_length, **kwargs)


SIGMA_SPACINGS = ("scheduler", "trailing")


def evenly_spaced_blocks(num_teacher: int, num_student: int) -> list[int]:
    """The teacher block each of a shallower student's ``num_student`` blocks stands for: student block j (0-based)
    -> teacher block (j + 1) * num_teacher // num_student - 1, the last block of the j-th of ``num_student`` equal
    runs of teacher blocks (the last to the last; every block where the depths are equal). BK-SDM's depth reduction
    (Kim et al. 2023) keeps a stage's output and drops blocks inside it; a transformer has one stage per block."""
    if not 1 <= num_student <= num_teacher:
        raise ValueError(f"a student of {num_student} blocks cannot stand for a teacher of {num_teacher}: give it 1 "
                         f"to {num_teacher} blocks")
    return [(j + 1) * num_teacher // num_student - 1 for j in range(num_student)]


# the attribute of a transformer made of some of its teacher's blocks (distill.compress.depth_prune.keep_blocks): block
# list -> the teacher indices of its blocks, which feature distillation matches them to
KEPT_BLOCKS = "distill_kept_blocks"


def evenly_spaced_block_pairs(teacher: nn.Module, student: nn.Module,
                              block_lists: dict[str, str]) -> dict[str, str]:
    """Student block -> teacher block of a transformer's ``block_lists`` (block list -> the config key of its length,
    in forward order): in each list student block j of L_s -> teacher block (j + 1) L_t // L_s - 1
    (``evenly_spaced_blocks``; the same index at equal depth), or, for a student whose blocks were chosen from the
    teacher's (``KEPT_BLOCKS``: a depth-pruned one), block j -> its original index; a list the student lacks (L_s = 0)
    has no pairs. A student deeper than the teacher in any list is refused, naming the list and the fix."""
    kept = getattr(student, KEPT_BLOCKS, None) or {}
    pairs = {}
    for blocks, key in block_lists.items():
        num_teacher, num_student = len(getattr(teacher, blocks)), len(getattr(student, blocks))
        if num_student > num_teacher:
            raise ValueError(f"the student has {num_student} {blocks.replace('_', ' ')}, the teacher {num_teacher}: "
                             "feature distillation matches each student block to a teacher block; use a student of "
                             f"at most {num_teacher} (student=shallow student.{key}=...) or set "
                             "method.feature_weight=0")
        indices = kept.get(blocks)
        if indices is None or len(indices) != num_student or max(indices, default=-1) >= num_teacher:
            indices = evenly_spaced_blocks(num_teacher, num_student) if num_student else []
        pairs.update({f"{blocks}.{j}": f"{blocks}.{i}" for j, i in enumerate(indices)})
    return pairs


def trailing_sigmas(num_inference_steps: int) -> list[float]:
    """The unshifted sigmas of an N-step grid ending at 0, linspace(1, 1 / N, N), as the float32 values the flow
    scheduler's ``set_timesteps(sigmas=...)`` takes them (what a stock pipeline call passes as ``sigmas``)."""
    return [float(s) for s in np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps).astype(np.float32)]


# ---------------------------------------------------------------------- lookups


def detect_family(name_or_path: str | Path, configs: dict[str, dict], key: str = TEACHER_KEY) -> type[ModelFamily]:
    """The registered family of a pipeline, from its configs (``pipeline_configs``); one that no family detects is
    refused, first by ``check_family`` where it is of a kind distill does not run yet, naming ``key``."""
    found = [family for _, family in FAMILIES.items() if family.detect(configs)]
    if len(found) != 1:
        check_family(name_or_path, configs, key)
        what = (configs["pipeline"].get("_class_name") or configs["unet"].get("_class_name")
                or configs.get("transformer", {}).get("_class_name") or "an unknown pipeline")
        raise ValueError(f"{key}={str(name_or_path)!r} ({what}) is recognised by "
                         f"{[f.__name__ for f in found] or 'no registered model family'}; registered: "
                         f"{FAMILIES.names()}. Add a family in distill/families/ (@FAMILIES.register) whose "
                         "detect() recognises it")
    return found[0]


def check_supported(name_or_path: str | Path, configs: dict[str, dict], key: str = TEACHER_KEY) -> None:
    """Refuse, from its configs, a pipeline of a kind distill does not run yet (``check_family``), unless a
    registered family detects it (SD3 is flow matching, and runs)."""
    if not any(family.detect(configs) for _, family in FAMILIES.items()):
        check_family(name_or_path, configs, key)


def check_method_serves(name_or_path: str | Path, configs: dict[str, dict], method: str | None,
                        key: str = TEACHER_KEY) -> None:
    """Refuse, from the teacher's configs, a training ``method`` (its METHODS name) that cannot serve the teacher's
    family (``ModelFamily.methods``), naming the family, the methods that can and what runs on it."""
    found = [(name, family) for name, family in FAMILIES.items() if family.detect(configs)]
    if len(found) != 1 or found[0][1].methods is None or method in found[0][1].methods:
        return  # no family or several: detect_family reports it where the teacher loads
    name, family = found[0]
    can = f"the methods that can: {list(family.methods)}" if family.methods else "no training method serves it yet"
    flow = is_flow_matching(configs["scheduler"])
    raise ValueError(f"{key}={str(name_or_path)!r} is a {name!r} teacher ({family.__name__}"
                     f"{', flow matching' if flow else ''}), which method={method!r} cannot train; {can}. What runs on "
                     f"it: python -m distill.evaluate pipeline={name_or_path}"
                     f"{' schedulers=[flow_euler]' if flow else ''} and python -m distill.sample pipeline={name_or_path}")


def check_components(name_or_path: str | Path, key: str = TEACHER_KEY) -> None:
    """A pipeline's family's ``check_components`` on its configs (nothing where no single family detects it)."""
    configs = pipeline_configs(name_or_path)
    found = [family for _, family in FAMILIES.items() if family.detect(configs)]
    if len(found) == 1:
        found[0].check_components(name_or_path, configs, key)


def load_teacher(pretrained_model_name_or_path: str, revision: str | None = None, variant: str | None = None,
                 torch_dtype: str | None = None) -> Teacher:
    """Load and freeze a teacher (``requires_grad_(False)``, ``eval()``) from a pipeline folder or hub id: its
    family is detected from its configs (for a hub id, fetched without the weights), then loads it."""
    configs = pipeline_configs(pretrained_model_name_or_path, revision)
    if Path(pretrained_model_name_or_path).exists() and not configs["pipeline"]:
        check_pipeline_folder(pretrained_model_name_or_path)  # no model_index.json: says what to give instead
    family = detect_family(pretrained_model_name_or_path, configs)
    return family.load(pretrained_model_name_or_path, revision=revision, variant=variant, torch_dtype=torch_dtype)


def family_of(pipe) -> type[ModelFamily]:
    """The registered family of an in-memory pipeline (its class)."""
    found = [family for _, family in FAMILIES.items() if family.matches(pipe)]
    if not found:
        raise ValueError(f"{type(pipe).__name__} is of no registered model family ({FAMILIES.names()}); add one in "
                         "distill/families/")
    return max(found, key=lambda f: len(f.__mro__))  # the most specific


def denoiser_of(pipe) -> nn.Module:
    """The denoising network of an in-memory pipeline (its family's ``denoiser_component``)."""
    return family_of(pipe).denoiser_of(pipe)


def set_denoiser(pipe, network: nn.Module) -> None:
    """Make ``network`` the denoising network of an in-memory pipeline (``ModelFamily.set_denoiser``)."""
    family_of(pipe).set_denoiser(pipe, network)


def native_size(pipe) -> int:
    """The image side (pixels) an in-memory pipeline samples at natively."""
    return family_of(pipe).native_size(pipe)


def family_for(scheduler, vae: nn.Module | None, conditioner: nn.Module) -> ModelFamily:
    """The family instance of a network trained from scratch on ``conditioner``'s conditioning (plain diffusion
    training): the registered family that conditions with it."""
    found = [family for _, family in FAMILIES.items() if isinstance(conditioner, family.conditioner_type)]
    if not found:
        raise ValueError(f"no registered model family conditions with a {type(conditioner).__name__}; registered: "
                         f"{FAMILIES.names()}")
    return max(found, key=lambda f: len(f.conditioner_type.__mro__))(scheduler, vae, conditioner)
