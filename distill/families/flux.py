"""FLUX.1 (Black Forest Labs, 2024): a ``FluxTransformer2DModel`` (double- then single-stream MMDiT blocks, 3-axis
rotary positions) predicting the flow velocity on ``FlowMatchEulerDiscreteScheduler``'s resolution-shifted schedule
(``use_dynamic_shifting``: mu from the image's packed token count, diffusers' ``calculate_shift``), conditioned on
T5's token states (``encoder_hidden_states``) and CLIP-L's pooled output (``pooled_projections``); FLUX.1-dev also
takes its distilled guidance scale as an input (``guidance_embeds``; FLUX.1-schnell has none). ``AutoencoderKL``
latents with a ``shift_factor``.

The family's latents are the VAE's (N, C, H, W), as for every other family: ``denoise`` packs them in 2x2 patches
(``distill.diffusion.packing``) with their ``img_ids`` for the call and unpacks the velocity, so that the flow
math, the samplers and ``decode`` see one layout. Packing is a permutation and the flow math is elementwise, so a
loop on unpacked latents equals ``FluxPipeline``'s on packed ones bit for bit.

T5 is not optional: Flux has no T5-free mode (its context is T5's tokens alone), so a folder without
``text_encoder_2``/``tokenizer_2`` is refused before any weights load. ``distill.evaluate``, ``distill.sample`` and
``distill.serve`` run on it (the engine's hooks: ``set_timesteps``, ``latent_shape``, ``call_latents``,
``guidance_input``, ``size_multiple``).

It trains with consistency distillation (``+exp=consistency_flux``), progressive distillation
(``+exp=progressive_flux``) and ECT (``+exp=consistency_training_flux``), with a copy or LoRA student
(``student=lora``; ``FluxPipeline``'s ``load_lora_weights`` reads its file: ``ModelFamily.lora_weights``). The
training images have one resolution (``method.resolution`` = ``data.resolution``), and its mu (``shift_mu``)
shifts the student's time grid (``inference_sigmas``: FluxPipeline's sigmas linspace(1, 1 / N, N) at that mu:
consistency's solver grid, each progressive round's N- and 2N-step grids); the export samples at that resolution
by default (``resolution_defaults``: ``default_sample_size``), so at the same shift (ECT's FlowMatchLCMScheduler
too), and records the resolution and mu in distill.json. A FLUX.1-dev-style teacher (``guidance_embedded``) is
stepped at its guidance input with no CFG pass, as ``FluxPipeline`` calls it, and its student takes the guidance
scale the same way (ECT, which has no guidance, at 1); a teacher without the embedding is guided by true CFG
(``FluxPipeline``'s ``true_cfg_scale``) in velocity form, and its student samples guidance-distilled.

It is compressed by BK-SDM's output and feature distillation (``+exp=compress_flux``): the student is the teacher's
transformer with some double- and single-stream blocks kept (``student=shallow``), each block's image tokens
(``block_feature``) matched to those of its evenly spaced teacher block of the same kind (``feature_block_pairs``),
t drawn logit-normal and shifted by the training resolution's mu, teacher and student both at the export's embedded
guidance (FLUX.1-dev) or without guidance (FLUX.1-schnell), sampled as the teacher: FluxPipeline's 28 Euler steps.

sCM, rCM and MeanFlow (``+exp=scm_flux``, ``+exp=rcm_flux``, ``+exp=meanflow_flux``; docs/scm.md) take the JVP through
``denoise``; a FLUX.1-dev teacher's tangent or velocity is one pass at its guidance input, at which the student is
called too, and a teacher without the embedding is guided by true CFG. MeanFlow's student and export are
``MeanFlowFluxTransformer2DModel`` and ``DistillMeanFlowFluxPipeline`` (``distill.models.meanflow``,
``distill.inference.meanflow``).
"""

from __future__ import annotations

import diffusers
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps
from torch import nn

from distill.diffusion.flow import (
    BASE_IMAGE_SEQ_LEN,
    BASE_SHIFT,
    MAX_IMAGE_SEQ_LEN,
    MAX_SHIFT,
    flux_sigmas,
    image_seq_len,
    resolution_shift_mu,
)
from distill.diffusion.packing import latent_image_ids, pack_latents, unpack_latents
from distill.families.base import (
    FAMILIES,
    ModelFamily,
    TransformerCallDefaults,
    evenly_spaced_block_pairs,
)
from distill.models.conditioning import TextConditioner
from distill.models.teacher import Teacher, is_flow_matching, pipeline_configs

