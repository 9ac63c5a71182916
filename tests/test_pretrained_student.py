"""``student=pretrained``: a UNet trained before (pruned, low-rank, plain) is loaded as the student exactly,
gains a zero-initialised guidance-scale input that leaves its output unchanged, is refused where it does not
fit the teacher, and a pruned export is made few-step by ``+exp=consistency`` through the CLI."""

import json

import pytest
import torch
from diffusers import DiffusionPipeline, StableDiffusionPipeline, UNet2DConditionModel

from distill.compress.lowrank import LowRankUNet2DConditionModel, lowrank_unet
from distill.compress.prune import PrunedUNet2DConditionModel, prune_unet, unet_example_inputs
from distill.students.pretrained import pretrained_student
from distill.worlds.digits import asset_path


@pytest.fixture(scope="module")
def teacher_unet():
    return UNet2DConditionModel.from_pretrained(asset_path("teacher") / "unet").eval()


@pytest.fixture(scope="module")
def inputs(teacher_unet):
    return unet_example_inputs(teacher_unet, batch_size=2, text_len=16)


@pytest.fixture(scope="module")
def pruned_export(teacher_unet, inputs, tmp_path_factory):
    """A pipeline folder whose unet/ is the teacher pruned to half its parameters (untrained: weights as kept)."""
    pipe = StableDiffusionPipeline.from_pretrained(asset_path("teacher"))
    pruned, _ = prune_unet(pipe.unet, 0.5, target="params", iterative_steps=10, example_inputs=inputs)
    pipe.register_modules(unet=pruned.eval())
    folder = tmp_path_factory.mktemp("pruned_export")
    pipe.save_pretrained(folder)
    return folder, pruned


def _out(model, inputs, **extra):
    with torch.no_grad():
        return model.eval()(**inputs, **extra).sample


@pytest.mark.parametrize("where", ["pipeline", "unet"])
def test_a_pruned_export_loads_as_the_identical_student(pruned_export, teacher_unet, inputs, where):
    folder, pruned = pruned_export
    student = pretrained_student(teacher_unet, str(folder if where == "pipeline" else folder / "unet"))
    assert type(student) is PrunedUNet2DConditionModel and student.training
    assert student.config.layer_shapes == pruned.config.layer_shapes
    assert all(p.requires_grad and p.dtype == torch.float32 for p in student.parameters())
    assert torch.equal(_out(student, inputs), _out(pruned, inputs))


def test_an_added_guidance_input_starts_at_zero_and_changes_nothing(pruned_export, teacher_unet, inputs):
    folder, pruned = pruned_export
    student = pretrained_student(teacher_unet, str(folder), time_cond_proj_dim=8)
    assert student.config.time_cond_proj_dim == 8 and student.config.layer_shapes == pruned.config.layer_shapes
    assert torch.count_nonzero(student.time_embedding.cond_proj.weight) == 0
    w = torch.randn(inputs["sample"].shape[0], 8)
    assert torch.equal(_out(student, inputs, timestep_cond=w), _out(pruned, inputs))
    student.save_pretrained(folder.parent / "with_w")  # it saves and loads with the new input
    again = pretrained_student(teacher_unet, str(folder.parent / "with_w"), time_cond_proj_dim=8)
    assert torch.equal(_out(again, inputs, timestep_cond=w), _out(student, inputs, timestep_cond=w))
    with pytest.raises(ValueError, match="student.time_cond_proj_dim=8 or null"):
        pretrained_student(teacher_unet, str(folder.parent / "with_w"), time_cond_proj_dim=16)


def test_a_low_rank_and_a_plain_unet_load_too(teacher_unet, inputs, tmp_path):
    low, _ = lowrank_unet(teacher_unet, energy=0.9)
    low.save_pretrained(tmp_path / "low")
    student = pretrained_student(teacher_unet, str(tmp_path / "low"), time_cond_proj_dim=4)
    assert type(student) is LowRankUNet2DConditionModel and student.config.lowrank_ranks == low.config.lowrank_ranks
    assert torch.equal(_out(student, inputs, timestep_cond=torch.ones(2, 4)), _out(low, inputs))
    teacher_unet.save_pretrained(tmp_path / "plain")
    plain = pretrained_student(teacher_unet, str(tmp_path / "plain"))
    assert type(plain) is UNet2DConditionModel and torch.equal(_out(plain, inputs), _out(teacher_unet, inputs))


def test_a_unet_of_another_model_or_an_unknown_class_is_refused(teacher_unet, tmp_path):
    other = UNet2DConditionModel.from_config({**teacher_unet.config, "cross_attention_dim": 8})
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="cross_attention_dim=8"):
        pretrained_student(teacher_unet, str(tmp_path / "other"))
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, "_class_name": "NoSuchUNet"}))
    with pytest.raises(ValueError, match="NoSuchUNet"):
        pretrained_student(teacher_unet, str(tmp_path / "other"))
    with pytest.raises(FileNotFoundError, match="student.path="):
        pretrained_student(teacher_unet, str(tmp_path))


