"""Output + feature distillation (BK-SDM): each term against a direct computation, the exact limit of a student
that is the teacher (both distillation terms 0), learned regressors for a narrower student, bad settings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel

from distill.diffusion import add_noise, alpha_sigma
from distill.families import load_teacher
from distill.methods.feature_distillation import FeatureDistillation
from distill.students.copies import copy_student
from distill.worlds.digits import asset_path


@pytest.fixture(scope="module")
def teacher():
    return load_teacher(str(asset_path("teacher")))


def _method(teacher, student=copy_student, **kw):  # copy_student's default: no guidance input
    torch.manual_seed(0)
    return FeatureDistillation(teacher, student, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), **kw)


def _batch(n: int = 6) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"pixel_values": torch.rand(n, 1, 32, 32, generator=g) * 2 - 1, "caption": [f"digit {i}" for i in range(n)],
            "label": torch.arange(n)}


def _narrow(unet: UNet2DConditionModel) -> UNet2DConditionModel:
    """The teacher's architecture at half the width of its last two stages (block outputs narrower)."""
    config = dict(unet.config)
    config["block_out_channels"] = [32, 32, 32]
    return UNet2DConditionModel.from_config(config)


def test_a_student_that_is_the_teacher_has_zero_distillation_terms(teacher):
    method = _method(teacher)
    terms = method.loss_terms(_batch(), torch.Generator().manual_seed(0))
    assert terms["output"].item() == 0.0 and terms["feature"].item() == 0.0
    assert terms["task"].item() > 0 and len(method.regressors) == 0
    assert terms["loss"].item() == pytest.approx(terms["task"].item())


def test_terms_equal_a_direct_computation(teacher):
    method = _method(teacher, _narrow, task_weight=0.5, output_weight=2.0, feature_weight=3.0, cond_dropout=0.0)
    # the narrow student's down_blocks.1/2 and up blocks 0/1 are 32 wide against the teacher's 64 (BK-SDM matches
    # the down and up stages, not the mid block)
    assert sorted(method.regressors) == ["down_blocks_1", "down_blocks_2", "up_blocks_0", "up_blocks_1"]
    assert list(method.family.feature_blocks(method.student)) == ["down_blocks.0", "down_blocks.1", "down_blocks.2", "up_blocks.0",
                                                    "up_blocks.1", "up_blocks.2"]
    batch = _batch()
    terms = method.loss_terms(batch, torch.Generator().manual_seed(7))
    # the same draws by hand: latents, timesteps, noise, in the method's order
    g = torch.Generator().manual_seed(7)
    x0 = method.latents(batch, g)
    t = torch.randint(0, method.num_train_timesteps, (6,), generator=g)
    eps = torch.randn(x0.shape, generator=g)
    x_t = add_noise(x0, eps, *alpha_sigma(teacher.scheduler.alphas_cumprod, t, 4))  # the teacher's own table
    cond = method.conditioner(batch)["encoder_hidden_states"]
    feats = {}

    def keep(which: str, name: str):
        def hook(module, args, output):  # returns None: the output is not replaced
            feats[(which, name)] = output[0] if isinstance(output, tuple) else output
        return hook

    hooks = [b.register_forward_hook(keep(w, n))
             for w, net in (("t", method.teacher_unet), ("s", method.student)) for n, b in method.family.feature_blocks(net).items()]
    with torch.no_grad():
        out_t = method.teacher_unet(x_t, t, encoder_hidden_states=cond).sample
        out_s = method.student(x_t, t, encoder_hidden_states=cond).sample
    for h in hooks:
        h.remove()
    assert terms["task"].item() == pytest.approx(F.mse_loss(out_s, eps).item(), rel=1e-5)
    assert terms["output"].item() == pytest.approx(F.mse_loss(out_s, out_t).item(), rel=1e-5)
    feature = 0.0
    for name in method.family.feature_blocks(method.teacher_unet):
        f_s = feats[("s", name)]
        key = name.replace(".", "_")
        if key in method.regressors:
            f_s = method.regressors[key](f_s)
        feature += F.mse_loss(f_s, feats[("t", name)]).item()
    assert terms["feature"].item() == pytest.approx(feature, rel=1e-5)
    expected = 0.5 * terms["task"] + 2.0 * terms["output"] + 3.0 * terms["feature"]
    assert terms["loss"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_regressors_train_with_the_student_and_stay_out_of_the_export(teacher, tmp_path):
    method = _method(teacher, _narrow)
    trainable = {id(p) for p in method.trainable_parameters()}
    assert all(id(p) in trainable for p in method.regressors.parameters())
    loss = method.loss_terms(_batch(), torch.Generator().manual_seed(0))["loss"]
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in method.regressors.parameters())
    method.student.zero_grad()
    out = method.export(tmp_path / "export")
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(out)
    assert pipe.unet.config.block_out_channels == [32, 32, 32]
    assert not any("regressor" in k for k in pipe.unet.state_dict())
    image = pipe("3", num_inference_steps=2, output_type="np").images
    assert image.shape == (1, 32, 32, 3) or image.shape[:3] == (1, 32, 32)


