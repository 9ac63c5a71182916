"""Output + feature distillation (BK-SDM) on a flow-matching teacher (the SD3 stand-in, tests/sd3_tiny.py): the
recorded features are the image-token stream of each joint block (against the blocks called by hand), the three
terms against a hand computation at SD3's logit-normal, shifted t with the velocity target, a shallower student's
blocks on evenly spaced teacher blocks, linear regressors (FitNets) on the token width that receive gradients, what
cannot be matched refused, and two CLI steps whose export samples through DiffusionPipeline.from_pretrained."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline, SD3Transformer2DModel

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.families import load_teacher
from distill.families.base import evenly_spaced_blocks
from distill.methods.feature_distillation import FeatureDistillation
from distill.students.copies import copy_student, shallow_student
from tests.conftest import run_train
from tests.sd3_tiny import SD3_SHIFT, write_tiny_sd3

PROMPT = "a handwritten digit three"


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return write_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


@pytest.fixture(scope="module")
def teacher(sd3_dir):
    return load_teacher(str(sd3_dir))


def _method(teacher, student=copy_student, **kw) -> FeatureDistillation:
    torch.manual_seed(0)  # the regressors' initialisation
    return FeatureDistillation(teacher, student, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), **kw)


def _narrow(transformer: SD3Transformer2DModel, num_layers: int = 2, patch_size: int = 2) -> SD3Transformer2DModel:
    """The teacher's architecture at half its width (one head of 8: tokens 8 wide against the teacher's 16)."""
    config = {**dict(transformer.config), "num_attention_heads": 1, "caption_projection_dim": 8,
              "num_layers": num_layers, "dual_attention_layers": (), "patch_size": patch_size}
    torch.manual_seed(1)
    return SD3Transformer2DModel.from_config(config)


def _batch(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"pixel_values": torch.rand(n, 1, 32, 32, generator=g) * 2 - 1, "caption": [f"digit {i}" for i in range(n)]}


def _by_hand(net: SD3Transformer2DModel, x, timestep, cond) -> tuple[list, list]:
    """The transformer's forward written out (diffusers' SD3Transformer2DModel.forward): each joint block's two
    outputs (text stream, image tokens)."""
    hidden = net.pos_embed(x)  # (N, T, D)
    temb = net.time_text_embed(timestep, cond["pooled_projections"])
    context = net.context_embedder(cond["encoder_hidden_states"])
    texts, images = [], []
    for block in net.transformer_blocks:
        context, hidden = block(hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        texts.append(context)
        images.append(hidden)
    return texts, images


def test_the_recorded_features_are_each_joint_blocks_image_tokens(teacher):
    """The recorder keeps the family's ``block_feature`` of each block, JointTransformerBlock's second output: equal to
    the image tokens (N, 16 patches, 16) of the blocks called by hand, not the text stream (N, 8 + 256 tokens, 16),
    which the last block (context_pre_only) does not even return."""
    method = _method(teacher).eval()
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([0.3, 0.8])
    cond = method.family.condition({"caption": [PROMPT, ""]})
    with torch.no_grad():
        method.family.denoise(method.teacher_unet, x, t, cond)
        recorded = method._teacher_rec.pop()
        texts, images = _by_hand(method.teacher_unet, x, 1000 * t, cond)
    assert list(recorded) == ["transformer_blocks.0", "transformer_blocks.1"]
    for i, name in enumerate(recorded):
        assert recorded[name].shape == (2, 16, 16)
        torch.testing.assert_close(recorded[name], images[i], rtol=0, atol=0)
    assert texts[0].shape == (2, 8 + 256, 16) and texts[1] is None


def test_the_terms_equal_a_hand_computation_at_sd3s_times(teacher):
    """A half-width student, weights 0.5 / 2 / 3: t = shift(sigmoid(n)), n ~ N(0, 1) (SD3's logit-normal, shift 3), x_t =
    (1 - t) x0 + t eps; task = mse(v_s, eps - x0), output = mse(v_s, v_t), feature = the sum over blocks of each
    block's mse between the regressed student tokens and the teacher's (BK-SDM's sum, each term a mean)."""
    method = _method(teacher, _narrow, task_weight=0.5, output_weight=2.0, feature_weight=3.0, cond_dropout=0.0)
    assert method.flow and sorted(method.regressors) == ["transformer_blocks_0", "transformer_blocks_1"]
    assert all(isinstance(r, torch.nn.Linear) and (r.in_features, r.out_features) == (8, 16)
               for r in method.regressors.values())
    batch = _batch()
    terms = method.loss_terms(batch, torch.Generator().manual_seed(7))
    # the draws by hand, in the method's order: latents, times, noise
    g = torch.Generator().manual_seed(7)
    x0 = method.latents(batch, g)
    u = torch.sigmoid(torch.normal(0.0, 1.0, (4,), generator=g))
    t = SD3_SHIFT * u / (1 + (SD3_SHIFT - 1) * u)
    eps = torch.randn(x0.shape, generator=g)
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    cond = method.family.condition(batch)
    with torch.no_grad():
        v_t = method.teacher_unet(hidden_states=x_t, timestep=1000 * t, **cond).sample
        v_s = method.student(hidden_states=x_t, timestep=1000 * t, **cond).sample
        _, f_t = _by_hand(method.teacher_unet, x_t, 1000 * t, cond)
        _, f_s = _by_hand(method.student, x_t, 1000 * t, cond)
        feature = sum(F.mse_loss(method.regressors[f"transformer_blocks_{i}"](f_s[i]), f_t[i]) for i in range(2))
    assert terms["task"].item() == pytest.approx(F.mse_loss(v_s, eps - x0).item(), rel=1e-5)
    assert terms["output"].item() == pytest.approx(F.mse_loss(v_s, v_t).item(), rel=1e-5)
    assert terms["feature"].item() == pytest.approx(feature.item(), rel=1e-5)
    expected = 0.5 * terms["task"] + 2.0 * terms["output"] + 3.0 * terms["feature"]
    assert terms["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    assert 0.25 < t.min().item() and t.max().item() < 1  # the shift skews SD3's draws to noisier t


def test_a_shallower_student_matches_evenly_spaced_teacher_blocks(teacher):
    """Student block j of L_s -> teacher block (j + 1) L_t // L_s - 1; student=shallow keeps exactly those blocks, with
    their weights: the 1-block student's block is the teacher's last, so its tokens are the teacher's there once the
    inputs match, and a student that is the teacher has zero distillation terms."""
    assert evenly_spaced_blocks(24, 12) == list(range(1, 24, 2))
    assert evenly_spaced_blocks(24, 8) == [2, 5, 8, 11, 14, 17, 20, 23]
    assert evenly_spaced_blocks(3, 2) == [0, 2] and evenly_spaced_blocks(2, 1) == [1]
    assert evenly_spaced_blocks(4, 4) == [0, 1, 2, 3]
    method = _method(teacher, lambda net: shallow_student(net, 1), cond_dropout=0.0)
    assert method.feature_pairs == {"transformer_blocks.0": "transformer_blocks.1"} and len(method.regressors) == 0
    assert len(method.student.transformer_blocks) == 1 and method.student.transformer_blocks[0].context_pre_only
    kept = method.teacher_unet.transformer_blocks[1].state_dict()
    assert all(torch.equal(v, kept[k]) for k, v in method.student.transformer_blocks[0].state_dict().items())
    terms = method.loss_terms(_batch(), torch.Generator().manual_seed(0))
    assert terms["feature"].item() > 0  # block 1 of the teacher sees block 0's tokens, the student's the raw patches
    same = _method(teacher, cond_dropout=0.0).loss_terms(_batch(), torch.Generator().manual_seed(0))
    assert same["output"].item() == 0.0 and same["feature"].item() == 0.0 and same["task"].item() > 0


def test_gradients_reach_the_regressors_which_stay_out_of_the_export(teacher, tmp_path):
    method = _method(teacher, lambda net: _narrow(net, num_layers=1))
    assert method.feature_pairs == {"transformer_blocks.0": "transformer_blocks.1"}
    trainable = {id(p) for p in method.trainable_parameters()}
    assert all(id(p) in trainable for p in method.regressors.parameters())
    method.loss_terms(_batch(), torch.Generator().manual_seed(0))["loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in method.regressors.parameters())
    pipe = DiffusionPipeline.from_pretrained(method.export(tmp_path / "export"))
    assert pipe.transformer.config.num_layers == 1 and not any("regressor" in k for k in pipe.transformer.state_dict())


def test_what_cannot_be_matched_is_refused_naming_the_value_and_the_fix(teacher):
    with pytest.raises(ValueError, match=r"the student has 3 transformer blocks, the teacher 2: .*student=shallow "
                                         r"student.num_layers=.*method.feature_weight=0"):
        _method(teacher, lambda net: _narrow(net, num_layers=3))
    with pytest.raises(ValueError, match=r"outputs \(64, 8\), teacher block transformer_blocks.0 \(16, 16\): .*token "
                                         r"count\); set method.feature_weight=0"):
        _method(teacher, lambda net: _narrow(net, patch_size=1))  # 64 patches of 1 against the teacher's 16 of 2
    with pytest.raises(ValueError, match=r"student.num_layers=3: a student of 3 blocks cannot stand for a teacher of 2"):
        shallow_student(teacher.denoiser, 3)
    with pytest.raises(ValueError, match=r"scheduler.name: 'ddim' .*flow matching"):
        _method(teacher, sampling={"name": "ddim", "guidance_scale": 3.0, "num_inference_steps": 25})
    assert _method(teacher).sampling == {"name": "flow_euler", "guidance_scale": 7.0, "num_inference_steps": 28}


def test_two_cli_steps_export_a_pipeline_that_samples_with_cfg_on_flow_euler(sd3_dir, tmp_path):
    """+exp=compress_flow, a 1-block student (student=shallow's default, half) of the 2-block teacher: the export is a
    DistillSD3Pipeline on FlowMatchEulerDiscreteScheduler whose default call runs 28 steps of classifier-free guidance
    at 7 (two transformer rows a step)."""
    from distill.metrics.cost import NFECounter

    run_dir = tmp_path / "run"
    proc = run_train("+exp=compress_flow", f"teacher.pretrained_model_name_or_path={sd3_dir}",  # num_layers: half
                     "callbacks.quality_cost=null", "data.batch_size=4", "trainer.max_steps=2",
                     "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1", "trainer.val_check_interval=2",
                     "sample_grid_seeds=1", "logger=csv", f"hydra.run.dir={run_dir}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = run_dir / "export"
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == "DistillSD3Pipeline"
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert (index["default_num_inference_steps"], index["default_guidance_scale"], index["guidance_distilled"]) == \
        (28, 7.0, False)
    info = json.loads((export / "distill.json").read_text())
    assert info["method"] == "feature_distillation" and info["prediction_type"] == "flow_prediction"
    assert (info["time_sampling"], info["shift"]) == ("logit_normal", SD3_SHIFT)
    assert info["feature_pairs"] == {"transformer_blocks.0": "transformer_blocks.1"}
    assert info["sampling"]["nfe_per_step"] == 2
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.config.num_layers == 1
    with NFECounter(pipe.transformer) as counter:
        images = pipe(PROMPT, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert (counter.calls, counter.examples) == (28, 56) and images.shape == (1, 1, 32, 32)
    assert torch.isfinite(images).all()


def test_a_vp_sampler_or_time_proposal_on_a_flow_teacher_is_refused_at_validation(sd3_dir, compose):
    """The config check (exit 2 in distill.train, before any model is built) names the key and the fix."""
    teacher = f"teacher.pretrained_model_name_or_path={sd3_dir}"
    FeatureDistillation.check_config(compose("+exp=compress_flow", teacher))
    for override, needle in (("scheduler=ddim", "scheduler.name: 'ddim' steps a discrete VP"),
                             ("method.noise.timesteps=lognormal", "method.noise.timesteps='lognormal'"),
                             ("method.noise.stratified=true", "leave method.noise.timesteps=default, stratified=false")):
        with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
            FeatureDistillation.check_config(compose("+exp=compress_flow", teacher, override))
