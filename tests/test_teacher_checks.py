"""Teachers and pipelines of families distill does not run yet (flow matching) are refused from their configs alone,
before any weights load, through the commands users call; an SDXL folder without its second text encoder is refused
naming it; and a plain pipeline is sampled with its own pipeline's default guidance."""

import json
import shutil
from pathlib import Path

import pytest
from diffusers import FlowMatchEulerDiscreteScheduler

from distill.worlds.digits import asset_path
from tests.conftest import ROOT, run_cli, run_train

TEACHER = Path(asset_path("teacher"))


def configs_only(folder: Path, scheduler: dict | None = None, pipeline: dict | None = None,
                 unet: dict | None = None) -> Path:
    """The shipped teacher's JSON files and nothing else (no weights), with the given keys changed."""
    for config in TEACHER.rglob("*.json"):
        target = folder / config.relative_to(TEACHER)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(config, target)
    for name, changes in (("scheduler/scheduler_config.json", scheduler), ("model_index.json", pipeline),
                          ("unet/config.json", unet)):
        if changes is not None:
            path = folder / name
            path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


def flow_matching(folder: Path) -> Path:
    """An SD-layout folder whose scheduler is diffusers' FlowMatchEulerDiscreteScheduler (as SD3 and Flux ship)."""
    configs_only(folder)
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(folder / "scheduler")
    return folder


SDXL_INDEX = {"_class_name": "StableDiffusionXLPipeline", "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
              "tokenizer_2": ["transformers", "CLIPTokenizer"]}
SDXL_UNET = {"addition_embed_type": "text_time", "addition_time_embed_dim": 256}


def _evaluate(*overrides, tmp_path):
    import sys

    return run_cli([sys.executable, "-m", "distill.evaluate", *overrides, f"hydra.run.dir={tmp_path / 'eval'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_flow_matching_teacher_is_refused_by_train_before_any_weights_load(tmp_path):
    teacher = flow_matching(tmp_path / "sd3_like")
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", f"teacher.pretrained_model_name_or_path={teacher}", f"hydra.run.dir={run_dir}",
                     "logger=csv", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "FlowMatchEulerDiscreteScheduler (flow matching)" in proc.stderr  # was: 'FrozenDict' ... 'prediction_type'
    assert "teacher.pretrained_model_name_or_path" in proc.stderr and not run_dir.exists()


def test_a_flow_matching_pipeline_is_refused_by_evaluate(tmp_path):
    proc = _evaluate(f"pipeline={flow_matching(tmp_path / 'sd3_like')}", tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]  # was 0: sampled with DDPM betas and epsilon prediction
    assert "pipeline=" in proc.stderr and "FlowMatchEulerDiscreteScheduler (flow matching)" in proc.stderr
    assert not (tmp_path / "eval" / "quality_cost.csv").exists()


@pytest.mark.slow  # a process start (~15-50 s); test_an_sdxl_folder_without_its_second_text_encoder covers it in-process
def test_an_sdxl_teacher_without_its_second_text_encoder_is_refused_by_train_before_any_weights_load(tmp_path):
    teacher = configs_only(tmp_path / "sdxl", pipeline=SDXL_INDEX, unet=SDXL_UNET)
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", f"teacher.pretrained_model_name_or_path={teacher}", f"hydra.run.dir={run_dir}",
                     "logger=csv", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "names ['text_encoder_2', 'tokenizer_2'] but the folder has no text_encoder_2/, tokenizer_2/" in proc.stderr
    assert not run_dir.exists()


def test_an_sdxl_folder_without_its_second_text_encoder_is_refused_at_validation_naming_it(compose, tmp_path):
    """SDXL is a family distill runs (tests/test_family_sdxl.py); model_index.json naming text_encoder_2 and
    tokenizer_2 without their folders is refused before any weights load (was: 'is an SDXL pipeline')."""
    from distill.config.validate import ConfigError, validate

    teacher = configs_only(tmp_path / "sdxl", pipeline=SDXL_INDEX, unet=SDXL_UNET)
    cfg = compose("+exp=consistency", f"teacher.pretrained_model_name_or_path={teacher}")
    with pytest.raises(ConfigError, match=r"names \['text_encoder_2', 'tokenizer_2'\] but the folder has no "):
        validate(cfg)


def test_a_hub_teacher_is_checked_from_its_configs_before_its_weights(tmp_path, monkeypatch):
    """A hub id: model_index.json and the scheduler and UNet configs are fetched; then the weights load through the
    detected family's pipeline class (SDXL's here), never another's."""
    import diffusers
    import huggingface_hub

    from distill.families import load_teacher

    local = configs_only(tmp_path / "hub", pipeline=SDXL_INDEX, unet=SDXL_UNET)
    fetched, loaded = [], []

    def download(repo_id, filename, revision=None, **_):
        fetched.append((repo_id, filename, revision))
        return str(local / filename)

    def load_weights(cls, name, **options):
        loaded.append((cls.__name__, name, options["revision"], len(fetched)))
        raise RuntimeError("weights")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(diffusers.StableDiffusionPipeline, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("loaded by the SD family")))
    monkeypatch.setattr(diffusers.StableDiffusionXLPipeline, "from_pretrained", classmethod(load_weights))
    with pytest.raises(RuntimeError, match="weights"):
        load_teacher("someone/sdxl-base", revision="main")
    assert [f for _, f, _ in fetched] == ["model_index.json", "scheduler/scheduler_config.json", "unet/config.json"]
    assert {(r, v) for r, _, v in fetched} == {("someone/sdxl-base", "main")}
    assert loaded == [("StableDiffusionXLPipeline", "someone/sdxl-base", "main", 3)]  # after the three configs


def test_a_teacher_folder_without_its_tokenizer_folder_is_refused_naming_it(compose, tmp_path):
    from distill.config.validate import ConfigError, validate

    teacher = tmp_path / "teacher"
    shutil.copytree(TEACHER, teacher, ignore=shutil.ignore_patterns("tokenizer"))
    cfg = compose("+exp=consistency", f"teacher.pretrained_model_name_or_path={teacher}")
    with pytest.raises(ConfigError, match=r"names \['tokenizer'\] but the folder has no tokenizer/"):
        validate(cfg)  # was: OverflowError: int too big to convert, from the tokenizer's loader


def test_evaluate_samples_a_plain_pipeline_with_its_own_default_guidance(tmp_path, monkeypatch):
    """A Stable Diffusion folder without distill.json: guidance 7.5, the default of StableDiffusionPipeline.__call__
    (was 1.0, no guidance at all); the command line's value wins."""
    import inspect

    from diffusers import StableDiffusionPipeline
    from hydra import compose, initialize_config_dir

    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs
    from distill.evaluate import sweep
    from tests.conftest import CONF
    from tests.sd_tiny import write_tiny_sd

    register_configs()
    register_resolvers()
    monkeypatch.setenv("HOME", str(tmp_path))  # the FID reference cache
    pipe = write_tiny_sd(tmp_path / "pipe")
    expected = inspect.signature(StableDiffusionPipeline.__call__).parameters["guidance_scale"].default
    assert expected == 7.5
    for extra, guidance in (([], expected), (["guidance_scale=2"], 2.0)):
        out = tmp_path / f"eval{len(extra)}"
        out.mkdir()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="evaluate", overrides=[
                f"pipeline={pipe}", "schedulers=[ddim]", "steps=[2]", "num_per_class=1", "cost_repeats=1",
                "grids=false", "eval.num_prompts=2", *extra])
        (row,) = sweep(cfg, out)
        assert json.loads((out / "protocol.json").read_text())["guidance_scale"] == guidance
        assert float(row["nfe"]) == 4  # 2 steps, each a conditional and an unconditional pass (CFG)


