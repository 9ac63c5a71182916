"""Training-speed switches: cached latents against fresh encoding, frozen networks in bf16 against float32,
each switch training and resuming, and bad settings failing or falling back loudly."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from distill.data.imagefolder import ImageFolderDataModule
from distill.data.latents import CachedLatentDataset, cache_folder, cached_latents
from distill.families import load_teacher
from distill.methods import base as method_base
from distill.methods.consistency import LatentConsistencyDistillation
from distill.students.copies import copy_student
from distill.utils.checkpoint import safe_load
from distill.worlds.digits import asset_path
from distill.worlds.digits.data import DigitsDataModule
from tests.conftest import run_train
from tests.test_resilience import LCM, _assert_same_state


@pytest.fixture(scope="module")
def teacher():
    return load_teacher(str(asset_path("teacher")))


def _method(teacher, **speed):
    torch.manual_seed(0)
    # +exp=consistency's guidance range (the one BENCHMARKS measured the speed switches with)
    return LatentConsistencyDistillation(teacher, lambda unet: copy_student(unet, 256),
                                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), guidance_scale_min=2.0,
                                         guidance_scale_max=6.0, **speed)


@pytest.fixture(scope="module")
def digits():
    dm = DigitsDataModule(resolution=32, batch_size=16)
    dm.setup()
    dm.train_set.images, dm.train_set.labels = dm.train_set.images[:40], dm.train_set.labels[:40]
    return dm


def _batch(items: list[dict]) -> dict:
    out = {"caption": [it["caption"] for it in items], "label": torch.tensor([it["label"] for it in items])}
    for key in ("pixel_values", "latent_mean", "latent_std"):
        if key in items[0]:
            out[key] = torch.stack([it[key] for it in items])
    return out


def test_cached_latents_equal_fresh_encoding_and_give_the_same_first_loss(teacher, digits, tmp_path):
    method = _method(teacher)
    cache = cached_latents(digits.train_set, method.vae, tmp_path, batch_size=16)
    assert len(cache) == 40 and cache.captions[3] == digits.train_set[3]["caption"]
    images = _batch([digits.train_set[i] for i in range(8)])
    cached = _batch([cache[i] for i in range(8)])
    with torch.no_grad():
        dist = method.vae.encode(images["pixel_values"]).latent_dist
    torch.testing.assert_close(cached["latent_mean"], dist.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cached["latent_std"], dist.std, rtol=1e-5, atol=1e-5)
    # the same generator gives the same posterior draw, and so the same loss
    fresh = method.latents(images, torch.Generator().manual_seed(3))
    torch.testing.assert_close(method.latents(cached, torch.Generator().manual_seed(3)), fresh, rtol=1e-4, atol=1e-4)
    loss_images = method.loss(images, torch.Generator().manual_seed(0))
    loss_cached = method.loss(cached, torch.Generator().manual_seed(0))
    assert loss_cached.item() == pytest.approx(loss_images.item(), rel=1e-4)
    # building it draws nothing from the global RNG (a run is the same whether it built the cache or found it)
    state = torch.get_rng_state()
    cached_latents(digits.train_set, method.vae, tmp_path / "other", batch_size=16)
    assert torch.equal(torch.get_rng_state(), state)
    # a second call reads the cache instead of encoding again
    again = cached_latents(digits.train_set, method.vae, tmp_path)
    assert again.folder == cache.folder and len([p for p in tmp_path.iterdir() if p.name != "other"]) == 1


def test_the_cache_is_rebuilt_when_the_vae_or_the_data_changes(teacher, digits, tmp_path):
    method = _method(teacher)
    first = cache_folder(tmp_path, method.vae, digits.train_set)
    vae = __import__("copy").deepcopy(method.vae)
    with torch.no_grad():
        next(vae.parameters()).view(-1)[0] += 1e-3
    assert cache_folder(tmp_path, vae, digits.train_set) != first
    other = DigitsDataModule(resolution=32, split_seed=1)
    other.setup()
    assert cache_folder(tmp_path, method.vae, other.train_set) != first


def test_image_folder_fingerprint_follows_the_files(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"shape {i}")
    dm = ImageFolderDataModule(str(root), resolution=8, heldout_fraction=0.25)
    dm.setup()
    before = dm.train_set.fingerprint()
    assert dm.train_set.fingerprint() == before  # stable
    name = dm.train_set.files[0].with_suffix(".txt")
    name.write_text("a different caption, longer")
    assert dm.train_set.fingerprint() != before


def test_a_bf16_teacher_moves_the_consistency_target_by_a_small_part_of_the_residual(teacher, digits):
    """The residual f_student - f_target is what the loss trains on. A bf16 teacher (its DDIM step) moves the
    target by under 10% of that residual at initialisation and under 0.3% of the target's own scale (measured
    over 3 seeds at batch 40/64/128: 1.4-5.9% and 0.06-0.16%); the target network stays at the student's
    precision. Whether training notices is measured end to end (BENCHMARKS.md)."""
    if not method_base.cpu_has_bf16():
        pytest.skip("this CPU has no native bfloat16")
    batch = _batch([digits.train_set[i] for i in range(40)])
    fp32, bf16 = _method(teacher), _method(teacher, frozen_dtype="bf16")
    bf16.student.load_state_dict(fp32.student.state_dict())
    bf16.target.load_state_dict(fp32.target.state_dict())
    bf16._check_frozen_dtype()
    captured = {}
    for name, method in (("fp32", fp32), ("bf16", bf16)):
        original = method._consistency_fn

        def spy(net, *args, _orig=original, _name=name, _student=method.student):
            out = _orig(net, *args)
            captured[_name, net is _student] = out
            return out

        method._consistency_fn = spy
        method.loss(batch, torch.Generator().manual_seed(0))
    target, student, target_bf16 = captured["fp32", False], captured["fp32", True], captured["bf16", False]
    assert target_bf16.dtype == torch.float32
    torch.testing.assert_close(captured["bf16", True], student)  # the student's pass is untouched
    moved = (target_bf16 - target).norm()
    assert 0 < moved / (student - target).norm() < 0.1
    assert moved / target.norm() < 0.003


@pytest.mark.slow  # over 30 s: in `make test-all`, out of the 15-minute default suite (stop 26)
def test_every_switch_trains_and_resumes_bit_identically(tmp_path):
    fast = ["method.frozen_dtype=bf16", "method.latent_cache=true", f"method.latent_cache_dir={tmp_path / 'cache'}",
            "trainer.precision=bf16-mixed", "method.channels_last=true"]
    base = [*LCM, *fast, "trainer.max_steps=4", "method.lr_scheduler.total_steps=4", "logger=csv"]
    straight = run_train(*base, f"hydra.run.dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "encoding" in (tmp_path / "straight" / "train.log").read_text()
    assert len(list((tmp_path / "cache").iterdir())) == 1
    first = run_train(*base, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_train(*base, "ckpt_path=last", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "training from cached latents" in (tmp_path / "resumed" / "train.log").read_text()  # built once
    a = safe_load(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    b = safe_load(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 4
    _assert_same_state(a["state_dict"], b["state_dict"])


@pytest.mark.slow
def test_compiled_student_and_frozen_networks_train_and_resume(tmp_path):
    base = [*LCM, "method.compile=true", "trainer.max_steps=3", "method.lr_scheduler.total_steps=3", "logger=csv",
            f"hydra.run.dir={tmp_path / 'run'}"]
    first = run_train(*base, "trainer.max_steps=2", timeout=1200, fresh=True)
    assert first.returncode == 0, first.stderr[-3000:]
    state = safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")["state_dict"]
    assert not any("_orig_mod" in k for k in state)  # compiled in place: the checkpoint keys are the plain ones
    second = run_train(*base, "ckpt_path=last", timeout=1200, fresh=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert safe_load(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 3


def _digit_shard(folder, digits, n: int) -> str:
    """The first ``n`` training digits as one webdataset shard (key.png + key.txt, unique keys)."""
    import io
    import tarfile

    folder.mkdir()
    path = folder / "shard-000000.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            item = digits.train_set[i]
            pixels = ((item["pixel_values"].permute(1, 2, 0).numpy() + 1) * 127.5).round().clip(0, 255)
            buffer = io.BytesIO()
            Image.fromarray(pixels.astype(np.uint8).squeeze(-1) if pixels.shape[-1] == 1 else pixels.astype(np.uint8)).save(buffer, format="PNG")
            for name, payload in ((f"{i:04d}.png", buffer.getvalue()), (f"{i:04d}.txt", f"{i}: {item['caption']}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return str(path)


def test_streamed_data_is_encoded_in_the_workers_as_the_vae_encodes_it(teacher, digits, tmp_path):
    from distill.data.latents import PosteriorEncoder
    from distill.data.shards import WebDatasetDataModule

    urls = _digit_shard(tmp_path / "shards", digits, 12)
    plain = WebDatasetDataModule(urls, resolution=32, channels=1, batch_size=5, shuffle_buffer=4)
    encoded = WebDatasetDataModule(urls, resolution=32, channels=1, batch_size=5, shuffle_buffer=4, num_workers=1)
    encoded.encode_in_workers(PosteriorEncoder(teacher.vae))
    images = {c: b["pixel_values"][i] for b in plain.train_dataloader() for i, c in enumerate(b["caption"])}
    batches = list(encoded.train_dataloader())
    assert [len(b["caption"]) for b in batches] == [5, 5, 2] and "pixel_values" not in batches[0]
    latents = {c: (b["latent_mean"][i], b["latent_std"][i]) for b in batches for i, c in enumerate(b["caption"])}
    assert sorted(latents) == sorted(images)  # every streamed image, encoded once
    assert encoded.encoder.vae.decoder is None and teacher.vae.decoder is not None  # the workers hold the encoder only
    captions = sorted(images)
    with torch.no_grad():
        dist = teacher.vae.encode(torch.stack([images[c] for c in captions])).latent_dist
    mean = torch.stack([latents[c][0] for c in captions])
    std = torch.stack([latents[c][1] for c in captions])
    torch.testing.assert_close(mean, dist.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std, dist.std, rtol=1e-5, atol=1e-5)


def test_streamed_training_with_latent_cache_encodes_in_workers(tmp_path, digits):
    urls = _digit_shard(tmp_path / "shards", digits, 24)
    run_dir = tmp_path / "run"
    proc = run_train(*LCM, "data=webdataset", f"data.urls={urls}", "data.resolution=32", "data.channels=1", "data.num_workers=1",
                     "data.shuffle_buffer=8", "method.latent_cache=true", "trainer.max_steps=3", "logger=csv",
                     f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert safe_load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 3
    assert "the frozen VAE's encoder runs in the 1 data workers" in (run_dir / "train.log").read_text()


def test_bad_speed_settings_fail_with_a_message(tmp_path):
    proc = run_train(*LCM, "method.frozen_dtype=fp8", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "bf16" in proc.stderr


def test_compile_where_unsupported_and_bf16_without_hardware(teacher, monkeypatch, caplog):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(ValueError, match="method.compile=false"):
        _method(teacher, compile=True)
    monkeypatch.undo()
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        method_base._check_compile_supported(torch.device("cpu"))
    monkeypatch.undo()
    monkeypatch.setattr(method_base, "cpu_has_bf16", lambda: False)
    method = _method(teacher, frozen_dtype="bf16")
    with caplog.at_level(logging.WARNING):
        method._check_frozen_dtype()
    assert "no native bfloat16" in caplog.text and method._frozen_autocast_dtype is None
    with pytest.raises(ValueError, match="frozen_dtype"):
        _method(teacher, frozen_dtype="int8")


def test_cached_dataset_refuses_another_format(tmp_path, teacher, digits):
    cache = cached_latents(digits.train_set, _method(teacher).vae, tmp_path)
    meta = cache.folder / "meta.json"
    meta.write_text(meta.read_text().replace('"format": 1', '"format": 99'))
    with pytest.raises(ValueError, match="delete the folder"):
        CachedLatentDataset(cache.folder)


SHRUNK = ["trainer.limit_val_batches=0", "callbacks.samples=null", "callbacks.progress=null", "export=false",
          "sample_grid_seeds=0", "logger=csv"]


@pytest.mark.parametrize("exp, extra", [
    # two rounds: the second round's teacher is a copy of the student, prepared by the same switches
    ("progressive", ["method.start_steps=8", "method.final_steps=2", "method.steps_per_round=2",
                     "callbacks.quality_cost=null", "method.frozen_dtype=bf16", "trainer.precision=bf16-mixed",
                     "method.channels_last=true"]),
    ("teacher", ["student.size=debug"]),  # plain latent diffusion: the cache stands in for its VAE encode
])
def test_progressive_and_plain_latent_diffusion_take_the_same_switches(tmp_path, exp, extra):
    run_dir = tmp_path / "run"
    proc = run_train(f"+exp={exp}", "data.batch_size=8", "trainer.max_steps=4", "method.latent_cache=true",
                     f"method.latent_cache_dir={tmp_path / 'cache'}", *extra, *SHRUNK, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "encoding" in (run_dir / "train.log").read_text()
    state = safe_load(run_dir / "checkpoints" / "last.ckpt")
    assert state["global_step"] == 4
    if exp == "progressive":
        assert state["progressive"]["round_index"] == 1  # the hand-over happened under the switches


def test_vae_encodes_in_float32_inside_a_mixed_precision_step(teacher, digits):
    from distill.methods.base import encode_latents

    pixels = _batch([digits.train_set[i] for i in range(4)])["pixel_values"]
    plain = encode_latents(teacher.vae, pixels, torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = encode_latents(teacher.vae, pixels, torch.Generator().manual_seed(0))
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, plain, rtol=0, atol=0)


def test_progressive_runs_only_the_original_teacher_in_the_frozen_dtype(teacher):
    """After a hand-over the teacher is a trained student: it runs at the student's precision, because the
    x-target divides by a_e - s_e a_t / s_t and so amplifies the teacher's error."""
    from distill.methods.progressive import ProgressiveDistillation

    torch.manual_seed(0)
    method = ProgressiveDistillation(teacher, lambda unet: copy_student(unet), optimizer=torch.optim.AdamW,
                                     start_steps=8, final_steps=2, steps_per_round=1, frozen_dtype="bf16")
    method._check_frozen_dtype()
    x, t, cond = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 16, 64)
    assert method.teacher_is_original
    with torch.no_grad():
        fp32 = teacher.denoiser(x, t, encoder_hidden_states=cond).sample
    if method_base.cpu_has_bf16():
        assert not torch.equal(method.teacher_forward(x, t, {"encoder_hidden_states": cond}), fp32)  # the original teacher: bf16
    method.finish_round()
    assert not method.teacher_is_original
    with torch.no_grad():
        student = method.student(x, t, encoder_hidden_states=cond).sample
    torch.testing.assert_close(method.teacher_forward(x, t, {"encoder_hidden_states": cond}), student, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- bench/train_speed.py's
# reference configuration (diffusers' train_lcm_distill_sd_wds.py, which is not in the wheel)

def test_digit_shards_decode_through_the_reference_scripts_webdataset_steps(tmp_path):
    import webdataset as wds

    from bench import train_speed

    pattern, n = train_speed.write_digit_shards(tmp_path, resolution=32, per_shard=2, limit=5)
    assert n == 5 and pattern.endswith("digits-{000000..000002}.tar")
    # the script's steps: decode("pil") (RGB, or grey as its runner sets for a 1-channel VAE), rename, to_tuple
    samples = list(wds.DataPipeline(wds.SimpleShardList(pattern), wds.tarfile_to_samples(), wds.decode("pill"),
                                    wds.rename(image="jpg;png;jpeg;webp", text="text;txt;caption"),
                                    wds.to_tuple("image", "text")))
    digits = DigitsDataModule(resolution=32)
    digits.setup()
    assert [text for _, text in samples] == [digits.train_set[i]["caption"] for i in range(5)]
    image = samples[3][0]
    assert image.size == (32, 32) and image.mode == "L"
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)) / 127.5 - 1
    torch.testing.assert_close(pixels, digits.train_set[3]["pixel_values"][0], rtol=0, atol=1.001 / 255)