def test_lcm_makes_a_pruned_export_few_step_through_the_cli(pruned_export, tmp_path):
    import distill.inference.pipelines  # noqa: F401  (what `import distill` gives a user)
    from tests.conftest import run_train

    folder, pruned = pruned_export
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency", "student=pretrained", f"student.path={folder}",
                     "student.time_cond_proj_dim=256", "data.batch_size=16", "trainer.max_steps=2",
                     "callbacks.quality_cost=null", "callbacks.samples=null", "trainer.limit_val_batches=1",
                     "sample_grid_seeds=0", "logger=csv", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    pipe = DiffusionPipeline.from_pretrained(run_dir / "export")
    assert type(pipe.unet) is PrunedUNet2DConditionModel and pipe.unet.config.time_cond_proj_dim == 256
    assert pipe.unet.config.layer_shapes == pruned.config.layer_shapes
    calls = []
    pipe.unet.register_forward_hook(lambda m, a, k, o: calls.append(a[0].shape[0]) and None, with_kwargs=True)
    assert pipe("a handwritten digit 3").images[0].size == (32, 32)
    info = json.loads((run_dir / "export" / "distill.json").read_text())
    assert len(calls) == info["sampling"]["num_inference_steps"] and set(calls) == {1}  # LCM: one pass a step


def test_a_missing_path_exits_2_before_any_compute(tmp_path):
    from tests.conftest import run_train

    proc = run_train("+exp=consistency", "student=pretrained", f"student.path={tmp_path / 'nothing'}",
                     "trainer.max_steps=1", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "student.path=" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------- transformer exports (SD3, Flux, the digits DiT)

@pytest.mark.parametrize("family", ["digits_flow", "flux"])
def test_a_pruned_transformer_export_loads_as_the_identical_student(family, tmp_path):
    """A pipeline folder whose transformer/ is a pruned DiT (the digits flow teacher, SD3 layout; a Flux stand-in)
    loads as the same class with the same per-block heads and widths and the same output, from the pipeline folder
    and from its transformer/; a UNet export for a transformer teacher, and a guidance input on a transformer, are
    refused naming the fix."""
    from distill.compress.prune_transformer import prune_transformer, transformer_example_inputs

    if family == "flux":
        from tests.flux_tiny import tiny_flux_pipeline

        teacher = tiny_flux_pipeline(tmp_path / "teacher", num_layers=2, num_single_layers=2).transformer
        inputs = transformer_example_inputs(teacher, text_len=3, latent_size=8)
    else:
        from distill.families import load_teacher

        teacher = load_teacher(str(asset_path("flow_teacher"))).denoiser
        inputs = transformer_example_inputs(teacher, text_len=3)
    teacher = teacher.eval()
    pruned, _ = prune_transformer(teacher, 0.5, example_inputs=inputs)
    pruned.save_pretrained(tmp_path / "export" / "transformer")  # where an export keeps it
    # the reference: the saved network as diffusers loads it (the in-memory pruned copy's sliced weights are not
    # contiguous, and CPU kernels round such layouts differently, up to 2.4e-7 here)
    exported = type(pruned).from_pretrained(tmp_path / "export" / "transformer").eval()
    for where in (tmp_path / "export", tmp_path / "export" / "transformer"):
        student = pretrained_student(teacher, str(where))
        assert type(student) is type(pruned) and student.training
        assert student.config.pruned_blocks == pruned.config.pruned_blocks and pruned.config.pruned_blocks
        assert all(p.requires_grad and p.dtype == torch.float32 for p in student.parameters())
        with torch.no_grad():
            assert torch.equal(student.eval()(**inputs).sample, exported(**inputs).sample)
            torch.testing.assert_close(student(**inputs).sample, pruned.eval()(**inputs).sample, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="student.time_cond_proj_dim=null"):
        pretrained_student(teacher, str(tmp_path / "export"), time_cond_proj_dim=8)
    UNet2DConditionModel.from_pretrained(asset_path("teacher") / "unet").save_pretrained(tmp_path / "unet")
    with pytest.raises(ValueError, match="a UNet for a UNet teacher, a transformer for SD3/Flux"):
        pretrained_student(teacher, str(tmp_path / "unet"))


def test_a_meanflow_export_is_refused_naming_its_two_times(tmp_path, teacher_unet):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": "MeanFlowSD3Transformer2DModel"}))
    with pytest.raises(ValueError, match=r"a MeanFlow student: it takes two times \(r, t\).*method=meanflow"):
        pretrained_student(teacher_unet, str(tmp_path))
