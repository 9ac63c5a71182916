"""The evaluation set as config: today's digits numbers through the new path, KID, the metric registry, the
prompt/reference sources, early config errors, and an arbitrary SD-format pipeline on a captioned RGB image
folder (evaluate and a 2-step distillation) whose outputs never mention the embedded world."""

import csv
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from tests.conftest import CONF, run_cli, run_train
from tests.sd_tiny import write_tiny_sd


def compose_eval(*overrides: str, config: str = "evaluate"):
    from hydra import compose, initialize_config_dir

    from distill.config.resolvers import register_resolvers
    from distill.config.schema import register_configs

    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=config, overrides=list(overrides))


def instantiate_eval(*overrides: str, **kwargs):
    from hydra.utils import instantiate

    return instantiate(compose_eval(*overrides).eval, **kwargs)


# ---------------------------------------------------------------- eval=digits is today's protocol

# Measured with the code before the evaluation set existed (commit e50d8c1: build_evaluator("digits", clip,
# classifier, num_per_class=5, seed=0, resolution=32)) on the images of `digits_samples` below.
BEFORE = {
    "floor": {"fid": 3.2600485353137856, "fid_std": 0.8219390230132394},
    "noise_0.1": {"fid": 17.457493284662178, "fid_std": 1.7495131177660603, "clip_score": 86.31277465820312,
                  "clip_score_std": 0.18791658540417333, "prompt_accuracy": 1.0, "prompt_accuracy_std": 0.0},
    "noise_0.1_16px": {"fid": 4.427365742621873, "fid_std": 0.855164338887441, "clip_score": 86.18787384033203,
                       "clip_score_std": 0.1952841170957125, "prompt_accuracy": 1.0, "prompt_accuracy_std": 0.0},
    "noise_0.45": {"fid": 271.23294275550495, "fid_std": 3.2465758353640433, "clip_score": 85.55683898925781,
                   "clip_score_std": 0.4136718293452012, "prompt_accuracy": 0.14000000059604645,
                   "prompt_accuracy_std": 0.04907137667299613},
}


def digits_samples(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The first five training digits of each class in the evaluator's interleaved order, plus seeded noise."""
    from distill.worlds.digits.data import DigitsDataModule

    dm = DigitsDataModule(resolution=32)
    dm.setup()
    train = dm.train_set
    idx = torch.cat([torch.nonzero(train.labels == d).flatten()[:5] for d in range(10)]).view(10, 5).T.flatten()
    assert torch.equal(train.labels[idx], labels)
    clean = train.images[idx]
    noisy = (clean + 0.1 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(1))).clamp(-1, 1)
    return {"noise_0.1": noisy,
            "noise_0.1_16px": torch.nn.functional.interpolate(noisy, size=(16, 16), mode="bilinear", align_corners=False),
            "noise_0.45": (clean + 0.45 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(2))).clamp(-1, 1)}


def test_eval_digits_gives_the_numbers_of_the_code_before(tmp_path):
    from distill.metrics.quality_cost import build_evaluator

    eval_set = instantiate_eval("eval=digits", cache_dir=str(tmp_path))
    evaluator, floor, _ = build_evaluator(eval_set, num_per_class=5, seed=0)
    words = "zero one two three four five six seven eight nine".split()
    assert evaluator.captions == [f"a handwritten digit {w}" for _ in range(5) for w in words]
    assert evaluator.labels.tolist() == list(range(10)) * 5
    # Bit-identical on the machine that measured them; 1e-6 leaves room for other CPUs' float32 kernels.
    for key, value in BEFORE["floor"].items():
        assert floor[key] == pytest.approx(value, rel=1e-6), key
    for name, images in digits_samples(evaluator.labels).items():
        row = evaluator.quality(images)
        for key, value in BEFORE[name].items():
            assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (name, key)
        assert math.isfinite(row["kid"]) and row["kid_std"] > 0
    grid = eval_set.grid_batch(4)  # the sample-grid rows of before: each digit 0-9 four times
    assert grid["label"].tolist() == torch.arange(10).repeat_interleave(4).tolist()
    assert grid["caption"][::4] == [f"a handwritten digit {w}" for w in words]


