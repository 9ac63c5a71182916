"""The generation engine behind ``distill.serve``: dynamic batching, pipelined stages and stream batching for
any text-to-image pipeline of a registered model family (SD, SDXL, SD3, Flux: a teacher, or an LCM, progressive, MoE
or compressed student, with or without a training-free accelerator). Every stage goes through the family
(``distill.families``): the prompts through ``condition`` / ``null_condition``, the timesteps through
``set_timesteps`` (Flux's resolution shift), stream mode's initial noise through ``latent_shape`` and its network
calls through ``denoise_at`` (with ``guidance_input``: Flux's guidance embedding), a pipeline call's latents through
``call_latents`` (Flux's unpacked), and the latents through ``decode`` (with the VAE's ``shift_factor`` where it has
one).

A request (a :class:`Job`: prompts, seeds, steps, guidance, size, scheduler) passes three stages, each a
batch at a time: text encoding, denoising, VAE decoding (+ PNG encoding). ``mode`` chooses how:

- ``sequential``: one job at a time, the three stages one after another (the baseline);
- ``batch``: dynamic batching: jobs that can share one pipeline call (same size, steps, guidance and
  scheduler) wait up to ``max_wait_ms`` to fill ``max_batch_size`` images; the stages run one after another;
- ``pipeline``: the same batches, each stage in its own thread, connected by bounded queues, so that batch
  i+1 is encoded and batch i-1 decoded while batch i denoises (on a GPU each stage runs on its own CUDA stream);
- ``stream``: pipelined stages, and the denoiser batches *steps*, not requests (StreamDiffusion's stream batch,
  Kodaira et al. 2023, the continuous batching of LLM servers): every denoiser call advances each active job
  by one step of its own scheduler, so jobs that arrived at different times, with different step counts,
  guidance scales or schedulers share one network batch, and a finished job leaves at once while a new one joins.

Every image's noise comes from its own ``torch.Generator`` seeded with its seed (the initial latents and any
noise a stochastic scheduler draws), so an image depends on its seed and request, not on what it was
batched with. Modes ``sequential``/``batch``/``pipeline`` call the pipeline itself (``output_type="latent"``)
with the encoded prompts (``pipeline_call_inputs``: SDXL's and SD3's pooled embeddings too): its own loop, hooks and
accelerators. ``stream`` runs the loop of the family's pipeline ``__call__`` per job (scale input, network,
classifier-free guidance or the guidance embedding, scheduler step), batched across jobs.

Backpressure: at most ``queue_size`` jobs are held at once, waiting or in a stage (:class:`QueueFull` beyond it,
the HTTP layer's 429), so memory is bounded under any load and an overload is refused at the door rather than
left to expire inside the stages; stage queues hold ``stage_queue_size`` batches. A job past its deadline, or whose future was
cancelled, is dropped at the next stage boundary (or denoising step, in stream mode) with
:class:`DeadlineExceeded`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from distill.families import denoiser_of, family_of, native_size

log = logging.getLogger(__name__)

# the serving modes, typed so that the config schema makes engine.mode a fixed set of choices from this signature
Mode = Literal["sequential", "batch", "pipeline", "stream"]
MODES = get_args(Mode)
# admitted only when expected to finish within this share of the deadline: the estimate is a mean, and jobs finish
# in waves of a batch, so one that the estimate puts at the end of a wave may land in the next
ADMIT_SHARE = 0.9
STAGES = ("encode", "denoise", "decode")


class QueueFull(RuntimeError):
    """The engine holds ``queue_size`` jobs, or more work than it can finish before the request's deadline: retry
    after ``retry_after`` seconds."""

    def __init__(self, depth: int, retry_after: float, reason: str | None = None):
        reason = reason or f"{depth} requests are held (engine.queue_size)"
        super().__init__(f"{reason}; retry after {math.ceil(retry_after)} s")
        self.retry_after = retry_after


class DeadlineExceeded(TimeoutError):
    """The job's deadline passed before it finished; its remaining work was dropped."""


class Draining(RuntimeError):
    """The engine is shutting down: it finishes the jobs it holds and takes no new ones."""


@dataclass(eq=False)  # identity, not field equality: queues remove jobs by identity
class Job:
    """One request: ``len(prompts)`` images, image i from seed ``seeds[i]``."""

    prompts: list[str]
    seeds: list[int]
    steps: int
    guidance_scale: float
    height: int
    width: int
    scheduler: str | None = None  # a distill.inference.schedulers name; None: the pipeline's own
    timeout_s: float | None = None
    future: Future = field(default_factory=Future)
    id: int = 0
    submitted: float = 0.0
    deadline: float = float("inf")
    # filled by the stages
    embeds: dict | None = None  # the family's condition of the prompts (the network's keyword arguments)
    latents: torch.Tensor | None = None
    timings: dict = field(default_factory=dict)  # stage -> seconds of the batch the job was in
    batch_sizes: dict = field(default_factory=dict)  # stage -> images in that batch (denoise: largest)
    # stream denoising state
    sched: object = None
    timesteps: torch.Tensor | None = None
    index: int = 0
    cfg: bool = False
    step_kwargs: dict = field(default_factory=dict)
    timestep_cond: torch.Tensor | None = None  # the guidance embedding of an LCM-style student
    png: list[bytes] = field(default_factory=list)
    stage: str = "queued"  # queued, then each of STAGES while in it, then done
    rows: int = 1  # network rows per image and step (2 with classifier-free guidance)
    calls: int = 0  # network calls of the trajectory (steps, or more for a second-order scheduler); index counts them
    area: float = 1.0  # pixels per image relative to the model's native size (a network call's cost scales with it)

    @property
    def n(self) -> int:
        return len(self.prompts)

    @property
    def step(self) -> int:
        """Denoising steps done, of ``steps``."""
        return self.index * self.steps // max(self.calls or self.steps, 1)

    @property
    def units(self) -> float:
        """What one network call costs for this job, in native-size rows: rows per image (2 with guidance) x images x
        relative area."""
        return self.rows * self.n * self.area

    def calls_left(self) -> int:
        return 0 if self.stage in ("decode", "done") else max((self.calls or self.steps) - self.index, 0)

    def batch_key(self) -> tuple:
        """Jobs with equal keys can share one pipeline call."""
        return (self.height, self.width, self.steps, float(self.guidance_scale), self.scheduler)

    def size_key(self) -> tuple:
        return (self.height, self.width)

    def dead(self, now: float | None = None) -> bool:
        return self.future.done() or (now or time.monotonic()) > self.deadline


