"""FID (Heusel et al. 2017) with a pluggable feature network, and cached reference statistics.

The reference statistics are torchmetrics' ``FrechetInceptionDistance`` states; only the feature
extractor changes: the shipped digit classifier's penultimate layer for the embedded digits (Inception
cannot be downloaded there), Inception-v3 (torch-fidelity) for natural images, or any nn.Module/TorchScript
file. The generated side is computed once as features, so that its bootstrap spread costs no network call.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

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


def resample_indices(strata: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Indices of one bootstrap resample drawn with replacement within each stratum of ``strata`` (N,), each
    stratum keeping its size (stratified bootstrap, Efron & Tibshirani 1993, sec. 8.3)."""
    groups = [torch.nonzero(strata == s).flatten() for s in strata.unique()]
    return torch.cat([g[torch.randint(len(g), (len(g),), generator=generator)] for g in groups])


@runtime_checkable
class PenultimateFeatures(Protocol):
    """A classifier that exposes the layer FID is measured in: ``features(images)`` -> (N, ``feature_dim``)."""

    feature_dim: int

    def features(self, images: torch.Tensor) -> torch.Tensor: ...


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


def load_feature_net(spec: str, input_shape: tuple[int, int, int]) -> nn.Module | str:
    """``digits`` (the shipped classifier), ``inception`` (needs torch-fidelity), a classifier folder,
    or a TorchScript ``.pt`` file mapping images (N, *input_shape) in [-1, 1] to (N, D) features."""
    if spec == "inception":
        return _inception()
    if spec == "digits":
        from distill.assets import asset_path

        spec = str(asset_path("classifier"))
    path = Path(spec)
    if path.is_dir():
        from distill.models.classifier import DigitClassifier

        return FeatureNet(DigitClassifier.from_pretrained(path), f"classifier:{path.resolve()}", input_shape)
    if path.is_file():
        return FeatureNet(torch.jit.load(str(path), map_location="cpu"), f"torchscript:{path.resolve()}", input_shape)
    raise FileNotFoundError(f"fid feature network {spec!r} not found; use 'digits', 'inception', a folder or a .pt file")


def _inception() -> nn.Module:
    try:
        import torch_fidelity  # noqa: F401
        from torchmetrics.image.fid import NoTrainInceptionV3  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "feature=inception needs torch-fidelity and a torch with a matching torchvision: "
            "pip install 'distill[inception]'; on the embedded digits use feature=digits"
        ) from err
    return "inception"


class FID:
    """FID between a fixed reference set and generated images; reference statistics are cached on disk."""

    def __init__(self, feature: nn.Module | str = "digits", cache_dir: str | Path | None = DEFAULT_CACHE,
                 input_shape: tuple[int, int, int] = (1, 32, 32)):
        from torchmetrics.image.fid import FrechetInceptionDistance

        net = load_feature_net(feature, input_shape) if isinstance(feature, str) else feature
        if isinstance(net, str):  # inception: torchmetrics builds it; expects images in [0, 1]
            self.metric = FrechetInceptionDistance(feature=2048, normalize=True, reset_real_features=False)
            self.inception, self.fingerprint = True, "inception-2048"
        else:
            net = net if isinstance(net, FeatureNet) else FeatureNet(net, type(net).__name__, input_shape)
            self.metric = FrechetInceptionDistance(feature=net, reset_real_features=False)
            self.inception, self.fingerprint = False, net.fingerprint()
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.has_reference = False

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
        """Load the reference statistics for ``reference_key`` from the cache, or compute them from ``images``."""
        cache = self._cache_file(reference_key) if reference_key else None
        if cache is not None and cache.is_file():
            state = torch.load(cache, map_location="cpu", weights_only=True)
            self.metric.real_features_sum.copy_(state["sum"])
            self.metric.real_features_cov_sum.copy_(state["cov_sum"])
            self.metric.real_features_num_samples.copy_(state["n"])
        else:
            if images is None:
                raise ValueError(f"no cached reference {reference_key!r}; pass the reference images")
            for chunk in images.split(batch_size):
                self.metric.update(self._prepare(chunk), real=True)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(".tmp")
                torch.save({"sum": self.metric.real_features_sum, "cov_sum": self.metric.real_features_cov_sum,
                            "n": self.metric.real_features_num_samples}, tmp)
                tmp.replace(cache)
        self.has_reference = True

    def reference_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean (D,) and unbiased covariance (D, D) of the reference features, from torchmetrics' sums."""
        if not self.has_reference:
            raise RuntimeError("FID reference not set; call set_reference first")
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

    def bootstrap_std(self, features: torch.Tensor, num_resamples: int = 50, seed: int = 0,
                      strata: torch.Tensor | None = None) -> float:
        """Spread of the FID of ``features`` (N, D): the standard deviation over ``num_resamples`` resamples
        of the N samples with replacement, the reference fixed (Efron & Tibshirani 1993, Alg. 6.1).

        ``strata`` (N,) gives each sample's stratum (its class label or prompt id) when the protocol draws a
        fixed number per stratum: resampling within strata keeps that mix, as repeated draws do, whereas
        pooled resampling (``strata=None``) would add the spread of the mix itself.
        """
        if strata is not None and strata.shape != (len(features),):
            raise ValueError(f"bootstrap strata of shape {tuple(strata.shape)} for {len(features)} samples; "
                             "pass one stratum id per sample, or strata=None to resample the pool")
        reference = self.reference_statistics()
        generator = torch.Generator().manual_seed(seed)
        strata = torch.zeros(len(features), dtype=torch.long) if strata is None else strata.cpu()
        values = [frechet_distance(*reference, *gaussian_statistics(features[resample_indices(strata, generator)]))
                  for _ in range(num_resamples)]
        return float(torch.tensor(values, dtype=torch.float64).std())

    @torch.no_grad()
    def features(self, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """Features (N, D) in float64 of ``images`` (N, C, H, W) in [-1, 1], as torchmetrics' update extracts them."""
        chunks = []
        for chunk in images.split(batch_size):
            x = self._prepare(chunk)
            chunks.append(self.metric.inception((x * 255).byte() if self.inception else x).double().reshape(len(x), -1))
        return torch.cat(chunks)