# ---------------------------------------------------------------- KID


def test_kid_equals_torchmetrics_on_the_same_subsets():
    from torchmetrics.image.kid import KernelInceptionDistance

    from distill.metrics.kid import kernel_inception_distance

    g = torch.Generator().manual_seed(0)
    real, fake = torch.randn(100, 6, generator=g), torch.randn(80, 6, generator=g) * 1.3 + 0.2
    metric = KernelInceptionDistance(feature=nn.Flatten(), subsets=7, subset_size=20)
    metric.update(real.view(100, 6, 1, 1), real=True)
    metric.update(fake.view(80, 6, 1, 1), real=False)
    torch.manual_seed(3)  # torchmetrics draws its subsets from the global generator, in the same order
    mean, std = metric.compute()
    ours = kernel_inception_distance(real, fake, subsets=7, subset_size=20, seed=3)
    assert ours == pytest.approx((float(mean), float(std)), rel=1e-5)
    assert ours[0] > 0 and ours[1] > 0


def test_kid_is_unbiased_at_small_sample_counts_where_fid_is_not():
    """Sets of 20 from the reference distribution: KID averages to 0 over draws, FID stays well above it."""
    from distill.metrics.fid import frechet_distance, gaussian_statistics
    from distill.metrics.kid import kernel_inception_distance

    g = torch.Generator().manual_seed(0)
    reference = torch.randn(400, 4, generator=g)
    kid = torch.tensor([kernel_inception_distance(reference, torch.randn(20, 4, generator=g), 20, 10, seed=i)[0]
                        for i in range(200)])
    fid = torch.tensor([frechet_distance(*gaussian_statistics(reference),
                                         *gaussian_statistics(torch.randn(20, 4, generator=g))) for _ in range(50)])
    assert abs(kid.mean().item()) < 3 * kid.std().item() / math.sqrt(len(kid))  # centred on the true 0
    assert fid.mean().item() > 10 * fid.std().item() / math.sqrt(len(fid))  # biased upwards at 20 samples
    shifted = kernel_inception_distance(reference, torch.randn(20, 4, generator=g) + 0.5, 20, 10)
    assert shifted[0] > 3 * shifted[1] / math.sqrt(20)
    with pytest.raises(ValueError, match="at least 4"):
        kernel_inception_distance(reference, torch.randn(3, 4))


# ---------------------------------------------------------------- the registry


def test_a_registered_metric_reaches_every_table_and_csv(request, tmp_path):
    """Adding a metric is one class: the evaluator measures it, the CSV, table and console lines show it."""
    from distill.metrics.quality_cost import QualityCostEvaluator
    from distill.metrics.registry import METRICS, Estimate, Metric, Samples, mean_estimate
    from distill.metrics.report import columns, format_quality, format_table, write_csv
    from distill.report import read_rows

    class MeanBrightness(Metric):
        name, label, real_data = "brightness", "bright", True

        def __call__(self, samples: Samples) -> Estimate:
            values = samples.images.mean(dim=(1, 2, 3))
            return mean_estimate(values, samples, 20, self.seed, values.std().item() / math.sqrt(len(values)))

    METRICS.register("brightness")(MeanBrightness)
    request.addfinalizer(lambda: METRICS.unregister("brightness"))
    eval_set = instantiate_eval("eval=digits", "eval.metrics=[brightness]", "eval.clip=null")
    evaluator = QualityCostEvaluator(eval_set, num_per_class=2)
    images = torch.linspace(-1, 1, 20).view(20, 1, 1, 1).expand(20, 1, 32, 32)
    row = evaluator.quality(images)
    assert list(row) == ["replicate_key", "brightness", "brightness_std", "brightness_replicates"]
    assert row["brightness"] == pytest.approx(0.0, abs=1e-6) and len(row["brightness_replicates"]) == 20
    row.update(model="m", scheduler="ddim", steps=1)
    assert "brightness" in columns() and "bright=" in format_quality(row)
    assert "| brightness |" in format_table([row])
    write_csv([row], tmp_path / "qc.csv")
    assert float(next(csv.DictReader(open(tmp_path / "qc.csv")))["brightness_std"]) == pytest.approx(row["brightness_std"])
    assert read_rows(tmp_path / "qc.csv")[0]["brightness_replicates"] == pytest.approx(row["brightness_replicates"])


