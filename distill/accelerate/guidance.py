"""Classifier guidance (Dhariwal & Nichol 2021): steer each step towards class y with the gradient of a
classifier's log p(y | x_t), added to the noise prediction,

    eps <- eps - sqrt(1 - abar_t) * s * grad_x log p(y | x_t)        (their Algorithm 2, eps form)

``mode=noisy`` takes the gradient of a noise-aware classifier of latents (``NoisyLatentClassifier``).
``mode=x0`` needs no noise-aware model: it scores the decoded
prediction of the clean image, x0 = (x_t - sqrt(1 - abar_t) eps) / sqrt(abar_t), with a classifier of clean
images and carries the gradient back to x_t through x0 with eps held
fixed (grad_x = grad_x0 / sqrt(abar_t)), the usual approximation of guidance through the predicted x0.
``mode=clip`` does the same with a CLIP model's score of the decoded x0 against each sample's prompt,
100 cos(image, prompt) (CLIPScore's scale). The guide is a folder (``classifier``); the presets
``conf/accelerate/classifier*.yaml`` name the shipped ones. A guide that is also the evaluation's network (the
CLIP of the CLIP score, the classifier of prompt accuracy and FID features) makes those numbers judge the guide
by itself.

On a flow-matching model (x_t = (1 - t) x0 + t eps, the network's v = eps - x0; SD3's layout) the same term is
added in velocity form (``distill.diffusion.flow.classifier_guided_velocity``): the score is
grad log p_t(x_t) = -(x_t + (1 - t) v) / t, so v = -(x_t + t score) / (1 - t) and the guided velocity is

    v <- v - s t / (1 - t) grad_x log p(y | x_t)

(in eps form eps - t s grad, with sigma_t = t and alpha_t = 1 - t in place of sqrt(1 - abar_t) and sqrt(abar_t)).
``mode=x0`` and ``clip`` take x0 = x_t - t v and grad_x = grad_x0 / (1 - t) (eps held fixed); at t = 1 (the
first step of a flow Euler schedule) nothing is added: there x_t = eps carries no class, the exact gradient is 0
and the factor 1 / (1 - t) is infinite. ``mode=noisy`` is refused on a flow model (its classifier knows a VP
schedule's noise levels), and so is a transformer that packs latents into tokens (Flux).

It is an alternative to classifier-free guidance (one UNet pass a step instead of two, plus the classifier's
forward and backward), and combines with it: under CFG the UNet batch holds the unconditional and conditional
halves (the same x_t), the gradient is taken once (in x0 mode at the x0 of the CFG-combined prediction) and both
halves get the same term, so the guided prediction is CFG's plus the classifier term once. A prompt whose
label is unknown (-1) is sampled unguided. Labels and prompts come from the sampling context (``labels`` /
``prompts``; ``distill.evaluate`` passes the evaluation set's, also under ``null_prompts``) or the ``labels`` /
``prompts`` options.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distill.accelerate.base import Accelerator, call_input, like_output, output_tensor
from distill.accelerate.registry import ACCELERATORS
from distill.diffusion import flow

MODES = ("noisy", "x0", "clip")
GUIDE_KINDS = {"noisy": "NoisyLatentClassifier", "x0": "ImageClassifier", "clip": "CLIP model"}


def load_guide(mode: str, path: str):
    """The guide of ``mode`` from ``path``, in eval mode: a ``NoisyLatentClassifier``, an ``ImageClassifier``, or a
    (CLIPModel, CLIPTokenizer) pair."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        kind = GUIDE_KINDS[mode]
        raise FileNotFoundError(f"accelerate.options.classifier={str(folder)!r} holds no config.json; give the "
                                f"folder of a {kind}")
    if mode == "noisy":
        from distill.models.noisy_classifier import NoisyLatentClassifier

        model = NoisyLatentClassifier.from_pretrained(folder)
    elif mode == "x0":
        from distill.models.classifier import ImageClassifier

        model = ImageClassifier.from_pretrained(folder)
    else:
        from transformers import CLIPModel, CLIPTokenizer

        return CLIPModel.from_pretrained(folder).eval().requires_grad_(False), CLIPTokenizer.from_pretrained(folder)
    return model.eval().requires_grad_(False)


