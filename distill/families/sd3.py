"""Stable Diffusion 3 / 3.5 (Esser et al. 2024): an ``SD3Transformer2DModel`` (MMDiT) predicting the flow velocity
on ``FlowMatchEulerDiscreteScheduler``'s shifted schedule, conditioned on CLIP-L + CLIP-G (+ optional T5) token
states and their pooled projections, ``AutoencoderKL`` latents with a ``shift_factor``.

T5 is optional, as SD3 allows: a pipeline saved without ``text_encoder_3`` loads with it None, and its context
then ends in ``max_sequence_length`` zero tokens, as ``StableDiffusion3Pipeline.encode_prompt`` pads them. SD3's
default is 256 tokens (``SD3_MAX_SEQUENCE_LENGTH``); on tiny latents they dominate the transformer's cost, so the
conditioner and the export take it as a setting (``max_sequence_length``).

Consistency distillation (``method=consistency``: Euler steps of the flow ODE, exported with
``FlowMatchLCMScheduler``, ``scheduler=flow_lcm``) and progressive distillation (``method=progressive``: flow Euler
steps, the student sampled on the trailing sigmas it learned, ``sigma_spacing``) and ECT (``method=consistency_training``:
ECT's noise-level pairs at flow times sigma / (1 + sigma), sampled with ``scheduler=flow_lcm``) and BK-SDM's output
and feature distillation (``method=feature_distillation``: t drawn as SD3 trains, each joint block's image tokens
matched, a shallower student's blocks to evenly spaced teacher blocks, ``student=shallow``) and DMD2
(``method=dmd2``: a generator of x0 = x_t - t v on the trailing sigmas, ``+exp=dmd2_flow``) serve this family; the
other training methods step the discrete VP schedule at integer timesteps, and a run of one on an SD3 teacher is refused
before anything loads. ``distill.evaluate`` and
``distill.sample`` run on it, and ``method=flow_matching`` trains an SD3 transformer from scratch (``+exp=flow_teacher``).
"""

from __future__ import annotations

import diffusers
import torch
from diffusers import StableDiffusion3Pipeline
from torch import nn

from distill.families.base import (
    FAMILIES,
    SIGMA_SPACINGS,
    ModelFamily,
    TransformerCallDefaults,
    evenly_spaced_block_pairs,
    trailing_sigmas,
)
from distill.models.teacher import Teacher, is_flow_matching, pipeline_configs

SD3_MAX_SEQUENCE_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length: T5 tokens (zeros without T5)
SD3_NUM_INFERENCE_STEPS, SD3_GUIDANCE_SCALE = 28, 7.0  # StableDiffusion3Pipeline.__call__'s defaults
T5_PARTS = ("text_encoder_3", "tokenizer_3")
SD3_BLOCK_LISTS = {"transformer_blocks": "num_layers"}  # SD3Transformer2DModel's joint blocks, with their count's key