# ---------------------------------------------------------------- sources of prompts and references


def write_shapes(root: Path, size: int = 32) -> list[str]:
    """16 RGB images of coloured discs and squares with .txt captions (8 distinct); returns the captions."""
    root.mkdir(parents=True, exist_ok=True)
    colours = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
    yy, xx = np.mgrid[:size, :size]
    captions = []
    for i in range(16):
        name, rgb = list(colours.items())[i % 4]
        shape = "disc" if (i // 4) % 2 == 0 else "square"
        r = 6 + i % 3 * 2
        mask = ((yy - 16) ** 2 + (xx - 16) ** 2 < r * r) if shape == "disc" else ((abs(yy - 16) < r) & (abs(xx - 16) < r))
        array = np.full((size, size, 3), 245, dtype=np.uint8)
        array[mask] = rgb
        Image.fromarray(array).save(root / f"{i:02d}.png")
        caption = f"a {name} {shape}"
        (root / f"{i:02d}.txt").write_text(caption)
        captions.append(caption)
    return captions


def test_prompt_and_reference_sources(tmp_path):
    from distill.data import ImageFolderDataModule
    from distill.metrics.eval_set import EvalSet
    from distill.metrics.fid import FID, FeatureNet

    captions = write_shapes(tmp_path / "images")
    data = ImageFolderDataModule(str(tmp_path / "images"), resolution=16, heldout_fraction=0.5)
    from_data = EvalSet("shapes", data=data, num_prompts=3)
    prompts, labels = from_data.prompts()
    heldout = [data.heldout_set[i]["caption"] for i in range(len(data.heldout_set))]
    assert prompts == list(dict.fromkeys(heldout))[:3] and labels is None and set(prompts) <= set(captions)
    batch = from_data.grid_batch(2)
    assert batch["caption"] == [p for p in prompts for _ in range(2)] and batch["label"].tolist() == [-1] * 6
    images, key = from_data.reference_images()
    assert images.shape == (8, 3, 32, 32) and key.startswith("shapes-r32-")  # the 16px data judged at 32px

    (tmp_path / "prompts.txt").write_text("a red disc\n\na blue square\n")
    pooled = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten())  # 12 features: a full-rank covariance of 16 images
    from_file = EvalSet("files", prompts_file=str(tmp_path / "prompts.txt"), labels=[3, 1],
                        reference=str(tmp_path / "images"), resolution=16, feature=pooled, cache_dir=None)
    assert from_file.prompts()[0] == ["a red disc", "a blue square"] and from_file.prompts()[1].tolist() == [3, 1]
    folder_images, _ = from_file.reference_images()
    assert folder_images.shape == (16, 3, 16, 16) and from_file.real_images(None, 4) is None

    # .npz statistics (pytorch-fid's format) give the same FID as the images they were computed from
    fid = from_file.fid()
    features = fid.features(folder_images)
    np.savez(tmp_path / "stats.npz", mu=features.mean(0).numpy(), sigma=np.cov(features.numpy(), rowvar=False))
    from_stats = EvalSet("stats", prompts=["a red disc"], reference=str(tmp_path / "stats.npz"), resolution=16,
                         feature=pooled, cache_dir=None)
    shifted = (folder_images[:6] + 0.2).clamp(-1, 1)
    assert from_stats.fid()(shifted) == pytest.approx(fid(shifted), rel=1e-6)
    assert from_stats.fid().reference_features is None  # KID then reports NaN
    wrong = FID(FeatureNet(nn.Flatten(), "flat", (3, 8, 8)), cache_dir=None, input_shape=(3, 8, 8))
    with pytest.raises(ValueError, match="gives 192 features"):  # statistics of another feature network
        wrong.set_reference_statistics(tmp_path / "stats.npz")


