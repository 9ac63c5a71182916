"""Depth pruning of diffusion transformers (distill/compress/depth_prune.py, student=depth_pruned) on the embedded
digits flow DiT (4 joint blocks) and the SD3 / Flux stand-ins: removing blocks against SD3's own skip_layers and
against blocks made the identity, with the feature map of the kept blocks' original indices; the kept blocks are the
teacher's bit for bit; the importance against a hand computation; a skipped block that is the identity changes
nothing; the export is the stock class that diffusers alone loads in a fresh process; bad input refused before
compute."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from diffusers import DiffusionPipeline, StableDiffusion3Pipeline

from distill.compress.depth_prune import block_importance, depth_prune, keep_blocks, skipped
from distill.families import load_teacher
from distill.families.base import KEPT_BLOCKS
from distill.families.flux import FluxFamily
from distill.families.sd3 import StableDiffusion3Family as SD3Family
from distill.methods.feature_distillation import FeatureDistillation
from distill.worlds import asset_path
from tests.conftest import run_train
from tests.flux_tiny import tiny_flux_pipeline, write_tiny_flux
from tests.sd3_tiny import tiny_sd3_pipeline

# a block's layers whose outputs reach the residual streams: zeroed, the block is the identity
OUTPUT_LAYERS = ("attn.to_out.0", "attn.to_add_out", "attn2.to_out.0", "ff.net.2", "ff_context.net.2", "proj_out")


@pytest.fixture(scope="module")
def digits():
    return load_teacher(str(asset_path("flow_teacher")))


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vocab")
    return {"sd3": tiny_sd3_pipeline(folder / "sd3").transformer,
            "flux": tiny_flux_pipeline(folder / "flux", num_layers=2, num_single_layers=2).transformer}


def _inputs(net, n: int = 2) -> dict:
    """Seeded keyword inputs of the stand-in's forward (Flux: 16 packed tokens and their ids)."""
    c, g = net.config, torch.Generator().manual_seed(3)
    cond = {"encoder_hidden_states": torch.randn(n, 3, c.joint_attention_dim, generator=g),
            "pooled_projections": torch.randn(n, c.pooled_projection_dim, generator=g),
            "timestep": torch.full((n,), 400.0)}
    if "single_transformer_blocks" not in dict(net.named_children()):
        return {"hidden_states": torch.randn(n, c.in_channels, 8, 8, generator=g), **cond}
    return {"hidden_states": torch.randn(n, 16, c.in_channels, generator=g), "img_ids": torch.zeros(16, 3),
            "txt_ids": torch.zeros(3, 3), "guidance": torch.full((n,), 3.5), **cond}


def _out(net, inputs, **kw) -> torch.Tensor:
    with torch.no_grad():
        return net(**inputs, **kw).sample


def _identity_copy(net, blocks: dict[str, list[int]]):
    """A copy of ``net`` whose listed blocks have every output layer zeroed: each is then the identity."""
    copy = type(net).from_config(net.config)
    copy.load_state_dict(net.state_dict())
    with torch.no_grad():
        for name, indices in blocks.items():
            for i in indices:
                block = getattr(copy, name)[i]
                layers = [m for n, m in block.named_modules() if n in OUTPUT_LAYERS]
                assert layers, f"{name}.{i} has none of {OUTPUT_LAYERS}"
                for layer in layers:
                    layer.weight.zero_()
                    layer.bias.zero_()
    return copy


def _features(net, inputs, **kw) -> dict[int, torch.Tensor]:
    """The image tokens each joint block outputs (a forward hook on every block)."""
    found = {}
    handles = [b.register_forward_hook(lambda m, a, o, i=i: found.__setitem__(i, o[1]))
               for i, b in enumerate(net.transformer_blocks)]
    _out(net, inputs, **kw)
    for h in handles:
        h.remove()
    return found


def test_removing_a_block_of_a_two_block_toy_and_mapping_its_features(stand_ins):
    """SD3 stand-in (2 joint blocks, SD3.5's attn2 in block 0): keeping block 1 gives the stock class with one block
    that computes what the teacher computes with block 0 skipped by diffusers' own skip_layers, output and block
    tokens; the feature map is student block 0 -> teacher block 1. Flux stand-in (2 + 2 blocks): keeping double
    block 0 and single block 1 (not the evenly spaced choice for the double list) equals the teacher with the other
    two blocks made the identity, and the map names the kept blocks' original indices."""
    sd3 = stand_ins["sd3"]
    student = keep_blocks(sd3, {"transformer_blocks": [1]})
    assert type(student) is type(sd3) and student.config.num_layers == 1
    assert student.config.dual_attention_layers == () and student.transformer_blocks[0].context_pre_only
    inputs = _inputs(sd3)
    assert torch.equal(_out(student, inputs), _out(sd3, inputs, skip_layers=[0]))
    assert torch.equal(_features(student, inputs)[0], _features(sd3, inputs, skip_layers=[0])[1])
    assert SD3Family.feature_block_pairs(sd3, student) == {"transformer_blocks.0": "transformer_blocks.1"}

    flux = stand_ins["flux"]
    kept = {"transformer_blocks": [0], "single_transformer_blocks": [1]}
    student = keep_blocks(flux, kept)
    assert (student.config.num_layers, student.config.num_single_layers) == (1, 1)
    assert getattr(student, KEPT_BLOCKS) == kept
    inputs = _inputs(flux)
    hand = _out(_identity_copy(flux, {"transformer_blocks": [1], "single_transformer_blocks": [0]}), inputs)
    assert torch.allclose(_out(student, inputs), hand, rtol=0, atol=1e-6)
    assert FluxFamily.feature_block_pairs(flux, student) == {
        "transformer_blocks.0": "transformer_blocks.0", "single_transformer_blocks.0": "single_transformer_blocks.1"}


