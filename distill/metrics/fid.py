"""FID (Heusel et al. 2017) with a pluggable feature network, and cached reference statistics.

The metric is torchmetrics' ``FrechetInceptionDistance``; only the feature extractor changes:
the shipped digit classifier's penultimate layer for the embedded digits (Inception cannot be
downloaded there), Inception-v3 (torch-fidelity) for natural images, or any nn.Module/TorchScript file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

DEFAULT_CACHE = Path.home() / ".cache" / "distill" / "fid_reference"


class FeatureNet(nn.Module):
    """Adapts a network to torchmetrics: images (N, C, H, W) in [-1, 1] -> features (N, D)."""

    def __init__(self, net: nn.Module, name: str):
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.name = name
        with torch.no_grad():
            self.num_features = int(self(torch.zeros(1, 1, 32, 32)).shape[-1]) if hasattr(net, "features") else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if hasattr(self.net, "features"):
            return self.net.features(images.float())
        return self.net(images.float())

    def fingerprint(self) -> str:
        """Hash of the weights: a reference cache entry is only reused by the very same network."""
        h = hashlib.sha256(self.name.encode())
        for value in self.net.state_dict().values():
            h.update(value.detach().cpu().float().numpy().tobytes())
        return h.hexdigest()[:16]


def load_feature_net(spec: str = "digits") -> nn.Module:
    """``digits`` (the shipped classifier), ``inception`` (needs torch-fidelity), a classifier folder,
    or a TorchScript ``.pt`` file mapping images in [-1, 1] to (N, D) features."""
    if spec == "inception":
        return _inception()
    if spec == "digits":
        from distill.assets import asset_path

        spec = str(asset_path("classifier"))
    path = Path(spec)
    if path.is_dir():
        from distill.models.classifier import DigitClassifier

        return FeatureNet(DigitClassifier.from_pretrained(path), f"classifier:{path.resolve()}")
    if path.is_file():
        return FeatureNet(torch.jit.load(str(path), map_location="cpu"), f"torchscript:{path.resolve()}")
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

    def __init__(self, feature: nn.Module | str = "digits", cache_dir: str | Path | None = DEFAULT_CACHE):
        from torchmetrics.image.fid import FrechetInceptionDistance

        net = load_feature_net(feature) if isinstance(feature, str) else feature
        if isinstance(net, str):  # inception: torchmetrics builds it; expects images in [0, 1]
            self.metric = FrechetInceptionDistance(feature=2048, normalize=True, reset_real_features=False)
            self.inception, self.fingerprint = True, "inception-2048"
        else:
            net = net if isinstance(net, FeatureNet) else FeatureNet(net, type(net).__name__)
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

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, batch_size: int = 256) -> float:
        """FID of ``images`` (N, C, H, W) in [-1, 1] against the reference."""
        if not self.has_reference:
            raise RuntimeError("FID reference not set; call set_reference first")
        self.metric.reset()  # clears fake statistics only (reset_real_features=False)
        for chunk in images.split(batch_size):
            self.metric.update(self._prepare(chunk), real=False)
        return float(self.metric.compute())

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.metric.inception(self._prepare(images)).double()
