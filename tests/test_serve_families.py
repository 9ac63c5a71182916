"""distill.serve on every family (issues 32 and 33): the engine encodes prompts with the pipeline's family
(``condition`` / ``null_condition``), calls the network through ``denoise_at`` and decodes with ``decode`` (the
VAE's shift_factor), so that SDXL's, SD3's and Flux's tiny stand-ins serve in each engine mode, each image equal to
the pipeline's own call with the same seed (Flux: the timesteps shifted by the resolution's mu, noise of the packed
latents' channels, guidance an input of the transformer rather than a CFG pass, latents unpacked before decoding); classifier guidance reads its schedule and latents from the family too,
and refuses a flow-matching one naming it.

The reference is the pipeline called alone, ``pipe(prompt, num_inference_steps, guidance_scale, generator)``; the
bound is 1/255 a pixel, test_serve's (a batch of several jobs sums floats in another order than one alone); a
single job served sequentially is byte-identical."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from distill.families import native_size
from distill.serve.engine import MODES, Engine
from tests.flux_tiny import tiny_flux_pipeline, write_tiny_flux
from tests.sd3_tiny import tiny_sd3_pipeline
from tests.sd_tiny import write_tiny_sdxl

PROMPTS = ["a handwritten digit three", "a handwritten digit seven", "a handwritten digit one"]
STEPS, GUIDANCE = 3, 3.0
SIDE = 32  # the requests' image side: SDXL's and SD3's native size; Flux's 128 is native to the byte-identical test


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(write_tiny_sdxl(tmp_path_factory.mktemp("sdxl") / "pipe"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    pipe = tiny_sd3_pipeline(tmp_path_factory.mktemp("sd3") / "_vocab")
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """FLUX.1-dev's layout at 128x128 (its native size through the stand-in's factor-1 VAE: 4096 packed tokens)."""
    pipe = tiny_flux_pipeline(tmp_path_factory.mktemp("flux") / "_vocab")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, prompt: str, seed: int, guidance: float = GUIDANCE, side: int | None = None) -> np.ndarray:
    image = pipe(prompt, num_inference_steps=STEPS, guidance_scale=guidance, height=side, width=side,
                 generator=torch.Generator().manual_seed(seed)).images[0]
    return np.asarray(image.convert("RGB"))


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def serve(pipe, mode: str, requests: list[tuple[str, int, float]], side: int | None = None) -> list[np.ndarray]:
    """Each (prompt, seed, guidance) request's image at ``side`` (None: native), the requests submitted together
    (sharing batches)."""
    engine = Engine(pipe, steps=STEPS, guidance_scale=GUIDANCE, mode=mode, max_wait_ms=200.0)
    try:
        futures = [engine.submit(engine.job([p], seed=s, guidance_scale=g, height=side, width=side))
                   for p, s, g in requests]
        return [pixels(f.result(timeout=120).png[0]) for f in futures]
    finally:
        engine.close(timeout=60)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_each_engine_mode_serves_the_pipelines_own_images(family, mode, request):
    """Three requests, one unguided (guidance 1: no CFG rows), in one batch where the mode batches: every image
    within 1/255 of the pipeline's own call with its seed (stream mode batches the guided and unguided ones into
    one network call; Flux's two guidance values are then two rows of its guidance input). 32x32 is Flux's 256
    packed tokens, mu 0.5 where its native size's is 1.15: the timesteps follow the request's size."""
    pipe = request.getfixturevalue(family)
    requests = [(PROMPTS[0], 0, GUIDANCE), (PROMPTS[1], 5, GUIDANCE), (PROMPTS[2], 9, 1.0)]
    if mode in ("batch", "pipeline"):  # a batch shares one guidance scale: the unguided one is its own batch
        requests[2] = (PROMPTS[2], 9, GUIDANCE)
    served = serve(pipe, mode, requests, SIDE)
    for image, (prompt, seed, guidance) in zip(served, requests):
        expected = reference(pipe, prompt, seed, guidance, SIDE)
        assert image.shape == expected.shape == (SIDE, SIDE, 3)
        diff = np.abs(image.astype(int) - expected.astype(int))
        assert diff.max() <= 1, f"{family} {mode}: max pixel difference {diff.max()} > 1/255"
    assert not np.array_equal(served[0], served[1])  # the prompts and seeds matter


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_one_job_served_alone_is_byte_identical(family, request):
    pipe = request.getfixturevalue(family)
    image, = serve(pipe, "sequential", [(PROMPTS[0], 3, GUIDANCE)])
    assert image.shape == (native_size(pipe), native_size(pipe), 3)
    assert np.array_equal(image, reference(pipe, PROMPTS[0], 3))


def test_sd3_sizes_are_multiples_of_the_vae_factor_times_the_patch_size(sd3):
    engine = Engine(sd3, steps=STEPS, guidance_scale=GUIDANCE, mode="sequential")
    try:
        (field, message), = engine.check(["a digit"], None, None, 36, None, None, None)  # 36 = 9 latents: odd
        assert field == "height" and "VAE factor x patch size 8" in message
        assert engine.check(["a digit"], None, None, 40, 24, None, None) == []
    finally:
        engine.close()


def test_flux_sizes_are_multiples_of_the_vae_factor_times_its_2x2_packing(flux):
    engine = Engine(flux, steps=STEPS, guidance_scale=GUIDANCE, mode="sequential")
    try:
        (field, message), = engine.check(["a digit"], None, None, 33, None, None, None)  # the factor-1 VAE's 33 latents
        assert field == "height" and "VAE factor x patch size 2 in [2, 512]" in message
        assert engine.check(["a digit"], None, None, 34, 24, None, None) == []
        assert not engine.needs_cfg(GUIDANCE) and engine.job(["a digit"], seed=0).rows == 1  # guidance is an input
    finally:
        engine.close()


def test_the_engine_conditions_sdxl_on_the_requested_size(sdxl):
    engine = Engine(sdxl, steps=STEPS, guidance_scale=GUIDANCE, mode="sequential")
    try:
        cond = engine.embed(PROMPTS[:2], (48, 24))
        assert sorted(cond) == ["encoder_hidden_states", "text_embeds", "time_ids"]
        assert cond["time_ids"].tolist() == [[48, 24, 0, 0, 48, 24]] * 2
        null = engine.null(cond)  # force_zeros_for_empty_prompt: zeros, with the size ids of the rows they pair with
        assert not null["encoder_hidden_states"].any() and torch.equal(null["time_ids"], cond["time_ids"])
        image = pixels(engine.submit(engine.job([PROMPTS[0]], seed=1, height=48, width=24)).result(timeout=60).png[0])
    finally:
        engine.close()
    expected = sdxl(PROMPTS[0], num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=48, width=24,
                    generator=torch.Generator().manual_seed(1)).images[0]
    assert np.array_equal(image, np.asarray(expected.convert("RGB")))


def test_pipeline_call_inputs_name_the_calls_arguments_and_refuse_an_unknown_key(sd3):
    from distill.families import family_of

    family = family_of(sd3).from_pipeline(sd3)
    cond = family.condition({"caption": PROMPTS[:1]})
    inputs = family.pipeline_call_inputs(cond, family.null_condition(1))
    assert sorted(inputs) == ["negative_pooled_prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                              "prompt_embeds"]
    with pytest.raises(ValueError, match="'class_labels'.*DistillSD3Pipeline's call"):
        family.pipeline_call_inputs({**cond, "class_labels": torch.zeros(1)})


def test_unscale_latents_inverts_scale_latents_with_the_shift_factor(sd3):
    from distill.families import family_of

    family = family_of(sd3).from_pipeline(sd3)
    assert family.vae.config.shift_factor == pytest.approx(0.0609)
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(family.unscale_latents(family.scale_latents(z)), z, atol=1e-6)
    assert torch.allclose(family.unscale_latents(torch.zeros(1)), torch.tensor([0.0609]))


def test_classifier_guidance_refuses_a_flow_matching_pipeline_naming_its_family(sd3, tmp_path):
    from distill.accelerate import ClassifierGuidance
    from distill.models.noisy_classifier import NoisyLatentClassifier

    NoisyLatentClassifier(channels=(16, 32), time_dim=32, groups=4).save_pretrained(tmp_path)
    guidance = ClassifierGuidance(classifier=str(tmp_path))
    with pytest.raises(ValueError, match="'sd3' family \\(StableDiffusion3Family\\), flow matching"):
        guidance.use_pipeline(sd3)


def test_classifier_guidance_steers_sdxl_with_its_familys_schedule(sdxl, tmp_path):
    """On SDXL's Euler schedule (fractional timesteps, interpolated abar) the guided prediction is
    eps - sqrt(1 - abar_t) s grad, abar read from the family's schedule."""
    from distill.accelerate import ClassifierGuidance, SamplingContext, accelerated
    from distill.models.noisy_classifier import NoisyLatentClassifier

    torch.manual_seed(0)
    NoisyLatentClassifier(channels=(16, 32), time_dim=32, groups=4).save_pretrained(tmp_path)
    guidance = ClassifierGuidance(scale=2.0, classifier=str(tmp_path), labels=[4])
    guidance.attach(sdxl.unet, SamplingContext(pipe=sdxl))
    guidance.detach()
    abar = guidance._abar(torch.tensor(250.5), torch.zeros(1))
    table = sdxl.scheduler.alphas_cumprod.double()
    assert float(abar) == pytest.approx(float((table[250] + table[251]) / 2), rel=1e-6)
    generator = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 4, 8, 8, generator=generator), torch.tensor(250.5)
    cond = {"encoder_hidden_states": torch.randn(1, 77, 48, generator=generator),
            "added_cond_kwargs": {"text_embeds": torch.randn(1, 24, generator=generator),
                                  "time_ids": torch.tensor([[32.0, 32, 0, 0, 32, 32]])}}
    with torch.no_grad():
        plain = sdxl.unet(x, t, **cond).sample
        with accelerated(sdxl, guidance, guidance_scale=1.0):
            guided = sdxl.unet(x, t, **cond).sample
    grad = guidance.gradient(x, t, torch.tensor([4]))
    assert grad.abs().max() > 0
    assert torch.allclose(guided, plain - (1 - abar).sqrt() * 2.0 * grad, atol=1e-6)


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_distill_serve_builds_its_engine_on_a_saved_pipeline_of_the_family(family, tmp_path):
    """``python -m distill.serve pipeline=<folder>``'s engine (``cli.build``) on the saved stand-in serves the image
    of the pipeline loaded from the same folder."""
    from distill.inference.loading import load_pipeline
    from distill.serve.cli import build
    from tests.sd3_tiny import write_tiny_sd3
    from tests.test_serve import _compose_serve

    folder = {"sdxl": write_tiny_sdxl, "sd3": write_tiny_sd3, "flux": write_tiny_flux}[family](tmp_path / family)
    engine, _ = build(_compose_serve(f"pipeline={folder}", "device=cpu", f"steps={STEPS}",
                                     f"guidance_scale={GUIDANCE}", "engine.mode=stream"))
    try:
        image = pixels(engine.submit(engine.job([PROMPTS[1]], seed=2)).result(timeout=60).png[0])
    finally:
        engine.close()
    pipe = load_pipeline(str(folder))
    pipe.set_progress_bar_config(disable=True)
    assert np.array_equal(image, reference(pipe, PROMPTS[1], 2))


