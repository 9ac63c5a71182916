"""What an export says about itself: ``distill.json`` (machine-readable) and a model card ``README.md``.

Both carry the intended call (scheduler, step count, guidance, UNet evaluations per step), how the guidance
was distilled, and the quality-cost rows measured for this student during training.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

INFO_FILE = "distill.json"
NOT_MEASURED = "Not measured during training (no quality-cost callback ran)."


def call_info(scheduler: str, scheduler_class: str, num_inference_steps: int, guidance_scale: float,
              cfg_pass: bool) -> dict:
    """The intended call of a pipeline: ``name`` is the scheduler's ``conf/scheduler`` name (what sweeps and
    ``distill.sample sampler=`` call it, so that a sweep's row of that name keeps the export's own scheduler),
    ``class`` the diffusers or distill class the folder holds; ``cfg_pass`` when it runs a second
    (unconditional) UNet pass a step."""
    return {"name": scheduler, "class": scheduler_class, "num_inference_steps": int(num_inference_steps),
            "guidance_scale": float(guidance_scale), "nfe_per_step": 2 if cfg_pass else 1}


def write_export_info(out_dir: str | Path, info: dict, quality_table: str | None = None) -> Path:
    """Write ``info`` to ``out_dir/distill.json`` and the model card rendered from it to ``out_dir/README.md``;
    ``quality_table``: the measured quality-cost rows as the command renders them (none: not measured)."""
    out_dir = Path(out_dir)
    if info.get("conditioning") != "class" and (out_dir / "model_index.json").is_file():
        info = dict(info, stock=stock_extras(out_dir, info.get("pipeline", "DistillTextToImagePipeline")))
    (out_dir / INFO_FILE).write_text(json.dumps(info, indent=2))
    (out_dir / "README.md").write_text(model_card(info, quality_table))
    return out_dir


def read_export_info(folder: str | Path) -> dict:
    """The export's ``distill.json`` ({} for a folder without one, e.g. a teacher from elsewhere)."""
    path = Path(folder) / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def rows_of_export(history: list[dict], num_inference_steps: int) -> list[dict]:
    """The rows of the latest quality-cost evaluation that measured ``num_inference_steps`` (the exported
    student's step count): that evaluation judged the weights the export holds."""
    steps = [r["step"] for r in history if r.get("steps") == num_inference_steps and "step" in r]
    return [r for r in history if steps and r.get("step") == max(steps)]


def attach_quality_cost(folder: str | Path, history: list[dict], render_table: Callable[[list[dict]], str]) -> list[dict]:
    """Add the quality-cost rows of this export (``rows_of_export``) to its distill.json and, rendered by
    ``render_table`` (the command's table of the rows), to its model card."""
    info = read_export_info(folder)
    if not info:
        return []
    rows = rows_of_export(history, info["sampling"]["num_inference_steps"])
    if rows:
        write_export_info(folder, dict(info, quality_cost=rows), render_table(rows))
    return rows


def _example(info: dict) -> str:
    return "" if info.get("conditioning") == "class" else '"<prompt>"'


def stock_extras(folder: Path, pipeline: str) -> dict:
    """What diffusers' stock class needs beyond the step count and the guidance to sample the folder as its distill
    class does: ``call``, the registered defaults of other call arguments (``default_max_sequence_length``: the T5
    tokens, zeros without T5, which change the transformer's context; the ``sigmas`` of ``sigma_spacing``
    "trailing"; the height and width of ``default_sample_size``, FluxPipeline's fixed 128 latent pixels otherwise,
    whose resolution shift would then differ from the one the student was trained at), and ``load``, the components
    the folder saved as null that the stock class does not list as optional (``from_pretrained(..., name=None)``)."""
    import diffusers

    import distill.inference.pipelines  # noqa: F401  (registers distill's classes with diffusers)

    index = json.loads((folder / "model_index.json").read_text())
    cls = getattr(diffusers, pipeline)
    stock = next(c for c in cls.__mro__ if c.__module__.startswith("diffusers."))
    call = {name[len("default_"):]: index[name] for name in ("default_max_sequence_length",) if name in index}
    if index.get("sigma_spacing") == "trailing":  # the grid the student learned, which the stock call must be given
        from distill.families.base import trailing_sigmas

        call["sigmas"] = trailing_sigmas(index["default_num_inference_steps"])
    if "default_sample_size" in index and (folder / "vae" / "config.json").is_file():
        blocks = json.loads((folder / "vae" / "config.json").read_text())["block_out_channels"]
        call["height"] = call["width"] = index["default_sample_size"] * 2 ** (len(blocks) - 1)
    load = [name for name, spec in index.items() if isinstance(spec, list) and spec == [None, None]
            and name not in stock._optional_components]
    return {"call": call, "load": load}