class SD3Conditioner(nn.Module):
    """Captions -> ``{"encoder_hidden_states": (N, L + max_sequence_length, joint_dim), "pooled_projections":
    (N, P_L + P_G)}`` as ``StableDiffusion3Pipeline.encode_prompt`` makes them: each CLIP's penultimate hidden states
    (padded to ``tokenizer.model_max_length``, the first tokenizer's length for both), concatenated along the
    features and zero-padded to the transformer's ``joint_dim``, followed by T5's ``max_sequence_length`` token
    states (zeros without T5); the pooled projections of both CLIPs concatenated. The null condition is the empty
    prompt "" (SD3's negative prompt). Embeddings are cached per distinct prompt, as ``TextConditioner`` caches."""

    def __init__(self, text_encoder: nn.Module, tokenizer, text_encoder_2: nn.Module, tokenizer_2, joint_dim: int,
                 text_encoder_3: nn.Module | None = None, tokenizer_3=None,
                 max_sequence_length: int = SD3_MAX_SEQUENCE_LENGTH, cache: bool = True):
        super().__init__()
        if max_sequence_length < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length} must be >= 1 (SD3's default: "
                             f"{SD3_MAX_SEQUENCE_LENGTH} T5 tokens)")
        if (text_encoder_3 is None) != (tokenizer_3 is None):
            raise ValueError("text_encoder_3 and tokenizer_3 (T5) come together: give both or neither")
        self.text_encoder = text_encoder.requires_grad_(False).eval()
        self.text_encoder_2 = text_encoder_2.requires_grad_(False).eval()
        self.text_encoder_3 = text_encoder_3.requires_grad_(False).eval() if text_encoder_3 is not None else None
        self.tokenizer, self.tokenizer_2, self.tokenizer_3 = tokenizer, tokenizer_2, tokenizer_3
        self.joint_dim, self.max_sequence_length = joint_dim, max_sequence_length
        self.cache_enabled = cache
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.encoder_calls = 0  # prompts actually run through the encoders (the cache's misses)

    def train(self, mode: bool = True):
        super().train(mode)
        for encoder in (self.text_encoder, self.text_encoder_2, self.text_encoder_3):
            if encoder is not None:
                encoder.eval()  # frozen: dropout stays off whatever the method's mode
        return self

    def _clip(self, encoder: nn.Module, tokenizer, prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").input_ids.to(device)
        out = encoder(ids, output_hidden_states=True)
        return out.hidden_states[-2].to(self.text_encoder.dtype), out[0]  # penultimate states, pooled projection

    def _t5(self, prompts: list[str], device) -> torch.Tensor:
        if self.text_encoder_3 is None:
            return torch.zeros(len(prompts), self.max_sequence_length, self.joint_dim, device=device,
                               dtype=self.text_encoder.dtype)
        ids = self.tokenizer_3(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                               add_special_tokens=True, return_tensors="pt").input_ids.to(device)
        return self.text_encoder_3(ids)[0].to(self.text_encoder_3.dtype)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds (N, L + max_sequence_length, joint_dim), pooled (N, P)) for ``prompts``."""
        device = next(self.text_encoder.parameters()).device
        todo = [p for p in dict.fromkeys(prompts) if not (self.cache_enabled and p in self._cache)]
        fresh = {}
        if todo:
            states_l, pooled_l = self._clip(self.text_encoder, self.tokenizer, todo, device)
            states_g, pooled_g = self._clip(self.text_encoder_2, self.tokenizer_2, todo, device)
            clip = torch.cat([states_l, states_g], dim=-1)
            t5 = self._t5(todo, device)
            clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
            embeds, pooled = torch.cat([clip, t5], dim=-2), torch.cat([pooled_l, pooled_g], dim=-1)
            self.encoder_calls += len(todo)
            fresh = {p: (e, q) for p, e, q in zip(todo, embeds, pooled)}
            if self.cache_enabled:
                self._cache.update(fresh)
        table = self._cache if self.cache_enabled else fresh
        return (torch.stack([table[p][0].to(device) for p in prompts]),
                torch.stack([table[p][1].to(device) for p in prompts]))

    def forward(self, batch: dict, drop: torch.Tensor | None = None) -> dict:
        prompts = list(batch["caption"])
        if drop is not None:
            prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        embeds, pooled = self.encode(prompts)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled}

    def null(self, batch_size: int, device: torch.device | str = "cpu") -> dict:
        embeds, pooled = self.encode([""] * batch_size)
        return {"encoder_hidden_states": embeds.to(device), "pooled_projections": pooled.to(device)}

    def _apply(self, fn, recurse=True):
        self._cache.clear()  # cached tensors live on the old device/dtype
        return super()._apply(fn, recurse)

    @classmethod
    def from_clip(cls, pretrained_model_name_or_path: str, joint_dim: int,
                  max_sequence_length: int = SD3_MAX_SEQUENCE_LENGTH) -> SD3Conditioner:
        """SD3's two CLIP towers (CLIP-L and CLIP-G) both derived from one ``CLIPModel``: its text tower and text
        projection, copied into a ``CLIPTextModelWithProjection`` (bit-identical outputs), with its tokenizer; no
        T5. For a model trained in SD3's layout on a world with a single CLIP."""
        from transformers import CLIPModel, CLIPTextModelWithProjection, CLIPTokenizer

        clip = CLIPModel.from_pretrained(pretrained_model_name_or_path)
        config = clip.config.text_config
        config.projection_dim = clip.config.projection_dim

        def tower() -> CLIPTextModelWithProjection:
            encoder = CLIPTextModelWithProjection(config)
            encoder.text_model.load_state_dict(clip.text_model.state_dict())
            encoder.text_projection.load_state_dict(clip.text_projection.state_dict())
            return encoder

        tokenizer = CLIPTokenizer.from_pretrained(pretrained_model_name_or_path)
        return cls(tower(), tokenizer, tower(), tokenizer, joint_dim, max_sequence_length=max_sequence_length)


