"""diffusers pipelines whose default call is the exported student's intended call.

A distilled student has an intended step count and guidance, and may have distilled classifier-free
guidance (CFG) without a guidance input; diffusers' stock defaults (50 steps, CFG 7.5, two UNet passes a
step) are then wrong. These pipelines register the intended defaults in their config, so that
``model_index.json`` carries them and ``from_pretrained(folder)(prompt)`` samples as intended.

Importing this module registers the classes in the ``diffusers`` namespace, where
``DiffusionPipeline.from_pretrained`` resolves the ``_class_name`` of ``model_index.json``;
``DistillTextToImagePipeline.from_pretrained(folder)`` needs no registration.
"""

import functools

import diffusers
import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    ImagePipelineOutput,
    UNet2DModel,
)
from diffusers.image_processor import VaeImageProcessor
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor

# The libraries of distill's components (GridDDIMScheduler, the MoE and compressed UNets) named in
# model_index.json: diffusers loads a component only from a library that is already imported, so importing
# this module is all that loading any distill export needs.
import distill.compress.lowrank  # noqa: F401
import distill.compress.lowrank_transformer  # noqa: F401  (the low-rank SD3 and Flux transformers)
import distill.compress.prune  # noqa: F401
import distill.compress.prune_transformer  # noqa: F401  (the pruned SD3 and Flux transformers)
import distill.families.sd3  # noqa: F401  (DistillSD3Pipeline, the SD3 family's export class)
import distill.inference.schedulers  # noqa: F401
import distill.models.moe  # noqa: F401
import distill.models.moe_transformer  # noqa: F401  (the MoE SD3 and Flux transformers)
import distill.models.precondition  # noqa: F401
from distill.inference.intended_call import (  # noqa: F401  (re-exported: exports and callers name them here)
    DistillStableDiffusionXLPipeline,
    DistillTextToImagePipeline,
    IntendedCall,
)
from distill.inference.sampling import sample


def class_labels(labels, num_classes: int, batch_size: int, generator: torch.Generator | None) -> torch.Tensor:
    """(N,) long labels from ints, integer strings or a tensor; ``None`` draws ``batch_size`` uniformly from
    [0, num_classes) with ``generator``. ``num_classes`` itself is the null class (unconditional)."""
    if labels is None:
        return torch.randint(num_classes, (batch_size,), generator=generator)
    if isinstance(labels, (int, str)):
        labels = [labels]
    try:
        labels = torch.as_tensor([int(v) for v in labels] if isinstance(labels, (list, tuple)) else labels).long()
    except ValueError as err:
        raise ValueError(f"class labels {labels!r} must be integers in [0, {num_classes}] (or strings of them)") from err
    if labels.ndim != 1 or (labels < 0).any() or (labels > num_classes).any():
        raise ValueError(f"class labels {labels.tolist()} must be integers in [0, {num_classes}] "
                         f"({num_classes} is the null class: unconditional)")
    return labels


def cfg_uncond_first(pipe) -> bool:
    """Whether ``pipe`` batches classifier-free guidance as [unconditional, conditional] (diffusers' pipelines), not
    [conditional, unconditional] (``DistillClassPipeline``, whose class attribute of this name says so)."""
    return getattr(pipe, "cfg_uncond_first", True)


class DistillClassPipeline(DiffusionPipeline):
    """A class-conditional UNet2DModel (class ``num_class_embeds - 1`` is the null class of CFG training), its
    sampling scheduler and an optional VAE (latent models). ``pipe()`` draws a label with the generator;
    ``pipe([3, 7])`` or ``pipe(["3", "7"])`` samples those classes. ``guidance_scale > 1`` runs CFG against the
    null class, conditional and unconditional passes in one batch."""

    model_cpu_offload_seq = "unet->vae"
    _optional_components = ["vae"]

    def __init__(self, unet: UNet2DModel, scheduler: SchedulerMixin, vae: AutoencoderKL | None = None,
                 default_num_inference_steps: int = 50, default_guidance_scale: float = 1.0):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler, vae=vae)
        self.register_to_config(default_num_inference_steps=default_num_inference_steps,
                                default_guidance_scale=default_guidance_scale)
        self.image_processor = VaeImageProcessor(do_resize=False)

    cfg_uncond_first = False  # distill.inference.sampling batches CFG as [conditional, unconditional]; read it
    # with cfg_uncond_first(pipe)

    @property
    def num_classes(self) -> int:
        return self.unet.config.num_class_embeds - 1

    @property
    def vae_scale_factor(self) -> int:
        return 1 if self.vae is None else 2 ** (len(self.vae.config.block_out_channels) - 1)

    def _denoise(self, x: torch.Tensor, t, **cond) -> torch.Tensor:
        return self.unet(x, t, **cond).sample

    @torch.no_grad()
    def __call__(self, class_labels_or_prompt=None, batch_size: int = 1, num_inference_steps: int | None = None,
                 guidance_scale: float | None = None, generator: torch.Generator | None = None,
                 output_type: str = "pil", return_dict: bool = True, height: int | None = None,
                 width: int | None = None, callback_on_step_end=None):
        """Images of the given classes (drawn when none are given), in ``output_type`` "pil", "np" or "pt" ([0, 1]);
        ``height`` / ``width`` (for callers that pass them) must be the native size: nothing is resized.
        ``callback_on_step_end(pipe, i, t, {"latents": x})``: diffusers' step callback."""
        c = self.unet.config
        size = c.sample_size * self.vae_scale_factor
        if (height or size) != size or (width or size) != size:
            raise ValueError(f"height={height}, width={width}: this model samples {size}x{size} images only")
        labels = class_labels(class_labels_or_prompt, self.num_classes, batch_size, generator).to(self.device)
        shape = (len(labels), c.in_channels, c.sample_size, c.sample_size)
        noise = randn_tensor(shape, generator=generator, device=self.device, dtype=self.unet.dtype)
        null = torch.full_like(labels, self.num_classes)
        steps = num_inference_steps or self.config.default_num_inference_steps
        self.scheduler.set_timesteps(steps, device=self.device)
        with self.progress_bar(total=steps):  # opened once before the first step, as diffusers' pipelines do
            x0 = sample(self._denoise, self.scheduler, noise, {"class_labels": labels}, {"class_labels": null},
                        self.config.default_guidance_scale if guidance_scale is None else guidance_scale, steps,
                        generator, None if callback_on_step_end is None else functools.partial(callback_on_step_end, self))
        if self.vae is not None:
            x0 = self.vae.decode(x0 / self.vae.config.scaling_factor).sample
        images = self.image_processor.postprocess(x0, output_type=output_type)
        return ImagePipelineOutput(images=images) if return_dict else (images,)


for _cls in (DistillTextToImagePipeline, DistillStableDiffusionXLPipeline, DistillClassPipeline):
    # DiffusionPipeline.from_pretrained looks model_index.json's _class_name up in this namespace
    setattr(diffusers, _cls.__name__, _cls)

# every registered family's export class too (DistillSD3Pipeline, ...), so that this one import is what loading
# any distill export needs; families that build on the classes above import this module first
from distill.families import FAMILIES  # noqa: E402

for _name, _family in FAMILIES.load().items():
    if _family.pipeline_class is not None:
        setattr(diffusers, _family.pipeline_class.__name__, _family.pipeline_class)

import distill.inference.meanflow  # noqa: E402, F401  (the MeanFlow exports' pipelines, schedulers and networks)
