"""``student.gradient_checkpointing``: every student type gets the same gradients (and buffers) with it as
without it, checkpoints non-reentrantly (LoRA's frozen base still passes gradients to the adapters), and
skips it in forwards without gradients (sampling, validation)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler

from distill.families import load_teacher
from distill.inference.sampling import sample
from distill.models import classifier as classifier_module
from distill.students.assets import build_vae
from distill.students.copies import copy_student, lora_student
from distill.students.sized import build_class_unet, build_text_unet
from distill.worlds.digits.classifier import build_digit_classifier
from distill.worlds.digits.clip import build_clip_model, build_tokenizer
from tests.sd_tiny import write_tiny_sd

KINDS = ("copy", "lora", "class_unet", "text_unet", "vae", "clip", "digit_classifier")
N = 4  # batch; BatchNorm needs more than one sample


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: one thread is faster than two, and does not stall when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def teacher_unet(tmp_path_factory):
    return load_teacher(str(write_tiny_sd(tmp_path_factory.mktemp("sd")))).denoiser  # debug text UNet, 4x8x8, ctx dim 32


def build(kind: str, gradient_checkpointing: bool, teacher_unet) -> torch.nn.Module:
    """A small student of ``kind`` through its config builder, in training mode."""
    torch.manual_seed(0)
    if kind == "copy":
        model = copy_student(teacher_unet, time_cond_proj_dim=8, gradient_checkpointing=gradient_checkpointing)
    elif kind == "lora":
        model = lora_student(copy.deepcopy(teacher_unet), rank=4, gradient_checkpointing=gradient_checkpointing)
    elif kind == "class_unet":
        model = build_class_unet(16, 1, size="debug", gradient_checkpointing=gradient_checkpointing)
    elif kind == "text_unet":
        model = build_text_unet(8, 4, size="debug", cross_attention_dim=32, gradient_checkpointing=gradient_checkpointing)
    elif kind == "vae":
        model = build_vae(1, 16, block_out_channels=(8, 16), norm_num_groups=4, gradient_checkpointing=gradient_checkpointing)
    elif kind == "clip":
        model = build_clip_model(model_max_length=8, projection_dim=16, text_hidden_size=16, text_layers=2, text_heads=2,
                                 image_size=16, patch_size=8, vision_hidden_size=16, vision_layers=2, vision_heads=2,
                                 mlp_ratio=2, gradient_checkpointing=gradient_checkpointing)
    else:
        model = build_digit_classifier(channels=[8, 16, 16], feature_dim=16, resolution=16, dropout=0.2,
                                       gradient_checkpointing=gradient_checkpointing)
    return model.train()


def loss_of(kind: str, model: torch.nn.Module) -> torch.Tensor:
    """A training loss on fixed random inputs; the global seed is reset so that dropout masks repeat."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(2)
    t = torch.randint(0, 1000, (N,), generator=g)
    if kind in ("copy", "lora", "text_unet"):
        x, ctx = torch.randn(N, 4, 8, 8, generator=g), torch.randn(N, 8, 32, generator=g)
        extra = {"timestep_cond": torch.randn(N, 8, generator=g)} if kind == "copy" else {}
        return F.mse_loss(model(x, t, encoder_hidden_states=ctx, **extra).sample, torch.randn(N, 4, 8, 8, generator=g))
    if kind == "class_unet":
        x, labels = torch.randn(N, 1, 16, 16, generator=g), torch.randint(0, 11, (N,), generator=g)
        return F.mse_loss(model(x, t, class_labels=labels).sample, torch.randn(N, 1, 16, 16, generator=g))
    if kind == "vae":
        x = torch.rand(N, 1, 16, 16, generator=g) * 2 - 1
        posterior = model.encode(x).latent_dist
        return F.mse_loss(model.decode(posterior.mode()).sample, x) + 1e-3 * posterior.kl().mean()
    if kind == "clip":
        tokens = build_tokenizer(8)(["a handwritten digit seven", "the number two", "3", "a picture of a nine"],
                                    padding="max_length", return_tensors="pt")
        pixels = torch.rand(N, 1, 16, 16, generator=g) * 2 - 1
        return model(**tokens, pixel_values=pixels, return_loss=True).loss
    x, labels = torch.rand(N, 1, 16, 16, generator=g) * 2 - 1, torch.randint(0, 10, (N,), generator=g)
    return F.cross_entropy(model(x), labels)


