"""LoRA students and gradient checkpointing on the flow-matching transformers (SD3's MMDiT, Flux), on the random
stand-ins (tests/sd3_tiny.py, tests/flux_tiny.py): the default targets are the network class's, only the adapters
train and with them disabled the student is the teacher; the exported lora/ file is what the stock pipeline's
``load_lora_weights`` reads whole, in a process that never imports distill, and gives the merged export's images;
two CLI steps of ``+exp=consistency_flow student=lora``; checkpointing changes no gradient of a copy or LoRA student.
"""

from __future__ import annotations

import copy
import csv
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

import distill.inference.pipelines  # noqa: F401  (registers distill's export classes, as a user loading an export does)
from distill.families import load_teacher
from distill.families.flux import FluxFamily
from distill.students.copies import (
    LORA_TARGET_MODULES,
    copy_student,
    lora_student,
    lora_target_modules,
)
from tests.conftest import run_train
from tests.flux_tiny import write_tiny_flux
from tests.sd3_tiny import JOINT_DIM, write_tiny_sd3
from tests.test_consistency_flow import FLOW_FAST
from tests.test_exports import _randomise
from tests.test_gradient_checkpointing import one_thread, spy_checkpoints  # noqa: F401  (one_thread: autouse)

RANK, ALPHA = 4, 16  # alpha != rank: a loader that drops alpha scales the adapters by 1 instead of 4
PROMPT = "a handwritten digit three"
TOLERANCE = 1e-5  # images in [0, 1]: unmerged (W x + B A x) against merged ((W + B A) x) weights, float32 rounding
# the adapted modules of the stand-ins under the MMDiT defaults: SD3's 2 joint blocks (the second context_pre_only:
# no to_add_out, no ff_context) with SD3.5's attn2 in block 0: 8 + 4 + 6 + 1 + 4 + 2; Flux's double block (12) and
# single block (to_q, to_k, to_v)
EXPECTED_COUNT = {"sd3": 25, "flux": 15}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {"sd3": write_tiny_sd3(root / "sd3"), "flux": write_tiny_flux(root / "flux")}


def _adapted(network: torch.nn.Module) -> list[str]:
    return sorted(name for name, m in network.named_modules() if isinstance(m, LoraLayer))


