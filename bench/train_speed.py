"""Training speed of latent consistency distillation: distill's `+exp=consistency` with each speed switch
against a minimal plain-PyTorch loop of the same algorithm (fp32, same teacher, data and batch).

    python bench/train_speed.py --batch-sizes 32 128 --steps 30 --warmup 10 --repeats 3
    python bench/train_speed.py --configs default latent_cache --batch-sizes 128   # a subset
    python bench/train_speed.py --configs default teacher_bf16 reference --reference-script \
        diffusers/examples/consistency_distillation/train_lcm_distill_sd_wds.py   # against diffusers' script

Each measurement is its own process, as a user runs it: ``python -m distill.train +exp=consistency ...`` with
a step timer callback, or this file's ``--plain`` loop. Images/s are taken over the steps after ``warmup``
(start-up, compilation and the final save cancelled out); the first ``warmup`` steps' time is reported
apart (it holds torch.compile's compilation). Runs are interleaved (plain loop, then every configuration,
``repeats`` times) and each configuration's speed-up is the median over repeats of its images/s divided
by the plain loop's of the same repeat. Results go in BENCHMARKS.md.

The plain loop follows the structure of diffusers' examples/consistency_distillation/train_lcm_distill_sd_wds.py
(Luo et al. 2023, Algorithm 1), written here from the paper: per step it encodes the images with the VAE and
the captions with the text encoder, runs the teacher's conditional and unconditional passes, one skipping
DDIM step, the EMA target, the pseudo-Huber loss, gradient clipping, AdamW and a per-parameter EMA update.
The algorithm is distill's default (per-example pseudo-Huber, zero-initialised w projection, warm-up + cosine
LR); the per-step work is the reference script's, and differs from distill's in three places that are
framework choices, not the algorithm: distill embeds each distinct caption once (a cache) instead of running the
text encoder on every batch, runs the conditional and unconditional teacher passes as one batch of 2N, and
updates the EMA target with one fused ``_foreach_lerp_`` instead of a loop over parameters.

The ``reference`` configuration runs diffusers' own script, examples/consistency_distillation/
train_lcm_distill_sd_wds.py, which is not in the diffusers wheel (``git clone https://github.com/huggingface/diffusers``
and pass ``--reference-script`` the file; checked with git blob 988c12aa, diffusers commit 58eb52c of 2026-08). It is
copied into a temporary folder with distill's digits training split written there as webdataset shards (``KEY.png``,
``KEY.txt``), and run from there in its own process as ``ACCELERATE_USE_CPU=true python train_lcm_distill_sd_wds.py
ARGS`` (on the CPU, as the other runs; the command is printed and written to ``--out``), under this file's
``--reference-run`` hooks, which record the wall time just before its training loop (``Accelerator.init_trackers``)
and after every optimizer step; its start-up and final save are outside the timed steps, and the same step window as
the other configurations is taken. Its arguments are read from
``+exp=consistency``'s composed config: teacher, resolution, batch size, steps, AdamW lr / betas / eps / weight decay,
warm-up steps with a cosine schedule, w in [guidance_scale_min - 1, guidance_scale_max - 1] (the script's w is LCM's,
as distill's), DDIM solver steps, loss ``huber`` with huber_c, EMA decay, timestep scaling, w-embedding size, gradient
clipping, seed; checkpoints and validation off. Its precision is left as it ships: ``--mixed_precision no`` keeps the
student, the target and the frozen weights in fp32, and the teacher's two passes and DDIM step run under
``torch.autocast("cpu")``, which is bf16 (fp16 on CUDA), so the closest distill configuration is ``teacher_bf16``.

Adaptations the hooks make for the digits assets and this environment (the script's file is not changed): the
tokenizer caps ``max_length`` at its ``model_max_length`` (the script pads the empty prompt to SD's 77 tokens; the
digits text encoder has 16 positions, distill's length); ``wds.decode("pil")`` yields grey instead of RGB images when
the teacher's VAE takes 1 channel; the script's shard reader runs without webdataset 1.0's end-of-shard marker, on
which its ``group_by_keys_nothrow`` raises KeyError('fname'); and where torchvision cannot be imported (the CPU torch
here: PyPI's torchvision 0.28 is a CUDA build that does not load against torch+cpu, 0.29 needs torch 2.14), a stand-in
for the four transforms its loader applies (resize and crop, both the identity on these 32x32 images, to_tensor,
normalize). Differences that remain from distill's run:

- loss: pseudo-Huber averaged per element (the script's only form) against distill's per example, same c;
- LR: diffusers' cosine decays to 0, distill's to 0.1 of the base (the same warm-up, which covers a short run);
- optimizer: torch's default AdamW; distill optimizer options the script has no argument for (e.g. ``fused``) are
  printed, not passed;
- per step: the teacher under autocast (distill's default: fp32), conditional and unconditional as two passes (distill:
  one batch of 2N), the text encoder on every batch (distill: once per caption), the VAE encode in chunks of 32
  (its ``--vae_encode_batch_size``), the EMA as a loop over parameters, tensorboard logging and a tqdm bar per step
  (its defaults; distill's run logs to csv); the student's new w projection is randomly initialised (distill: zero);
- data: webdataset shards resampled with replacement through a 1,000-sample shuffle buffer in one loader worker
  process (the script divides by ``--dataloader_num_workers``, so 0 is impossible) against distill's in-process loader
  over per-epoch permutations; images as 8-bit PNG (within 1/255 of distill's float tensors); ``--max_train_samples``
  is batch x steps so that the loader's epoch, which refills the shuffle buffer, spans the run;
- timing: after each optimizer step (a step's EMA update and logging fall in the next interval) against distill's
  end-of-batch callback; over the same number of steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
SWITCHES = {
    "default": [],
    "latent_cache": ["method.latent_cache=true"],
    "teacher_bf16": ["method.frozen_dtype=bf16"],
    "student_bf16": ["trainer.precision=bf16-mixed"],
    "channels_last": ["method.channels_last=true"],
    "fused_adamw": ["+method.optimizer.fused=true"],
    "compile": ["method.compile=true"],
    "cache+teacher_bf16": ["method.latent_cache=true", "method.frozen_dtype=bf16"],
    "cache+bf16": ["method.latent_cache=true", "method.frozen_dtype=bf16", "trainer.precision=bf16-mixed"],
    "cache+bf16+compile": ["method.latent_cache=true", "method.frozen_dtype=bf16", "trainer.precision=bf16-mixed",
                           "method.compile=true"],
}


class StepTimer(L.Callback):
    """Wall time at the end of every training batch, written to ``step_times.json`` in the run directory."""

    def __init__(self):
        self.times: list[float] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.times.append(time.perf_counter())  # times[0]: the start, before the first step (and its compilation)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        Path(trainer.default_root_dir, "step_times.json").write_text(json.dumps(self.times))


def images_per_s(times: list[float], batch_size: int, warmup: int) -> tuple[float, float]:
    """(images/s over the steps after ``warmup``, seconds of the first ``warmup`` steps); ``times`` holds the
    start and then the end of every step."""
    steady = times[warmup:]
    return batch_size * (len(steady) - 1) / (steady[-1] - steady[0]), times[warmup] - times[0]


# ---------------------------------------------------------------------------------------------- plain loop

def plain_loop(batch_size: int, steps: int, seed: int = 0) -> list[float]:
    """The minimal fp32 LCM loop; returns the wall time at its start and at the end of each step."""
    from diffusers import UNet2DConditionModel

    from distill.families import load_teacher
    from distill.worlds.digits import asset_path
    from distill.worlds.digits.data import DigitsDataModule

    torch.manual_seed(seed)
    teacher = load_teacher(str(asset_path("teacher")))
    vae, text_encoder, tokenizer = teacher.vae.eval(), teacher.text_encoder.eval(), teacher.tokenizer
    teacher_unet = teacher.denoiser.eval().requires_grad_(False)
    for m in (vae, text_encoder):
        m.requires_grad_(False)
    student = UNet2DConditionModel.from_config({**teacher_unet.config, "time_cond_proj_dim": 256})
    student.load_state_dict(teacher_unet.state_dict(), strict=False)  # teacher weights; the w-embedding new
    torch.nn.init.zeros_(student.time_embedding.cond_proj.weight)  # so that the student starts as the teacher
    student.train()
    target = UNet2DConditionModel.from_config(student.config).eval().requires_grad_(False)
    target.load_state_dict(student.state_dict())
    optimizer = torch.optim.AdamW(student.parameters(), lr=2e-4, weight_decay=0.0)
    def lr_factor(s: int) -> float:  # linear warm-up over 50 steps, cosine to 0.1 at 1,000 (the experiment's)
        if s < 50:
            return (s + 1) / 50
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - 50) / 950)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)

    abar = teacher.scheduler.alphas_cumprod.float()
    T, n_solver = teacher.scheduler.config.num_train_timesteps, 50
    skip = T // n_solver
    solver_t = torch.arange(1, n_solver + 1) * skip - 1  # t_n on the DDIM solver grid
    huber_c, sigma_data, t_scale, ema = 0.001, 0.5, 10.0, 0.95

    def tokens(captions):
        return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids

    def scalings(t):  # LCM boundary scalings at timestep_scaling 10
        s = (t * t_scale).float()
        c_skip = sigma_data**2 / (s**2 + sigma_data**2)
        return c_skip.view(-1, 1, 1, 1), (s / (s**2 + sigma_data**2).sqrt()).view(-1, 1, 1, 1)

    def w_embedding(w, dim=256):  # sinusoidal embedding of w * 1000 (as LCM)
        half = dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half) / (half - 1))
        args = (w * 1000.0)[:, None] * freqs[None]
        return torch.cat([args.sin(), args.cos()], dim=1)

    def x0_of(eps, x, t):
        a = abar[t].sqrt().view(-1, 1, 1, 1)
        s = (1 - abar[t]).sqrt().view(-1, 1, 1, 1)
        return (x - s * eps) / a

    with torch.no_grad():
        uncond = text_encoder(tokens([""]))[0]
    dm = DigitsDataModule(resolution=32, batch_size=batch_size)
    dm.setup()
    loader = dm.train_dataloader()
    times, step = [time.perf_counter()], 0
    while step < steps:
        for batch in loader:
            with torch.no_grad():
                latents = vae.encode(batch["pixel_values"]).latent_dist.sample() * vae.config.scaling_factor
                cond = text_encoder(tokens(batch["caption"]))[0]
            n = latents.shape[0]
            index = torch.randint(0, n_solver, (n,))
            t = solver_t[index]
            t_prev = (t - skip).clamp(min=0)
            noise = torch.randn_like(latents)
            x_t = abar[t].sqrt().view(-1, 1, 1, 1) * latents + (1 - abar[t]).sqrt().view(-1, 1, 1, 1) * noise
            w = 1.0 + 4.0 * torch.rand(n)  # cfg scale - 1 in [1, 5] (cfg scale 2..6)
            w_emb = w_embedding(w)
            c_skip, c_out = scalings(t)
            eps_s = student(x_t, t, timestep_cond=w_emb, encoder_hidden_states=cond).sample
            pred = c_skip * x_t + c_out * x0_of(eps_s, x_t, t)
            with torch.no_grad():
                eps_c = teacher_unet(x_t, t, encoder_hidden_states=cond).sample
                eps_u = teacher_unet(x_t, t, encoder_hidden_states=uncond.expand(n, -1, -1)).sample
                wv = w.view(-1, 1, 1, 1)
                x0_c, x0_u = x0_of(eps_c, x_t, t), x0_of(eps_u, x_t, t)
                x0_g, eps_g = x0_c + wv * (x0_c - x0_u), eps_c + wv * (eps_c - eps_u)
                x_prev = abar[t_prev].sqrt().view(-1, 1, 1, 1) * x0_g + (1 - abar[t_prev]).sqrt().view(-1, 1, 1, 1) * eps_g
                eps_t = target(x_prev, t_prev, timestep_cond=w_emb, encoder_hidden_states=cond).sample
                c_skip_p, c_out_p = scalings(t_prev)
                tgt = c_skip_p * x_prev + c_out_p * x0_of(eps_t, x_prev, t_prev)
            # pseudo-Huber per example (iCT), distill's default; diffusers' script takes it per element
            loss = (((pred - tgt) ** 2).flatten(1).sum(1).add(huber_c**2).sqrt() - huber_c).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p_t, p_s in zip(target.parameters(), student.parameters()):
                    p_t.mul_(ema).add_(p_s, alpha=1 - ema)
            times.append(time.perf_counter())
            step += 1
            if step == steps:
                break
    return times


# ---------------------------------------------------------------------------------------------- reference script

REFERENCE_FILE = "train_lcm_distill_sd_wds.py"
REFERENCE_HOWTO = (
    "the 'reference' configuration runs diffusers' examples/consistency_distillation/train_lcm_distill_sd_wds.py, "
    "which is not in the diffusers wheel: git clone https://github.com/huggingface/diffusers and pass "
    "--reference-script diffusers/examples/consistency_distillation/train_lcm_distill_sd_wds.py")
SCRIPT_LOSS = {"pseudo_huber": "huber", "pseudo_huber_elementwise": "huber", "huber": "huber", "l2": "l2"}


def distill_settings() -> dict:
    """The settings of ``+exp=consistency`` that the reference script has arguments for, from the composed config
    (so that a change to the experiment changes what the script is given)."""
    from hydra import compose, initialize_config_dir

    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["+exp=consistency"])
    method, optimizer, scheduler = cfg.method, cfg.method.optimizer, cfg.method.lr_scheduler
    loss_type = str(getattr(method.loss_type, "value", method.loss_type))
    if loss_type not in SCRIPT_LOSS or optimizer._target_ != "torch.optim.AdamW":
        raise ValueError(f"+exp=consistency's loss {loss_type} / optimizer {optimizer._target_} has no "
                         "counterpart in the reference script")
    warmup_cosine = scheduler is not None and scheduler._target_ == "distill.methods.base.warmup_cosine"
    return {
        "teacher": str(Path(cfg.teacher.pretrained_model_name_or_path)), "resolution": cfg.data.resolution,
        "lr": optimizer.lr, "weight_decay": optimizer.get("weight_decay", 0.01),
        "betas": list(optimizer.get("betas", (0.9, 0.999))), "eps": optimizer.get("eps", 1e-8),
        "optimizer_extra": {k: v for k, v in optimizer.items()
                            if k not in ("_target_", "_partial_", "lr", "weight_decay", "betas", "eps")},
        "lr_scheduler": "cosine" if warmup_cosine else "constant",
        "warmup_steps": scheduler.warmup_steps if warmup_cosine else 0,
        # distill samples the guidance scale w + 1; the script samples LCM's w (x0_c + w (x0_c - x0_u)), as distill
        "w_min": method.guidance_scale_min - 1, "w_max": method.guidance_scale_max - 1,
        "num_ddim_timesteps": method.num_ddim_timesteps, "loss_type": loss_type,
        "script_loss": SCRIPT_LOSS[loss_type], "huber_c": method.huber_c, "ema_decay": method.ema_decay,
        "timestep_scaling": method.timestep_scaling, "time_cond_proj_dim": cfg.student.time_cond_proj_dim,
        "grad_clip": cfg.trainer.gradient_clip_val, "seed": cfg.seed, "channels": cfg.data.channels,
    }


def reference_args(settings: dict, batch_size: int, steps: int, shards: str, output_dir: Path) -> list[str]:
    """The script's arguments for a run like ``+exp=consistency data.batch_size=B trainer.max_steps=S``; its
    precision handling is left as it ships (``--mixed_precision no``: fp32 student, teacher under autocast)."""
    s = settings
    args = {
        "pretrained_teacher_model": s["teacher"], "output_dir": output_dir, "train_shards_path_or_url": shards,
        "resolution": s["resolution"], "train_batch_size": batch_size, "max_train_steps": steps,
        # one webdataset "epoch" spans the whole run (the script restarts its loader and refills the shuffle buffer
        # at each; with 1,437 images that would happen every 11-45 steps, unlike the LAION-scale data it targets)
        "max_train_samples": batch_size * steps,
        "dataloader_num_workers": 1,  # 0 divides by zero in the script's SDText2ImageDataset
        "learning_rate": s["lr"], "adam_weight_decay": s["weight_decay"], "adam_beta1": s["betas"][0],
        "adam_beta2": s["betas"][1], "adam_epsilon": s["eps"], "lr_scheduler": s["lr_scheduler"],
        "lr_warmup_steps": s["warmup_steps"], "w_min": s["w_min"], "w_max": s["w_max"],
        "num_ddim_timesteps": s["num_ddim_timesteps"], "loss_type": s["script_loss"], "huber_c": s["huber_c"],
        "ema_decay": s["ema_decay"], "timestep_scaling_factor": s["timestep_scaling"],
        "unet_time_cond_proj_dim": s["time_cond_proj_dim"], "max_grad_norm": s["grad_clip"],
        "mixed_precision": "no", "seed": s["seed"],
        # as distill's run: no checkpoints, no validation
        "checkpointing_steps": 1_000_000, "validation_steps": 1_000_000,
    }
    return [item for key, value in args.items() for item in (f"--{key}", str(value))]


def write_digit_shards(folder: Path, resolution: int = 32, channels: int = 1, per_shard: int = 500,
                       limit: int | None = None) -> tuple[str, int]:
    """distill's digits training split (``DigitsDataModule`` at ``resolution``, its default split) as webdataset
    tar shards, one sample per key: ``KEY.png`` (8-bit, grey or RGB as ``channels``) and ``KEY.txt`` (the
    caption). Returns the shards' brace pattern and the number of samples. The reference script decodes these
    with ``wds.decode("pil")`` and renames ``png`` to ``image`` and ``txt`` to ``text``; its ``WebdatasetFilter``
    (json size and watermark filter) is defined but not in its pipeline, so no json is written."""
    import io
    import tarfile

    from PIL import Image

    from distill.worlds.digits.data import DigitsDataModule

    dm = DigitsDataModule(resolution=resolution, channels=channels)
    dm.setup()
    data = dm.train_set
    n = len(data) if limit is None else min(limit, len(data))
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = math.ceil(n / per_shard)
    for shard in range(n_shards):
        with tarfile.open(folder / f"digits-{shard:06d}.tar", "w") as tar:
            for i in range(shard * per_shard, min(n, (shard + 1) * per_shard)):
                item = data[i]
                pixels = ((item["pixel_values"] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
                array = pixels[0].numpy() if channels == 1 else pixels.permute(1, 2, 0).numpy()
                png = io.BytesIO()
                Image.fromarray(array, mode="L" if channels == 1 else "RGB").save(png, format="PNG")
                for ext, payload in (("png", png.getvalue()), ("txt", item["caption"].encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    if n_shards == 1:
        return str(folder / "digits-000000.tar"), n
    return str(folder / f"digits-{{000000..{n_shards - 1:06d}}}.tar"), n


def git_blob_sha(path: Path) -> str:
    """The file's git object id (``git hash-object``): which version of the script was run."""
    import hashlib

    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def torchvision_stand_in() -> dict:
    """A minimal ``torchvision`` as {module name: module} (``transforms.functional``: resize, crop, to_tensor,
    normalize; ``transforms.RandomCrop.get_params``; ``InterpolationMode``) for a torch that has no loadable torchvision
    (the CPU torch here: PyPI's torchvision is a CUDA build). The reference script uses only these, in its data
    loader worker, on images that are already at the training resolution."""
    import enum
    import importlib.machinery
    import types

    import numpy as np
    from PIL import Image

    class InterpolationMode(enum.Enum):
        NEAREST = Image.Resampling.NEAREST
        NEAREST_EXACT = Image.Resampling.NEAREST
        BILINEAR = Image.Resampling.BILINEAR
        BICUBIC = Image.Resampling.BICUBIC
        BOX = Image.Resampling.BOX
        HAMMING = Image.Resampling.HAMMING
        LANCZOS = Image.Resampling.LANCZOS

    def resize(image, size, interpolation=InterpolationMode.BILINEAR, **_):
        w, h = image.size
        if isinstance(size, (list, tuple)) and len(size) == 2:
            oh, ow = size
        else:  # the shorter side to size, the aspect ratio kept
            size = size[0] if isinstance(size, (list, tuple)) else size
            oh, ow = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
        return image if (ow, oh) == (w, h) else image.resize((ow, oh), interpolation.value)

    def crop(image, top, left, height, width):
        return image.crop((left, top, left + width, top + height))

    def to_tensor(image):
        array = np.array(image, dtype=np.uint8, copy=True)
        array = array[:, :, None] if array.ndim == 2 else array
        return torch.from_numpy(array).permute(2, 0, 1).float().div(255)

    def normalize(tensor, mean, std):
        mean = torch.as_tensor(mean, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / torch.as_tensor(std, dtype=tensor.dtype).view(-1, 1, 1)

    class RandomCrop:
        @staticmethod
        def get_params(image, output_size):
            w, h = image.size
            th, tw = output_size
            if h < th or w < tw:
                raise ValueError(f"crop size {output_size} is larger than the image {(h, w)}")
            top = int(torch.randint(0, h - th + 1, (1,))) if h > th else 0
            left = int(torch.randint(0, w - tw + 1, (1,))) if w > tw else 0
            return top, left, th, tw

    package, transforms, functional = (types.ModuleType(name) for name in (
        "torchvision", "torchvision.transforms", "torchvision.transforms.functional"))
    for module in (package, transforms, functional):
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    for name, value in (("resize", resize), ("crop", crop), ("to_tensor", to_tensor), ("normalize", normalize),
                        ("InterpolationMode", InterpolationMode)):
        setattr(functional, name, value)
    transforms.functional, transforms.RandomCrop = functional, RandomCrop
    transforms.InterpolationMode = InterpolationMode
    package.transforms, package.__version__ = transforms, "stand-in"
    return {module.__name__: module for module in (package, transforms, functional)}


def reference_runner(script: Path, times_out: Path, script_args: list[str], grey: bool) -> None:
    """Runs the reference script in this process as ``python SCRIPT ARGS`` would, with hooks that record the wall
    time once before its training loop (``Accelerator.init_trackers``, called just before it) and after every
    optimizer step; writes them to ``times_out`` (the script's start-up and final save are outside them)."""
    import runpy

    try:
        import torchvision  # noqa: F401

        vision = torchvision.__version__
    except Exception:  # absent, or a build that cannot load against this torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        import diffusers.training_utils  # before the stand-in: diffusers looks for an installed torchvision

        sys.modules.update(torchvision_stand_in())
        diffusers.training_utils.is_torchvision_available = lambda: True
        diffusers.training_utils.transforms = sys.modules["torchvision.transforms"]
        vision = "stand-in"

    import inspect

    import accelerate
    import transformers.tokenization_utils_base as tokenization
    import webdataset.autodecode
    import webdataset.tariterators

    times: list[float] = []

    def step_done(optimizer, args, kwargs) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(time.perf_counter())

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(step_done)
    init_trackers = accelerate.Accelerator.init_trackers

    def init_trackers_then_start(self, *args, **kwargs):
        out = init_trackers(self, *args, **kwargs)
        times.append(time.perf_counter())
        return out

    accelerate.Accelerator.init_trackers = init_trackers_then_start
    # The script pads the empty prompt to 77 tokens, SD's length; the digits text encoder has 16 positions.
    call = tokenization.PreTrainedTokenizerBase.__call__

    def capped_call(self, *args, max_length=None, **kwargs):
        if max_length is not None and self.model_max_length and max_length > self.model_max_length:
            max_length = self.model_max_length
        return call(self, *args, max_length=max_length, **kwargs)

    tokenization.PreTrainedTokenizerBase.__call__ = capped_call
    if grey:  # wds.decode("pil") converts to RGB; a 1-channel VAE needs the grey image
        webdataset.autodecode.imagespecs["pil"] = ("pil", None, "l")
    # webdataset >= 1.0 ends each shard with an empty end-of-shard marker, on which the script's
    # group_by_keys_nothrow raises KeyError('fname'); the script's shard reader gets the expander without it
    expander = webdataset.tariterators.tar_file_expander
    if "eof_value" in inspect.signature(expander).parameters:
        def expander_without_eof(data, *args, **kwargs):
            return expander(data, *args, **{"eof_value": None, **kwargs})

        webdataset.tariterators.tar_file_expander = expander_without_eof
    sys.argv = [str(script), *script_args]
    runpy.run_path(str(script), run_name="__main__")
    times_out.write_text(json.dumps({"times": times, "torchvision": vision}))


def prepare_reference(script: Path, folder: Path) -> dict:
    """Copies the script into ``folder`` and writes the digits shards there; returns what the runs need."""
    settings = distill_settings()
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(script, folder / REFERENCE_FILE)
    shards, n = write_digit_shards(folder / "shards", settings["resolution"], settings["channels"])
    vae = json.loads((Path(settings["teacher"]) / "vae" / "config.json").read_text())
    return {"folder": folder, "settings": settings, "shards": shards, "n_train": n, "sha": git_blob_sha(script),
            "grey": vae.get("in_channels", 3) == 1}


def run_reference(ref: dict, batch_size: int, steps: int, run_dir: Path) -> tuple[list[float], list[str], str]:
    """One run of the script from its temporary folder; (step times, its command, the torchvision used)."""
    folder = ref["folder"]
    args = reference_args(ref["settings"], batch_size, steps, ref["shards"], run_dir)
    times_out = run_dir.with_suffix(".times.json")
    runner = [sys.executable, str(Path(__file__).resolve()), "--reference-run", "--times-out", str(times_out),
              *(["--grey"] if ref["grey"] else []), "--", REFERENCE_FILE, *args]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "ACCELERATE_USE_CPU": "true",  # on the CPU, as distill's runs here (accelerate launch --cpu)
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(runner, cwd=folder, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"reference script failed (in {folder}):\n{proc.stderr[-3000:]}")
    out = json.loads(times_out.read_text())
    return out["times"], ["ACCELERATE_USE_CPU=true", "python", REFERENCE_FILE, *args], out["torchvision"]


# ---------------------------------------------------------------------------------------------- runner

def run_distill(config: str, batch_size: int, steps: int, run_dir: Path, cache_dir: Path,
                root: Path = ROOT) -> list[float]:
    """One timed ``python -m distill.train`` of ``config``, with the distill of the checkout at ``root``."""
    overrides = ["+exp=consistency", f"data.batch_size={batch_size}", f"trainer.max_steps={steps}",
                 "callbacks.quality_cost=null", "callbacks.samples=null", "callbacks.progress=null", "logger=csv",
                 "export=false", "sample_grid_seeds=0", "trainer.limit_val_batches=0",
                 "checkpoint.every_n_train_steps=1000000", f"method.latent_cache_dir={cache_dir}",
                 "+callbacks.step_timer._target_=bench.train_speed.StepTimer", f"hydra.run.dir={run_dir}",
                 *SWITCHES[config]]
    if config == "fused_adamw":
        overrides.append("trainer.gradient_clip_val=null")  # Lightning refuses clipping with a fused optimizer under AMP
    proc = subprocess.run([sys.executable, "-m", "distill.train", *overrides], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(root)})
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "step_times.json").read_text())