def test_feature_distillation_matches_each_kept_block_to_its_original(tmp_path):
    """The method's block map on a depth-pruned Flux student (double block 0, single block 1 of 2 + 2), where the
    evenly spaced map would pair the double block with teacher block 1."""
    teacher = load_teacher(str(write_tiny_flux(tmp_path / "flux", num_layers=2, num_single_layers=2)))
    method = FeatureDistillation(teacher, lambda net: keep_blocks(net, {"transformer_blocks": [0],
                                                                         "single_transformer_blocks": [1]}),
                                 optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), resolution=16)
    assert method.feature_pairs == {"transformer_blocks.0": "transformer_blocks.0",
                                    "single_transformer_blocks.0": "single_transformer_blocks.1"}
    assert method.export_info()["feature_pairs"] == method.feature_pairs


def _calib(family, n: int = 2, batches: int = 2) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 4, 8, 8, generator=g), family.null_condition(n)) for _ in range(batches)]


def test_importance_is_the_hand_computed_relative_velocity_change(digits):
    """I_b = sum_{t, batch} |v - v_{-b}|^2 / sum |v|^2 with v_{-b} from diffusers' skip_layers=[b], x_t = (1 - t) x0 +
    t eps, eps seeded seed + batch index, at the transformer's timestep 1000 t."""
    net, family = digits.denoiser, digits.family
    calib, times = _calib(family), [0.3, 0.8]
    got = block_importance(net, family, calib, flow_times=times, seed=7)["transformer_blocks"]
    change, total = torch.zeros(4, dtype=torch.float64), 0.0
    for i, (x0, cond) in enumerate(calib):
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(7 + i))
        for t in times:
            inputs = {"hidden_states": (1 - t) * x0 + t * eps, "timestep": torch.full((2,), 1000 * t), **cond}
            v = _out(net, inputs).double()
            total += v.pow(2).sum().item()
            for b in range(4):
                change[b] += (v - _out(net, inputs, skip_layers=[b]).double()).pow(2).sum().item()
    assert got == pytest.approx((change / total).tolist(), rel=1e-5)
    assert all(v > 0 for v in got)


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_skipping_a_block_that_is_the_identity_changes_nothing(name, stand_ins):
    """Every block of the stand-in, made the identity (its output layers zeroed), then skipped: the same output bit for
    bit, and the same as before the skip."""
    net = stand_ins[name]
    inputs = _inputs(net)
    for blocks in ("transformer_blocks", "single_transformer_blocks"):
        for i in range(len(getattr(net, blocks, []))):
            copy = _identity_copy(net, {blocks: [i]})
            before = _out(copy, inputs)
            with skipped(getattr(copy, blocks)[i]):
                during = _out(copy, inputs)
            assert torch.equal(during, before) and torch.equal(_out(copy, inputs), before), (blocks, i)
            assert not torch.equal(_out(net, inputs), before)  # the block did something before it was zeroed


@pytest.fixture(scope="module")
def halved(digits):
    """The digits DiT depth-pruned to 2 of its 4 blocks on two small calibration batches."""
    return depth_prune(digits.denoiser, {"transformer_blocks": 2}, digits.family, _calib(digits.family),
                       flow_times=[0.25, 0.75])


def test_the_kept_blocks_are_the_teachers_bit_for_bit_and_the_most_important(digits, halved):
    student, report = halved
    teacher = digits.denoiser
    kept = report.kept["transformer_blocks"]
    importance = report.importance["transformer_blocks"]
    assert 3 in kept and len(kept) == 2 and kept == getattr(student, KEPT_BLOCKS)["transformer_blocks"]
    assert importance[kept[0]] == max(importance[:3])  # the last (context_pre_only) stays; the best of the others
    assert type(student) is type(teacher) and student.config.num_layers == 2
    assert json.loads(json.dumps({k: v for k, v in student.config.items() if k != "num_layers"})) == \
        json.loads(json.dumps({k: v for k, v in teacher.config.items() if k != "num_layers"}))
    state, original = student.state_dict(), teacher.state_dict()
    for key, value in state.items():
        if key.startswith("transformer_blocks."):
            j, rest = key.split(".", 2)[1:]
            key = f"transformer_blocks.{kept[int(j)]}.{rest}"
        assert torch.equal(value, original[key]), key
    assert report.params_after < report.params_before and report.flops_after < 0.6 * report.flops_before