def test_torchvision_stand_in_does_what_the_reference_loader_needs():
    from bench import train_speed

    modules = train_speed.torchvision_stand_in()
    functional, transforms = modules["torchvision.transforms.functional"], modules["torchvision.transforms"]
    image = Image.fromarray(np.arange(32 * 32, dtype=np.uint8).reshape(32, 32), mode="L")
    assert functional.resize(image, 32, interpolation=transforms.InterpolationMode.BILINEAR) is image
    assert functional.resize(image, 16).size == (16, 16)
    top, left, h, w = transforms.RandomCrop.get_params(image, output_size=(32, 32))
    assert (top, left, h, w) == (0, 0, 32, 32)
    tensor = functional.normalize(functional.to_tensor(functional.crop(image, top, left, h, w)), [0.5], [0.5])
    assert tensor.shape == (1, 32, 32)
    torch.testing.assert_close(tensor[0], torch.from_numpy(np.asarray(image, dtype=np.float32)) / 127.5 - 1)


def test_reference_arguments_follow_the_consistency_experiment():
    from bench import train_speed

    settings = train_speed.distill_settings()
    args = train_speed.reference_args(settings, 32, 6, "shards.tar", "out")
    given = dict(zip(args[::2], args[1::2]))
    assert given["--train_batch_size"] == "32" and given["--max_train_steps"] == "6"
    assert given["--mixed_precision"] == "no" and given["--loss_type"] == "huber"
    assert float(given["--w_min"]) == settings["w_min"] == 1.0 and float(given["--w_max"]) == 5.0  # scales 2-6
    assert given["--resolution"] == "32" and float(given["--learning_rate"]) == 2e-4