# FluxPipeline.__call__'s defaults: 28 steps, embedded guidance 3.5, 512 T5 tokens; its default_sample_size, 128
# latent pixels (1024 px through FLUX.1's VAE)
FLUX_NUM_INFERENCE_STEPS, FLUX_GUIDANCE_SCALE, FLUX_MAX_SEQUENCE_LENGTH = 28, 3.5, 512
FLUX_SAMPLE_SIZE = 128
FLUX_TIMESTEP_SCALE = 1000  # FluxPipeline passes timestep / 1000; the transformer multiplies by 1000 again
PACK = 2  # latents are packed in PACK x PACK patches (FluxPipeline's _pack_latents)
T5_PARTS = ("text_encoder_2", "tokenizer_2")
# FluxTransformer2DModel's block lists in forward order, each with the config key of its length
FLUX_BLOCK_LISTS = {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"}


class FluxConditioner(TextConditioner):
    """Captions -> ``{"encoder_hidden_states": (N, max_sequence_length, D_T5), "pooled_projections": (N, D_CLIP)}``
    as ``FluxPipeline.encode_prompt`` makes them: T5's last hidden states over ``max_sequence_length`` padded tokens
    and the CLIP text model's pooled output (over ``tokenizer.model_max_length`` tokens). The null condition is the
    empty prompt "" (true CFG's negative prompt). Embeddings are cached per distinct prompt (``TextConditioner``)."""

    def __init__(self, text_encoder: nn.Module, tokenizer, text_encoder_2: nn.Module, tokenizer_2,
                 max_sequence_length: int = FLUX_MAX_SEQUENCE_LENGTH, cache: bool = True):
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length} must be >= 1 (FluxPipeline's default: "
                             f"{FLUX_MAX_SEQUENCE_LENGTH} T5 tokens)")
        super().__init__(text_encoder, tokenizer, cache=cache)
        self.text_encoder_2 = text_encoder_2.requires_grad_(False).eval()
        self.tokenizer_2, self.max_sequence_length = tokenizer_2, max_sequence_length

    def train(self, mode: bool = True):
        super().train(mode)
        self.text_encoder_2.eval()
        return self

    def run_encoder(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(M, max_sequence_length, D_T5) T5 states, (M, D_CLIP) CLIP's pooled output."""
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.max_length, truncation=True,
                             return_tensors="pt").input_ids
        pooled = self.text_encoder(ids.to(next(self.text_encoder.parameters()).device)).pooler_output
        ids_2 = self.tokenizer_2(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                 return_tensors="pt").input_ids
        states = self.text_encoder_2(ids_2.to(next(self.text_encoder_2.parameters()).device))[0]
        return states.to(self.text_encoder_2.dtype), pooled.to(self.text_encoder.dtype)

    def forward(self, batch: dict, drop: torch.Tensor | None = None) -> dict:
        prompts = list(batch["caption"])
        if drop is not None:
            prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        states, pooled = self.encode_all(prompts)
        return {"encoder_hidden_states": states, "pooled_projections": pooled}

    def null(self, batch_size: int, device: torch.device | str = "cpu") -> dict:
        return {k: v.to(device) for k, v in self({"caption": [""] * batch_size}).items()}


class DistillFluxPipeline(TransformerCallDefaults, FluxPipeline):
    """A ``FluxPipeline`` whose call defaults are the exported model's: ``default_num_inference_steps``,
    ``default_guidance_scale`` (the embedded guidance of a ``guidance_embeds`` transformer), ``default_max_sequence_length``
    (T5 tokens), ``default_sample_size`` (latent pixels; ``FluxPipeline`` fixes 128: a student trained at one
    resolution samples at it, and so on the resolution shift it was trained with) and ``guidance_distilled`` (a
    student of a teacher without a guidance embedding, guided by CFG in training: ``guidance_scale`` has no effect and
    no ``true_cfg_scale`` is needed), registered in its config so that ``model_index.json`` carries them
    (``TransformerCallDefaults``)."""

    def __init__(self, scheduler, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, transformer,
                 image_encoder=None, feature_extractor=None,
                 default_num_inference_steps: int = FLUX_NUM_INFERENCE_STEPS,
                 default_guidance_scale: float = FLUX_GUIDANCE_SCALE,
                 default_max_sequence_length: int = FLUX_MAX_SEQUENCE_LENGTH,
                 default_sample_size: int = FLUX_SAMPLE_SIZE, guidance_distilled: bool = False):
        super().__init__(scheduler, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, transformer,
                         image_encoder, feature_extractor)
        self.register_to_config(default_num_inference_steps=default_num_inference_steps,
                                default_guidance_scale=default_guidance_scale,
                                default_max_sequence_length=default_max_sequence_length,
                                default_sample_size=default_sample_size, guidance_distilled=guidance_distilled)
        self.default_sample_size = default_sample_size


