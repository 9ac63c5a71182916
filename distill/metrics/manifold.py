"""Fidelity and diversity on k-nearest-neighbour manifolds: precision and coverage (Naeem et al. 2020,
"Reliable Fidelity and Diversity Metrics for Generative Models", arXiv 2002.09797, eqs. 3 and 4 with
Kynkäänniemi et al. 2019's precision, eq. 1).

Each real (reference) feature r_i gets a ball of radius NND_k(r_i), its distance to its k-th nearest other real
feature. Then, for M generated features y_j,

- precision = (1/M) sum_j 1[y_j lies in at least one real ball]: the share of samples that look real;
- coverage  = (1/N) sum_i 1[the ball of r_i holds at least one y_j]: the share of the real data's neighbourhoods that
  the samples reach. A student that collapses onto a few modes keeps a high precision and loses coverage, which
  FID, a distance between two Gaussians, can blur; coverage is the diversity column of a quality table.

Both use balls around the real features only, so they are functions of the sample set that a bootstrap over the
samples can resample (recall and density's other half need balls around the generated features, which a resample
with repeated samples shrinks to zero). The reference implementation is the authors' package ``prdc``
(``prdc.compute_prdc``); the tests compare against it. Distances are Euclidean in the feature space of the FID
(the evaluation set's ``feature`` network), computed in float64 in chunks, so a reference of tens of thousands of
images needs no N x N matrix.
"""

from __future__ import annotations

import torch

NEAREST_K = 5  # Naeem et al.'s default k (section 4: k = 5 with 10k real and fake samples)


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def real_radii(real: torch.Tensor, k: int = NEAREST_K, chunk: int = 1024) -> torch.Tensor:
    """NND_k of every real feature (N,): the distance to its k-th nearest neighbour among the others."""
    real = real.double()
    if len(real) <= k:
        raise ValueError(f"{len(real)} reference features cannot give the distance to a {k}-th nearest neighbour; "
                         f"use a reference of more than {k} images")
    out = []
    for rows in _chunks(len(real), chunk):
        d = torch.cdist(real[rows], real)
        out.append(d.topk(k + 1, dim=1, largest=False).values[:, k])  # index 0 is the point itself (distance 0)
    return torch.cat(out)


def real_fake_distances(real: torch.Tensor, fake: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Euclidean distances (N, M) between real and generated features, float64."""
    real, fake = real.double(), fake.double().to(real.device)
    return torch.cat([torch.cdist(real[rows], fake) for rows in _chunks(len(real), chunk)])


def precision_and_coverage(distances: torch.Tensor, radii: torch.Tensor,
                           fake_index: torch.Tensor | None = None) -> tuple[float, float]:
    """Precision and coverage from the real-fake ``distances`` (N, M) and the real balls' ``radii`` (N,), on the
    generated samples ``fake_index`` (a bootstrap resample; None: all of them)."""
    d = distances if fake_index is None else distances[:, fake_index]
    inside = d < radii[:, None]  # strict, as prdc
    precision = inside.any(dim=0).double().mean().item()
    coverage = inside.any(dim=1).double().mean().item()  # = min_j d_ij < NND_k(r_i)
    return precision, coverage