@pytest.mark.parametrize("kwargs, needle", [
    ({"prompts": None}, "no prompts"),
    ({"reference": "/no/such/folder"}, "eval.reference='/no/such/folder'"),
    ({"prompts_file": "/no/such.txt", "prompts": None}, "eval.prompts_file"),
    ({"metrics": ["fid", "sharpness"]}, "unknown ['sharpness']"),
    ({"feature": "/no/such/model"}, "eval.feature='/no/such/model' does not exist"),
    ({"labels": [1, 2]}, "eval.labels has 2 entries for 1"),
])
def test_bad_eval_set_names_the_key(tmp_path, kwargs, needle):
    from distill.metrics.eval_set import EvalSet

    args = {"name": "x", "prompts": ["a"], "reference": str(tmp_path), **kwargs}
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        EvalSet(**args)


@pytest.mark.slow  # over 30 s: in `make test-all`, out of the 15-minute default suite (stop 26)
def test_bad_eval_config_fails_before_any_model_is_built(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train("eval=nope", f"hydra.run.dir={run_dir}", "logger=csv", timeout=120)
    assert proc.returncode == 1 and "eval/nope" in proc.stderr and "imagefolder" in proc.stderr
    proc = run_train("eval.reference=/no/such/folder", f"hydra.run.dir={run_dir}", "logger=csv", timeout=120)
    assert proc.returncode == 2 and "eval.reference='/no/such/folder'" in proc.stderr, proc.stderr[-2000:]
    write_shapes(tmp_path / "images")
    proc = run_train("+exp=consistency", "data=imagefolder", f"data.root={tmp_path / 'images'}", "data.resolution=32",
                     f"hydra.run.dir={run_dir}", "logger=csv", timeout=120)
    assert proc.returncode == 2 and "eval.feature is not set" in proc.stderr, proc.stderr[-2000:]
    assert not run_dir.exists()
    proc = run_cli([sys.executable, "-m", "distill.evaluate", f"pipeline={tmp_path}", "eval.reference=/no/such",
                           f"hydra.run.dir={tmp_path / 'o'}"], capture_output=True, text=True)
    assert proc.returncode == 2 and "eval.reference='/no/such'" in proc.stderr and "model_index" not in proc.stderr
    proc = run_cli([sys.executable, "-m", "distill.evaluate", f"pipeline={tmp_path}", "eval=files",
                           f"hydra.run.dir={tmp_path / 'o'}"], capture_output=True, text=True)
    assert proc.returncode == 2 and "eval.prompts_file=" in proc.stderr and "model_index" not in proc.stderr


# ---------------------------------------------------------------- any SD-format model on any captioned folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A random RGB SD-format pipeline, a captioned image folder, a CLIP vision tower (FID/KID features) and a
    CLIP model (CLIP score), each saved with save_pretrained to a local folder."""
    from diffusers import AutoencoderKL
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer, CLIPVisionConfig, CLIPVisionModel

    root = tmp_path_factory.mktemp("world")
    pipe = write_tiny_sd(root / "pipe")
    torch.manual_seed(0)
    AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
                  up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=4, norm_num_groups=4, sample_size=32,
                  scaling_factor=0.5).save_pretrained(pipe / "vae")
    vision = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_channels=3)
    CLIPVisionModel(CLIPVisionConfig(**vision)).save_pretrained(root / "vision")
    tokenizer = CLIPTokenizer.from_pretrained(pipe / "tokenizer")
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(root / "clip")
    tokenizer.save_pretrained(root / "clip")
    captions = write_shapes(root / "images")
    return {"pipe": pipe, "vision": root / "vision", "clip": root / "clip", "images": root / "images",
            "captions": set(captions)}


def world_overrides(world) -> list[str]:
    return ["data=imagefolder", f"data.root={world['images']}", "data.resolution=32", "data.heldout_fraction=0.5",
            f"eval.feature={world['vision']}", f"eval.clip={world['clip']}"]


def assert_no_digits(texts: dict[str, str]) -> None:
    for where, text in texts.items():
        assert "digit" not in text.lower(), f"{where} mentions digits: ...{text[max(0, text.lower().find('digit') - 200):][:400]}"


def grid_prompts(path: Path) -> list[str]:
    with Image.open(path) as image:
        return json.loads(image.text["prompts"])


def test_evaluate_any_pipeline_on_a_captioned_folder(world, tmp_path):
    out = tmp_path / "eval"
    proc = run_cli(
        [sys.executable, "-m", "distill.evaluate", f"pipeline={world['pipe']}", *world_overrides(world), "steps=[1,2]",
         "num_per_class=2", "cost_repeats=1", "model_name=shapes", f"hydra.run.dir={out}"],
        capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "quality_cost.csv")))
    assert [r["steps"] for r in rows] == ["1", "2"]
    for r in rows:
        for key in ("fid", "fid_std", "kid", "kid_std", "clip_score", "clip_score_std"):
            assert math.isfinite(float(r[key])), key
        assert float(r["fid"]) > 0 and float(r["fid_std"]) > 0 and r["prompt_accuracy"] == ""  # no labels
    protocol = json.loads((out / "protocol.json").read_text())
    assert set(protocol["prompts"]) <= world["captions"] and protocol["num_samples"] == 2 * len(protocol["prompts"])
    assert protocol["feature"] == f"{world['vision']}" and protocol["metrics"] == ["fid", "kid", "clip_score", "precision", "coverage"]
    assert math.isfinite(protocol["real_data_floor"])
    grids = sorted((out / "grids").glob("*.png"))
    assert len(grids) == 2 and all(set(grid_prompts(g)) <= world["captions"] for g in grids)
    assert_no_digits({"stdout": proc.stdout, "stderr": proc.stderr, "csv": (out / "quality_cost.csv").read_text(),
                      "table": (out / "table.md").read_text(), "protocol": (out / "protocol.json").read_text(),
                      "grids": json.dumps([grid_prompts(g) for g in grids])})
    proc = run_cli([sys.executable, "-m", "distill.sample", f"pipeline={world['pipe']}", f"out={tmp_path / 'g.png'}",
                           "num_seeds=1", "num_inference_steps=1", *world_overrides(world)[:4]],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(grid_prompts(tmp_path / "g.png")) <= world["captions"]


def test_two_step_distillation_of_any_pipeline_on_a_captioned_folder(world, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(
        "+exp=consistency", f"teacher.pretrained_model_name_or_path={world['pipe']}", *world_overrides(world),
        "data.batch_size=4", "student.time_cond_proj_dim=8", "trainer.max_steps=2", "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1", "checkpoint.every_n_train_steps=2", "callbacks.samples.num_seeds=1",
        "sample_grid_seeds=1", "callbacks.quality_cost.steps=[1]", "callbacks.quality_cost.teacher_schedulers=[ddim]",
        "callbacks.quality_cost.teacher_steps=[1]", "callbacks.quality_cost.num_per_class=2",
        "callbacks.quality_cost.grid_seeds=1", "logger=csv", f"hydra.run.dir={run_dir}", env={"HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(run_dir / "quality_cost.csv")))
    assert [(r["model"], r["scheduler"], r["steps"]) for r in rows] == [("teacher", "ddim", "1"), ("student", "lcm", "1")]
    for r in rows:
        assert all(math.isfinite(float(r[k])) for k in ("fid", "fid_std", "kid", "kid_std", "clip_score"))
    grids = sorted((run_dir / "samples").glob("*.png"))
    assert {g.name for g in grids} >= {"teacher-ddim-1.png", "student-lcm-1_step_0000002.png", "final.png"}
    assert all(set(grid_prompts(g)) <= world["captions"] for g in grids)
    texts = {"stdout": proc.stdout, "stderr": proc.stderr, "grids": json.dumps([grid_prompts(g) for g in grids])}
    for path in [run_dir / "quality_cost.csv", run_dir / "csv" / "metrics.csv", *run_dir.glob("*.log"),
                 run_dir / "export" / "README.md", run_dir / "export" / "distill.json"]:
        texts[str(path.relative_to(run_dir))] = path.read_text()
    assert_no_digits(texts)