def spy_checkpoints(model: torch.nn.Module, monkeypatch) -> list:
    """Records each checkpointed call: diffusers' and transformers' modules go through their
    ``_gradient_checkpointing_func``, the digit classifier through ``checkpoint`` in its module."""
    calls = []

    def counting(fn):
        def wrapped(*args, **kwargs):
            calls.append(fn)
            return fn(*args, **kwargs)
        return wrapped

    for module in model.modules():
        if "_gradient_checkpointing_func" in vars(module):
            monkeypatch.setattr(module, "_gradient_checkpointing_func", counting(module._gradient_checkpointing_func))
    monkeypatch.setattr(classifier_module, "checkpoint", counting(classifier_module.checkpoint))
    return calls


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("enabled", [False, True])
def test_config_switch_reaches_every_student(compose, kind, enabled, teacher_unet):
    """``student=<kind> student.gradient_checkpointing=...`` through the real config and its builder."""
    from hydra.utils import instantiate

    required = ["student.sample_size=8", "student.cross_attention_dim=64"] if kind == "text_unet" else []
    cfg = compose(f"student={kind}", f"student.gradient_checkpointing={str(enabled).lower()}", *required)
    student = instantiate(cfg.student)
    if kind in ("copy", "lora"):  # partials of the teacher's UNet
        student = student(copy.deepcopy(teacher_unet))
    assert any(getattr(m, "gradient_checkpointing", False) for m in student.modules()) == enabled


@pytest.mark.parametrize("kind", KINDS)
def test_checkpointing_changes_no_gradient(kind, teacher_unet, monkeypatch):
    plain, checkpointed = build(kind, False, teacher_unet), build(kind, True, teacher_unet)
    if kind == "lora":
        # peft zero-initialises lora_B, which would make every lora_A gradient zero: give B values
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
    checkpointed.load_state_dict(plain.state_dict())
    calls = spy_checkpoints(checkpointed, monkeypatch)
    loss_plain, loss_checkpointed = loss_of(kind, plain), loss_of(kind, checkpointed)
    loss_plain.backward()
    loss_checkpointed.backward()

    assert len(calls) > 0  # checkpointing really ran
    assert torch.equal(loss_plain, loss_checkpointed)
    grads = {n: p.grad for n, p in checkpointed.named_parameters()}
    for name, p in plain.named_parameters():
        if p.grad is None:
            assert grads[name] is None, name
        else:
            assert grads[name] is not None and torch.allclose(p.grad, grads[name], rtol=1e-5, atol=1e-7), name
    # BatchNorm running statistics count the batch once, not again when the backward pass recomputes it
    for (name, a), (_, b) in zip(plain.named_buffers(), checkpointed.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    if kind == "lora":
        trained = {n for n, g in grads.items() if g is not None}
        adapters = {n for n in grads if "lora_" in n}
        assert trained == adapters and all(grads[n].abs().sum() > 0 for n in adapters)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpointing_is_off_without_gradients(kind, teacher_unet, monkeypatch):
    model = build(kind, True, teacher_unet)
    calls = spy_checkpoints(model, monkeypatch)
    with torch.no_grad():
        loss_of(kind, model)
    assert calls == []
    loss_of(kind, model)
    assert len(calls) > 0


def test_validation_sampling_runs_without_checkpointing(teacher_unet, monkeypatch):
    """The sampling loop of validation runs no checkpoint, even with the student left in training mode."""
    student = build("copy", True, teacher_unet)
    calls = spy_checkpoints(student, monkeypatch)
    cond = {"encoder_hidden_states": torch.randn(2, 8, 32), "timestep_cond": torch.zeros(2, 8)}
    x0 = sample(lambda x, t, **c: student(x, t, **c).sample, DDIMScheduler(), torch.randn(2, 4, 8, 8), cond,
                num_inference_steps=2)
    assert x0.shape == (2, 4, 8, 8) and calls == []
