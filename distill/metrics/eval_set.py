"""The evaluation set: what samples are generated from and judged against, chosen by config (``conf/eval/``).

One object supplies the prompts (a list, a text file, or the captions of a data module's held-out split)
with optional class labels, the reference images (a folder, the data module's held-out split, or
precomputed ``.npz`` statistics), the real images of the data floor (the data module's training split),
the feature network of FID and KID, the CLIP model of the CLIP score and a classifier for prompt accuracy,
and optionally further feature spaces for FID and KID (``extra_features``: ``distill.metrics.feature_spaces``).
Nothing is loaded before it is used: a sample grid needs only the prompts.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from distill.metrics.feature_spaces import EXTRA_FEATURE_SPACES, PIXEL_GRID, PixelFeatures
from distill.metrics.fid import DEFAULT_CACHE, FID, processor_normalization
from distill.metrics.registry import METRICS

log = logging.getLogger(__name__)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def _looks_local(spec: str) -> bool:
    """A path rather than a hub id (owner/name)."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") != 1 or Path(spec).exists()


def draw_like(labels: torch.Tensor, wanted: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Indices into ``labels`` (M,) of a random draw without replacement holding as many of each label as
    ``wanted`` (N,) does."""
    values, counts = wanted.unique(return_counts=True)
    pools = [torch.nonzero(labels == v).flatten() for v in values]
    return torch.cat([p[torch.randperm(len(p), generator=generator)[:int(n)]] for p, n in zip(pools, counts)])


def _digest(images: torch.Tensor) -> str:
    return hashlib.sha256(images.contiguous().numpy().tobytes()).hexdigest()[:12]


class EvalSet:
    """Prompts, reference and measuring networks of one evaluation protocol; see the module docstring.

    Every argument is the config key ``eval.<name>`` of the same name (``distill.config.schema.EvalConfig``
    documents each). ``data`` is a LightningDataModule whose held-out split gives the captions (when no
    prompts are given) and the reference (when no ``reference`` is given), and whose training split gives
    the real-data floor. ``feature`` and ``classifier`` are a path, a hub id, or a factory returning a module.
    """

    def __init__(self, name: str, prompts: Sequence[str] | None = None, prompts_file: str | None = None,
                 labels: Sequence[int] | None = None, data: Any = None, num_prompts: int | None = None,
                 reference: str | None = None, channels: int = 3, resolution: int = 32, feature: Any = None,
                 clip: str | None = None, classifier: Any = None, extra_features: Sequence[str] = (),
                 metrics: Sequence[str] | None = None,
                 fid_bootstrap: int = 50, kid_subsets: int = 100, kid_subset_size: int = 1000,
                 cache_dir: str | Path | None = DEFAULT_CACHE):
        self.name, self.data, self.num_prompts = name, data, num_prompts
        self.prompt_list = list(prompts) if prompts is not None else None
        self.prompts_file, self.label_list = prompts_file, list(labels) if labels is not None else None
        self.reference, self.channels, self.resolution = reference, channels, resolution
        self.feature, self.clip, self.classifier = feature, clip, classifier
        self.extra_features = list(extra_features)
        self.metrics = list(metrics) if metrics is not None else METRICS.names()  # None: every registered metric
        self.fid_bootstrap = fid_bootstrap
        self.kid_subsets, self.kid_subset_size, self.cache_dir = kid_subsets, kid_subset_size, cache_dir
        self._prompts: tuple[list[str], torch.Tensor | None] | None = None
        self._heldout: tuple[torch.Tensor, list[str], torch.Tensor] | None = None
        self._reference: tuple[torch.Tensor, str] | None = None
        self._fids: dict[str, FID] = {}  # per feature space: "feature" (eval.feature), then the extra ones
        self._clip = None
        self._classifier = None
        self.reference_key: str | None = None
        self.check()

    # ------------------------------------------------------------------ validation (no loading)

    def check(self, needs_fid: bool = False) -> None:
        """Fail on a config that cannot work, naming the key and the fix, before anything is loaded;
        ``needs_fid``: the caller (the quality-cost sweep) measures FID, so a feature network is required."""
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown:
            raise ValueError(f"eval.metrics={self.metrics} holds unknown {unknown}; use some of {sorted(METRICS)}")
        if self.prompt_list is None and self.prompts_file is None and self.data is None:
            raise ValueError("the evaluation set has no prompts: set eval.prompts=[...], eval.prompts_file=<text "
                             "file, one prompt a line> or eval.data (a data module whose captions are used)")
        if self.prompt_list is not None and not self.prompt_list:
            raise ValueError("eval.prompts=[] is empty; give at least one prompt, or null to use another source")
        if self.prompt_list is None and self.prompts_file is not None and not Path(self.prompts_file).is_file():
            raise ValueError(f"eval.prompts_file={self.prompts_file!r} is not a file; give a text file with one "
                             "prompt a line")
        if self.label_list is not None and self.prompt_list is not None and len(self.label_list) != len(self.prompt_list):
            raise ValueError(f"eval.labels has {len(self.label_list)} entries for {len(self.prompt_list)} eval.prompts; "
                             "give one label per prompt, or eval.labels=null")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"eval.num_prompts={self.num_prompts} must be >= 1 (null: all)")
        if self.reference is not None:
            path = Path(self.reference).expanduser()
            if not (path.is_dir() or (path.is_file() and path.suffix == ".npz")):
                raise ValueError(f"eval.reference={self.reference!r} is neither a folder of images nor a .npz file of "
                                 "statistics; point it at one"
                                 + (", or set eval.reference=null to use the held-out split of eval.data"
                                    if self.data is not None else ""))
        elif self.data is None:
            raise ValueError("the evaluation set has no reference images: set eval.reference=<folder of images or "
                             ".npz statistics> or eval.data (a data module whose held-out split is the reference)")
        if self.fid_bootstrap < 2:
            raise ValueError(f"eval.fid_bootstrap={self.fid_bootstrap} resamples cannot give a spread; use at least 2 "
                             "(default 50)")
        if self.kid_subsets < 2 or self.kid_subset_size < 2:
            raise ValueError(f"eval.kid_subsets={self.kid_subsets} and eval.kid_subset_size={self.kid_subset_size} "
                             "must be >= 2 (defaults 100 and 1000)")
        for key in ("feature", "clip", "classifier"):
            spec = getattr(self, key)
            if isinstance(spec, str) and spec != "inception" and _looks_local(spec) and not Path(spec).expanduser().exists():
                raise ValueError(f"eval.{key}={spec!r} does not exist; give a local model folder or file, a hub id "
                                 f"(owner/name), or eval.{key}=null")
        unknown = [s for s in self.extra_features if s not in EXTRA_FEATURE_SPACES]
        if unknown:
            raise ValueError(f"eval.extra_features={self.extra_features} holds unknown {unknown}; use some of "
                             f"{list(EXTRA_FEATURE_SPACES)}")
        if "clip" in self.extra_features and self.clip is None:
            raise ValueError("eval.extra_features holds 'clip' (the CLIP image tower) but eval.clip is not set; set "
                             "eval.clip=<CLIP model folder or hub id> or drop 'clip'")
        if self.extra_features and self.reference is not None and str(self.reference).endswith(".npz"):
            raise ValueError(f"eval.extra_features={self.extra_features} needs reference images, but "
                             f"eval.reference={self.reference!r} holds statistics in eval.feature's space only; point "
                             "eval.reference at a folder of images, or set eval.extra_features=[]")
        if needs_fid and (self.feature is None or "fid" not in self.metrics):
            raise ValueError("the quality-cost sweep measures FID, but " + (
                "eval.feature is not set; set eval.feature=<a CLIP/DINOv2 vision model folder or hub id, or a "
                "TorchScript .pt file>, or drop the sweep (callbacks.quality_cost=null)" if self.feature is None else
                f"eval.metrics={self.metrics} lacks 'fid'; add it"))

    # ------------------------------------------------------------------ prompts

    def prompts(self) -> tuple[list[str], torch.Tensor | None]:
        """The distinct prompts (P,) in order and their class labels (P,), or None when unlabelled."""
        if self._prompts is None:
            if self.prompt_list is not None:
                prompts, labels = self.prompt_list, self.label_list
            elif self.prompts_file is not None:
                prompts = [line.strip() for line in Path(self.prompts_file).read_text().splitlines() if line.strip()]
                labels = self.label_list
            else:
                prompts, labels = self._data_prompts()
            if self.num_prompts is not None:
                prompts, labels = prompts[:self.num_prompts], labels[:self.num_prompts] if labels is not None else None
            if not prompts:
                raise ValueError(f"the evaluation set {self.name!r} found no prompts; check eval.prompts_file or the "
                                 "data's captions")
            if labels is not None and len(labels) != len(prompts):
                raise ValueError(f"eval.labels has {len(labels)} entries for {len(prompts)} prompts; give one per prompt")
            self._prompts = list(prompts), torch.tensor(labels, dtype=torch.long) if labels is not None else None
        return self._prompts

    def grid_batch(self, num_seeds: int, max_rows: int = 10) -> dict:
        """Conditions of a sample grid: each of the first ``max_rows`` prompts ``num_seeds`` times, row by row;
        ``label`` -1 where the set is unlabelled (a class-conditional model then samples its null class)."""
        prompts, labels = self.prompts()
        rows = min(max_rows, len(prompts))
        labels = labels[:rows] if labels is not None else torch.full((rows,), -1, dtype=torch.long)
        return {"caption": [p for p in prompts[:rows] for _ in range(num_seeds)],
                "label": labels.repeat_interleave(num_seeds)}

    # ------------------------------------------------------------------ images

    def _split(self, split: str):
        """The data module's map-style dataset of ``split`` ("train" or "heldout"), or its loader."""
        self.data.setup("fit")
        dataset = getattr(self.data, f"{split}_set", None)
        if dataset is not None and hasattr(dataset, "__len__"):
            return dataset
        return self.data.val_dataloader() if split == "heldout" else self.data.train_dataloader()

    @staticmethod
    def _items(source, indices: Sequence[int] | None = None) -> Iterator[dict]:
        """Items (``pixel_values``, ``caption``, ``label``) of a dataset (at ``indices``) or of a loader's batches."""
        if not isinstance(source, DataLoader):
            yield from (source[i] for i in (indices if indices is not None else range(len(source))))
            return
        for batch in source:
            labels = torch.as_tensor(batch["label"])
            for i, caption in enumerate(batch["caption"]):
                yield {"pixel_values": batch["pixel_values"][i], "caption": caption, "label": int(labels[i])}

    def _collect(self, items: Iterable[dict], limit: int | None = None, chunk: int = 256):
        """Images (N, C, R, R) at the evaluation resolution (resized a chunk at a time, so that only the resized
        images are held), captions (N,) and labels (N,) of the first ``limit`` ``items``."""
        images, pending, captions, labels = [], [], [], []
        for item in itertools.islice(items, limit):
            pending.append(item["pixel_values"])
            captions.append(item["caption"])
            labels.append(int(item["label"]))
            if len(pending) == chunk:
                images.append(self._resized(torch.stack(pending)))
                pending = []
        if pending:
            images.append(self._resized(torch.stack(pending)))
        if not images:
            return torch.empty(0, self.channels, self.resolution, self.resolution), [], torch.empty(0, dtype=torch.long)
        return torch.cat(images), captions, torch.tensor(labels)

    def _data_prompts(self) -> tuple[list[str], list[int] | None]:
        """The first ``num_prompts`` distinct captions of the held-out split (only as many items are read) and
        the label of each (None unless every one is labelled)."""
        first: dict[str, int] = {}
        for item in self._items(self._split("heldout")):
            first.setdefault(item["caption"], int(item["label"]))
            if self.num_prompts is not None and len(first) >= self.num_prompts:
                break
        labelled = bool(first) and all(label >= 0 for label in first.values())
        return list(first), list(first.values()) if labelled else None

    def heldout(self) -> tuple[torch.Tensor, list[str], torch.Tensor]:
        """The data module's held-out images at the evaluation resolution, captions and labels (-1: unlabelled)."""
        if self._heldout is None:
            self._heldout = self._collect(self._items(self._split("heldout")))
        return self._heldout

    def reference_images(self) -> tuple[torch.Tensor, str]:
        """The reference images (N, C, R, R) in [-1, 1] at the evaluation resolution and their cache key."""
        if self.reference is not None:
            from PIL import Image

            from distill.data.transforms import image_to_tensor

            folder = Path(self.reference).expanduser()
            files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
            if len(files) < 2:
                raise ValueError(f"eval.reference={self.reference!r} holds {len(files)} image(s); FID needs at least 2 "
                                 f"({', '.join(IMAGE_EXTENSIONS)})")
            images = []
            for path in files:
                with Image.open(path) as image:
                    images.append(image_to_tensor(image, self.resolution, self.channels))
            images = torch.stack(images)
        else:
            images = self.heldout()[0]
            if len(images) < 2:
                raise ValueError(f"the held-out split of eval.data holds {len(images)} image(s); FID needs at least 2: "
                                 "raise data.heldout_fraction or set eval.reference=<folder>")
        return images, f"{self.name}-r{self.resolution}-{_digest(images)}"

    def real_images(self, wanted_labels: torch.Tensor | None, count: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Real training images for the data floor, drawn without replacement (seed 0): as many of each label
        as ``wanted_labels`` holds when both sides are labelled, else ``count`` at random (at most all).
        Returns images at the evaluation resolution and their labels, or None without a data module."""
        if self.data is None:
            return None
        source = self._split("train")
        generator = torch.Generator().manual_seed(0)
        indices, limit = None, count
        if not isinstance(source, DataLoader):
            labels = getattr(source, "labels", None)
            if wanted_labels is not None and labels is not None:
                indices = draw_like(torch.as_tensor(labels), wanted_labels, generator).tolist()
            else:
                indices = torch.randperm(len(source), generator=generator)[:count].tolist()
            limit = None
        images, _, labels = self._collect(self._items(source, indices), limit)
        return images, labels if wanted_labels is not None and bool((labels >= 0).all()) else None

    def _resized(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-1] == self.resolution and images.shape[-2] == self.resolution:
            return images
        return torch.nn.functional.interpolate(images, size=(self.resolution, self.resolution), mode="bilinear",
                                               align_corners=False, antialias=True)

    # ------------------------------------------------------------------ measuring networks

    def feature_spec(self, space: str = "feature") -> Any:
        """The feature network of ``space``: "feature" (``eval.feature``) or one of ``EXTRA_FEATURE_SPACES``."""
        if space == "feature":
            return self.feature
        if space == "pixels":
            return partial(PixelFeatures, size=PIXEL_GRID)  # the size named in the reference cache's key
        if space == "clip":
            return self.clip
        raise ValueError(f"feature space {space!r} is unknown; use 'feature' or one of {list(EXTRA_FEATURE_SPACES)}")

    def fid(self, space: str = "feature") -> FID:
        """The FID in ``space`` (see ``feature_spec``) with the reference loaded (statistics cached on disk)."""
        if space not in self._fids:
            if self.feature_spec(space) is None:
                raise ValueError("eval.feature is not set; FID and KID need a feature network (a CLIP/DINOv2 vision "
                                 "model folder or hub id, or a TorchScript .pt file)" if space == "feature" else
                                 f"the {space!r} feature space needs eval.{space}; set it or drop {space!r} from "
                                 "eval.extra_features")
            if self.reference is not None and str(self.reference).endswith(".npz"):
                if space != "feature":
                    raise ValueError(f"eval.reference={self.reference!r} holds statistics in eval.feature's space only; "
                                     f"FID in the {space!r} space needs reference images")
                fid = FID(self.feature, cache_dir=self.cache_dir, input_shape=(self.channels, self.resolution, self.resolution))
                fid.set_reference_statistics(Path(self.reference).expanduser())
                self.reference_key = f"{self.name}-stats-{Path(self.reference).name}"
            else:
                if self._reference is None:  # read once for every feature space
                    self._reference = self.reference_images()
                images, self.reference_key = self._reference
                fid = FID(self.feature_spec(space), cache_dir=self.cache_dir, input_shape=tuple(images.shape[1:]))
                fid.set_reference(images, self.reference_key)
            self._fids[space] = fid
        return self._fids[space]

    def clip_model(self):
        """(CLIPModel, CLIPTokenizer, image mean, image std) of ``clip``, or None."""
        if self.clip is None:
            return None
        if self._clip is None:
            from transformers import CLIPModel, CLIPTokenizer

            model = CLIPModel.from_pretrained(self.clip).eval()
            normalization = processor_normalization(self.clip) or ([0.5], [0.5], None)
            self._clip = model, CLIPTokenizer.from_pretrained(self.clip), normalization[0], normalization[1]
        return self._clip

    def classifier_model(self) -> torch.nn.Module | None:
        """The classifier of prompt accuracy (logits over the labels' classes), or None."""
        if self.classifier is None:
            return None
        if self._classifier is None:
            spec = self.classifier
            net = spec() if callable(spec) else torch.jit.load(str(Path(spec).expanduser()), map_location="cpu")
            self._classifier = net.eval()
        return self._classifier

    def available(self, need: str) -> bool:
        """Whether the input a metric needs ("feature", "clip", "classifier", "labels", "captions", or
        "features:<space>" for an extra feature space) is there."""
        if need == "labels":
            return self.prompts()[1] is not None
        if need == "captions":  # every sample of a sweep has its prompt (the set refuses to have none)
            return True
        if need.startswith("features:"):
            return need.removeprefix("features:") in self.extra_features
        return getattr(self, need) is not None