def test_reference_without_the_script_exits_2_saying_how_to_get_it(monkeypatch, capsys):
    from bench import train_speed

    monkeypatch.setattr("sys.argv", ["train_speed.py", "--configs", "default", "reference"])
    with pytest.raises(SystemExit) as exit_:
        train_speed.main()
    assert exit_.value.code == 2
    assert "git clone https://github.com/huggingface/diffusers" in capsys.readouterr().err


@pytest.mark.slow
def test_reference_script_runs_and_is_timed(tmp_path):
    """Needs your copy of the script: DISTILL_REFERENCE_SCRIPT=.../train_lcm_distill_sd_wds.py."""
    import os
    import subprocess
    import sys

    script = os.environ.get("DISTILL_REFERENCE_SCRIPT")
    if not script:
        pytest.skip("set DISTILL_REFERENCE_SCRIPT to diffusers' examples/consistency_distillation/"
                    "train_lcm_distill_sd_wds.py")
    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "bench/train_speed.py", "--configs", "reference", "--reference-script",
                           script, "--batch-sizes", "8", "--steps", "3", "--warmup", "1", "--repeats", "1", "--out",
                           str(tmp_path / "raw.json")], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    raw = __import__("json").loads((tmp_path / "raw.json").read_text())
    assert raw["8"]["reference"][0]["images_per_s"] > 0
    assert "--mixed_precision" in raw["reference"]["commands"]["8"]


def test_fused_optimizer_falls_back_loudly_where_it_cannot_run(teacher, monkeypatch, caplog):
    import functools
    import types

    method = _method(teacher)
    method.optimizer_factory = functools.partial(torch.optim.AdamW, lr=1e-4, fused=True)
    plugin = types.SimpleNamespace(scaler=None)
    method._trainer = types.SimpleNamespace(precision_plugin=plugin)
    assert method._optimizer_factory() is method.optimizer_factory  # CPU, no scaler: fused runs
    plugin.scaler = object()  # 16-mixed with a GradScaler
    with caplog.at_level(logging.WARNING):
        factory = method._optimizer_factory()
    assert factory.keywords == {"lr": 1e-4, "fused": False} and "GradScaler" in caplog.text
    plugin.scaler = None
    monkeypatch.setattr("torch.utils._foreach_utils._get_fused_kernels_supported_devices", lambda: ["cuda"])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert method._optimizer_factory().keywords["fused"] is False
    assert "cpu device has no fused optimizer kernels" in caplog.text