def _inputs(kind: str, n: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Random (x, timestep, cond) of the stand-in's shapes; the family's ``denoise_at`` packs Flux's latents."""
    g = torch.Generator().manual_seed(seed)
    width, tokens = (JOINT_DIM, 6) if kind == "sd3" else (16, 4)
    return (torch.randn(n, 4, 8, 8, generator=g), torch.tensor([250.0, 800.0][:n]),
            {"encoder_hidden_states": torch.randn(n, tokens, width, generator=g),
             "pooled_projections": torch.randn(n, 16, generator=g)})


# ---------------------------------------------------------------------- the student


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_lora_adapts_the_class_defaults_and_only_they_train(folders, kind):
    teacher = load_teacher(str(folders[kind]))
    network = teacher.denoiser
    targets = LORA_TARGET_MODULES[type(network).__name__]
    expected = sorted(name for name, _ in network.named_modules() if any(name.endswith("." + t) for t in targets))
    student = lora_student(copy.deepcopy(network), rank=RANK, alpha=ALPHA)
    assert _adapted(student) == expected and len(expected) == EXPECTED_COUNT[kind]
    for stream in ("attn.to_q", "attn.add_k_proj", "attn.to_add_out", "ff.net.2", "ff_context.net.0.proj"):
        assert any(name.endswith(stream) for name in expected), stream  # image and context streams, attention and MLP
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    _randomise(student, ("lora_B",))  # trained adapters
    x, timestep, cond = _inputs(kind)
    with torch.no_grad():
        before = teacher.family.denoise_at(network, x, timestep, cond)
        adapted = teacher.family.denoise_at(student, x, timestep, cond)
        student.disable_adapters()
        disabled = teacher.family.denoise_at(student, x, timestep, cond)
    assert (adapted - before).abs().max() > 1e-2  # the adapters change the function
    assert torch.equal(disabled, before)  # and without them it is the teacher, bit for bit


def test_explicit_target_modules_win_and_an_unknown_class_is_refused(folders):
    network = load_teacher(str(folders["sd3"])).denoiser
    student = lora_student(copy.deepcopy(network), rank=RANK, target_modules=("add_q_proj",))
    assert _adapted(student) == ["transformer_blocks.0.attn.add_q_proj", "transformer_blocks.1.attn.add_q_proj"]
    with pytest.raises(ValueError, match=r"no default target modules for a Sequential .*student.target_modules"):
        lora_target_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# ---------------------------------------------------------------------- the export, loaded as a user does

# A user's process (distill never imported): the teacher folder through the stock class, the export's scheduler, the
# LoRA file through load_lora_weights, the call the model card states; the images, the adapted modules and the
# scaling come back. Images without the LoRA too: the adapters must matter for the comparison to mean anything.
LOAD = r"""
import json, sys, torch, diffusers
from peft.tuners.lora import LoraLayer

teacher, export, out = sys.argv[1:4]
spec = json.loads(sys.argv[4])
pipe = getattr(diffusers, spec["pipeline"]).from_pretrained(teacher, **{name: None for name in spec["load"]})
scheduler = json.load(open(export + "/scheduler/scheduler_config.json"))["_class_name"]
pipe.scheduler = getattr(diffusers, scheduler).from_pretrained(export, subfolder="scheduler")
pipe.set_progress_bar_config(disable=True)


def images():
    torch.manual_seed(0)  # FlowMatchLCMScheduler re-noises from the global RNG
    return pipe(spec["prompt"], generator=torch.Generator().manual_seed(0), output_type="pt", **spec["call"]).images


plain = images()
pipe.load_lora_weights(export + "/lora")
lora = images()
torch.save({"lora": lora, "plain": plain}, out)
layers = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, LoraLayer)}
assert not any(name == "distill" or name.startswith("distill.") for name in sys.modules), "distill was imported"
print(json.dumps({"adapted": sorted(layers), "scaling": sorted({s for m in layers.values() for s in m.scaling.values()}),
                  "pipeline": type(pipe).__name__}))
"""


def _load_as_user(tmp_path, teacher, export, spec: dict) -> tuple[dict, dict]:
    out = tmp_path / f"{spec['pipeline']}.pt"
    proc = subprocess.run([sys.executable, "-c", LOAD, str(teacher), str(export), str(out), json.dumps(spec)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # what diffusers (keys it dropped) and peft (targets the file does not fill) warn of a partial load
    for warning in ("unexpected keys", "inconsistency was discovered", "No LoRA keys associated to SD3Transformer2DModel",
                    "No LoRA keys associated to FluxTransformer2DModel"):
        assert warning not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(out)


def _merged_images(export, call: dict) -> torch.Tensor:
    """The full export as ``DiffusionPipeline.from_pretrained`` loads it (its merged weights), with the same call."""
    pipe = DiffusionPipeline.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(0)
    return pipe(PROMPT, generator=torch.Generator().manual_seed(0), output_type="pt", **call).images


def test_sd3_lora_export_loads_whole_in_the_stock_pipeline(folders, tmp_path):
    """Consistency distillation's export of a LoRA student on the SD3 stand-in: StableDiffusion3Pipeline on the
    teacher folder + load_lora_weights(export/lora), called as the model card says (4 steps, guidance 1, its
    max_sequence_length, T5 loaded as None), adapts the 25 trained modules at alpha / rank and gives the merged
    export's images within TOLERANCE."""
    from distill.methods.consistency import LatentConsistencyDistillation

    torch.manual_seed(0)
    method = LatentConsistencyDistillation(
        load_teacher(str(folders["sd3"])), lambda net: lora_student(net, rank=RANK, alpha=ALPHA), torch.optim.AdamW,
        ema_decay=0.0, sigma_spacing="trailing", num_ddim_timesteps=48,  # +exp=consistency_flow's grid
        sampling={"name": "flow_lcm", "num_inference_steps": 4, "guidance_scale": 1.0})
    _randomise(method.student, ("lora_B",))
    trained = _adapted(method.student)
    export = method.eval().export(tmp_path / "export")
    keys = load_file(export / "lora" / "pytorch_lora_weights.safetensors")
    assert {k.split(".")[0] for k in keys} == {"transformer"}
    assert sum(".lora_A." in k for k in keys) == len(trained) == EXPECTED_COUNT["sd3"]

    info = json.loads((export / "distill.json").read_text())
    assert "LoRA adapters merged" in info["student"]
    call = {"num_inference_steps": info["sampling"]["num_inference_steps"],
            "guidance_scale": info["sampling"]["guidance_scale"], **info["stock"]["call"]}
    got, images = _load_as_user(tmp_path, folders["sd3"], export, {
        "pipeline": "StableDiffusion3Pipeline", "load": info["stock"]["load"], "call": call, "prompt": PROMPT})
    assert got["pipeline"] == "StableDiffusion3Pipeline" and got["adapted"] == trained
    assert got["scaling"] == [ALPHA / RANK]
    merged = _merged_images(export, call)
    assert (images["lora"] - images["plain"]).abs().max() > 1e-2  # the adapters matter: a dropped one would show
    assert torch.allclose(images["lora"], merged, rtol=0, atol=TOLERANCE), (images["lora"] - merged).abs().max()


def test_flux_lora_file_loads_whole_in_the_stock_pipeline(folders, tmp_path):
    """No training method serves Flux yet (consistency needs a static shift), so the family's half of the export is
    checked directly: FluxPipeline.save_lora_weights(**FluxFamily.lora_weights(student)), as save_pipeline calls it,
    read back by FluxPipeline.load_lora_weights on the teacher folder: the 15 adapted modules at alpha / rank, and
    the images of the adapters merged into a DistillFluxPipeline (DiffusionPipeline.from_pretrained) within
    TOLERANCE."""
    teacher = FluxFamily.load(str(folders["flux"]), max_sequence_length=8)
    family = teacher.family
    torch.manual_seed(0)
    student = lora_student(teacher.denoiser, rank=RANK, alpha=ALPHA)
    _randomise(student, ("lora_B",))
    trained = _adapted(student)
    export = tmp_path / "export"
    kwargs = FluxFamily.lora_weights(student)
    assert set(kwargs) == {"transformer_lora_layers", "transformer_lora_adapter_metadata"}
    merged = copy.deepcopy(student)
    merged.fuse_lora()
    merged.unload_lora()
    pipe = family.pipeline(merged, family.default_scheduler())
    pipe.save_lora_weights(export / "lora", safe_serialization=True, **kwargs)
    pipe.save_pretrained(export)

    call = {"num_inference_steps": 2, "guidance_scale": 3.5, "height": 16, "width": 16, "max_sequence_length": 8}
    got, images = _load_as_user(tmp_path, folders["flux"], export, {
        "pipeline": "FluxPipeline", "load": [], "call": call, "prompt": PROMPT})
    assert got["adapted"] == trained and len(trained) == EXPECTED_COUNT["flux"]
    assert got["scaling"] == [ALPHA / RANK]
    ours = _merged_images(export, call)
    assert (images["lora"] - images["plain"]).abs().max() > 1e-2
    assert torch.allclose(images["lora"], ours, rtol=0, atol=TOLERANCE), (images["lora"] - ours).abs().max()


def test_two_cli_steps_of_consistency_flow_with_a_lora_student(folders, tmp_path):
    """+exp=consistency_flow student=lora method.ema_decay=0 on the SD3 stand-in through python -m distill.train: two
    finite losses; the export's lora/ file holds the transformer's 25 adapters alone (lora_ keys only), trained away
    from peft's zero start, beside the merged DistillSD3Pipeline."""
    run_dir = tmp_path / "run"
    proc = run_train("+exp=consistency_flow", f"teacher.pretrained_model_name_or_path={folders['sd3']}",
                     "student=lora", "method.ema_decay=0", *FLOW_FAST, f"hydra.run.dir={run_dir}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(r["train/loss"]) for r in csv.DictReader(open(run_dir / "csv" / "metrics.csv")) if r.get("train/loss")]
    assert len(losses) == 2 and all(0 < loss < 100 for loss in losses), losses
    export = run_dir / "export"
    keys = load_file(export / "lora" / "pytorch_lora_weights.safetensors")
    assert {k.split(".")[0] for k in keys} == {"transformer"} and all(".lora_" in k for k in keys)
    assert sum(".lora_A." in k for k in keys) == EXPECTED_COUNT["sd3"]
    assert any(keys[k].abs().max() > 0 for k in keys if ".lora_B." in k)  # trained away from peft's zero start
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == "DistillSD3Pipeline"
    assert "LoRA adapters merged" in json.loads((export / "distill.json").read_text())["student"]


# ---------------------------------------------------------------------- gradient checkpointing


def _build(folders, kind: str, student: str, gradient_checkpointing: bool):
    teacher = load_teacher(str(folders[kind]))
    torch.manual_seed(0)
    if student == "copy":
        network = copy_student(teacher.denoiser, gradient_checkpointing=gradient_checkpointing)
    else:
        network = lora_student(teacher.denoiser, rank=RANK, gradient_checkpointing=gradient_checkpointing)
        for name, p in network.named_parameters():
            if "lora_B" in name:  # peft's zero start would make every lora_A gradient zero
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    return teacher.family, network.train()


@pytest.mark.parametrize("kind", ["sd3", "flux"])
@pytest.mark.parametrize("student", ["copy", "lora"])
def test_checkpointing_a_transformer_changes_no_gradient(folders, kind, student, monkeypatch):
    family, plain = _build(folders, kind, student, False)
    _, checkpointed = _build(folders, kind, student, True)
    assert not plain.gradient_checkpointing and checkpointed.gradient_checkpointing
    calls = spy_checkpoints(checkpointed, monkeypatch)
    x, timestep, cond = _inputs(kind)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    losses = [F.mse_loss(family.denoise_at(net, x, timestep, cond), target) for net in (plain, checkpointed)]
    for loss in losses:
        loss.backward()

    # each joint block (and Flux's single-stream block) recomputed in the backward pass
    blocks = len(checkpointed.transformer_blocks) + len(getattr(checkpointed, "single_transformer_blocks", ()))
    assert len(calls) == blocks
    assert torch.equal(*losses)
    grads = {n: p.grad for n, p in checkpointed.named_parameters()}
    trained = [n for n, p in plain.named_parameters() if p.grad is not None]
    assert trained and sum(p.grad.abs().sum() for p in plain.parameters() if p.grad is not None) > 0
    for name, p in plain.named_parameters():
        if p.grad is None:
            assert grads[name] is None, name
        else:
            assert torch.allclose(p.grad, grads[name], rtol=1e-5, atol=1e-7), name
    if student == "lora":
        assert all("lora_" in n for n in trained)
    with torch.no_grad():  # no recomputation where no gradient is taken (sampling, validation)
        calls.clear()
        family.denoise_at(checkpointed, x, timestep, cond)
    assert calls == []


def test_the_config_switch_reaches_a_transformer_student(compose, folders):
    from hydra.utils import instantiate

    for student in ("copy", "lora"):
        cfg = compose("+exp=consistency_flow", f"student={student}", "student.gradient_checkpointing=true")
        network = instantiate(cfg.student)(load_teacher(str(folders["sd3"])).denoiser)
        assert network.gradient_checkpointing, student
