"""Step forecasting: predict the denoiser's output on some steps from the outputs of the steps computed before,
and skip the network there (the "accelerate" method).

The network calls of a trajectory (``SamplingContext.num_calls``: one a step for first-order and multistep
schedulers, one more for PNDM's PLMS warm-up, only the steps run at img2img ``strength < 1``) are real (the
network runs) or predicted (it does not, and the sampling context records so), by a pattern: the first ``warmup`` and the last ``last`` calls are real, and
between them one call in ``interval`` (``interval=1``: every call is real, plain sampling); or an explicit list of
real calls. A second-order scheduler (Heun: two calls a step, at two points) is refused. Two predictors:

- ``taylor`` (training-free, TaylorSeer, Liu et al. 2025, applied to the whole output): a Taylor expansion in
  the call index about the last real call, its k-th derivative estimated by the k-th backward difference of the
  real outputs; computed by diffusers' ``TaylorSeerState`` (which diffusers applies to single modules of a
  transformer).
- ``fitted``: per predicted step k, ``out_k = sum_j a_kj * out_(r_j) + c_k * x_k``, a linear combination of the
  last ``lags`` real outputs and the current input, with scalar coefficients fitted by ridge regression on
  recorded teacher trajectories (``fit_forecaster``; ``python -m distill.fit_forecaster``), saved as
  ``forecaster.json`` next to the pipeline and looked up by scheduler, step count and pattern.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from diffusers.hooks.taylorseer_cache import TaylorSeerState

from distill.accelerate.base import (
    Accelerator,
    call_input,
    check_schedulers,
    like_output,
    output_tensor,
)
from distill.accelerate.registry import ACCELERATORS

PREDICTORS = ("taylor", "fitted")
FILE = "forecaster.json"


def real_steps(num_steps: int, interval: int = 2, warmup: int = 2, last: int = 1,
               steps: Sequence[int] | None = None) -> list[int]:
    """The steps (of ``num_steps``) on which the network runs; the others are predicted."""
    if steps is not None:
        return sorted({int(s) for s in steps if 0 <= int(s) < num_steps} | {0})
    real = set(range(min(warmup, num_steps))) | set(range(max(num_steps - last, 0), num_steps))
    real |= {k for k in range(warmup, num_steps) if (k - warmup) % interval == interval - 1} if interval > 1 \
        else set(range(num_steps))
    return sorted(real)


@dataclass
class StepFit:
    """Coefficients of one predicted step: on the last real outputs (oldest first) and on the input x."""
    lags: list[int]
    a: list[float]
    c: float
    residual: float = float("nan")  # relative RMS error on the fitting trajectories


@dataclass
class FittedForecaster:
    """Fitted coefficients for one (scheduler, steps, pattern, guidance scale); ``scheduler_class`` is the class
    the trajectories were recorded with (its timestep grid is what the coefficients know)."""
    scheduler: str
    num_steps: int
    real: list[int]
    guidance_scale: float = 1.0
    scheduler_class: str | None = None
    steps: dict[int, StepFit] = field(default_factory=dict)
    ridge: float = 1e-4
    trajectories: int = 0

    @property
    def key(self) -> str:
        return forecaster_key(self.scheduler, self.num_steps, self.real, self.guidance_scale)

    def predict(self, step: int, history: list[tuple[int, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
        fit = self.steps[step]
        outs = dict(history)
        pred = fit.c * x.float()
        for lag, a in zip(fit.lags, fit.a):
            pred = pred + a * outs[lag].float()
        return pred


def forecaster_key(scheduler: str, num_steps: int, real: Sequence[int], guidance_scale: float | None = 1.0) -> str:
    return f"{scheduler}/{num_steps}/" + ",".join(map(str, real)) + f"/cfg{float(guidance_scale or 1.0):g}"


def fit_step(outputs: torch.Tensor, inputs: torch.Tensor, step: int, lags: list[int], ridge: float) -> StepFit:
    """Ridge regression of ``outputs[:, step]`` on ``outputs[:, lags]`` and ``inputs[:, step]`` with scalar
    coefficients over every element; ``outputs`` / ``inputs`` are (trajectories, steps, ...) recordings."""
    target = outputs[:, step].double().flatten()
    design = torch.stack([outputs[:, j].double().flatten() for j in lags] + [inputs[:, step].double().flatten()], 1)
    gram = design.T @ design
    scale = gram.diagonal().mean()
    coef = torch.linalg.solve(gram + ridge * scale * torch.eye(gram.shape[0], dtype=gram.dtype), design.T @ target)
    residual = float((design @ coef - target).norm() / target.norm().clamp_min(1e-12))
    return StepFit(lags=list(lags), a=[float(v) for v in coef[:-1]], c=float(coef[-1]), residual=residual)


def fit_forecaster(outputs: torch.Tensor, inputs: torch.Tensor, scheduler: str, real: Sequence[int], lags: int = 2,
                   ridge: float = 1e-4, guidance_scale: float = 1.0, scheduler_class: str | None = None
                   ) -> FittedForecaster:
    """Fit every predicted step of pattern ``real`` on recorded trajectories (outputs and inputs, (n, steps, ...))."""
    if outputs.shape[:2] != inputs.shape[:2]:
        raise ValueError(f"outputs {tuple(outputs.shape)} and inputs {tuple(inputs.shape)} must be recorded "
                         "over the same trajectories and steps")
    if lags < 1:
        raise ValueError(f"lags={lags} must be >= 1 (real outputs a prediction combines)")
    num_steps, real = outputs.shape[1], sorted(real)
    fitted = FittedForecaster(scheduler, num_steps, list(real), float(guidance_scale or 1.0), scheduler_class,
                              ridge=ridge, trajectories=outputs.shape[0])
    for step in range(num_steps):
        if step in real:
            continue
        before = [r for r in real if r < step][-lags:]
        fitted.steps[step] = fit_step(outputs, inputs, step, before, ridge)
    return fitted


def save_forecasters(folder: str | Path, forecasters: Sequence[FittedForecaster]) -> Path:
    """Add ``forecasters`` to ``folder/forecaster.json`` (others kept), keyed by scheduler/steps/pattern."""
    path = Path(folder) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.is_file() else {}
    for f in forecasters:
        data[f.key] = asdict(f)
    path.write_text(json.dumps(data, indent=1))
    return path


def load_forecaster(folder: str | Path, scheduler: str, num_steps: int, real: Sequence[int],
                    guidance_scale: float | None = 1.0) -> FittedForecaster:
    path = Path(folder) / FILE
    key = forecaster_key(scheduler, num_steps, real, guidance_scale)
    data = json.loads(path.read_text()) if path.is_file() else {}
    if key not in data:
        raise FileNotFoundError(
            f"no fitted forecaster for {key} in {path}" + (f" (it has {sorted(data)})" if data else "") +
            f"; fit one: python -m distill.fit_forecaster pipeline={Path(folder)} scheduler={scheduler} "
            f"steps=[{num_steps}] guidance_scale={float(guidance_scale or 1.0):g} ...")
    raw = data[key]
    steps = {int(k): StepFit(**v) for k, v in raw.pop("steps").items()}
    return FittedForecaster(**raw, steps=steps)


def _refuse_second_order(order: int, name: str, calls: str = "") -> None:
    """A forecast extrapolates a trajectory's outputs call after call; a second-order scheduler's two calls a step
    evaluate two different points, so they are not one trajectory."""
    if order > 1:
        raise ValueError(f"accelerate=forecast predicts UNet calls one after another, but {name} is of order {order} "
                         f"({calls}two calls a step, at two points); use a first-order or multistep scheduler")


@ACCELERATORS.register("forecast")
class Forecast(Accelerator):
    """Skip the denoiser on the predicted steps of the pattern and return a forecast of its output instead:
    ``predictor=taylor`` (of ``order``) or ``fitted`` (coefficients from ``forecaster.json`` in ``path``,
    default the pipeline's folder, for the scheduler ``scheduler`` this is sampled with)."""

    name = "forecast"

    def __init__(self, predictor: str = "taylor", interval: int = 2, warmup: int = 2, last: int = 1,
                 steps: list[int] | None = None, order: int = 1, path: str | None = None,
                 scheduler: str | None = None, guidance_scale: float | None = None):
        if predictor not in PREDICTORS:
            raise ValueError(f"accelerate.options.predictor={predictor!r} is not one of {list(PREDICTORS)}")
        for key, value, low in (("interval", interval, 1), ("warmup", warmup, 1), ("last", last, 0), ("order", order, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"accelerate.options.{key}={value!r} must be an integer >= {low}")
        if predictor == "taylor" and steps is None and warmup < order + 1:
            raise ValueError(f"accelerate.options.warmup={warmup} is below order + 1 = {order + 1}: a Taylor "
                             "forecast of that order needs as many real steps first")
        self.predictor, self.interval, self.warmup, self.last = predictor, interval, warmup, last
        self.steps, self.order, self.path, self.scheduler = steps, order, path, scheduler
        self._given_scheduler, self.guidance_scale, self._given_guidance = scheduler, guidance_scale, guidance_scale
        self.fitted: FittedForecaster | None = None
        self._fits: dict[tuple, FittedForecaster] = {}
        self.num_inference_steps, self.real = None, None
        self.history: list[tuple[int, torch.Tensor]] = []
        self.taylor = None
        self.calls, self.key = 0, None

    def describe(self) -> str:
        pattern = f"steps={list(self.steps)}" if self.steps is not None else f"N={self.interval}"
        return f"forecast({self.predictor}{self.order if self.predictor == 'taylor' else ''},{pattern})"

    def check_scheduler(self, scheduler) -> None:
        _refuse_second_order(getattr(scheduler, "order", 1), scheduler.__name__ if isinstance(scheduler, type)
                             else type(scheduler).__name__)

    def check(self, scheduler: str, num_steps: int, guidance_scale: float | None) -> None:
        """Fail now if the scheduler is second-order, or a fitted forecaster has no coefficients for this call
        (before any sampling)."""
        check_schedulers(self, [scheduler])
        if self.predictor == "fitted":
            if self.path is None:
                raise ValueError("accelerate.options.predictor=fitted needs the forecaster's folder: set "
                                 "accelerate.options.path=... (distill.evaluate passes the pipeline's)")
            self._coefficients(self._given_scheduler or scheduler, num_steps,
                               self._given_guidance if self._given_guidance is not None else guidance_scale)

    def _coefficients(self, scheduler: str, num_steps: int, guidance_scale: float | None) -> FittedForecaster:
        """The fitted coefficients for this call, read from forecaster.json once per (scheduler, steps, guidance)."""
        key = (scheduler, num_steps, guidance_scale)
        if key not in self._fits:
            self._fits[key] = load_forecaster(self.path, scheduler, num_steps, self.pattern(num_steps), guidance_scale)
        return self._fits[key]

    def pattern(self, num_steps: int) -> list[int]:
        return real_steps(num_steps, self.interval, self.warmup, self.last, self.steps)

    def begin(self, context, num_calls: int | None) -> None:
        super().begin(context, num_calls)
        num_inference_steps, sampler = self.num_inference_steps, context.scheduler
        # the options name the scheduler and guidance the coefficients were fitted for, else the caller does
        self.scheduler = self._given_scheduler or context.scheduler_name
        self.guidance_scale = self._given_guidance if self._given_guidance is not None else context.guidance_scale
        if num_inference_steps:
            _refuse_second_order(context.order, type(sampler).__name__ if sampler is not None else "the scheduler",
                                 f"it calls the UNet {self.num_calls} times for {num_inference_steps} steps: ")
        self.real = set(self.pattern(self.num_calls)) if self.num_calls else None
        self.history, self.calls, self.key = [], 0, None
        self.position, self.last_timestep = -1, None
        self.taylor = (TaylorSeerState(taylor_factors_dtype=torch.float32, max_order=self.order)
                       if self.predictor == "taylor" else None)
        if self.predictor == "fitted" and num_inference_steps:
            if self.path is None or self.scheduler is None:
                raise ValueError("accelerate.options.predictor=fitted needs the forecaster's folder and scheduler "
                                 "(distill.evaluate passes the pipeline's; set accelerate.options.path=...)")
            scheduled = getattr(sampler, "num_inference_steps", None)
            if self.num_calls != num_inference_steps or scheduled not in (None, num_inference_steps):
                raise ValueError(f"accelerate.options.predictor=fitted has coefficients for whole trajectories of one "
                                 f"call a step, but this call makes {self.num_calls} UNet calls for "
                                 f"{num_inference_steps} steps" + (f" of {scheduled}" if scheduled else "") +
                                 " (PNDM's warm-up call, or img2img at strength < 1); use predictor=taylor")
            self.fitted = self._coefficients(self.scheduler, num_inference_steps, self.guidance_scale)
            used = type(sampler).__name__ if sampler is not None else None
            if used is not None and self.fitted.scheduler_class not in (None, used):
                raise ValueError(f"the forecaster for {self.fitted.key} was fitted on {self.fitted.scheduler_class} "
                                 f"trajectories, but the pipeline samples with {used}; fit it again for this one")

    def passed_calls(self, num_calls: int | None) -> int | None:
        return len(self.real) if self.real is not None else num_calls

    def _advance(self, timestep) -> int:
        """The index of this call's timestep among the distinct timesteps so far: a Taylor forecast extrapolates
        along the trajectory's time, and PLMS's warm-up calls the UNet twice at one timestep (PNDM: 900, 800, 800,
        700, ...), so that call index is not the time axis."""
        t = float(timestep.flatten()[0]) if torch.is_tensor(timestep) else timestep
        if t is None or t != self.last_timestep:
            self.position += 1
        self.last_timestep = t
        return self.position

    def call(self, context, forward, *args, **kwargs):
        sample = call_input(args, kwargs)
        key = (tuple(sample.shape), sample.dtype)
        step, self.calls = self.calls, self.calls + 1
        position = self._advance(args[1] if len(args) > 1 else kwargs.get("timestep"))
        # after a real call of the same batch (TaylorSeer lowers the order while fewer real outputs exist)
        predict = self.real is not None and step not in self.real and self.key == key
        if predict:  # no network runs: the context records the call as predicted
            if self.predictor == "taylor":
                self.taylor.current_step = position  # at a repeated timestep: the last real output itself
                pred = self.taylor.predict()[0]
            else:
                pred = self.fitted.predict(step, self.history, sample)
            return like_output(self._template, pred.to(output_tensor(self._template).dtype))
        out = forward(*args, **kwargs)
        self.key, self._template = key, out
        tensor = output_tensor(out).detach()
        if self.predictor == "fitted":
            self.history.append((step, tensor))  # the real outputs of this trajectory (what the lags index)
        elif self.taylor.last_update_step != position:  # a second real output at one timestep adds no slope
            self.taylor.current_step = position
            self.taylor.update((tensor,))
        return out