@pytest.mark.parametrize("kw, needle", [
    ({"task_weight": -1.0}, "method.task_weight=-1.0"),
    ({"task_weight": 0.0, "output_weight": 0.0, "feature_weight": 0.0}, "nothing to train"),
    ({"cond_dropout": 1.0}, "method.cond_dropout=1.0"),
    # a guidance input turns diffusers' CFG off: the student would sample unguided
    ({"student": lambda unet: copy_student(unet, 256)}, "student.time_cond_proj_dim=256"),
])
def test_bad_settings_name_the_key(teacher, kw, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        _method(teacher, **kw)


@pytest.mark.parametrize("student, cls, overrides", [
    ("lowrank", "LowRankUNet2DConditionModel", ["student.budget=0.5"]),
    # Diff-Pruning's Taylor importance on two batches of the training data (every 100th timestep: the default loop
    # over every timestep is tested against the reference in test_compress_prune.py, and takes minutes here)
    ("pruned", "PrunedUNet2DConditionModel", ["student.importance=taylor", "student.calib_data=${data}",
                                              "student.calib_batches=2", "student.timesteps=[0,100,200,300,400]"]),
])
def test_compress_recipe_trains_a_student_that_loads_and_samples_as_the_teacher(tmp_path, student, cls, overrides):
    import json

    from diffusers import DiffusionPipeline

    import distill.inference.pipelines  # noqa: F401  (what `import distill` gives a user: distill's pipeline classes)
    from tests.conftest import run_train

    run_dir = tmp_path / "run"
    proc = run_train("+exp=compress", f"student={student}", *overrides, "data.batch_size=16",
                     "trainer.max_steps=3", "callbacks.quality_cost=null", "callbacks.samples=null",
                     "trainer.limit_val_batches=1", "sample_grid_seeds=0", "logger=csv", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((run_dir / "export" / "distill.json").read_text())
    assert info["student"] == cls and info["sampling"]["nfe_per_step"] == 2
    pipe = DiffusionPipeline.from_pretrained(run_dir / "export")  # a user's call: no argument but the prompt
    params = sum(p.numel() for p in pipe.unet.parameters())
    assert type(pipe.unet).__name__ == cls and params < 0.6 * 1_489_028
    calls = []
    pipe.unet.register_forward_hook(lambda m, a, k, o: calls.append(a[0].shape[0]) and None, with_kwargs=True)
    image = pipe("a handwritten digit 3").images[0]
    assert image.size == (32, 32) and len(calls) == 25 and set(calls) == {2}  # DDIM 25, conditional + unconditional


@pytest.mark.parametrize("student, override, needle", [
    ("lowrank", "student.budget=1.5", "budget"), ("lowrank", "student.energy=0.9", "exactly one"),
    ("pruned", "student.ratio=1.0", "student.ratio"), ("pruned", "student.ratio=0", "student.ratio"),
    ("pruned", "student.importance=taylor", "student.calib_data"),
])
def test_bad_compression_settings_exit_2_naming_the_key(tmp_path, student, override, needle):
    from tests.conftest import run_train

    proc = run_train("+exp=compress", f"student={student}", override, "trainer.max_steps=1", "logger=csv",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_mid_block_is_matched_on_request(teacher):
    method = _method(teacher, _narrow, cond_dropout=0.0, match_mid_block=True)
    assert list(method.family.feature_blocks(method.student, mid_block=True))[3] == "mid_block"
    narrower = method.student.mid_block.resnets[-1].conv2.out_channels < method.teacher_unet.mid_block.resnets[-1].conv2.out_channels
    assert ("mid_block" in method.regressors) == narrower
    terms = method.loss_terms(_batch(), torch.Generator().manual_seed(7))
    plain = _method(teacher, _narrow, cond_dropout=0.0).loss_terms(_batch(), torch.Generator().manual_seed(7))
    assert terms["feature"].item() > plain["feature"].item()  # one more (non-zero) block term
