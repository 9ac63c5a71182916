"""The text-to-image pipeline classes whose default call is a distilled student's intended call (``IntendedCall``),
on their own so that pipeline modules which build on them (``distill.inference.meanflow``) can import them without
importing ``distill.inference.pipelines``, which imports those modules to register their classes with diffusers."""

import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline


class IntendedCall:
    """The call defaults of a distilled student on a diffusers text-to-image pipeline class (mixed in before it):
    ``default_num_inference_steps``, ``default_guidance_scale`` and ``guidance_distilled`` (the UNet learned a
    guided teacher without a guidance input: no CFG pass is ever run, and ``guidance_scale`` has no effect),
    registered in the config by ``register_call_defaults``.

    A UNet with a guidance input (``time_cond_proj_dim``) gets ``guidance_scale`` as that input, as in the
    parent class; other UNets run CFG (two evaluations a step) when ``guidance_scale > 1`` and the guidance
    was not distilled.
    """

    def register_call_defaults(self, default_num_inference_steps: int, default_guidance_scale: float,
                               guidance_distilled: bool) -> None:
        self.register_to_config(default_num_inference_steps=default_num_inference_steps,
                                default_guidance_scale=default_guidance_scale, guidance_distilled=guidance_distilled)

    @property
    def do_classifier_free_guidance(self) -> bool:
        return super().do_classifier_free_guidance and not self.config.guidance_distilled

    @torch.no_grad()
    def __call__(self, prompt=None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 **kwargs):
        """The parent class's ``__call__`` with the registered defaults for the step count and guidance."""
        return super().__call__(
            prompt, num_inference_steps=num_inference_steps or self.config.default_num_inference_steps,
            guidance_scale=self.config.default_guidance_scale if guidance_scale is None else guidance_scale, **kwargs)


class DistillTextToImagePipeline(IntendedCall, StableDiffusionPipeline):
    """A ``StableDiffusionPipeline`` whose call defaults are the student's (``IntendedCall``)."""

    # safety_checker and feature_extractor without defaults, as in StableDiffusionPipeline: DiffusionPipeline's
    # from_pretrained(folder, safety_checker=None) replaces only the components it finds as required parameters
    def __init__(self, vae, text_encoder, tokenizer, unet, scheduler, safety_checker, feature_extractor,
                 image_encoder=None, requires_safety_checker: bool = False, default_num_inference_steps: int = 50,
                 default_guidance_scale: float = 7.5, guidance_distilled: bool = False):
        super().__init__(vae, text_encoder, tokenizer, unet, scheduler, safety_checker, feature_extractor,
                         image_encoder, requires_safety_checker)
        self.register_call_defaults(default_num_inference_steps, default_guidance_scale, guidance_distilled)


class DistillStableDiffusionXLPipeline(IntendedCall, StableDiffusionXLPipeline):
    """A ``StableDiffusionXLPipeline`` whose call defaults are the student's (``IntendedCall``); the defaults of
    StableDiffusionXLPipeline.__call__ otherwise (50 steps, guidance 5.0)."""

    def __init__(self, vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2, unet, scheduler, image_encoder=None,
                 feature_extractor=None, force_zeros_for_empty_prompt: bool = True, add_watermarker: bool | None = None,
                 default_num_inference_steps: int = 50, default_guidance_scale: float = 5.0,
                 guidance_distilled: bool = False):
        super().__init__(vae, text_encoder, text_encoder_2, tokenizer, tokenizer_2, unet, scheduler, image_encoder,
                         feature_extractor, force_zeros_for_empty_prompt, add_watermarker)
        self.register_call_defaults(default_num_inference_steps, default_guidance_scale, guidance_distilled)
