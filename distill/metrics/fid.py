"""FID (Heusel et al. 2017) in a pluggable feature space, and the reference set it is measured against.

The reference statistics are torchmetrics' ``FrechetInceptionDistance`` states; only the feature
extractor changes: any network mapping images in [-1, 1] to (N, D) features (a classifier's penultimate
layer, a TorchScript file), a transformers vision tower (CLIP, SigLIP, DINOv2, ...) from a local folder or
a hub id, or Inception-v3 (torch-fidelity). The generated side is computed once as features, so that its
bootstrap spread and KID cost no network call; the reference features are kept for KID.
"""

from __future__ import annotations

import hashlib
import json
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from distill.metrics.bootstrap import bootstrap_replicates

DEFAULT_CACHE = Path.home() / ".cache" / "distill" / "fid_reference"


def gaussian_statistics(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (D,) and unbiased covariance (D, D) of ``features`` (N, D), in float64."""
    features = features.double()
    mu = features.mean(0)
    centred = features - mu
    return mu, centred.T @ centred / (len(features) - 1)


def frechet_distance(mu1: torch.Tensor, sigma1: torch.Tensor, mu2: torch.Tensor, sigma2: torch.Tensor) -> float:
    """||mu1 - mu2||^2 + Tr(S1 + S2 - 2 (S1 S2)^(1/2)), Heusel et al. 2017 eq. 6 (the root's trace from the
    eigenvalues of S1 S2, as torchmetrics computes it)."""
    root_trace = torch.linalg.eigvals(sigma1 @ sigma2).sqrt().real.sum()
    return float((mu1 - mu2).square().sum() + sigma1.trace() + sigma2.trace() - 2 * root_trace)


@runtime_checkable
class PenultimateFeatures(Protocol):
    """A classifier that exposes the layer FID is measured in: ``features(images)`` -> (N, ``feature_dim``)."""

    feature_dim: int

    def features(self, images: torch.Tensor) -> torch.Tensor: ...


def processor_normalization(name_or_path: str) -> tuple[list[float], list[float], int | None] | None:
    """(image_mean, image_std, input size) from a transformers model's ``preprocessor_config.json`` (local
    folder or cached hub id), or None when it has none."""
    from transformers.utils import cached_file

    try:
        file = cached_file(str(name_or_path), "preprocessor_config.json", _raise_exceptions_for_missing_entries=False)
    except OSError:
        return None
    if file is None:
        return None
    config = json.loads(Path(file).read_text())
    size = config.get("crop_size") if config.get("do_center_crop") else config.get("size")
    if isinstance(size, dict):
        size = size.get("height") or size.get("shortest_edge")
    return config.get("image_mean", [0.5]), config.get("image_std", [0.5]), size


def to_model_pixels(images: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """Images in [-1, 1] -> a vision model's normalised pixels ((x + 1) / 2 - mean) / std; a model that
    already takes [-1, 1] (mean = std = 0.5) gets the images untouched."""
    if all(m == 0.5 for m in mean) and all(s == 0.5 for s in std):
        return images
    shape = (1, -1, 1, 1)
    mean_t = torch.tensor(mean, dtype=images.dtype, device=images.device).view(shape)
    std_t = torch.tensor(std, dtype=images.dtype, device=images.device).view(shape)
    return ((images + 1) / 2 - mean_t) / std_t


class VisionTowerFeatures(nn.Module):
    """A transformers vision model as a feature network: images (N, C, H, W) in [-1, 1] are resized to the
    model's input size, made RGB and normalised as its image processor does; the features are the projected
    image embedding of a contrastive model (CLIP, SigLIP: ``get_image_features``), else the pooled output
    (DINOv2's layer-normed class token, ViT)."""

    def __init__(self, model: nn.Module, image_size: int, num_channels: int, mean: list[float], std: list[float]):
        super().__init__()
        self.model, self.image_size, self.num_channels = model, image_size, num_channels
        self.mean, self.std = list(mean), list(std)

    @classmethod
    def from_pretrained(cls, name_or_path: str) -> VisionTowerFeatures:
        from transformers import AutoModel
        from transformers.utils.constants import (
            IMAGENET_DEFAULT_MEAN,
            IMAGENET_DEFAULT_STD,
            OPENAI_CLIP_MEAN,
            OPENAI_CLIP_STD,
        )

        model = AutoModel.from_pretrained(str(name_or_path)).eval()
        vision = getattr(model.config, "vision_config", model.config)
        processor = processor_normalization(name_or_path)
        if processor is None:  # no processor saved: the family's usual normalisation at the model's own size
            clip_like = "clip" in model.config.model_type or "siglip" in model.config.model_type
            mean, std = (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD) if clip_like else (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
            size = vision.image_size
        else:
            mean, std, size = processor
        return cls(model, int(size or vision.image_size), getattr(vision, "num_channels", 3), list(mean), list(std))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(next(self.model.parameters()).dtype)
        if x.shape[1] != self.num_channels:  # grey samples to RGB (or RGB to the model's grey)
            x = x.expand(-1, self.num_channels, -1, -1) if x.shape[1] == 1 else x.mean(1, keepdim=True)
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bicubic", align_corners=False,
                              antialias=True)
        x = to_model_pixels(x, self.mean, self.std)
        if hasattr(self.model, "get_image_features"):
            out = self.model.get_image_features(pixel_values=x)
            return out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 4 / 5
        out = self.model(pixel_values=x)
        return out.pooler_output if getattr(out, "pooler_output", None) is not None else out.last_hidden_state[:, 0]


class FeatureNet(nn.Module):
    """Adapts a network to torchmetrics: images (N, C, H, W) in [-1, 1] -> features (N, D).

    A ``PenultimateFeatures`` classifier is measured through its ``features``; any other network (a
    TorchScript file, a torchvision net whose ``.features`` is a conv trunk) through its forward, which must
    return (N, D). ``input_shape`` (C, H, W) is that of the images measured; one forward pass on it checks the
    output and gives ``num_features``.
    """

    def __init__(self, net: nn.Module, name: str, input_shape: tuple[int, int, int] = (1, 32, 32)):
        super().__init__()
        self.net = net.eval()
        for p in self.net.parameters():  # not net.requires_grad_: TorchScript modules do not support it
            p.requires_grad_(False)
        self.name = name
        with torch.no_grad():
            shape = tuple(self(torch.zeros(1, *input_shape)).shape)
        if len(shape) != 2:
            raise ValueError(f"fid feature network {name!r} maps images {(1, *input_shape)} to {shape}, not (N, D); "
                             "give a network whose forward returns (N, D) features (e.g. end it with pooling and "
                             "nn.Flatten)")
        self.num_features = shape[1]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if isinstance(self.net, PenultimateFeatures):
            return self.net.features(images.float())
        return self.net(images.float())

    def fingerprint(self) -> str:
        """Hash of the weights: a reference cache entry is only reused by the very same network."""
        h = hashlib.sha256(self.name.encode())
        for value in self.net.state_dict().values():
            h.update(value.detach().cpu().float().numpy().tobytes())
        return h.hexdigest()[:16]


def describe(spec: Any) -> str:
    """A readable name of a feature-network spec: a path, a hub id, or a factory with its arguments."""
    if isinstance(spec, partial):
        args = ", ".join([repr(a) for a in spec.args] + [f"{k}={v!r}" for k, v in spec.keywords.items()])
        return f"{spec.func.__module__}.{spec.func.__qualname__}({args})"
    return str(spec) if isinstance(spec, (str, Path)) else type(spec).__name__


def load_feature_net(spec: Any, input_shape: tuple[int, int, int]) -> FeatureNet | str:
    """The feature network named by ``spec``: a module, a factory that returns one (a Hydra ``_partial_``
    node), ``inception`` (torch-fidelity), a TorchScript ``.pt`` file mapping images (N, *input_shape) in
    [-1, 1] to (N, D), or a transformers vision model (folder or hub id; offline: the local cache)."""
    if isinstance(spec, nn.Module):
        return spec if isinstance(spec, FeatureNet) else FeatureNet(spec, type(spec).__name__, input_shape)
    if callable(spec):
        return FeatureNet(spec(), describe(spec), input_shape)
    spec = str(spec)
    if spec == "inception":
        return _inception()
    path = Path(spec).expanduser()
    if path.is_file():
        return FeatureNet(torch.jit.load(str(path), map_location="cpu"), f"torchscript:{path.resolve()}", input_shape)
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"feature network folder {spec!r} has no config.json; give a transformers vision "
                                "model folder (save_pretrained), a TorchScript .pt file, or a hub id")
    try:
        net = VisionTowerFeatures.from_pretrained(str(path) if path.is_dir() else spec)
    except OSError as err:
        raise FileNotFoundError(f"feature network {spec!r} is neither a file, a model folder, nor a hub id in the "
                                f"local cache ({err}); download it once (huggingface-cli download {spec}) or give a "
                                "local path") from err
    name = f"transformers:{path.resolve() if path.is_dir() else spec}"
    return FeatureNet(net, name, input_shape)