@ACCELERATORS.register("classifier")
class ClassifierGuidance(Accelerator):
    """Classifier guidance of scale ``scale`` (0: unguided) by the classifier at ``classifier`` (``mode``)."""

    name = "classifier"

    def __init__(self, scale: float = 1.0, mode: str = "noisy", classifier: str | None = None,
                 labels: list[int] | None = None, prompts: list[str] | None = None):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
            raise ValueError(f"accelerate.options.scale={scale!r} must be a number >= 0 (0 = unguided)")
        if mode not in MODES:
            raise ValueError(f"accelerate.options.mode={mode!r} is not one of {list(MODES)}")
        if classifier is None:
            raise ValueError(f"accelerate.options.classifier is not set: give the folder of a {GUIDE_KINDS[mode]} "
                             "(the presets accelerate=classifier, classifier_x0, classifier_clip name the shipped ones)")
        self.scale, self.mode, self.path = float(scale), mode, classifier
        self.fixed_labels = None if labels is None else torch.as_tensor(list(labels), dtype=torch.long)
        self.fixed_prompts = None if prompts is None else list(prompts)
        self._text = None
        self.classifier, self.family, self.vae, self.pipe = None, None, None, None
        self.uncond_first, self.flow = True, False

    def describe(self) -> str:
        return f"classifier({self.mode},s={self.scale:g})"

    @property
    def needs_labels(self) -> bool:
        """Whether the caller must give each call's class labels (the context's ``labels``): a classifier's
        guide without fixed labels; the CLIP guide steers towards the prompts."""
        return self.mode != "clip" and self.fixed_labels is None

    def use_pipeline(self, pipe) -> None:
        """The pipeline's family (its noise schedule and VAE latents) and CFG batch order (what the guide's
        gradient needs): a noise prediction on a discrete VP schedule, or a velocity on a flow-matching one (not
        in ``mode=noisy``, whose classifier knows VP noise levels)."""
        from distill.diffusion import FlowMatchingSchedule
        from distill.families import FAMILIES, family_of
        from distill.inference.pipelines import cfg_uncond_first

        cls = family_of(pipe)
        family = cls.from_pipeline(pipe)
        self.flow = isinstance(family.schedule, FlowMatchingSchedule)
        if self.flow and self.mode == "noisy":
            name = next(n for n, f in FAMILIES.items() if f is cls)
            raise ValueError(f"accelerate.options.mode=noisy guides with a classifier of a VP schedule's noisy "
                             f"latents; {type(pipe).__name__} is of the {name!r} family ({cls.__name__}), flow "
                             "matching, whose noise levels it does not know; use mode=x0 or mode=clip (a guide of "
                             "clean images, through the predicted x0)")
        if not self.flow and family.prediction_type != "epsilon":
            raise ValueError(f"accelerate=classifier guides a noise prediction; the pipeline's scheduler says "
                             f"prediction_type={family.prediction_type!r}")
        self.family, self.vae, self.pipe = family, family.vae, pipe
        self.uncond_first = cfg_uncond_first(pipe)

    def attach(self, denoiser: torch.nn.Module, context) -> None:
        self.detach()
        if context.pipe is not None:
            self.use_pipeline(context.pipe)
        if self.classifier is None:
            self.classifier = load_guide(self.mode, self.path)
        if self.family is None:
            raise ValueError("accelerate=classifier steers with the pipeline's noise schedule (its model family): "
                             "sample through the pipeline, accelerated(pipe, ...) or enable(pipe, ...), or call "
                             "use_pipeline(pipe) first")
        config = denoiser.config
        latent_channels = getattr(getattr(self.vae, "config", None), "latent_channels", None)
        if self.flow and latent_channels is not None and config.get("in_channels") != latent_channels:
            raise ValueError(f"accelerate=classifier guides C x H x W latents; this {type(denoiser).__name__} takes "
                             f"{config.get('in_channels')} channels for the VAE's {latent_channels} (it packs "
                             "latents into tokens, as Flux does), which it does not guide")
        if self.mode == "noisy":
            want = (self.classifier.in_channels, self.classifier.sample_size)
            have = (config.get("in_channels"), config.get("sample_size"))
            if want != have:
                raise ValueError(f"accelerate.options.classifier: the guide takes {want[0]}x{want[1]}x{want[1]} "
                                 f"latents, the denoiser makes {have[0]}x{have[1]}x{have[1]}; give a classifier of "
                                 "this model's latents")
        elif self.mode == "x0" and self.vae is None and config.get("in_channels") != self.classifier.in_channels:
            raise ValueError("accelerate.options.mode=x0 decodes the predicted x0 with the pipeline's VAE; this "
                             "pipeline has none and its samples do not fit the classifier")
        model = self.classifier[0] if self.mode == "clip" else self.classifier
        model.to(next(denoiser.parameters()).device)
        super().attach(denoiser, context)

    def gradient(self, x: torch.Tensor, t, labels: torch.Tensor | list[str], eps: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """grad_x log p(labels | x_t) (noisy), or its approximation through x0 (``eps`` held fixed): of the
        classifier's log-probability (x0), or of the CLIP score 100 cos(image, prompt) (clip, ``labels`` the
        prompts)."""
        alpha, sigma = self._alpha_sigma(t, x)
        dtype = torch.promote_types(x.dtype, torch.float32)  # at least float32 (float64 stays, for checks)
        with torch.enable_grad():
            if self.mode == "noisy":
                inp = x.detach().to(dtype).requires_grad_(True)
                # a non-leaf input: torch's FLOP counter hooks module inputs and cannot see a leaf inside grad()
                logits = self.classifier(inp.clone(), torch.as_tensor(t, device=x.device).reshape(-1).expand(len(x)))
            else:
                inp = ((x.to(dtype) - sigma * eps.to(dtype)) / alpha).detach().requires_grad_(True)
                images = inp
                if self.vae is not None:  # decoded in the VAE's dtype; unclamped, so that every pixel steers
                    images = self.vae.decode(self.family.unscale_latents(inp).to(self.vae.dtype)).sample
                if self.mode == "clip":
                    from distill.models.clip import encode_images

                    model = self.classifier[0]
                    cos = (encode_images(model, images.to(model.dtype)) * self._text_embeddings(labels)).sum(-1)
                    logp = 100.0 * cos.to(dtype).sum()  # CLIPScore's scale (w = 100)
                else:
                    param = next(self.classifier.parameters())
                    logits = self.classifier(images.to(param.dtype))
            if self.mode != "clip":
                logp = torch.log_softmax(logits.to(dtype), dim=1).gather(1, labels.view(-1, 1)).sum()
            grad = torch.autograd.grad(logp, inp)[0]
        return grad if self.mode == "noisy" else grad / alpha

    def _text_embeddings(self, prompts: list[str]) -> torch.Tensor:
        """Unit-norm CLIP embeddings of ``prompts`` (cached for the last batch of prompts)."""
        from distill.models.clip import encode_text

        key = tuple(prompts)
        if self._text is None or self._text[0] != key:
            with torch.no_grad():
                self._text = key, encode_text(self.classifier[0], self.classifier[1], list(prompts))
        return self._text[1]

    def _alpha_sigma(self, t, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_t = alpha x0 + sigma eps at the network's timestep t: sqrt(abar), sqrt(1 - abar) on a VP schedule,
        1 - t, t on a flow one (t = timestep / num_train_timesteps)."""
        if self.flow:
            dtype = torch.promote_types(x.dtype, torch.float32)
            time = torch.tensor(self._flow_time(t), dtype=dtype, device=x.device)
            return 1 - time, time
        abar = self._abar(t, x)
        return abar.sqrt(), (1 - abar).sqrt()

    def _flow_time(self, t) -> float:
        return float(torch.as_tensor(t).reshape(-1)[0]) / self.family.schedule.num_train_timesteps

    def _abar(self, t, x: torch.Tensor) -> torch.Tensor:
        """abar at timestep t, linearly interpolated between integer timesteps (schedulers with fractional ones)."""
        t = float(torch.as_tensor(t).reshape(-1)[0])
        schedule = self.family.schedule  # abar at t = 0..T-1 (and the clean sample's 1 at T, left out here)
        table = schedule.abar[:schedule.num_train_timesteps].to(torch.float64)
        lo = min(int(t), len(table) - 1)
        hi, frac = min(lo + 1, len(table) - 1), t - lo
        value = table[lo] * (1 - frac) + table[hi] * frac
        return value.to(device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))

    def _cfg(self, guidance_scale: float | None) -> bool:
        """Whether this call's network batch holds CFG's two halves."""
        if guidance_scale is None and self.pipe is not None and hasattr(self.pipe, "_guidance_scale"):
            try:  # a user's pipe(prompt, guidance_scale=...) call: the pipeline knows
                return bool(self.pipe.do_classifier_free_guidance)
            except (AttributeError, TypeError):
                pass
        return (guidance_scale or 1.0) > 1.0

    def call(self, context, forward, *args, **kwargs):
        out = forward(*args, **kwargs)
        labels = self.fixed_labels if self.fixed_labels is not None else context.labels
        prompts = self.fixed_prompts if self.fixed_prompts is not None else context.prompts
        if self.scale == 0 or (prompts if self.mode == "clip" else labels) is None:
            return out
        x = call_input(args, kwargs)
        t = args[1] if len(args) > 1 else kwargs["timestep"]
        if self.flow and self._flow_time(t) >= 1.0:  # x_t = eps: no class to steer towards (see the docstring)
            return out
        guidance_scale = context.guidance_scale
        halves = 2 if self._cfg(guidance_scale) else 1
        if self.mode == "clip":  # every prompt steers (an empty one towards the empty caption)
            labels = torch.arange(len(prompts), device=x.device)  # indices into the prompts
        else:
            labels = labels.to(x.device)
        if len(x) % (halves * len(labels)):
            raise ValueError(f"{len(labels)} labels for a network batch of {len(x)}")
        # diffusers repeats each prompt's images next to each other (num_images_per_prompt)
        labels = labels.repeat_interleave(len(x) // (halves * len(labels)))
        guided = labels >= 0
        if not guided.any():
            return out
        pred = output_tensor(out)
        alpha, sigma = self._alpha_sigma(t, x)
        eps = flow.eps_from_velocity(pred.to(alpha.dtype), x.to(alpha.dtype), sigma) if self.flow else pred
        n = len(labels)
        x_one, eps_one = x[:n], eps[:n]  # under CFG both halves see the same x_t
        if halves == 2 and self.mode != "noisy":
            # x0 from the guided prediction the sampler will use: one term, added after CFG
            w = float(guidance_scale if guidance_scale is not None else self.pipe._guidance_scale)
            uncond, cond = (eps[:n], eps[n:]) if self.uncond_first else (eps[n:], eps[:n])
            eps_one = uncond + w * (cond - uncond)
        targets = [prompts[i] for i in labels.tolist()] if self.mode == "clip" else labels.clamp_min(0)
        grad = self.gradient(x_one, t, targets, eps_one)
        shift = sigma * self.scale * grad * guided.view(-1, 1, 1, 1)  # in eps form
        shift = shift.repeat(halves, 1, 1, 1)  # the same term on both halves: CFG keeps it once
        if self.flow:  # v = (eps - x_t) / (1 - t): flow.classifier_guided_velocity
            return like_output(out, (pred.float() - shift / alpha).to(pred.dtype))
        return like_output(out, (pred.float() - shift).to(pred.dtype))