def test_classifier_guidance_without_a_pipeline_says_what_it_needs(sd3, tmp_path):
    from distill.accelerate import ClassifierGuidance, SamplingContext
    from distill.models.noisy_classifier import NoisyLatentClassifier

    NoisyLatentClassifier(channels=(16, 32), time_dim=32, groups=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="noise schedule \\(its model family\\).*use_pipeline\\(pipe\\)"):
        ClassifierGuidance(classifier=str(tmp_path)).attach(sd3.transformer, SamplingContext())


@pytest.mark.parametrize("family", ["sdxl", "sd3", "flux"])
def test_a_long_prompt_is_truncated_and_never_logged(family, request, caplog, capfd):
    """Issue 31 on every family: a prompt far past the text encoders' length is tokenised with truncation (its
    condition has the shapes of a short prompt's) and nothing of it reaches the log or stderr (diffusers'
    encode_prompt tokenises it again in full and writes the cut part to stderr through its own handler)."""
    pipe = request.getfixturevalue(family)
    engine = Engine(pipe, steps=STEPS, guidance_scale=GUIDANCE, mode="sequential")
    try:
        capfd.readouterr()
        with caplog.at_level("DEBUG"):
            long = engine.embed(["seven " * 1000])
        short = engine.embed([PROMPTS[1]])
    finally:
        engine.close()
    assert {k: v.shape for k, v in long.items()} == {k: v.shape for k, v in short.items()}
    written = caplog.text + "".join(capfd.readouterr())
    assert "seven seven" not in written, written[:500]