def _inception() -> str:
    try:
        import torch_fidelity  # noqa: F401
        from torchmetrics.image.fid import NoTrainInceptionV3  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "feature=inception needs torch-fidelity and a torch with a matching torchvision: "
            "pip install 'distill[inception]'; or give a CLIP/DINOv2 model folder or hub id"
        ) from err
    return "inception"


class FID:
    """FID between a fixed reference set and generated images; reference statistics are cached on disk."""

    def __init__(self, feature: Any, cache_dir: str | Path | None = DEFAULT_CACHE,
                 input_shape: tuple[int, int, int] = (1, 32, 32)):
        from torchmetrics.image.fid import FrechetInceptionDistance

        net = load_feature_net(feature, input_shape)
        if isinstance(net, str):  # inception: torchmetrics builds it; expects images in [0, 1]
            self.metric = FrechetInceptionDistance(feature=2048, normalize=True, reset_real_features=False)
            self.inception, self.fingerprint = True, "inception-2048"
        else:
            self.metric = FrechetInceptionDistance(feature=net, reset_real_features=False)
            self.inception, self.fingerprint = False, net.fingerprint()
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.has_reference = False
        self.reference_features: torch.Tensor | None = None  # (N, D), for KID; None for statistics-only references
        self._statistics: tuple[torch.Tensor, torch.Tensor] | None = None

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        if self.inception:
            images = (images.clamp(-1, 1) + 1) / 2
            return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images
        return images.clamp(-1, 1)

    def _cache_file(self, reference_key: str) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"{self.fingerprint}-{reference_key}.pt"

    @torch.no_grad()
    def set_reference(self, images: torch.Tensor | None = None, reference_key: str | None = None,
                      batch_size: int = 256) -> None:
        """Load the reference statistics and features for ``reference_key`` from the cache, or compute them
        from ``images`` (one pass of the network; the sums accumulate per batch, as torchmetrics' update)."""
        cache = self._cache_file(reference_key) if reference_key else None
        state = torch.load(cache, map_location="cpu", weights_only=True) if cache is not None and cache.is_file() else None
        if state is not None and "features" in state:
            self.metric.real_features_sum.copy_(state["sum"])
            self.metric.real_features_cov_sum.copy_(state["cov_sum"])
            self.metric.real_features_num_samples.copy_(state["n"])
            self.reference_features = state["features"]
        else:
            if images is None:
                raise ValueError(f"no cached reference {reference_key!r}; pass the reference images")
            chunks = []
            for chunk in images.split(batch_size):
                features = self.features(chunk, batch_size)
                self.metric.real_features_sum += features.sum(dim=0)
                self.metric.real_features_cov_sum += features.t().mm(features)
                self.metric.real_features_num_samples += len(chunk)
                chunks.append(features)
            self.reference_features = torch.cat(chunks)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(".tmp")
                torch.save({"sum": self.metric.real_features_sum, "cov_sum": self.metric.real_features_cov_sum,
                            "n": self.metric.real_features_num_samples, "features": self.reference_features}, tmp)
                tmp.replace(cache)
        self.has_reference = True

    def set_reference_statistics(self, path: str | Path) -> None:
        """Reference mean ``mu`` (D,) and covariance ``sigma`` (D, D) from a ``.npz`` file (pytorch-fid's and
        clean-fid's format), optionally with the ``features`` (N, D) themselves, which KID needs."""
        data = np.load(path)
        if "mu" not in data or "sigma" not in data:
            raise ValueError(f"reference statistics {str(path)!r} lack 'mu' and 'sigma' (keys: {sorted(data.keys())}); "
                             "save them with numpy.savez(path, mu=..., sigma=...[, features=...])")
        mu, sigma = torch.from_numpy(data["mu"]).double(), torch.from_numpy(data["sigma"]).double()
        dim = self.metric.real_features_sum.shape[0]
        if mu.shape != (dim,) or sigma.shape != (dim, dim):
            raise ValueError(f"reference statistics {str(path)!r} have mu {tuple(mu.shape)} and sigma "
                             f"{tuple(sigma.shape)}, but the feature network gives {dim} features; compute them "
                             "with the same feature network")
        self._statistics = mu, sigma
        self.reference_features = torch.from_numpy(data["features"]).double() if "features" in data else None
        self.has_reference = True

    def reference_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean (D,) and unbiased covariance (D, D) of the reference features, from torchmetrics' sums."""
        if not self.has_reference:
            raise RuntimeError("FID reference not set; call set_reference first")
        if self._statistics is not None:
            return self._statistics
        n = self.metric.real_features_num_samples.double()
        mu = self.metric.real_features_sum / n
        return mu, (self.metric.real_features_cov_sum - n * torch.outer(mu, mu)) / (n - 1)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, batch_size: int = 256) -> float:
        """FID of ``images`` (N, C, H, W) in [-1, 1] against the reference."""
        return self.from_features(self.features(images, batch_size))

    def from_features(self, features: torch.Tensor) -> float:
        """FID of generated ``features`` (N, D) against the reference, in float64."""
        return frechet_distance(*self.reference_statistics(), *gaussian_statistics(features))

    def bootstrap_values(self, features: torch.Tensor, num_resamples: int = 50, seed: int = 0,
                         strata: torch.Tensor | None = None) -> torch.Tensor:
        """FID of ``features`` (N, D) on each of ``num_resamples`` resamples of the N samples with replacement,
        the reference fixed (Efron & Tibshirani 1993, Alg. 6.1): (num_resamples,) float64.

        ``strata`` (N,) gives each sample's stratum (its class label or prompt id) when the protocol draws a
        fixed number per stratum: resampling within strata keeps that mix, as repeated draws do, whereas
        pooled resampling (``strata=None``) would add the spread of the mix itself. The resamples depend only
        on ``seed`` and ``strata``, so sets of the same prompts and seeds are resampled together (the paired
        bootstrap of a difference, ``distill.metrics.bootstrap.difference_std``).
        """
        if strata is not None and strata.shape != (len(features),):
            raise ValueError(f"bootstrap strata of shape {tuple(strata.shape)} for {len(features)} samples; "
                             "pass one stratum id per sample, or strata=None to resample the pool")
        reference = self.reference_statistics()
        strata = torch.zeros(len(features), dtype=torch.long) if strata is None else strata
        return bootstrap_replicates(lambda i: frechet_distance(*reference, *gaussian_statistics(features[i])),
                                    strata, num_resamples, seed)

    def bootstrap_std(self, features: torch.Tensor, num_resamples: int = 50, seed: int = 0,
                      strata: torch.Tensor | None = None) -> float:
        """Spread of the FID of ``features`` (N, D): the standard deviation of ``bootstrap_values``."""
        return float(self.bootstrap_values(features, num_resamples, seed, strata).std())

    @torch.no_grad()
    def features(self, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """Features (N, D) in float64 of ``images`` (N, C, H, W) in [-1, 1], as torchmetrics' update extracts them."""
        chunks = []
        for chunk in images.split(batch_size):
            x = self._prepare(chunk)
            chunks.append(self.metric.inception((x * 255).byte() if self.inception else x).double().reshape(len(x), -1))
        return torch.cat(chunks)