setattr(diffusers, DistillFluxPipeline.__name__, DistillFluxPipeline)  # where from_pretrained resolves _class_name


@FAMILIES.register("flux")
class FluxFamily(ModelFamily):
    """FLUX.1-dev / -schnell; conditioning ``{"encoder_hidden_states", "pooled_projections"}`` (``FluxConditioner``),
    the null condition the empty prompt's; the flow-matching schedule of its scheduler (``FlowMatchingSchedule`` with
    Flux's resolution shift); exported as a ``DistillFluxPipeline``."""

    conditioner_type = FluxConditioner
    pipeline_class = DistillFluxPipeline
    denoiser_component = "transformer"
    call_inputs = {"encoder_hidden_states": "prompt_embeds", "pooled_projections": "pooled_prompt_embeds"}
    # their time grids and exports at the training resolution's shift (resolution_shift)
    methods = ("consistency", "progressive", "consistency_training", "feature_distillation", "dmd2", "scm", "rcm",
               "meanflow")
    flow_matching = True
    classifier_free_guidance = False  # FluxPipeline passes guidance_scale to the transformer (guidance_input)
    resolution_shift = True  # FluxPipeline shifts by mu of the packed token count (shift_mu)
    components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")
    component_notes = dict.fromkeys(T5_PARTS, "T5, whose token states are Flux's whole text context: Flux has no "
                                              "T5-free mode; black-forest-labs/FLUX.1-dev has them")

    @classmethod
    def detect(cls, configs: dict[str, dict]) -> bool:
        """A ``FluxTransformer2DModel`` on a flow-matching scheduler."""
        return (configs.get("transformer", {}).get("_class_name") == "FluxTransformer2DModel"
                and is_flow_matching(configs["scheduler"]))

    @classmethod
    def load(cls, pretrained_model_name_or_path: str, revision: str | None = None, variant: str | None = None,
             torch_dtype: str | None = None, max_sequence_length: int = FLUX_MAX_SEQUENCE_LENGTH) -> Teacher:
        """``FluxPipeline.from_pretrained`` after ``check_components``, every network frozen."""
        cls.check_components(pretrained_model_name_or_path, pipeline_configs(pretrained_model_name_or_path, revision))
        dtype = getattr(torch, torch_dtype) if torch_dtype else None
        pipe = FluxPipeline.from_pretrained(pretrained_model_name_or_path, revision=revision, variant=variant,
                                            torch_dtype=dtype)
        return cls.teacher_of(pipe, pretrained_model_name_or_path,
                              {"revision": revision, "variant": variant, "torch_dtype": dtype},
                              max_sequence_length=max_sequence_length)

    @classmethod
    def conditioner_of(cls, pipe, cache_prompts: bool = True, max_sequence_length: int | None = None
                       ) -> FluxConditioner:
        """``max_sequence_length``: the T5 tokens; default the pipeline call's own (a ``DistillFluxPipeline``'s
        registered default, else ``FluxPipeline``'s 512)."""
        if max_sequence_length is None:
            max_sequence_length = pipe.config.get("default_max_sequence_length", FLUX_MAX_SEQUENCE_LENGTH)
        return FluxConditioner(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2,
                               max_sequence_length, cache=cache_prompts)

    def copy(self, cache_prompts: bool = True) -> FluxFamily:
        """A new instance on the same frozen parts with its own prompt cache."""
        c = self.conditioner
        conditioner = FluxConditioner(c.text_encoder, c.tokenizer, c.text_encoder_2, c.tokenizer_2,
                                      c.max_sequence_length, cache=cache_prompts)
        return type(self)(self.scheduler, self.vae, conditioner)

    # ------------------------------------------------------------------ schedule and denoiser

    def inference_sigmas(self, num_inference_steps: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmas (n + 1,), timesteps (n,)) of ``FluxPipeline.__call__`` for a ``height`` x ``width`` latent:
        linspace(1, 1 / n, n) shifted by mu of its packed token count (the scheduler's ``set_timesteps``)."""
        return self.schedule.inference_sigmas(sigmas=flux_sigmas(num_inference_steps),
                                              image_seq_len=image_seq_len(height, width, PACK))

    def set_timesteps(self, scheduler, num_inference_steps: int, height: int, width: int,
                      device: torch.device | str | None = None) -> None:
        """As ``FluxPipeline.__call__`` sets any scheduler it is given: the sigmas linspace(1, 1 / n, n) (none for a
        ``use_flow_sigmas`` scheduler) and mu of the packed token count from that scheduler's own config."""
        config = scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else flux_sigmas(num_inference_steps)
        mu = resolution_shift_mu(image_seq_len(height, width, PACK), config.get("base_image_seq_len", BASE_IMAGE_SEQ_LEN),
                                 config.get("max_image_seq_len", MAX_IMAGE_SEQ_LEN),
                                 config.get("base_shift", BASE_SHIFT), config.get("max_shift", MAX_SHIFT))
        retrieve_timesteps(scheduler, num_inference_steps, device, sigmas=sigmas, mu=mu)

    def latent_shape(self, network: nn.Module, n: int, height: int, width: int) -> tuple[int, ...]:
        """(N, in_channels / 4, H, W): the transformer's input channels are those of a packed 2x2 patch."""
        return (n, network.config.in_channels // PACK ** 2, height, width)

    def call_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``FluxPipeline``'s packed (N, H/2 * W/2, 4C) latents unpacked to (N, C, H, W)."""
        return unpack_latents(latents, height, width)

    def shift_mu(self, height: int, width: int) -> float | None:
        """mu of ``FluxPipeline``'s resolution shift for a ``height`` x ``width`` latent (``calculate_shift`` of its
        packed token count with the scheduler's base/max shift and sequence lengths); None without dynamic shifting."""
        return self.schedule.mu(image_seq_len(height, width, PACK))

    def resolution_defaults(self, height: int, width: int) -> dict:
        """The export's call defaults under which a call without height/width samples a ``height`` x ``width``
        latent, and so at its mu: ``DistillFluxPipeline``'s ``default_sample_size`` (one side: square latents only)."""
        if height != width:
            raise ValueError(f"a {height}x{width} latent: FluxPipeline's default_sample_size is one side, so an export "
                             "samples square images by default; train on square images (data.resolution)")
        if height % PACK:
            raise ValueError(f"a {height}x{width} latent: FluxPipeline packs 2x2 patches and samples the even size "
                             f"below it; train at a resolution of an even latent size ({height + 1} latent pixels)")
        return {"default_sample_size": height}

    def guidance_embedded(self, network: nn.Module) -> bool:
        """FLUX.1-dev's ``guidance_embeds``: ``FluxPipeline`` passes ``guidance_scale`` to the transformer and runs no
        CFG pass (``true_cfg_scale`` 1); FLUX.1-schnell has no embedding."""
        return bool(network.config.get("guidance_embeds"))

    def guidance_input(self, guidance_scale: torch.Tensor) -> dict:
        """``{"guidance": (N,)}``: ``denoise_at`` embeds it where the transformer has FLUX.1-dev's guidance embedding
        and drops it otherwise (FLUX.1-schnell)."""
        return {"guidance": guidance_scale}

    def denoise(self, network: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: dict, **extra) -> torch.Tensor:
        """The transformer's velocity at (x (N, C, H, W), t) for flow time t in [0, 1] (a float or (N,)), its timestep
        ``schedule.timestep(t)`` = 1000 t (``scheduler.timesteps``) as ``denoise_at`` passes it."""
        t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
        return self.denoise_at(network, x, self.schedule.timestep(t), cond, **extra)

    def denoise_at(self, network: nn.Module, x: torch.Tensor, timestep: torch.Tensor, cond: dict,
                   guidance: float | torch.Tensor = FLUX_GUIDANCE_SCALE, **extra) -> torch.Tensor:
        """The velocity (N, C, H, W) at the scheduler's timestep (1000 t) as ``FluxPipeline`` calls the transformer:
        x packed in 2x2 patches with their ``img_ids``, zero ``txt_ids``, ``timestep / 1000``, and ``guidance`` (a
        float or (N,)) where the transformer embeds it (FLUX.1-dev; FLUX.1-schnell ignores it, as the pipeline)."""
        n, _, height, width = x.shape
        timestep = torch.as_tensor(timestep, device=x.device)
        timestep = (timestep.expand(n) if timestep.ndim == 0 else timestep).to(x.dtype)
        if network.config.guidance_embeds:
            guidance = torch.as_tensor(guidance, dtype=torch.float32, device=x.device)
            guidance = guidance.expand(n) if guidance.ndim == 0 else guidance
        else:
            guidance = None
        states = cond["encoder_hidden_states"]
        out = network(hidden_states=pack_latents(x), timestep=timestep / FLUX_TIMESTEP_SCALE, guidance=guidance,
                      pooled_projections=cond["pooled_projections"], encoder_hidden_states=states,
                      txt_ids=torch.zeros(states.shape[1], 3, device=x.device, dtype=states.dtype),
                      img_ids=latent_image_ids(height, width, x.device, x.dtype), **extra).sample
        return unpack_latents(out, height, width)

    def example_inputs(self, network: nn.Module, n: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Zero inputs at FluxPipeline's native 128 latent pixels, one T5 token."""
        c = network.config
        return (torch.zeros(n, c.in_channels // 4, FLUX_SAMPLE_SIZE, FLUX_SAMPLE_SIZE), torch.zeros(n),
                {"encoder_hidden_states": torch.zeros(n, 1, c.joint_attention_dim),
                 "pooled_projections": torch.zeros(n, c.pooled_projection_dim)})

    @classmethod
    def feature_blocks(cls, network: nn.Module, mid_block: bool = False) -> dict[str, nn.Module]:
        """Every double-stream block, then every single-stream block (``mid_block`` has no meaning here)."""
        return {f"{blocks}.{i}": b for blocks in FLUX_BLOCK_LISTS for i, b in enumerate(getattr(network, blocks))}

    feature_width_dim = -1  # a block feature is (N, T, D): image tokens x width

    @staticmethod
    def block_feature(output: tuple) -> torch.Tensor:
        """The image tokens (N, T, D): ``FluxTransformerBlock`` and ``FluxSingleTransformerBlock`` both return
        (encoder_hidden_states, hidden_states), the text stream first (a single block splits its joint sequence back
        into the two)."""
        return output[1]

    @classmethod
    def feature_block_pairs(cls, teacher: nn.Module, student: nn.Module, mid_block: bool = False) -> dict[str, str]:
        """Double-stream blocks to double-stream blocks and single- to single-stream ones, in each list student block
        j of L_s -> teacher block (j + 1) L_t // L_s - 1 (``evenly_spaced_block_pairs``: the same index at equal
        depth; for ``student=shallow``, which keeps those very blocks, each block to its own origin). A student with
        more blocks of either kind is refused."""
        return evenly_spaced_block_pairs(teacher, student, FLUX_BLOCK_LISTS)

    @staticmethod
    def feature_regressor(student_width: int, teacher_width: int) -> nn.Module:
        """FitNets' regressor on the token width: a linear map D_s -> D_t applied to every token."""
        return nn.Linear(student_width, teacher_width)

    # ------------------------------------------------------------------ export and pipelines

    def pipeline(self, network: nn.Module, scheduler, **call_defaults) -> DistillFluxPipeline:
        c = self.conditioner
        call_defaults.setdefault("default_max_sequence_length", c.max_sequence_length)
        pipe = DistillFluxPipeline(scheduler=scheduler, vae=self.vae, text_encoder=c.text_encoder,
                                   tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
                                   transformer=network, **call_defaults)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @classmethod
    def matches(cls, pipe) -> bool:
        """Any FluxPipeline (a distill export or diffusers' own)."""
        return isinstance(pipe, FluxPipeline)

    @classmethod
    def native_size(cls, pipe) -> int:
        """``FluxPipeline``'s default image side: ``default_sample_size`` latent pixels times the VAE's factor."""
        return pipe.default_sample_size * pipe.vae_scale_factor

    @classmethod
    def size_multiple(cls, pipe) -> int:
        """The VAE's factor times the 2x2 packing (``FluxPipeline`` resizes other sizes down to it)."""
        return pipe.vae_scale_factor * PACK
