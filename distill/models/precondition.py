"""EDM preconditioning (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models",
table 1, "network and preconditioning") as a student wrapper: ``method.noise.preconditioning=edm``. It is the
network's parametrisation only; table 1's training rows (lambda(sigma), ln sigma ~ N(-1.2, 1.2^2)) are plain
diffusion's ``method.loss_weighting=edm`` (``distill.diffusion.losses.edm_loss_weight``).

The network F sees its input and noise level scaled to unit variance and learns an effective target of unit
variance; the denoiser is D(x; sigma) = c_skip(sigma) x + c_out(sigma) F(c_in(sigma) x; c_noise(sigma)) with
c_skip = sigma_data^2 / (sigma^2 + sigma_data^2), c_out = sigma sigma_data / sqrt(sigma^2 + sigma_data^2),
c_in = 1 / sqrt(sigma^2 + sigma_data^2) and c_noise = ln(sigma) / 4, here times 1000 (the timestep scale that
diffusers' UNets embed, as diffusers' CMStochasticIterativeScheduler passes it).

The wrapped UNet keeps the interface of the model it replaces: it takes a VP sample x_t = alpha_t x0 + sigma_t eps at
a (possibly fractional) timestep t of the teacher's noise schedule (sigma = sqrt((1 - abar_t) / abar_t) in the
VE view x = x_t / alpha_t) and returns the prediction type of that model (epsilon, v or x0), so that every loss,
scheduler and pipeline works unchanged, and its export loads through ``DiffusionPipeline.from_pretrained``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from diffusers import DDPMScheduler, ModelMixin, UNet2DConditionModel  # noqa: F401
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

from distill.diffusion.parametrization import PREDICTION_TYPES

# DiffusionPipeline.from_pretrained looks the loadable base classes (ModelMixin) up in the namespace of the module
# that model_index.json names, hence the import above.

SCHEDULE_KEYS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas",
                 "rescale_betas_zero_snr")


def edm_scalings(sigma: torch.Tensor, sigma_data: float) -> tuple[torch.Tensor, ...]:
    """(c_skip, c_out, c_in, c_noise) of EDM's preconditioning at noise level ``sigma`` (c_noise in timestep units:
    1000 ln(sigma) / 4)."""
    s2, d2 = sigma ** 2, sigma_data ** 2
    return d2 / (s2 + d2), sigma * sigma_data / (s2 + d2).sqrt(), 1 / (s2 + d2).sqrt(), 250.0 * sigma.log()


def edm_denoised(x: torch.Tensor, sigma: torch.Tensor, raw: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """D = c_skip x + c_out F for the VE sample x = x0 + sigma eps and the network output F (per-example sigma)."""
    c_skip, c_out, _, _ = edm_scalings(sigma, sigma_data)
    shape = (-1,) + (1,) * (x.ndim - 1)
    return c_skip.view(shape) * x + c_out.view(shape) * raw


def edm_raw_target(x: torch.Tensor, sigma: torch.Tensor, x0: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """The network output F that makes D exactly x0: (x0 - c_skip x) / c_out (EDM's effective training target)."""
    c_skip, c_out, _, _ = edm_scalings(sigma, sigma_data)
    shape = (-1,) + (1,) * (x.ndim - 1)
    return (x0 - c_skip.view(shape) * x) / c_out.view(shape)


class EDMPreconditionedUNet2DConditionModel(UNet2DConditionModel):
    """A ``UNet2DConditionModel`` run as EDM's F inside D (module docstring), presenting the VP interface of a
    model predicting ``edm_prediction_type``. The noise schedule (``edm_schedule``: the scheduler's betas) and
    ``edm_sigma_data`` are part of the config, so ``from_pretrained`` rebuilds the same function."""

    def __init__(self, *args, edm_schedule: Mapping | None = None, edm_sigma_data: float = 1.0,
                 edm_prediction_type: str = "epsilon", **kwargs):
        super().__init__(*args, **kwargs)  # registers the base UNet's config
        if edm_prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"edm_prediction_type={edm_prediction_type!r}; use one of {list(PREDICTION_TYPES)}")
        if edm_sigma_data <= 0:
            raise ValueError(f"method.noise.sigma_data={edm_sigma_data} must be > 0")
        schedule = {k: v for k, v in dict(edm_schedule or {}).items() if k in SCHEDULE_KEYS}
        self.register_to_config(edm_schedule=schedule, edm_sigma_data=edm_sigma_data,
                                edm_prediction_type=edm_prediction_type)
        abar = DDPMScheduler(**schedule).alphas_cumprod.double()
        if float(abar.min()) <= 0 or float(abar.max()) >= 1:
            raise ValueError("method.noise.preconditioning=edm needs 0 < alpha_bar < 1 at every timestep (finite "
                             "sigma); this schedule has zero terminal SNR (rescale_betas_zero_snr): set it to false "
                             "or method.noise.preconditioning=none")
        # float64, not a buffer: a module cast to bf16/fp16 keeps the noise levels exact (bf16 would err by ~1%)
        self._edm_log_sigmas = ((1 - abar) / abar).sqrt().log()
        self._edm_tables: dict = {}

    @classmethod
    def wrap(cls, unet: UNet2DConditionModel, schedule: Mapping, prediction_type: str,
             sigma_data: float) -> EDMPreconditionedUNet2DConditionModel:
        """``unet``'s architecture and weights (a fresh network: its function changes) as EDM's F."""
        if type(unet) is not UNet2DConditionModel:
            raise ValueError(f"method.noise.preconditioning=edm wraps a UNet2DConditionModel; the student is a "
                             f"{type(unet).__name__}: use student=fresh (or copy) or set method.noise.preconditioning=none")
        config = {k: v for k, v in dict(unet.config).items() if not k.startswith("_")}
        model = cls.from_config(config, edm_schedule=dict(schedule), edm_sigma_data=sigma_data,
                                edm_prediction_type=prediction_type)
        model.load_state_dict(unet.state_dict())
        if unet.is_gradient_checkpointing:
            model.enable_gradient_checkpointing()
        return model.to(device=unet.device, dtype=unet.dtype).train(unet.training)

    def edm_sigma(self, timestep: torch.Tensor) -> torch.Tensor:
        """sigma(t) of the schedule, log-linearly interpolated at fractional t (clamped to [0, T - 1]), in float64
        (float32 on a device without it)."""
        device = timestep.device
        if device not in self._edm_tables:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            self._edm_tables[device] = self._edm_log_sigmas.to(device=device, dtype=dtype)
        log_s = self._edm_tables[device]
        t = timestep.to(log_s.dtype).clamp(0, len(log_s) - 1)
        lo = t.floor().long().clamp(max=len(log_s) - 2)
        frac = (t - lo).to(log_s.dtype)
        return (log_s[lo] * (1 - frac) + log_s[lo + 1] * frac).exp()

    def forward(self, sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor, *args,
                return_dict: bool = True, **kwargs):
        n = sample.shape[0]
        t = torch.as_tensor(timestep, device=sample.device)
        t = t.expand(n) if t.ndim == 0 else t.reshape(-1).expand(n)
        sigma = self.edm_sigma(t).float()
        shape = (-1,) + (1,) * (sample.ndim - 1)
        alpha = (1 / (1 + sigma ** 2).sqrt()).view(shape)  # sqrt(abar)
        sigma_vp = (sigma.view(shape) * alpha)  # sqrt(1 - abar)
        x = sample.float() / alpha  # the VE view x0 + sigma eps
        sd = self.config.edm_sigma_data
        _, _, c_in, c_noise = edm_scalings(sigma, sd)
        raw = super().forward((c_in.view(shape) * x).to(sample.dtype), c_noise, encoder_hidden_states, *args,
                              return_dict=True, **kwargs).sample
        x0 = edm_denoised(x, sigma, raw.float(), sd)
        kind = self.config.edm_prediction_type
        if kind == "sample":
            out = x0
        else:
            eps = (x - x0) / sigma.view(shape)
            out = eps if kind == "epsilon" else alpha * eps - sigma_vp * x0
        out = out.to(sample.dtype)
        return UNet2DConditionOutput(sample=out) if return_dict else (out,)


# ConfigMixin.from_config passes the config keys that __init__'s signature names: the base UNet's and EDM's.
EDMPreconditionedUNet2DConditionModel.__init__.__signature__ = inspect.signature(UNet2DConditionModel.__init__).replace(
    parameters=[*inspect.signature(UNet2DConditionModel.__init__).parameters.values(),
                inspect.Parameter("edm_schedule", inspect.Parameter.KEYWORD_ONLY, default=None),
                inspect.Parameter("edm_sigma_data", inspect.Parameter.KEYWORD_ONLY, default=1.0),
                inspect.Parameter("edm_prediction_type", inspect.Parameter.KEYWORD_ONLY, default="epsilon")])