@dataclass
class Result:
    """What a finished job returns: one PNG per prompt and where its time went."""

    png: list[bytes]
    seeds: list[int]
    latency_s: float
    timings: dict
    batch_sizes: dict


def _is_text(prompt: str) -> bool:
    """Whether ``prompt`` is encodable text (JSON's \\ud800 escapes decode to lone surrogates, which are not)."""
    try:
        prompt.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _settle(job: Job, result=None, error: BaseException | None = None) -> bool:
    """Resolve the job's future unless the caller cancelled it (a late result is dropped); True if resolved."""
    try:
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)
        return True
    except InvalidStateError:
        return False


class JobQueue:
    """The bounded queue in front of the first stage; takes batches of compatible jobs in arrival order."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.items: deque[Job] = deque()
        self.cond = threading.Condition()

    def __len__(self) -> int:
        return len(self.items)

    def put(self, job: Job, retry_after: float) -> None:
        with self.cond:
            if len(self.items) >= self.maxsize:
                raise QueueFull(len(self.items), retry_after)
            self.items.append(job)
            self.cond.notify_all()

    def take(self, key: Callable[[Job], tuple] | None, max_images: int, max_wait: float,
             stop: threading.Event, poll: float = 0.05) -> list[Job]:
        """The oldest job and, waiting at most ``max_wait`` seconds for them, younger jobs of its key (``None``:
        any) in arrival order up to ``max_images`` images; [] when ``stop`` is set and nothing waits."""
        with self.cond:
            while not self.items:
                if stop.is_set():
                    return []
                self.cond.wait(poll)
            first = self.items.popleft()
            batch, images = [first], first.n
            want = None if key is None else key(first)
            deadline = time.monotonic() + max_wait
            while images < max_images:
                for job in list(self.items):
                    if want is not None and key(job) != want:
                        continue  # another batch's job
                    if images + job.n > max_images:
                        break  # no younger job of this key overtakes it: arrival order is kept
                    self.items.remove(job)
                    batch.append(job)
                    images += job.n
                left = deadline - time.monotonic()
                if images >= max_images or left <= 0:
                    break
                self.cond.wait(left)
            return batch


class Engine:
    """Serves generation requests on ``pipe``, a text-to-image pipeline of a registered model family (an export of
    any distill method, or diffusers' own StableDiffusion, StableDiffusionXL, StableDiffusion3 or Flux pipeline).

    ``max_batch_size``: images per batch (and per request); ``max_wait_ms``: how long a batch waits to fill;
    ``queue_size``: jobs held at once (waiting or in a stage) before :meth:`submit` raises :class:`QueueFull`;
    ``stage_queue_size``:
    batches between two stages; ``timeout_s``: a request's deadline unless it sets its own; ``max_steps``:
    the largest step count a request may ask for; ``max_prompt_chars``: the longest prompt, in characters (checked
    before any tokenisation; the tokenizer then truncates to the text encoder's length); ``stall_s``: how long a
    stage may go without progress (a denoising step, a finished batch) before :meth:`health` reports it.
    ``scheduler``, ``steps`` and ``guidance_scale`` are the
    defaults of a request that leaves them out (the entry point takes them from the export's distill.json;
    ``scheduler=None``: the pipeline's own); ``own_scheduler`` is the name the export's own scheduler answers to
    (its class and config are kept for it, e.g. a progressive student's grid DDIM); ``scheduler_options`` maps a
    scheduler name to its ``from_config`` options (default: the package's ``conf/scheduler/<name>.yaml``).
    ``accelerator``: a training-free accelerator (``distill.accelerate``) on every pipeline call; it keeps
    per-trajectory state, so it cannot run in ``stream`` mode.
    """

    def __init__(self, pipe, *, steps: int, guidance_scale: float, scheduler: str | None = None,
                 own_scheduler: str | None = None, scheduler_options: dict[str, dict] | None = None,
                 mode: Mode = "stream", max_batch_size: int = 8,
                 max_wait_ms: float = 10.0, queue_size: int = 64, stage_queue_size: int = 2, timeout_s: float = 120.0,
                 max_steps: int = 100, max_prompt_chars: int = 2000, stall_s: float = 60.0, accelerator=None,
                 metrics=None):
        from distill.inference.schedulers import SCHEDULERS

        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is unknown; use one of {list(MODES)}")
        for name, value, low in (("max_batch_size", max_batch_size, 1), ("queue_size", queue_size, 1),
                                 ("stage_queue_size", stage_queue_size, 1), ("max_steps", max_steps, 1),
                                 ("max_prompt_chars", max_prompt_chars, 1)):
            if value < low:
                raise ValueError(f"{name}={value} must be >= {low}")
        if max_wait_ms < 0 or timeout_s <= 0 or stall_s <= 0:
            raise ValueError(f"max_wait_ms={max_wait_ms} must be >= 0, timeout_s={timeout_s} and stall_s={stall_s} > 0")
        if scheduler is not None and scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={scheduler!r} is unknown; use one of {sorted(SCHEDULERS)}")
        if not 1 <= steps <= max_steps:
            raise ValueError(f"steps={steps} must lie in [1, max_steps={max_steps}]")
        if accelerator is not None and getattr(accelerator, "needs_labels", False):
            raise ValueError(f"accelerate={accelerator.describe()} guides towards class labels, which a served request "
                             "does not carry; give accelerate.options.labels, or use mode=clip (guidance by the prompt)")
        if mode == "stream" and accelerator is not None:
            raise ValueError(f"accelerate={accelerator.describe()} keeps state along one trajectory, and mode=stream "
                             "batches jobs at different steps; use mode=pipeline (or batch) with an accelerator")
        for name in ("encode_prompt", "vae", "scheduler", "image_processor"):  # the denoiser: denoiser_of, below
            if not hasattr(pipe, name):
                raise ValueError(f"{type(pipe).__name__} has no {name}: distill.serve serves text-to-image pipelines "
                                 "(encode_prompt, a denoiser, vae, scheduler) of a registered model family")
        self.pipe, self.mode = pipe, mode
        self.max_batch_size, self.max_wait = max_batch_size, max_wait_ms / 1e3
        self.timeout_s, self.max_steps = timeout_s, max_steps
        self.max_prompt_chars, self.stall_s = max_prompt_chars, stall_s
        self.default_scheduler, self.default_steps, self.default_guidance = scheduler, steps, guidance_scale
        self.own_name = own_scheduler
        self.scheduler_options = dict(scheduler_options or {})
        self._streams: dict[str, torch.cuda.Stream] = {}
        self.accelerator = accelerator
        # the prompts, the network call and the decoding go through the pipeline's family: no prompt cache (a server
        # sees unboundedly many prompts), except in the family that makes only the null condition (one prompt, "")
        self.family = family_of(pipe).from_pipeline(pipe, cache_prompts=False)
        self.null_family = family_of(pipe).from_pipeline(pipe, cache_prompts=True)
        self.denoiser = denoiser_of(pipe)  # the family's network (the UNet of a UNet family)
        self.device = self.denoiser.device
        self.factor = pipe.vae_scale_factor  # pixels per latent
        self.multiple = self.family.size_multiple(pipe)  # the VAE factor x a transformer's patches (SD3, Flux: 2)
        self.native = native_size(pipe)
        self.own_scheduler = (type(pipe.scheduler), pipe.scheduler.config)
        if accelerator is not None:  # the default scheduler must work with it before anything is computed
            accelerator.check_scheduler(self.scheduler_for(scheduler))
        pipe.set_progress_bar_config(disable=True)
        self.metrics = metrics
        self.queue = JobQueue(queue_size)
        self.queue_size = queue_size
        self.stage_queue_size = stage_queue_size
        self.stop = threading.Event()
        self.accepting = True
        self.inflight = 0
        self.jobs: set[Job] = set()  # accepted and not yet settled
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.ids = itertools.count(1)
        self._calls_seen: deque[tuple[float, float]] = deque(maxlen=64)  # (native-size rows, seconds) per call
        self._image_s: dict[str, float] = {}  # encode, decode -> running mean of seconds per image
        self._working: dict[str, float] = {}  # stage -> when its current call last made progress
        self.threads: list[threading.Thread] = []
        self._step_limits: dict[tuple, str | None] = {}
        self._calls: dict[tuple, int] = {}  # (scheduler, steps) -> network calls of the trajectory
        self.sampling = None  # the accelerator's sampling context (distill.accelerate), updated per call
        if accelerator is not None:
            from distill.accelerate import enable

            self.sampling = enable(pipe, accelerator)
        self._start()

    # ---------------------------------------------------------------- requests

    def needs_cfg(self, guidance_scale: float) -> bool:
        """Whether a call at this guidance runs classifier-free guidance (two network rows per image), as the
        pipeline decides: guidance > 1, the family guides so (not Flux, whose network takes guidance as an input), and
        the network neither takes guidance as an input nor distilled it."""
        return (guidance_scale > 1 and self.family.classifier_free_guidance
                and self.denoiser.config.get("time_cond_proj_dim") is None
                and not getattr(self.pipe.config, "guidance_distilled", False))

    def check(self, prompts: list[str], steps: int | None, guidance_scale: float | None, height: int | None,
              width: int | None, scheduler: str | None, timeout_s: float | None) -> list[tuple[str, str]]:
        """(field, message) of every invalid value of a request; [] when it can run."""
        from distill.inference.schedulers import SCHEDULERS

        errors = []
        if not prompts:
            errors.append(("prompt", "give a prompt (a non-empty string or list of strings)"))
        elif any(not isinstance(p, str) or not p.strip() for p in prompts):
            errors.append(("prompt", "every prompt must be a non-empty string"))
        elif any(len(p) > self.max_prompt_chars for p in prompts):
            longest = max(len(p) for p in prompts)
            errors.append(("prompt", f"a prompt of {longest} characters: at most engine.max_prompt_chars="
                                     f"{self.max_prompt_chars}"))
        elif not all(_is_text(p) for p in prompts):
            errors.append(("prompt", "a prompt holds a lone surrogate (e.g. \\ud800), which is not text: send UTF-8"))
        elif len(prompts) > self.max_batch_size:
            errors.append(("prompt", f"{len(prompts)} prompts: at most max_batch_size={self.max_batch_size} a request"))
        if steps is not None and not 1 <= steps <= self.max_steps:
            errors.append(("steps", f"steps={steps} must lie in [1, {self.max_steps}]"))
        if guidance_scale is not None and not 0 <= guidance_scale <= 50:
            errors.append(("guidance_scale", f"guidance_scale={guidance_scale} must lie in [0, 50]"))
        for name, value in (("height", height), ("width", width)):
            if value is not None and (value % self.multiple or not self.multiple <= value <= 4 * self.native):
                what = "VAE factor" if self.multiple == self.factor else "VAE factor x patch size"
                errors.append((name, f"{name}={value} must be a multiple of the {what} {self.multiple} in "
                                     f"[{self.multiple}, {4 * self.native}] (this model's native size is {self.native})"))
        if scheduler is not None and scheduler not in SCHEDULERS:
            errors.append(("scheduler", f"scheduler={scheduler!r} is unknown; use one of {sorted(SCHEDULERS)}"))
        elif steps is not None and 1 <= steps <= self.max_steps:
            limit = self.step_limit(scheduler or self.default_scheduler, steps)
            if limit:
                errors.append(("steps", f"steps={steps}: {limit}"))
        if self.accelerator is not None and (scheduler is None or scheduler in SCHEDULERS):
            try:  # e.g. a forecast with a second-order scheduler
                self.accelerator.check_scheduler(self.scheduler_for(scheduler or self.default_scheduler))
            except ValueError as err:
                errors.append(("scheduler", str(err)))
        if timeout_s is not None and not 0 < timeout_s <= self.timeout_s:
            errors.append(("timeout_s", f"timeout_s={timeout_s} must lie in (0, {self.timeout_s}] (engine.timeout_s)"))
        return errors

    def step_limit(self, scheduler: str | None, steps: int) -> str | None:
        """Why ``scheduler`` cannot take ``steps`` (e.g. LCM's limit of its training grid), else None."""
        key = (scheduler, steps)
        if key not in self._step_limits:
            try:
                self._set_timesteps(self.scheduler_for(scheduler), steps, self.native, self.native, "cpu")
                self._step_limits[key] = None
            except Exception as err:  # noqa: BLE001 - the scheduler's own message names the limit
                self._step_limits[key] = f"{scheduler or 'the pipeline scheduler'} refuses it ({err})"
        return self._step_limits[key]

    def job(self, prompts: list[str], seed: int, steps: int | None = None, guidance_scale: float | None = None,
            height: int | None = None, width: int | None = None, scheduler: str | None = None,
            timeout_s: float | None = None) -> Job:
        """A job with this engine's defaults for what the request leaves out; image i takes seed ``seed + i``."""
        errors = self.check(prompts, steps, guidance_scale, height, width, scheduler, timeout_s)
        if errors:
            raise ValueError("; ".join(message for _, message in errors))
        scheduler = scheduler or self.default_scheduler
        guidance = self.default_guidance if guidance_scale is None else float(guidance_scale)
        steps, height, width = steps or self.default_steps, height or self.native, width or self.native
        scheduler = None if scheduler == self.own_name else scheduler
        return Job(list(prompts), [seed + i for i in range(len(prompts))], steps, guidance, height, width, scheduler,
                   timeout_s or self.timeout_s, rows=2 if self.needs_cfg(guidance) else 1,
                   calls=self.calls_for(scheduler, steps), area=height * width / self.native ** 2)

    def calls_for(self, scheduler: str | None, steps: int) -> int:
        """Network calls of a trajectory of ``steps`` with ``scheduler`` (more than steps for a second-order one)."""
        key = (scheduler, steps)
        if key not in self._calls:
            sched = self.scheduler_for(scheduler)
            self._set_timesteps(sched, steps, self.native, self.native, "cpu")
            self._calls[key] = len(sched.timesteps)
        return self._calls[key]

    def _set_timesteps(self, sched, steps: int, height: int, width: int, device) -> None:
        """``sched``'s timesteps for ``steps`` at an image of ``height`` x ``width`` pixels, as the family's pipeline
        sets them (Flux: sigmas shifted by the resolution's mu)."""
        self.family.set_timesteps(sched, steps, height // self.factor, width // self.factor, device)

    def submit(self, job: Job) -> Future:
        """Queue ``job``; its future resolves to a :class:`Result`, or raises :class:`DeadlineExceeded` (or the
        error of its batch). Raises :class:`QueueFull` or :class:`Draining` at once: QueueFull also when it is not
        expected to finish within ADMIT_SHARE of its deadline (:meth:`expected_seconds`), so
        that what would expire inside the stages is refused at the door instead."""
        timeout = job.timeout_s or self.timeout_s
        with self.lock:  # against close(): a job is either refused or counted before the drain waits
            if not self.accepting:
                raise Draining("the service is shutting down")
            if self.inflight >= self.queue_size:  # admission control: waiting and in a stage count alike
                raise QueueFull(self.inflight, self.retry_after())
            expected = self.expected_seconds(job)
            if expected is not None and expected > ADMIT_SHARE * timeout:
                raise QueueFull(self.inflight, max(1.0, expected - ADMIT_SHARE * timeout), (
                    f"with the {self.inflight} requests held, this one would take {expected:.1f} s at the measured "
                    f"rate, more than {ADMIT_SHARE:.0%} of its timeout_s={timeout:g}"))
            self.inflight += 1
            self.jobs.add(job)
        job.id, job.submitted = next(self.ids), time.monotonic()
        job.deadline = job.submitted + timeout
        job.future.add_done_callback(lambda _: self._done(job))
        try:
            self.queue.put(job, self.retry_after())
        except QueueFull:
            _settle(job, error=Draining("not queued"))  # releases the in-flight count; the caller sees QueueFull
            raise
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self.queue))
        return job.future

    def call_seconds(self, units: float) -> float | None:
        """The measured time of one denoising call of ``units`` native-size rows: a least-squares line
        a + b * units through the last 64 calls (None before 3 of them)."""
        calls = list(self._calls_seen)
        if len(calls) < 3:
            return None
        xs, ys = [u for u, _ in calls], [t for _, t in calls]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
        if var == 0 or b <= 0:  # one size seen (or noise): proportional to the rows
            return my / mx * units
        a = max(my - b * mx, 0.0)
        return a + b * units

    def expected_seconds(self, job: Job) -> float | None:
        """How long ``job`` would take if admitted now, from the measured cost of a denoising call
        (:meth:`call_seconds`) and of encoding and decoding an image; None before they are measured.

        Stream mode: the job joins the active jobs once they leave room for its images (the soonest to finish
        leave first), then takes its own calls in batches as large as the jobs held make them. Other modes:
        the batches of the jobs held ahead (grouped by batch key) run one after another, then its own."""
        if self.call_seconds(1.0) is None or not self._image_s:
            return None
        held = [other for other in self.jobs if other.stage != "done"]
        per_image = sum(self._image_s.values())  # encoding and decoding one image
        if self.mode == "stream":
            active = [other for other in held if other.stage == "denoise"]
            ahead = [other for other in held if other.stage in ("queued", "encode")]
            images = sum(o.n for o in active + ahead) + job.n
            units = sum(o.units for o in active + ahead) + job.units
            if images > self.max_batch_size:
                units *= self.max_batch_size / images  # a call carries at most max_batch_size images
            per_call = self.call_seconds(units)
            wait, overflow = 0.0, images - self.max_batch_size
            if overflow > 0:  # wait until enough active jobs have finished, soonest first
                freed = 0
                for left, n in sorted((o.calls_left(), o.n) for o in active):
                    freed += n
                    wait = left * per_call
                    if freed >= overflow:
                        break
                else:  # jobs ahead of it still fill the room: a trajectory of theirs per batch of them
                    mean_calls = sum(o.calls_left() for o in ahead) / max(len(ahead), 1)
                    wait += math.ceil((overflow - freed) / self.max_batch_size) * mean_calls * per_call
            # the stages share the machine: the encoding and decoding of the jobs ahead take their time too
            return wait + job.calls_left() * per_call + per_image * (job.n + sum(o.n for o in ahead))
        groups: dict[tuple, list[Job]] = {}
        for other in [*held, job]:
            groups.setdefault(id(other) if self.mode == "sequential" else other.batch_key(), []).append(other)
        seconds = 0.0
        for members in groups.values():
            batches = math.ceil(sum(o.n for o in members) / self.max_batch_size)
            units = sum(o.units for o in members) / batches
            seconds += batches * max(o.calls_left() for o in members) * self.call_seconds(units)
        return seconds + per_image * (job.n + sum(o.n for o in held))

    def retry_after(self) -> float:
        """Seconds until the queue has room for a request: the time of a full batch of default requests at the
        measured cost (at least 1)."""
        per_call = self.call_seconds(float(self.max_batch_size))
        if per_call is None:
            return 1.0
        return max(1.0, self.calls_for(self.default_scheduler if self.default_scheduler != self.own_name else None,
                                       self.default_steps) * per_call)

    def _done(self, job: Job) -> None:
        with self.lock:
            self.inflight -= 1
            self.jobs.discard(job)
            self.idle.notify_all()

    def begin_drain(self) -> None:
        """Stop taking jobs (:meth:`submit` raises :class:`Draining`); the ones held go on."""
        with self.lock:
            self.accepting = False

    def close(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop taking jobs; with ``drain``, finish the ones held in at most ``timeout`` seconds, then settle what
        is left with :class:`Draining` (as without ``drain`` at once). True when every job finished in time."""
        self.begin_drain()
        with self.lock:
            settled = not drain or self.idle.wait_for(lambda: self.inflight == 0, timeout)
            held = list(self.jobs)
        for job in held:
            _settle(job, error=Draining(f"the service stopped before request {job.id} finished"))
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)
        if any(thread.is_alive() for thread in self.threads):
            log.warning("a stage is still busy after the drain; the pipeline is left as it is")
            return False
        if self.accelerator is not None:
            from distill.accelerate import disable

            disable(self.pipe)
        cls, config = self.own_scheduler
        self.pipe.scheduler = cls.from_config(config)  # as it was before any request chose another
        return settled

    def health(self) -> tuple[bool, str | None]:
        """(True, None) when every stage thread runs and none has gone ``stall_s`` seconds without progress;
        else (False, what is wrong, naming the stage)."""
        for thread in self.threads:
            if not thread.is_alive():
                return False, f"stage thread {thread.name} stopped"
        now = time.monotonic()
        for stage, since in list(self._working.items()):
            if now - since > self.stall_s:
                return False, f"stage {stage} has made no progress for {now - since:.0f} s (engine.stall_s={self.stall_s:g})"
        return True, None

    # ---------------------------------------------------------------- stages

    def _start(self) -> None:
        import queue

        if self.mode in ("sequential", "batch"):
            self.threads = [threading.Thread(target=self._serial, name="distill-serve", daemon=True)]
        else:
            q1, q2 = queue.Queue(self.stage_queue_size), queue.Queue(self.stage_queue_size)
            denoise = self._stream_denoiser if self.mode == "stream" else self._denoiser
            self.threads = [threading.Thread(target=self._encoder, args=(q1,), name="distill-encode", daemon=True),
                            threading.Thread(target=denoise, args=(q1, q2), name="distill-denoise", daemon=True),
                            threading.Thread(target=self._decoder, args=(q2,), name="distill-decode", daemon=True)]
        for thread in self.threads:
            thread.start()

    def _take(self) -> list[Job]:
        if self.mode == "sequential":
            return self.queue.take(None, 1, 0.0, self.stop)
        # stream: any jobs, in arrival order (the encoder groups by size within a batch): taking the oldest job's
        # size only would let younger jobs of the common size overtake one of another size at every batch
        key = None if self.mode == "stream" else Job.batch_key
        batch = self.queue.take(key, self.max_batch_size, self.max_wait, self.stop)
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self.queue))
        return batch

    def _live(self, jobs: list[Job]) -> list[Job]:
        """The jobs still wanted; the others are settled with DeadlineExceeded (or were cancelled)."""
        now, out = time.monotonic(), []
        for job in jobs:
            if job.dead(now):
                _settle(job, error=DeadlineExceeded(f"request {job.id} passed its deadline of {job.timeout_s} s"))
                if self.metrics is not None:
                    self.metrics.dropped.inc()
            else:
                out.append(job)
        return out

    def _timed(self, stage: str, jobs: list[Job], fn: Callable[[list[Job]], None]) -> list[Job]:
        """Run stage ``fn`` on ``jobs`` (on its own CUDA stream on a GPU); the jobs it worked for. When a batch
        fails, each of its jobs is run again alone, so that only the one that fails alone carries the error."""
        if not jobs:
            return []
        for job in jobs:
            job.stage = stage
        start = time.perf_counter()
        self._working[stage] = time.monotonic()
        try:
            with self._stream(stage):
                fn(jobs)
        except Exception as err:  # noqa: BLE001 - a failed batch fails its requests, never the service
            if len(jobs) == 1:
                log.exception("%s failed for request %s", stage, jobs[0].id)
                _settle(jobs[0], error=err)
                return []
            log.warning("%s failed (%s) for the batch of requests %s; running each alone", stage,
                        type(err).__name__, [j.id for j in jobs])
            return [job for job in jobs if self._timed(stage, [job], fn)]
        finally:
            self._working.pop(stage, None)
        seconds = time.perf_counter() - start
        images = sum(j.n for j in jobs)
        if stage == "denoise":  # a stream call is one step; a pipeline call all the steps of its batch
            self._calls_seen.append((sum(j.units for j in jobs),
                                     seconds / (1 if self.mode == "stream" else max(jobs[0].calls, 1))))
        else:
            per_image = seconds / images
            last = self._image_s.get(stage)
            self._image_s[stage] = per_image if last is None else 0.8 * last + 0.2 * per_image
        for job in jobs:
            job.timings[stage] = job.timings.get(stage, 0.0) + seconds
            job.batch_sizes[stage] = max(job.batch_sizes.get(stage, 0), images)
        if self.metrics is not None:
            self.metrics.stage_seconds.labels(stage).observe(seconds)
            self.metrics.batch_size.labels(stage).observe(images)
        return jobs

    @contextlib.contextmanager
    def _stream(self, stage: str):
        """On a GPU: the stage's own CUDA stream, synchronised at the end, since the next stage (another thread,
        another stream) reads what it made; on a CPU nothing."""
        if self.device.type != "cuda":
            yield
            return
        if stage not in self._streams:
            self._streams[stage] = torch.cuda.Stream(self.device)
        stream = self._streams[stage]
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    def _guarded(self, jobs: list[Job], fn: Callable[[], None]) -> None:
        """Run a stage loop's step; an error outside the stage's own work fails these jobs, not the thread."""
        try:
            fn()
        except Exception as err:  # noqa: BLE001
            log.exception("serving requests %s failed", [j.id for j in jobs])
            for job in jobs:
                _settle(job, error=err)

    def _serial(self) -> None:
        while True:
            jobs = self._live(self._take())
            if not jobs:
                if self.stop.is_set():
                    return
                continue

            def run(jobs=jobs):
                for stage, fn in (("encode", self._encode), ("denoise", self._denoise), ("decode", self._decode)):
                    jobs = self._timed(stage, jobs, fn)
                    if not jobs:
                        return
                    if stage == "decode":
                        self._finish(jobs)
                    else:
                        jobs = self._live(jobs)

            self._guarded(jobs, run)

    def _encoder(self, out) -> None:
        while True:
            jobs = self._live(self._take())
            if not jobs:
                if self.stop.is_set():
                    out.put(None)
                    return
                continue
            if jobs := self._timed("encode", jobs, self._encode):
                out.put(jobs)

    def _denoiser(self, inp, out) -> None:
        while (jobs := inp.get()) is not None:
            if jobs := self._timed("denoise", self._live(jobs), self._denoise):
                out.put(jobs)
        out.put(None)

    def _decoder(self, inp) -> None:
        while (jobs := inp.get()) is not None:
            # a request that gave up is not decoded
            if jobs := self._timed("decode", self._live(jobs), self._decode):
                self._guarded(jobs, lambda jobs=jobs: self._finish(jobs))

    # ---------------------------------------------------------------- the work of each stage

    @torch.no_grad()
    def _encode(self, jobs: list[Job]) -> None:
        sizes: dict[tuple, list[Job]] = {}
        for job in jobs:  # one encoder call per image size: a family may condition on it (SDXL's size ids)
            sizes.setdefault(job.size_key(), []).append(job)
        for size, group in sizes.items():
            cond = self.embed([prompt for job in group for prompt in job.prompts], size)
            for job, part in zip(group, split_condition(cond, [j.n for j in group])):
                job.embeds = part

    def embed(self, prompts: list[str], size: tuple[int, int] | None = None) -> dict:
        """The family's condition of the prompts for images of ``size`` (height, width; default the native size),
        as the pipeline's ``encode_prompt`` makes it without guidance, except that the prompts are tokenised once,
        with truncation: ``encode_prompt`` tokenises each prompt a second time in full to log what truncation
        removed, which echoes the prompt into the log and takes seconds for a long one."""
        pipe = self.pipe
        if hasattr(pipe, "maybe_convert_prompt"):  # textual-inversion tokens, as encode_prompt expands them
            prompts = pipe.maybe_convert_prompt(prompts, pipe.tokenizer)
        batch = {"caption": prompts, "image_size": size or (self.native, self.native)}
        return {key: value.to(self.device) for key, value in self.family.condition(batch).items()}

    def null(self, like: dict) -> dict:
        """The null condition of classifier-free guidance for the rows of ``like`` (the condition it pairs with)."""
        n = len(next(iter(like.values())))
        return self.null_family.null_condition(n, self.device, like=like)

    def scheduler_for(self, name: str | None):
        """A fresh scheduler: the pipeline's own class and config for ``None`` (or the export's own name),
        else ``name`` built from the pipeline's noise schedule with that scheduler's package options."""
        from distill.inference.schedulers import make_scheduler, scheduler_options

        cls, config = self.own_scheduler
        if name is None or name == self.own_name:
            return cls.from_config(config)
        options = self.scheduler_options[name] if name in self.scheduler_options else scheduler_options(name)
        return make_scheduler(name, config, **options)

    def _generators(self, jobs: list[Job]) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(seed) for job in jobs for seed in job.seeds]

    @torch.no_grad()
    def _denoise(self, jobs: list[Job]) -> None:
        """One pipeline call for jobs of one batch key (``output_type="latent"``: the decoder stage decodes)."""
        first = jobs[0]
        pipe = self.pipe
        pipe.scheduler = self.scheduler_for(first.scheduler)
        cond = concat_all([job.embeds for job in jobs])
        negative = self.null(cond) if self.needs_cfg(first.guidance_scale) else None
        if self.sampling is not None:
            self.sampling.update(scheduler_name=first.scheduler or self.own_name or "own",
                                 guidance_scale=first.guidance_scale, prompts=[p for job in jobs for p in job.prompts],
                                 labels=None)

        def progress(pipe, i, t, tensors):  # each step: the jobs' progress, and the stage's heartbeat
            if self.sampling is not None:
                self.sampling.step_end(pipe, i, t, tensors)
            for job in jobs:
                job.calls, job.index = pipe.num_timesteps, i + 1
            self._working["denoise"] = time.monotonic()
            if all(job.dead() for job in jobs):  # nobody waits for these latents: skip the remaining steps
                pipe._interrupt = True
            return tensors

        latents = pipe(**self.family.pipeline_call_inputs(cond, negative), num_inference_steps=first.steps,
                       guidance_scale=first.guidance_scale, height=first.height, width=first.width,
                       generator=self._generators(jobs), output_type="latent", callback_on_step_end=progress,
                       callback_on_step_end_tensor_inputs=[]).images
        latents = self.family.call_latents(latents, first.height // self.factor, first.width // self.factor)
        for job, part in zip(jobs, latents.split([j.n for j in jobs])):
            job.latents = part

    @torch.no_grad()
    def _decode(self, jobs: list[Job]) -> None:
        pipe = self.pipe
        latents = torch.cat([job.latents for job in jobs])
        pixels = self.family.decode(latents.to(pipe.vae.dtype))  # with the VAE's shift_factor where it has one
        denormalize = None
        if getattr(pipe, "safety_checker", None) is not None:  # as pipe(prompt) does: flagged images come out black
            pixels, flagged = pipe.run_safety_checker(pixels, self.device, latents.dtype)
            denormalize = [not f for f in flagged] if flagged is not None else None
        if getattr(pipe, "watermark", None) is not None:  # as SDXL's pipe(prompt) marks its images
            pixels = pipe.watermark.apply_watermark(pixels)
        images = pipe.image_processor.postprocess(pixels, output_type="pil", do_denormalize=denormalize)
        offset = 0
        for job in jobs:
            job.png = []
            for image in images[offset:offset + job.n]:
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                job.png.append(buffer.getvalue())
            offset += job.n

    def _finish(self, jobs: list[Job]) -> None:
        now = time.monotonic()
        for job in jobs:
            job.stage = "done"
            settled = _settle(job, Result(job.png, job.seeds, now - job.submitted, dict(job.timings),
                                          dict(job.batch_sizes)))
            if self.metrics is not None:
                if settled:
                    self.metrics.completed(job.n, now - job.submitted)
                else:
                    self.metrics.dropped.inc()

    # ---------------------------------------------------------------- stream batching

    def _prepare(self, job: Job) -> None:
        """Per-job state of the denoising loop, as the family's pipeline ``__call__`` sets it up."""
        from diffusers.utils.torch_utils import randn_tensor

        pipe = self.pipe
        if self.device.type == "cuda":  # made on the encoder's stream, read and freed on this one
            for value in job.embeds.values():
                value.record_stream(torch.cuda.current_stream(self.device))
        job.sched = self.scheduler_for(job.scheduler)
        self._set_timesteps(job.sched, job.steps, job.height, job.width, self.device)
        job.timesteps, job.index = job.sched.timesteps, 0
        job.calls = len(job.timesteps)
        gens = self._generators([job])
        c = self.denoiser.config
        shape = self.family.latent_shape(self.denoiser, job.n, job.height // self.factor, job.width // self.factor)
        dtype = job.embeds["encoder_hidden_states"].dtype  # the prompt embeddings', as the pipeline's latents
        job.latents = randn_tensor(shape, generator=gens, device=self.device, dtype=dtype)
        job.latents = job.latents * getattr(job.sched, "init_noise_sigma", 1.0)  # a flow scheduler starts at 1
        job.cfg = self.needs_cfg(job.guidance_scale)
        params = inspect.signature(job.sched.step).parameters  # the pipeline's prepare_extra_step_kwargs, per job
        job.step_kwargs = {**({"eta": 0.0} if "eta" in params else {}),
                           **({"generator": gens} if "generator" in params else {})}
        if c.get("time_cond_proj_dim") is not None:  # the guidance embedding of LCM-style students
            w = torch.tensor(job.guidance_scale - 1).repeat(job.n)
            job.timestep_cond = pipe.get_guidance_scale_embedding(w, embedding_dim=c.time_cond_proj_dim).to(
                device=self.device, dtype=job.latents.dtype)
        if job.cfg:  # the pipeline's order: [unconditional, conditional]
            job.embeds = concat_all([self.null(job.embeds), job.embeds])

    def _stream_denoiser(self, inp, out) -> None:
        """Continuous batching of denoising steps: admit encoded jobs while there is room, advance every
        active job by one step (one network call per image size among them), pass finished jobs to the decoder.

        Admission is first come, first served whatever a job's size, steps, guidance or scheduler: the oldest
        waiting job is admitted as soon as the active jobs leave room for its images, and no younger job
        overtakes it, so it waits at most until enough of the active jobs finish (at most ``max_steps`` calls, twice
        that for a second-order scheduler: docs/serving.md)."""
        active: list[Job] = []
        waiting: deque[Job] = deque()
        upstream_done = False
        while True:
            # take encoded jobs while fewer than a batch of images wait beside the active ones (the stage queue
            # stays the buffer, so that backpressure reaches the request queue); block only when idle
            while not upstream_done and sum(job.n for job in waiting) < self.max_batch_size:
                try:
                    jobs = inp.get(block=not active and not waiting, timeout=0.05)
                except Exception:  # queue.Empty
                    break
                if jobs is None:
                    upstream_done = True
                    break
                waiting.extend(jobs)
            images = sum(j.n for j in active)
            admitted = []
            while waiting and images + waiting[0].n <= self.max_batch_size:
                admitted.append(waiting.popleft())
                images += admitted[-1].n
            for job in self._live(admitted):
                try:
                    with self._stream("denoise"):  # the stream the steps run on
                        self._prepare(job)
                    job.stage = "denoise"
                    active.append(job)
                except Exception as err:  # noqa: BLE001
                    log.exception("request %s could not start", job.id)
                    _settle(job, error=err)
            active = self._live(active)
            if not active:
                if upstream_done and not waiting:
                    out.put(None)
                    return
                continue
            # a job whose step failed is settled already; a cancelled one is dropped (and counted) by _live
            active = [job for job in self._timed("denoise", active, self._stream_step)
                      if job.future.cancelled() or not job.future.done()]
            finished = [job for job in active if job.index >= len(job.timesteps)]
            active = [job for job in active if job.index < len(job.timesteps)]
            sizes: dict[tuple, list[Job]] = {}
            for job in finished:  # the decoder decodes one image size per batch
                sizes.setdefault(job.size_key(), []).append(job)
            for group in sizes.values():
                out.put(group)

    @torch.no_grad()
    def _stream_step(self, jobs: list[Job]) -> None:
        """Advance each job by one step of its own scheduler: one network call per image size among them. A network
        call that fails is made again for each of its jobs alone, and a scheduler step that fails fails its job
        alone, so that one bad job never fails the others (a job's state changes only once its step is done)."""
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            groups.setdefault(job.size_key(), []).append(job)
        for group in groups.values():
            try:
                predictions = self._stream_unet(group)
            except Exception as err:  # noqa: BLE001 - retried one by one below
                if len(group) == 1:
                    log.exception("denoising failed for request %s", group[0].id)
                    _settle(group[0], error=err)
                    continue
                log.warning("a denoising call failed for requests %s; running each alone", [j.id for j in group])
                predictions = []
                for job in group:
                    try:
                        predictions += self._stream_unet([job])
                    except Exception as err:  # noqa: BLE001
                        log.exception("denoising failed for request %s", job.id)
                        _settle(job, error=err)
                        predictions.append(None)
            for job, pred in zip(group, predictions):
                if pred is None:
                    continue
                try:
                    t = job.timesteps[job.index]
                    job.latents = job.sched.step(pred, t, job.latents, **job.step_kwargs, return_dict=False)[0]
                    job.index += 1
                except Exception as err:  # noqa: BLE001
                    log.exception("a scheduler step failed for request %s", job.id)
                    _settle(job, error=err)

    def _stream_unet(self, jobs: list[Job]) -> list[torch.Tensor]:
        """The guided prediction of each job (of one image size) at its current step, in one network call (the
        family's ``denoise_at``, at the schedulers' own timesteps)."""
        xs, ts, embeds, conds, scales = [], [], [], [], []
        for job in jobs:
            t = job.timesteps[job.index]
            x = torch.cat([job.latents] * 2) if job.cfg else job.latents
            if hasattr(job.sched, "scale_model_input"):
                x = job.sched.scale_model_input(x, t)
            xs.append(x)
            ts.append(t.reshape(1).expand(len(x)))
            embeds.append(job.embeds)
            scales.append(torch.full((len(x),), float(job.guidance_scale), device=self.device))
            if job.timestep_cond is not None:
                conds.append(job.timestep_cond)
        dtypes = {t.dtype for t in ts}
        t_all = torch.cat([t.float() for t in ts]) if len(dtypes) > 1 else torch.cat(ts)
        extra = {"timestep_cond": torch.cat(conds)} if conds else {}
        extra.update(self.family.guidance_input(torch.cat(scales)))  # Flux's guidance is a network input, per row
        out = self.family.denoise_at(self.denoiser, torch.cat(xs), t_all, concat_all(embeds), **extra)
        predictions = []
        for job, pred in zip(jobs, out.split([len(x) for x in xs])):
            if job.cfg:
                uncond, text = pred.chunk(2)
                pred = uncond + job.guidance_scale * (text - uncond)
            predictions.append(pred)
        return predictions


def concat_all(conds: list[dict]) -> dict:
    """Stack condition dicts along the batch."""
    return {key: torch.cat([cond[key] for cond in conds]) for key in conds[0]}


def split_condition(cond: dict, sizes: list[int]) -> list[dict]:
    """A condition dict cut along the batch into parts of ``sizes`` rows."""
    parts = {key: value.split(sizes) for key, value in cond.items()}
    return [{key: parts[key][i] for key in cond} for i in range(len(sizes))]