def _stock_note(info: dict) -> str:
    """How to load and call the folder through diffusers' stock class, which ignores the registered defaults; a
    method's own ``stock_note`` where no stock class can sample it (MeanFlow's two-time denoiser)."""
    if info.get("conditioning") == "class":
        return ""
    if info.get("stock_note"):
        return f"\n{info['stock_note']}\n"
    call = info["sampling"]
    guidance = 1.0 if info.get("guidance_distilled") else call["guidance_scale"]
    why = (" (the guidance is distilled: a larger value would add a CFG pass on top of it)"
           if info.get("guidance_distilled") else "")
    stock, steps, scale = stock_call(info.get("pipeline", "DistillTextToImagePipeline"))
    extras = info.get("stock") or {"call": {}, "load": []}
    arguments = ", ".join([f"num_inference_steps={call['num_inference_steps']}", f"guidance_scale={guidance}",
                           *(f"{k}={v}" for k, v in extras["call"].items())])
    load = (f" Load it with `{stock}.from_pretrained(<this folder>, {', '.join(f'{n}=None' for n in extras['load'])})`"
            " (the folder has none of these components)." if extras["load"] else "")
    grid = (" The sigmas are the grid the model was trained on; for M steps pass "
            "`num_inference_steps=M, sigmas=numpy.linspace(1, 1 / M, M).tolist()` (given sigmas, the pipeline ignores "
            "`num_inference_steps`)." if "sigmas" in extras["call"] else "")
    return (f"\nWith diffusers' stock `{stock}` (still after the import above, for distill's "
            f"component classes), pass the call explicitly: `{arguments}`{why}; its own defaults ({steps} steps, "
            f"guidance {scale}) are not this model's.{load}{grid}\n")


def stock_call(pipeline: str) -> tuple[str, int, float]:
    """The diffusers class a distill pipeline class (by name) subclasses, and that class's default step count and
    guidance (StableDiffusionPipeline: 50, 7.5; StableDiffusionXLPipeline: 50, 5.0)."""
    import inspect

    import diffusers

    import distill.inference.pipelines  # noqa: F401  (registers distill's classes with diffusers)

    cls = getattr(diffusers, pipeline)
    stock = next(c for c in cls.__mro__ if c.__module__.startswith("diffusers."))
    params = inspect.signature(stock.__call__).parameters
    return stock.__name__, params["num_inference_steps"].default, params["guidance_scale"].default


def _safety_note(info: dict) -> str:
    """What the folder keeps of the teacher's safety checker, which the pipeline runs on every image it returns."""
    if not info.get("safety_checker"):
        return ""
    return (f"\nThe teacher's safety checker (`{info['safety_checker']}`, with its `feature_extractor`) is kept: images "
            "it flags come out black and `nsfw_content_detected` says which; `from_pretrained(..., safety_checker=None)` "
            "loads the folder without it.\n")


def model_card(info: dict, quality_table: str | None = None) -> str:
    """A Hugging Face model card: the intended call, loading, how guidance was distilled, the measured rows
    (``quality_table``, rendered by the command that measured them)."""
    call = info["sampling"]
    steps, guidance, nfe = call["num_inference_steps"], call["guidance_scale"], call["nfe_per_step"]
    teacher = f" from the teacher `{info['teacher']}`" if info.get("teacher") else ""
    tag = "unconditional-image-generation" if info.get("conditioning") == "class" else "text-to-image"
    quality = quality_table or NOT_MEASURED
    return f"""---
library_name: diffusers
pipeline_tag: {tag}
tags: [distill, {info['method']}]
---

# {info['method']} student

Trained with `distill` (method `{info['method']}`{teacher}); the denoiser is a `{info['student']}`.

## Intended call

`{info['pipeline']}` registers these defaults in `model_index.json`, so `pipe({_example(info)})` uses them:
`num_inference_steps={steps}`, `guidance_scale={guidance}`, scheduler `{call.get('class', call['name'])}`;
{nfe} network evaluation(s) per step, {nfe * steps} per image.

Guidance: {info['guidance']}

## Loading

```python
import distill.inference.pipelines  # registers distill's pipeline classes with diffusers
from diffusers import DiffusionPipeline

pipe = DiffusionPipeline.from_pretrained("<this folder>")
image = pipe({_example(info)}).images[0]
```

`distill.sample` and `distill.evaluate` read the same defaults from `distill.json`.
{_stock_note(info)}{_safety_note(info)}

## Quality and cost (measured during training)

{quality}
"""