class DistillSD3Pipeline(TransformerCallDefaults, StableDiffusion3Pipeline):
    """A ``StableDiffusion3Pipeline`` whose call defaults are the exported model's: ``default_num_inference_steps``,
    ``default_guidance_scale``, ``default_max_sequence_length`` (the T5 tokens, zeros without T5) and
    ``guidance_distilled`` (no CFG pass is run; ``guidance_scale`` has no effect) and ``sigma_spacing`` ("trailing":
    the sigmas linspace(1, 1 / N, N) a progressive student learned; ``TransformerCallDefaults``), registered in its
    config so that
    ``model_index.json`` carries them. T5 (``text_encoder_3``, ``tokenizer_3``) is optional here, so that
    ``DiffusionPipeline.from_pretrained(export)`` loads an export saved without it."""

    _optional_components = [*StableDiffusion3Pipeline._optional_components, *T5_PARTS]

    def __init__(self, transformer, scheduler, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2,
                 text_encoder_3=None, tokenizer_3=None, image_encoder=None, feature_extractor=None,
                 default_num_inference_steps: int = SD3_NUM_INFERENCE_STEPS,
                 default_guidance_scale: float = SD3_GUIDANCE_SCALE,
                 default_max_sequence_length: int = SD3_MAX_SEQUENCE_LENGTH, guidance_distilled: bool = False,
                 sigma_spacing: str = "scheduler"):
        super().__init__(transformer, scheduler, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2,
                         text_encoder_3, tokenizer_3, image_encoder, feature_extractor)
        if sigma_spacing not in SIGMA_SPACINGS:
            raise ValueError(f"sigma_spacing={sigma_spacing!r}; use one of {list(SIGMA_SPACINGS)}")
        self.register_to_config(default_num_inference_steps=default_num_inference_steps,
                                default_guidance_scale=default_guidance_scale,
                                default_max_sequence_length=default_max_sequence_length,
                                guidance_distilled=guidance_distilled, sigma_spacing=sigma_spacing)

    @property
    def do_classifier_free_guidance(self) -> bool:
        return super().do_classifier_free_guidance and not self.config.guidance_distilled


setattr(diffusers, DistillSD3Pipeline.__name__, DistillSD3Pipeline)  # where from_pretrained resolves _class_name


