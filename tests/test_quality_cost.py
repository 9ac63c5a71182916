"""The quality-cost sweep end to end: `distill.evaluate` on a pipeline folder, and the training callback."""

import csv
import json
import sys

import pytest
import torch

from tests.conftest import run_cli, run_train
from tests.sd_tiny import write_tiny_sd


@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "pipe")


def tiny_teacher_run(tiny_sd) -> list[str]:
    """Overrides of a short `+exp=teacher` training on the tiny SD world."""
    return ["+exp=teacher", f"method.vae.pretrained_model_name_or_path={tiny_sd / 'vae'}",
            f"method.conditioner.text_encoder.pretrained_model_name_or_path={tiny_sd / 'text_encoder'}",
            f"method.conditioner.tokenizer.pretrained_model_name_or_path={tiny_sd / 'tokenizer'}",
            "student.size=debug", "student.cross_attention_dim=32", "data.batch_size=8"]


def test_evaluate_command_writes_table_csv_plot_and_grids(tiny_sd, tmp_path):
    out = tmp_path / "eval"
    proc = run_cli(
        [sys.executable, "-m", "distill.evaluate", f"pipeline={tiny_sd}", "schedulers=[ddim,euler]", "steps=[1,2]",
         "num_per_class=2", "cost_repeats=1", "model_name=tiny", "guidance_scale=1", f"hydra.run.dir={out}"],
        capture_output=True, text=True, env={**__import__("os").environ, "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "quality_cost.csv")))
    assert [(r["scheduler"], r["steps"]) for r in rows] == [("ddim", "1"), ("ddim", "2"), ("euler", "1"), ("euler", "2")]
    for r in rows:
        # Guidance 1.0 (set; the folder's own default is StableDiffusionPipeline's 7.5): one evaluation per step and
        # image, counted by the hook.
        assert float(r["nfe"]) == float(r["steps"])
        assert float(r["fid"]) > 0 and 0 <= float(r["prompt_accuracy"]) <= 1 and float(r["gflops_per_image"]) > 0
        p = float(r["prompt_accuracy"])  # the standard error of a proportion over the 20 samples
        assert float(r["prompt_accuracy_std"]) == pytest.approx((p * (1 - p) / 20) ** 0.5)
        assert float(r["fid_std"]) > 0 and float(r["clip_score_std"]) > 0
    # The numbers of the code before the evaluation set existed (commit e50d8c1, same command with
    # schedulers=[ddim]): eval=digits is that protocol.
    before = {"1": (249.04693748961682, 5.511684655848239, 17.666828155517578, 4.776669244087328, 0.05),
              "2": (249.62473128007315, 5.45432388875431, 18.74188232421875, 5.112400745136742, 0.05)}
    for r in rows[:2]:
        measured = [float(r[k]) for k in ("fid", "fid_std", "clip_score", "clip_score_std", "prompt_accuracy")]
        assert measured == pytest.approx(before[r["steps"]], rel=1e-4)
        assert 0 < float(r["kid_std"]) and abs(float(r["kid"])) < 1e3
        assert 0 <= float(r["coverage"]) <= 1 and 0 < float(r["coverage_std"]) < 0.5  # 20 samples, 360 balls
    assert "±" in (out / "table.md").read_text()
    assert (out / "pareto.png").stat().st_size > 1000
    assert len(list((out / "grids").glob("tiny-*.png"))) == 4
    protocol = json.loads((out / "protocol.json").read_text())
    assert protocol["num_samples"] == 20 and protocol["eval"] == "digits" and protocol["metrics"] == [
        "fid", "kid", "clip_score", "prompt_accuracy", "precision", "coverage"]
    assert (protocol["real_data_floor"], protocol["real_data_floor_std"]) == pytest.approx(
        (8.856545011544767, 1.3143815379493742), rel=1e-5)  # as before (float32 features: ~1e-7 run to run)
    assert "real-data floor" in proc.stdout
    # The reference statistics were cached under $HOME for the next run.
    assert list((tmp_path / ".cache" / "distill" / "fid_reference").glob("*.pt"))


def test_evaluate_rejects_bad_input(tmp_path):
    proc = run_cli([sys.executable, "-m", "distill.evaluate", f"pipeline={tmp_path}", f"hydra.run.dir={tmp_path / 'o'}"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "model_index.json" in proc.stderr
    proc = run_cli([sys.executable, "-m", "distill.evaluate", "schedulers=[plms]", f"hydra.run.dir={tmp_path / 'o'}"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "plms" in proc.stderr


def test_cfg_doubles_counted_nfe(tiny_sd):
    from diffusers import StableDiffusionPipeline

    from distill.metrics.cost import NFECounter
    from distill.metrics.quality_cost import PipelineSampler

    sampler = PipelineSampler(StableDiffusionPipeline.from_pretrained(tiny_sd))
    with NFECounter(sampler.denoiser) as counter:
        sampler(["a handwritten digit one"] * 3, torch.ones(3), "ddim", 4, 3.0, torch.Generator().manual_seed(0))
    assert counter.calls == 4 and counter.examples == 3 * 4 * 2


def test_swept_scheduler_takes_its_own_options(tiny_sd):
    """A hub-style teacher (leading spacing, steps_offset=1): each swept scheduler takes the options of its
    conf/scheduler/<name>.yaml over the pipeline's config (DDIM: trailing spacing, ending at t = 999)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from distill.inference.schedulers import make_scheduler
    from distill.metrics.quality_cost import PipelineSampler, scheduler_options

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing="leading", steps_offset=1)
    assert scheduler_options("ddim") == {"timestep_spacing": "trailing"}
    expected = make_scheduler("ddim", pipe.scheduler.config, timestep_spacing="trailing")
    expected.set_timesteps(4)
    assert expected.timesteps.tolist() == [999, 749, 499, 249]
    sampler = PipelineSampler(pipe)
    own = PipelineSampler(pipe, {"ddim": {}})  # options given by name (distill.evaluate's group) win over the yaml
    sampler(["a handwritten digit one"] * 2, torch.ones(2), "ddim", 4, 1.0, torch.Generator().manual_seed(0))
    assert sampler.pipe.scheduler.timesteps.tolist() == expected.timesteps.tolist()
    own(["a handwritten digit one"] * 2, torch.ones(2), "ddim", 4, 1.0, torch.Generator().manual_seed(0))
    assert own.pipe.scheduler.timesteps.tolist() == [751, 501, 251, 1]
    with pytest.raises(ValueError, match="plms"):
        sampler.scheduler("plms")


def test_teacher_rows_run_on_the_students_device_and_dtype(tiny_sd, tmp_path):
    """The teacher pipeline follows the student (float64 on the CPU standing in for another device/dtype)."""
    from types import SimpleNamespace

    from distill.callbacks.quality_cost import QualityCostCallback

    seen = {}

    class RecordingEvaluator:
        def sweep(self, sampler, model, plan, guidance_scale, measure, on_row):
            (scheduler, steps), = plan
            images = sampler(["a handwritten digit one"] * 2, torch.ones(2), scheduler, steps, guidance_scale,
                             torch.Generator().manual_seed(0))
            parameter = next(sampler.denoiser.parameters())
            seen[model] = (parameter.device, parameter.dtype, images.dtype)
            return [{"model": model, "scheduler": scheduler, "steps": steps, "fid": 1.0, "fid_std": 0.1,
                     "latency_s": 0.01}]

    callback = QualityCostCallback(None, steps=[1], teacher=str(tiny_sd), teacher_steps=[1], grid_seeds=0,
                                   measure_cost=False)
    callback._evaluator, callback._floor = RecordingEvaluator(), {"fid": 0.5, "fid_std": 0.05}
    student = torch.nn.Linear(2, 2).double()
    method = SimpleNamespace(student=student, sampling={},
                             generate=lambda batch, generator, **kw: torch.zeros(len(batch["caption"]), 1, 32, 32,
                                                                                 dtype=torch.float64))
    trainer = SimpleNamespace(is_global_zero=True, global_step=1, sanity_checking=False, fast_dev_run=False, callbacks=[],
                              default_root_dir=str(tmp_path), loggers=[])
    callback.run(trainer, method)
    assert seen["teacher"] == seen["student"] == (torch.device("cpu"), torch.float64, torch.float64)


def test_quality_cost_callback_during_training(tiny_sd, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        *tiny_teacher_run(tiny_sd), "trainer.max_steps=4",
        "trainer.val_check_interval=4", "trainer.limit_val_batches=1", "checkpoint.every_n_train_steps=4",
        "callbacks=[default,quality_cost]", "callbacks.quality_cost.every_n_steps=2",
        "callbacks.quality_cost.steps=[1,2]", f"callbacks.quality_cost.teacher={tiny_sd}",
        "callbacks.quality_cost.teacher_steps=[2]", "callbacks.quality_cost.num_per_class=1",
        "callbacks.samples=null", "sample_grid_seeds=0", "logger=[csv,tensorboard,wandb]", f"hydra.run.dir={run_dir}",
        "scheduler.num_inference_steps=2", env={"HOME": str(tmp_path), "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = next(r for r in csv.DictReader(open(run_dir / "quality_cost.csv"))
                 if (r["model"], r["steps"], r["step"]) == ("student", "2", "4"))
    # TensorBoard's HParams dashboard: the run's overrides against the student's final FID and latency
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0}).Reload()
    starts = [plugin_data_pb2.HParamsPluginData.FromString(v.metadata.plugin_data.content).session_start_info
              for f in sorted((run_dir / "tensorboard").glob("events.*")) for e in EventFileLoader(str(f)).Load()
              for v in e.summary.value if v.tag == "_hparams_/session_start_info"]
    # the last session (what the dashboard shows) holds the job's overrides
    assert starts[-1].hparams["callbacks.quality_cost.num_per_class"].string_value == "1"
    fid = [e.value for e in events.Scalars("hparams/fid")]
    assert fid == [pytest.approx(float(final["fid"]), rel=1e-5)]
    assert events.Scalars("hparams/latency_s")[0].value == pytest.approx(float(final["latency_s"]), rel=1e-5)
    # wandb (offline): the quality-cost table and its scatter chart are in the run's records
    (records,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = records.read_bytes()
    assert b"quality_cost" in data and b"quality_cost_scatter" in data and b"table-file" in data
    rows = list(csv.DictReader(open(run_dir / "quality_cost.csv")))
    # teacher once, then the student at steps 2 and 4 (the end), each at NFE 1 and 2
    assert [(r["model"], r["steps"], r["step"]) for r in rows] == [
        ("teacher", "2", "2"), ("student", "1", "2"), ("student", "2", "2"), ("student", "1", "4"), ("student", "2", "4")]
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["pareto_step_0000002.png", "pareto_step_0000004.png"]
    metrics = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    assert any(r.get("val/fid@ddim-2") for r in metrics) and any(r.get("val/fid_floor") for r in metrics)
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("QualityCost"))
    assert len(state["teacher_rows"]) == 1


def test_teacher_follows_the_trained_parameter_of_a_lora_like_student():
    """A frozen float64 base weight before a trainable float32 adapter: the adapter's dtype is the student's."""
    from distill.callbacks.quality_cost import trained_parameter

    base, adapter = torch.nn.Linear(2, 2).double().requires_grad_(False), torch.nn.Linear(2, 2)
    assert trained_parameter(torch.nn.Sequential(base, adapter)) is adapter.weight
    frozen = torch.nn.Sequential(torch.nn.Linear(2, 2).double(), torch.nn.Linear(2, 2)).requires_grad_(False)
    assert trained_parameter(frozen).dtype == torch.float64  # nothing trainable: the first parameter


def test_fid_bootstrap_strata_are_labels_else_prompt_ids():
    from distill.metrics.eval_set import draw_like
    from distill.metrics.fid import PenultimateFeatures
    from distill.metrics.quality_cost import prompt_strata
    from distill.models.classifier import ImageClassifier

    assert prompt_strata(["a", "b"], torch.tensor([7, 3])).tolist() == [7, 3]
    assert prompt_strata(["a", "b", "a", "c"], None).tolist() == [0, 1, 0, 2]
    labels = torch.tensor([0, 1, 1, 2, 1, 0, 2, 2])
    idx = draw_like(labels, torch.tensor([2, 1, 1, 0]), torch.Generator().manual_seed(0))
    assert sorted(labels[idx].tolist()) == [0, 1, 1, 2] and len(set(idx.tolist())) == 4
    assert isinstance(ImageClassifier(), PenultimateFeatures)  # the shipped classifier is measured by .features


@pytest.mark.slow  # ~30 s; the fusion's exactness is tested per layer in test_compress_fusion
def test_evaluate_fused_unet_gives_the_same_rows(tiny_sd, tmp_path):
    """fuse_qkv / channels_last are sampling options: the same images (FID, CLIP within float noise) under a
    model name that says so."""
    rows = {}
    for name, extra in (("plain", []), ("fused", ["fuse_qkv=true", "channels_last=true"])):
        out = tmp_path / name
        proc = run_cli(
            [sys.executable, "-m", "distill.evaluate", f"pipeline={tiny_sd}", "schedulers=[ddim]", "steps=[2]",
             "num_per_class=2", "cost_repeats=1", "grids=false", *extra, f"hydra.run.dir={out}"],
            capture_output=True, text=True, env={**__import__("os").environ, "HOME": str(tmp_path)},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[name] = next(csv.DictReader(open(out / "quality_cost.csv")))
    assert rows["fused"]["model"] == rows["plain"]["model"] + "+qkv+channels_last"
    for key in ("fid", "clip_score", "prompt_accuracy"):
        assert float(rows["fused"][key]) == pytest.approx(float(rows["plain"][key]), rel=1e-4, abs=1e-4), key


@pytest.mark.slow  # ~30 s; each accelerator has its own tests
def test_quality_cost_callback_sweeps_accelerators(tiny_sd, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        *tiny_teacher_run(tiny_sd), "trainer.max_steps=2",
        "trainer.limit_val_batches=1", "callbacks=[default,quality_cost]", "callbacks.quality_cost.every_n_steps=0",
        "callbacks.quality_cost.steps=[6]", f"callbacks.quality_cost.teacher={tiny_sd}",
        "callbacks.quality_cost.teacher_steps=[6]", "callbacks.quality_cost.num_per_class=1",
        "callbacks.quality_cost.accelerators=[none,deepcache,forecast,classifier]", "callbacks.samples=null",
        "sample_grid_seeds=0", "logger=csv", f"hydra.run.dir={run_dir}", env={"HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "quality_cost.csv")))
    assert [(r["model"], r["accelerate"]) for r in rows] == [
        (m + s, a) for m in ("teacher", "student") for s, a in (("", "none"), ("+deepcache", "deepcache"),
                                                                ("+forecast", "forecast"), ("+classifier", "classifier"))]
    for model in ("teacher", "student"):
        nfe = {r["accelerate"]: float(r["nfe"]) for r in rows if r["model"].startswith(model)}
        flops = {r["accelerate"]: float(r["gflops_per_image"]) for r in rows if r["model"].startswith(model)}
        assert nfe["deepcache"] == nfe["none"] and flops["deepcache"] < flops["none"]
        assert nfe["forecast"] == nfe["none"] * 4 / 6  # real steps 0, 1, 3, 5 of 6
        assert nfe["classifier"] == nfe["none"] and flops["classifier"] > flops["none"]  # the guide's passes
    metrics = list(csv.DictReader(open(run_dir / "csv" / "metrics.csv")))
    assert any(r.get("val/fid@ddim-6+forecast") for r in metrics)


def test_an_unknown_accelerator_preset_fails_before_training(tmp_path):
    proc = run_train("callbacks=[default,quality_cost]", "callbacks.quality_cost.accelerators=[none,warp]",
                     "trainer.max_steps=1", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "accelerator 'warp'" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