def test_sample_takes_a_plain_pipelines_own_default_guidance(tmp_path, capsys):
    """distill.sample on a folder without distill.json: StableDiffusionPipeline's 7.5 (was 1.0), as its docstring says."""
    from hydra import compose, initialize_config_dir

    import distill.sample as sample_cmd
    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs
    from tests.conftest import CONF
    from tests.sd_tiny import write_tiny_sd

    register_configs()
    register_resolvers()
    pipe = write_tiny_sd(tmp_path / "pipe")
    for extra, guidance in (([], 7.5), (["guidance_scale=1.5"], 1.5)):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="sample", overrides=[
                f"pipeline={pipe}", f"out={tmp_path / 'grid.png'}", "prompts=[a handwritten digit three]",
                "num_seeds=1", "upscale=1", "num_inference_steps=1", *extra])
        sample_cmd.main(cfg)
        assert f"1 images, 1 steps, guidance {guidance}:" in capsys.readouterr().out


@pytest.mark.parametrize("given, expected", [(None, 7.5), (2.5, 2.5)])
def test_the_quality_cost_callback_samples_a_plain_teacher_at_its_own_default_guidance(tmp_path, monkeypatch, given,
                                                                                         expected):
    """The training callback's teacher rows: a teacher folder without distill.json at StableDiffusionPipeline's 7.5
    (was 1.0), unless callbacks.quality_cost.teacher_guidance_scale is set."""
    import types

    import torch

    from distill.callbacks.quality_cost import QualityCostCallback
    from tests.sd_tiny import write_tiny_sd

    callback = QualityCostCallback(None, teacher=str(write_tiny_sd(tmp_path / "pipe")), teacher_steps=(2,),
                                   teacher_guidance_scale=given)
    swept = []
    monkeypatch.setattr(callback, "_sweep", lambda sampler, model, plan, guidance, *a, **k: swept.append(guidance) or [])
    callback._teacher_rows(types.SimpleNamespace(student=torch.nn.Linear(2, 2)))
    assert swept == [expected]