@FAMILIES.register("sd3")
class StableDiffusion3Family(ModelFamily):
    """SD3 / SD3.5; conditioning ``{"encoder_hidden_states", "pooled_projections"}`` (``SD3Conditioner``), the null
    condition the empty prompt's; the flow-matching schedule of its scheduler (``FlowMatchingSchedule``: t in
    [0, 1], the transformer's timestep 1000 t); exported as a ``DistillSD3Pipeline``."""

    conditioner_type = SD3Conditioner
    pipeline_class = DistillSD3Pipeline
    denoiser_component = "transformer"
    call_inputs = {"encoder_hidden_states": "prompt_embeds", "pooled_projections": "pooled_prompt_embeds"}
    # the others step the discrete VP schedule at integer timesteps
    methods = ("consistency", "progressive", "consistency_training", "feature_distillation", "dmd2", "scm",
               "meanflow", "rcm")
    flow_matching = True
    components = ("transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler")

    @classmethod
    def detect(cls, configs: dict[str, dict]) -> bool:
        """An ``SD3Transformer2DModel`` on a flow-matching scheduler."""
        return (configs.get("transformer", {}).get("_class_name") == "SD3Transformer2DModel"
                and is_flow_matching(configs["scheduler"]))

    @classmethod
    def load(cls, pretrained_model_name_or_path: str, revision: str | None = None, variant: str | None = None,
             torch_dtype: str | None = None, max_sequence_length: int | None = None) -> Teacher:
        """``StableDiffusion3Pipeline.from_pretrained`` after ``check_components``, T5 None where the pipeline has
        none (its model_index.json lacks ``text_encoder_3`` or records it as null), every network frozen.
        ``max_sequence_length`` (the T5 tokens of the teacher's context): default the one the pipeline samples with,
        its registered ``default_max_sequence_length`` (a distill export) or ``StableDiffusion3Pipeline``'s 256."""
        dtype = getattr(torch, torch_dtype) if torch_dtype else None
        index = pipeline_configs(pretrained_model_name_or_path, revision)["pipeline"]
        if max_sequence_length is None:
            max_sequence_length = index.get("default_max_sequence_length", SD3_MAX_SEQUENCE_LENGTH)
        absent = {name: None for name in T5_PARTS if (index.get(name) or [None])[0] is None}
        cls.check_components(pretrained_model_name_or_path, {"pipeline": index})
        pipe = StableDiffusion3Pipeline.from_pretrained(pretrained_model_name_or_path, revision=revision,
                                                        variant=variant, torch_dtype=dtype, **absent)
        return cls.teacher_of(pipe, pretrained_model_name_or_path,
                              {"revision": revision, "variant": variant, "torch_dtype": dtype},
                              max_sequence_length=max_sequence_length)

    @classmethod
    def conditioner_of(cls, pipe, cache_prompts: bool = True, max_sequence_length: int | None = None
                       ) -> SD3Conditioner:
        """``max_sequence_length``: the T5 tokens; default the pipeline call's own (a ``DistillSD3Pipeline``'s
        registered default, else ``StableDiffusion3Pipeline``'s)."""
        if max_sequence_length is None:
            max_sequence_length = pipe.config.get("default_max_sequence_length", SD3_MAX_SEQUENCE_LENGTH)
        return SD3Conditioner(pipe.text_encoder, pipe.tokenizer, pipe.text_encoder_2, pipe.tokenizer_2,
                              pipe.transformer.config.joint_attention_dim, pipe.text_encoder_3, pipe.tokenizer_3,
                              max_sequence_length, cache=cache_prompts)

    sigma_spacing = "scheduler"  # "trailing": a pipeline's registered sigma_spacing (``from_pipeline``)

    @classmethod
    def from_pipeline(cls, pipe, cache_prompts: bool = True) -> StableDiffusion3Family:
        """As ``ModelFamily.from_pipeline``, keeping the pipeline's registered ``sigma_spacing`` for ``set_timesteps``
        (the server steps the scheduler itself)."""
        family = super().from_pipeline(pipe, cache_prompts)
        family.sigma_spacing = pipe.config.get("sigma_spacing") or "scheduler"
        return family

    def copy(self, cache_prompts: bool = True) -> StableDiffusion3Family:
        """A new instance on the same frozen parts with its own prompt cache."""
        c = self.conditioner
        conditioner = SD3Conditioner(c.text_encoder, c.tokenizer, c.text_encoder_2, c.tokenizer_2, c.joint_dim,
                                     c.text_encoder_3, c.tokenizer_3, c.max_sequence_length, cache=cache_prompts)
        family = type(self)(self.scheduler, self.vae, conditioner)
        family.sigma_spacing = self.sigma_spacing
        return family

    def set_timesteps(self, scheduler, num_inference_steps: int, height: int, width: int,
                      device: torch.device | str | None = None) -> None:
        """As ``DistillSD3Pipeline``'s call sets them: the scheduler's own N steps, or with ``sigma_spacing``
        "trailing" the sigmas linspace(1, 1 / N, N)."""
        if self.sigma_spacing == "trailing":
            scheduler.set_timesteps(sigmas=trailing_sigmas(num_inference_steps), device=device)
        else:
            scheduler.set_timesteps(num_inference_steps, device=device)

    def denoise(self, network: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: dict, **extra) -> torch.Tensor:
        """The transformer's velocity at (x, t) for flow time t in [0, 1] (a float or (N,)), its timestep input
        ``schedule.timestep(t)`` = 1000 t as the pipeline passes it (``scheduler.timesteps``)."""
        t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
        return self.denoise_at(network, x, self.schedule.timestep(t.expand(len(x)) if t.ndim == 0 else t), cond,
                               **extra)

    def denoise_at(self, network: nn.Module, x: torch.Tensor, timestep: torch.Tensor, cond: dict, **extra
                   ) -> torch.Tensor:
        """The transformer's velocity at its own timestep input (1000 t; a flow scheduler's ``timesteps`` entry)."""
        return network(hidden_states=x, timestep=timestep, **cond, **extra).sample

    def example_inputs(self, network: nn.Module, n: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
        c = network.config
        return (torch.zeros(n, c.in_channels, c.sample_size, c.sample_size), torch.zeros(n),
                {"encoder_hidden_states": torch.zeros(n, 1, c.joint_attention_dim),
                 "pooled_projections": torch.zeros(n, c.pooled_projection_dim)})

    @classmethod
    def feature_blocks(cls, network: nn.Module, mid_block: bool = False) -> dict[str, nn.Module]:
        """Every joint transformer block (``mid_block`` has no meaning for a transformer)."""
        return {f"transformer_blocks.{i}": block for i, block in enumerate(network.transformer_blocks)}

    feature_width_dim = -1  # a block feature is (N, T, D): image tokens x width

    @staticmethod
    def block_feature(output: tuple) -> torch.Tensor:
        """The image tokens (N, T, D): ``JointTransformerBlock`` returns (encoder_hidden_states, hidden_states), the
        text stream first (None after the last block, ``context_pre_only``)."""
        return output[1]

    @classmethod
    def feature_block_pairs(cls, teacher: nn.Module, student: nn.Module, mid_block: bool = False) -> dict[str, str]:
        """Student block j of L_s -> teacher block (j + 1) L_t // L_s - 1 (``evenly_spaced_block_pairs``: the same
        index at equal depth; the block ending each of L_s equal runs of teacher blocks, the last to the last, for a
        shallower student such as ``student=shallow``, which starts from those very blocks). A deeper student is
        refused."""
        return evenly_spaced_block_pairs(teacher, student, SD3_BLOCK_LISTS)

    @staticmethod
    def feature_regressor(student_width: int, teacher_width: int) -> nn.Module:
        """FitNets' regressor on the token width: a linear map D_s -> D_t applied to every token."""
        return nn.Linear(student_width, teacher_width)

    def pipeline(self, network: nn.Module, scheduler, **call_defaults) -> DistillSD3Pipeline:
        c = self.conditioner
        call_defaults.setdefault("default_max_sequence_length", c.max_sequence_length)
        pipe = DistillSD3Pipeline(
            transformer=network, scheduler=scheduler, vae=self.vae, text_encoder=c.text_encoder,
            tokenizer=c.tokenizer, text_encoder_2=c.text_encoder_2, tokenizer_2=c.tokenizer_2,
            text_encoder_3=c.text_encoder_3, tokenizer_3=c.tokenizer_3, **call_defaults)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @classmethod
    def matches(cls, pipe) -> bool:
        """Any StableDiffusion3Pipeline (a distill export or diffusers' own)."""
        return isinstance(pipe, StableDiffusion3Pipeline)
