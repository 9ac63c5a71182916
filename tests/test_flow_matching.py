"""Flow-matching training (``method=flow_matching``, SD3's recipe) against diffusers' SD3 training utilities and a
hand computation: the loss is the (weighted) velocity regression on x_t = (1 - t) x0 + t eps at times drawn as
``compute_density_for_timestep_sampling`` draws them; SD3's two CLIP towers derived from one CLIP equal its text
tower; the digits VAE's shift and scaling factors in the config are the measured ones."""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import (
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)
from omegaconf import OmegaConf

from distill.families.sd3 import SD3Conditioner
from distill.methods.flow_matching import FlowMatchingTraining
from distill.models.vae import encode_latents, latent_shift_and_scaling, load_vae
from distill.students.sized import build_sd3_transformer
from distill.worlds import asset_path
from tests.conftest import CONF

METHOD_CFG = OmegaConf.load(CONF / "method" / "flow_matching.yaml")
SHIFT, SCALING = METHOD_CFG.vae.shift_factor, METHOD_CFG.vae.scaling_factor
CAPTIONS = ["a handwritten digit three", "a handwritten digit seven", "a handwritten digit zero",
            "a handwritten digit one"]


@pytest.fixture(scope="module")
def conditioner():
    return SD3Conditioner.from_clip(str(asset_path("clip")), joint_dim=128, max_sequence_length=1)


def _method(conditioner, noise_scheduler=None, **options) -> FlowMatchingTraining:
    torch.manual_seed(0)
    student = build_sd3_transformer(8, size="debug", joint_attention_dim=128, pooled_projection_dim=128)
    vae = load_vae(str(asset_path("vae")), shift_factor=SHIFT, scaling_factor=SCALING)
    return FlowMatchingTraining(student, noise_scheduler or FlowMatchEulerDiscreteScheduler(), conditioner,
                                functools.partial(torch.optim.AdamW, lr=1e-3), vae=vae, **options)


def _batch():
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.rand(4, 1, 32, 32, generator=g) * 2 - 1, "caption": CAPTIONS}


@pytest.mark.parametrize("loss_weighting,shift", [("none", 1.0), ("sigma_sqrt", 1.0), ("cosmap", 3.0)])
def test_the_loss_is_sd3s_velocity_regression(conditioner, loss_weighting, shift):
    """With one seed: x0 the VAE's posterior draw, (SD3's normalisation), u the logit-normal draw of diffusers'
    compute_density_for_timestep_sampling, t = shift u / (1 + (shift - 1) u) (the scheduler's shift), eps, the
    dropped rows; x_t = (1 - t) x0 + t eps, target eps - x0 (diffusers' SD3 training script), the transformer at
    timestep 1000 t, weighted by compute_loss_weighting_for_sd3."""
    method = _method(conditioner, FlowMatchEulerDiscreteScheduler(shift=shift), loss_weighting=loss_weighting,
                     cond_dropout=0.5).eval()
    batch = _batch()
    with torch.no_grad():
        loss = method.loss(batch, torch.Generator().manual_seed(7))
        g = torch.Generator().manual_seed(7)
        latent = method.vae.encode(batch["pixel_values"]).latent_dist.sample(g)
        x0 = (latent - SHIFT) * SCALING
        u = compute_density_for_timestep_sampling("logit_normal", 4, logit_mean=0.0, logit_std=1.0, generator=g)
        t = shift * u / (1 + (shift - 1) * u)
        eps = torch.randn(x0.shape, generator=g)
        drop = torch.rand(4, generator=g) < 0.5
        assert 0 < int(drop.sum()) < 4  # both kinds of rows in the batch
        prompts = ["" if d else c for c, d in zip(CAPTIONS, drop.tolist())]
        states, pooled = conditioner.encode(prompts)
        x_t = (1.0 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
        pred = method.student(hidden_states=x_t, timestep=1000 * t, encoder_hidden_states=states,
                              pooled_projections=pooled).sample
        weights = compute_loss_weighting_for_sd3(loss_weighting, t.view(-1, 1, 1, 1))
        expected = (weights * (pred - (eps - x0)) ** 2).reshape(4, -1).mean(1).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_sd3_towers_from_one_clip_are_its_text_tower(conditioner):
    """Both CLIPTextModelWithProjection towers give the CLIPModel's text features and hidden states bit for bit."""
    from transformers import CLIPModel

    clip = CLIPModel.from_pretrained(str(asset_path("clip"))).eval()
    ids = conditioner.tokenizer(CAPTIONS, padding="max_length", max_length=conditioner.tokenizer.model_max_length,
                                return_tensors="pt").input_ids
    with torch.no_grad():
        reference = clip.text_model(ids, output_hidden_states=True)
        features = clip.get_text_features(ids)
        features = getattr(features, "pooler_output", features)
        for tower in (conditioner.text_encoder, conditioner.text_encoder_2):
            out = tower(ids, output_hidden_states=True)
            assert torch.equal(out.text_embeds, features)
            assert torch.equal(out.hidden_states[-2], reference.hidden_states[-2])
        states, pooled = conditioner.encode(CAPTIONS[:2])
    # the joint context: both towers' penultimate states side by side (128 wide), then 1 zero T5 token
    assert states.shape == (2, 17, 128) and pooled.shape == (2, 128)
    assert torch.equal(states[:, :16, :64], states[:, :16, 64:]) and not states[:, 16].any()


def test_the_configs_vae_shift_and_scaling_are_measured_on_the_training_split():
    """distill.models.vae.latent_shift_and_scaling of the posterior samples (seed 0) of 64 training batches."""
    from distill.worlds.digits.data import DigitsDataModule

    vae = load_vae(str(asset_path("vae")))
    data = DigitsDataModule(resolution=32, batch_size=64)
    data.setup("fit")
    images = (b["pixel_values"] for i, b in enumerate(data.train_dataloader()) if i < 64)
    shift, scaling = latent_shift_and_scaling(encode_latents(vae, images, torch.Generator().manual_seed(0)))
    assert (shift, scaling) == (pytest.approx(SHIFT, abs=1e-6), pytest.approx(SCALING, rel=1e-6))
    assert load_vae(str(asset_path("vae")), shift_factor=SHIFT, scaling_factor=SCALING).config.shift_factor == SHIFT


def test_bad_settings_are_refused_naming_the_fix(conditioner):
    with pytest.raises(ValueError, match="flow matching trains on a flow-matching schedule.*use method=diffusion"):
        _method(conditioner, DDPMScheduler())
    from distill.models.conditioning import ClassConditioner

    with pytest.raises(ValueError, match=r"method.conditioner \(ClassConditioner\) makes a ClassUNetFamily network, "
                                         r"which is not flow matching.*use an SD3Conditioner with method=flow_matching"):
        FlowMatchingTraining(torch.nn.Linear(1, 1), FlowMatchEulerDiscreteScheduler(), ClassConditioner(10),
                             torch.optim.SGD)
    with pytest.raises(ValueError, match=r"scheduler.name: 'ddim' steps a discrete VP .*use one of \['flow_euler'"):
        _method(conditioner, sampling={"name": "ddim", "num_inference_steps": 4, "guidance_scale": 1.0})
    with pytest.raises(ValueError, match=r"method.time_sampling='beta'; use one of"):
        _method(conditioner, time_sampling="beta")
    with pytest.raises(ValueError, match="leave method.noise at its defaults"):
        _method(conditioner, noise={"antithetic": True})