def test_the_export_is_the_stock_class_that_diffusers_alone_loads_in_a_fresh_process(digits, halved, tmp_path):
    """The digits pipeline's components with the depth-pruned transformer, saved as the stock StableDiffusion3Pipeline:
    model_index.json names diffusers' classes, and in a new process that never imports distill
    DiffusionPipeline.from_pretrained (without T5, as SD3 is loaded without it) gives the in-memory weights bit for bit, its outputs and its images."""
    student = halved[0].eval()
    teacher_pipe = DiffusionPipeline.from_pretrained(asset_path("flow_teacher"))  # a DistillSD3Pipeline
    pipe = StableDiffusion3Pipeline(**{**teacher_pipe.components, "transformer": student})
    pipe.save_pretrained(tmp_path / "export")
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    inputs = _inputs(student)
    torch.save(inputs, tmp_path / "inputs.pt")
    pipe.set_progress_bar_config(disable=True)
    call = dict(num_inference_steps=2, guidance_scale=3.0, max_sequence_length=1, output_type="pt")
    images = pipe("a handwritten digit three", generator=torch.Generator().manual_seed(0), **call).images
    script = f"""
import sys, torch
from diffusers import DiffusionPipeline
pipe = DiffusionPipeline.from_pretrained({str(tmp_path / 'export')!r}, text_encoder_3=None, tokenizer_3=None)
pipe.set_progress_bar_config(disable=True)
with torch.no_grad():
    out = pipe.transformer(**torch.load({str(tmp_path / 'inputs.pt')!r})).sample
images = pipe("a handwritten digit three", generator=torch.Generator().manual_seed(0), **{call!r}).images
assert not any(m == "distill" or m.startswith("distill.") for m in sys.modules), "distill was imported"
torch.save({{"class": type(pipe.transformer).__name__, "state": pipe.transformer.state_dict(), "out": out,
            "images": images}}, {str(tmp_path / 'out.pt')!r})
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["class"] == "SD3Transformer2DModel"
    state = student.state_dict()
    assert state.keys() == out["state"].keys() and all(torch.equal(state[k], out["state"][k]) for k in state)
    assert torch.equal(out["out"], _out(student, inputs))
    assert torch.equal(out["images"], images)


@pytest.mark.parametrize("overrides, words", [
    (["student.num_layers=5"], ["student.num_layers=5", "keep 1 to 4"]),
    (["student.num_single_layers=1"], ["student.num_single_layers=1", "set student.num_single_layers=null"]),
    (["student.calib_data=null"], ["student.calib_data=${data}"]),
    (["student.flow_times=[0.5,2.0]"], ["student.flow_times=[0.5, 2.0]", "in [0, 1]"]),
])
def test_bad_input_is_refused_at_validation_naming_value_and_fix(overrides, words, compose):
    from distill.config.validate import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(compose("+exp=compress_flow", "teacher=digits_flow", "student=depth_pruned", *overrides))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_a_unet_teacher_and_too_many_blocks_on_the_cli_exit_2(compose, tmp_path):
    from distill.config.validate import ConfigError, validate

    with pytest.raises(ConfigError, match=r"student=depth_pruned removes blocks of an SD3 or Flux transformer.*"
                                          r"student=pruned or lowrank"):
        validate(compose("+exp=compress", "student=depth_pruned"))
    proc = run_train("+exp=compress_flow", "teacher=digits_flow", "student=depth_pruned", "student.num_layers=0",
                     f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 2 and "student.num_layers=0: keep 1 to 4" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "export").exists()


@pytest.mark.slow
def test_two_cli_steps_of_feature_distillation_export_the_stock_class(tmp_path):
    """+exp=compress_flow student=depth_pruned on the digits teacher: 2 of 4 blocks kept, two training steps with the
    kept blocks' map, an export whose transformer is diffusers' SD3Transformer2DModel with num_layers 2."""
    run_dir = tmp_path / "run"
    proc = run_train("+exp=compress_flow", "teacher=digits_flow", "student=depth_pruned", "student.calib_batches=1",
                     "student.flow_times=[0.25,0.75]", "callbacks.quality_cost=null", "data.batch_size=4",
                     "trainer.max_steps=2", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1",
                     "trainer.val_check_interval=2", "sample_grid_seeds=1", "logger=csv", f"hydra.run.dir={run_dir}",
                     env={"OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "depth-pruned student: transformer_blocks kept [" in proc.stderr + proc.stdout
    index = json.loads((run_dir / "export" / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "SD3Transformer2DModel"]
    config = json.loads((run_dir / "export" / "transformer" / "config.json").read_text())
    assert config["num_layers"] == 2
    info = json.loads((run_dir / "export" / "distill.json").read_text())
    assert info["method"] == "feature_distillation"
