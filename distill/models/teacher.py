"""Teachers are diffusers pipelines, a local folder or a hub id loaded the same way: the ``Teacher`` a model family
loads (``distill.families.load_teacher``), and the checks made from a pipeline's JSON configs before any weights."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from distill.diffusion.parametrization import PREDICTION_TYPES

REQUIRED = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
SECOND_TEXT_ENCODER = ("text_encoder_2", "tokenizer_2")  # SDXL's CLIP-G tower, required where model_index.json names it
SAFETY_COMPONENTS = ("safety_checker", "feature_extractor")  # what a stock SD pipeline runs on its images


@dataclass
class Teacher:
    """The frozen parts of a latent diffusion model, and its ``family`` (a ``distill.families.ModelFamily`` instance
    bound to these parts: conditioning, latents, schedule, denoise). ``denoiser`` is the denoising network, whatever
    its kind (a UNet, a transformer): what a student is built from. The encoders of the conditioning (one CLIP, two,
    CLIP + T5, none for class labels) are the family conditioner's."""

    denoiser: nn.Module
    vae: nn.Module
    scheduler: object
    source: str
    load_options: dict = field(default_factory=dict)  # from_pretrained's revision, variant, torch_dtype for source
    family: object = None  # set by the family that loads it

    @property
    def text_encoder(self) -> nn.Module | None:
        """The conditioner's (first) text encoder; None without text conditioning."""
        return getattr(getattr(self.family, "conditioner", None), "text_encoder", None)

    @property
    def tokenizer(self):
        """The tokenizer of ``text_encoder``; None without text conditioning."""
        return getattr(getattr(self.family, "conditioner", None), "tokenizer", None)

    @property
    def prediction_type(self) -> str:
        return self.scheduler.config.prediction_type

    @property
    def vae_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)


def pipeline_configs(name_or_path: str | Path, revision: str | None = None) -> dict[str, dict]:
    """model_index.json, the scheduler's and the denoiser's config of a pipeline folder or hub id, by component
    ("pipeline", "scheduler", "unet", and "transformer" where model_index.json names one; {} for a file it lacks).
    Only these JSON files are read (for a hub id, downloaded): enough to tell the model family before any weights
    load."""
    files = {"pipeline": "model_index.json", "scheduler": "scheduler/scheduler_config.json", "unet": "unet/config.json"}
    path = Path(name_or_path)
    if path.exists():
        configs = {k: json.loads((path / f).read_text()) if (path / f).is_file() else {} for k, f in files.items()}
        return _with_transformer(configs, path, revision)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError

    configs = {}
    for key, name in files.items():
        try:
            configs[key] = json.loads(Path(hf_hub_download(str(name_or_path), name, revision=revision)).read_text())
        except EntryNotFoundError:
            configs[key] = {}
    return _with_transformer(configs, name_or_path, revision)


def _with_transformer(configs: dict[str, dict], name_or_path: str | Path, revision: str | None) -> dict[str, dict]:
    """``configs`` with "transformer": the transformer's config of a pipeline whose model_index.json names one (a
    DiT: SD3, Flux), else {}."""
    configs["transformer"] = {}
    if "transformer" in configs["pipeline"]:
        path = Path(name_or_path) / "transformer" / "config.json"
        if not Path(name_or_path).exists():
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(str(name_or_path), "transformer/config.json", revision=revision))
        configs["transformer"] = json.loads(path.read_text()) if path.is_file() else {}
    return configs


def is_flow_matching(scheduler_config: dict) -> bool:
    """A flow-matching schedule (SD3, Flux, Sana: FlowMatch* schedulers, flow sigmas or flow prediction)."""
    return (str(scheduler_config.get("_class_name", "")).startswith("FlowMatch")
            or bool(scheduler_config.get("use_flow_sigmas")) or scheduler_config.get("prediction_type") == "flow_prediction")


def check_family(name_or_path: str | Path, configs: dict[str, dict], key: str = "teacher.pretrained_model_name_or_path") -> None:
    """Refuse, from the configs alone (``pipeline_configs``), a pipeline of a family distill does not run yet: flow
    matching (its schedule is not the discrete VP one every sampler and method here steps)."""
    scheduler = configs["scheduler"]
    if is_flow_matching(scheduler):
        raise ValueError(
            f"{key}={str(name_or_path)!r} samples with {scheduler.get('_class_name', 'a flow-matching scheduler')} "
            "(flow matching), which distill does not support yet: its samplers and methods step discrete-time "
            "VP (DDPM-family) schedules; give an SD-1.x/2.x or SDXL pipeline, or an SD3 one (an SD3Transformer2DModel "
            "in transformer/: the sd3 family evaluates and samples it)")


def check_pipeline_folder(path: str | Path) -> dict:
    """model_index.json of a local Stable-Diffusion-format pipeline folder, with a clear error for anything
    else (another family, a missing component or folder, an unsupported prediction type)."""
    path = Path(path)
    index = path / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"teacher.pretrained_model_name_or_path={str(path)!r} is not a diffusers pipeline folder "
            "(no model_index.json); give a StableDiffusionPipeline folder or a hub id"
        )
    configs = pipeline_configs(path)
    check_family(path, configs)
    spec = configs["pipeline"]
    missing = [k for k in REQUIRED if k not in spec]
    if missing:
        raise ValueError(f"teacher pipeline {str(path)!r} lacks {missing}; a Stable-Diffusion-format pipeline has {list(REQUIRED)}")
    required = REQUIRED + tuple(k for k in SECOND_TEXT_ENCODER if (spec.get(k) or [None])[0] is not None)
    absent = [k for k in required if not (path / k).is_dir()]
    if absent:
        raise FileNotFoundError(
            f"teacher.pretrained_model_name_or_path={str(path)!r}: model_index.json names {absent} but the folder has "
            f"no {', '.join(k + '/' for k in absent)}; copy those folders from the pipeline it was saved from "
            "(StableDiffusionPipeline.save_pretrained writes all of them)")
    prediction_type = configs["scheduler"].get("prediction_type", "epsilon")
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(
            f"teacher {str(path)!r} has prediction_type={prediction_type!r}; supported: {list(PREDICTION_TYPES)}"
        )
    return spec


def load_safety_components(source: str, **load_options) -> dict:
    """Those of the teacher pipeline's safety checker and its image processor that it has, by component name (for
    an export to keep them: the teacher's own pipeline runs them on every image it returns). Training never runs
    them, so ``load_teacher`` leaves them out and they load only here."""
    from diffusers import StableDiffusionPipeline

    index = pipeline_configs(source, load_options.get("revision"))["pipeline"]
    present = [name for name in SAFETY_COMPONENTS if (index.get(name) or [None])[0] is not None]
    if not present:
        return {}
    others = {name: None for name, spec in index.items() if isinstance(spec, list) and name not in present}
    pipe = StableDiffusionPipeline.from_pretrained(source, **others, **load_options)
    return {name: getattr(pipe, name) for name in present}