def run_plain(batch_size: int, steps: int) -> list[float]:
    proc = subprocess.run([sys.executable, __file__, "--plain", "--batch-sizes", str(batch_size), "--steps", str(steps)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"plain loop failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _reference_run_main(argv: list[str]) -> None:
    """``--reference-run --times-out PATH [--grey] -- SCRIPT ARGS...``: one timed run of the reference script."""
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="train_speed.py --reference-run")
    parser.add_argument("--times-out", type=Path, required=True)
    parser.add_argument("--grey", action="store_true")
    own = parser.parse_args(argv[:split])
    reference_runner(Path(argv[split + 1]), own.times_out, argv[split + 2:], own.grey)


def main() -> None:
    if sys.argv[1:2] == ["--reference-run"]:
        _reference_run_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=None, choices=[*SWITCHES, "reference"],
                        help="default: all the switches, and 'reference' when --reference-script is given")
    parser.add_argument("--reference-script", type=Path, default=None,
                        help="your copy of diffusers' examples/consistency_distillation/"
                             "train_lcm_distill_sd_wds.py (enables the 'reference' configuration; it is copied to "
                             "a temporary folder and run there)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the raw measurements as JSON")
    parser.add_argument("--plain", action="store_true", help="run only the plain loop and print its step times")
    parser.add_argument("--trees", nargs="+", default=None, metavar="NAME=PATH",
                        help="time each configuration with the distill of each checkout (e.g. before=/tmp/old "
                             "after=.), interleaved; rows are CONFIG@NAME")
    args = parser.parse_args()
    if args.plain:
        print(json.dumps(plain_loop(args.batch_sizes[0], args.steps)))
        return
    configs = args.configs or [*SWITCHES, *(["reference"] if args.reference_script else [])]
    trees = {}
    for spec in args.trees or []:
        name, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "distill" / "train.py").is_file():
            parser.exit(2, f"{parser.prog}: error: --trees {spec!r}: give NAME=PATH with PATH a distill checkout "
                           f"(PATH/distill/train.py must exist)\n")
        trees[name] = Path(path).resolve()
    if trees:
        configs = [f"{c}@{t}" if c != "reference" else c for c in configs for t in trees]
    if "reference" in configs and args.reference_script is None:
        parser.exit(2, f"{parser.prog}: error: {REFERENCE_HOWTO}\n")
    if args.reference_script is not None and not args.reference_script.is_file():
        parser.exit(2, f"{parser.prog}: error: --reference-script {args.reference_script} is not a file; "
                       f"{REFERENCE_HOWTO}\n")
    raw: dict = {}
    reference: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "latents"
        ref = prepare_reference(args.reference_script, Path(tmp) / "reference") if "reference" in configs else None
        if ref is not None:
            reference = {"script": str(args.reference_script), "script_blob": ref["sha"], "cwd": str(ref["folder"]),
                         "commands": {}, "not_passed": ref["settings"]["optimizer_extra"],
                         "distill_loss": ref["settings"]["loss_type"], "script_loss": ref["settings"]["script_loss"]}
        for batch_size in args.batch_sizes:
            for rep in range(args.repeats):
                for name in ["plain", *configs]:
                    run_dir = Path(tmp) / f"{name}-{batch_size}-{rep}"
                    if name == "plain":
                        times = run_plain(batch_size, args.steps)
                    elif name == "reference":
                        times, command, reference["torchvision"] = run_reference(ref, batch_size, args.steps, run_dir)
                        if str(batch_size) not in reference["commands"]:
                            reference["commands"][str(batch_size)] = command
                            print(f"reference at batch {batch_size}, run in {ref['folder']}: {shlex.join(command)}",
                                  file=sys.stderr, flush=True)
                    else:
                        config, _, tree = name.partition("@")
                        times = run_distill(config, batch_size, args.steps, run_dir, cache, trees.get(tree, ROOT))
                    ips, warm = images_per_s(times, batch_size, args.warmup)
                    raw.setdefault(str(batch_size), {}).setdefault(name, []).append({"images_per_s": ips, "warmup_s": warm})
                    print(f"batch {batch_size} repeat {rep} {name}: {ips:.0f} images/s (first {args.warmup} steps "
                          f"{warm:.1f} s)", file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps({**raw, **({"reference": reference} if reference else {})}, indent=1))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps, images/s over steps "
          f"{args.warmup + 1}-{args.steps}, median of {args.repeats} interleaved repeats")
    with_ref = "reference" in configs
    print("| batch | configuration | images/s | x plain loop |" + (" x reference |" if with_ref else "")
          + " first steps (s) |")
    print("|---|---|---|---|" + ("---|" if with_ref else "") + "---|")
    for batch_size, rows in raw.items():
        plain = [r["images_per_s"] for r in rows["plain"]]
        for name, runs in rows.items():
            ips = statistics.median(r["images_per_s"] for r in runs)
            ratio = statistics.median(r["images_per_s"] / p for r, p in zip(runs, plain))
            cells = [f"{ratio:.2f}"]
            if with_ref:
                ref_ratio = statistics.median(r["images_per_s"] / q["images_per_s"]
                                              for r, q in zip(runs, rows["reference"]))
                cells.append(f"{ref_ratio:.2f}")
            warm = statistics.median(r["warmup_s"] for r in runs)
            print(f"| {batch_size} | {name} | {ips:.0f} | {' | '.join(cells)} | {warm:.1f} |")
    if reference:
        print(f"reference: {REFERENCE_FILE} (git blob {reference['script_blob']}), copied to a temporary folder and "
              f"run there under this file's --reference-run hooks (step timer and the adaptations in its docstring) "
              f"as below; torchvision: {reference['torchvision']}")
        for batch_size, command in reference["commands"].items():
            print(f"  batch {batch_size}: {shlex.join(command)}")
        if reference["not_passed"]:
            print(f"  distill optimizer settings the script has no argument for: {reference['not_passed']}")


if __name__ == "__main__":
    main()
