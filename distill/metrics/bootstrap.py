"""Bootstrap replicates shared between sample sets, and the paired uncertainty of a difference.

Every row of one evaluation protocol holds samples of the same prompts with the same seeds, in the same order.
A replicate is the statistic on one stratified resample of the sample indices; the resamples depend only on the
seed and the strata, so replicate k of two rows is computed on the same prompts and seeds. The standard
deviation of the replicates' differences is then the paired bootstrap of the difference (Efron & Tibshirani
1993, sec. 8.2 and 8.3): shared prompts and seeds cancel instead of being counted twice, and for independent sets
it reduces to sqrt(std_a^2 + std_b^2).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch


def resample_indices(strata: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Indices of one bootstrap resample drawn with replacement within each stratum of ``strata`` (N,), each
    stratum keeping its size (stratified bootstrap, Efron & Tibshirani 1993, sec. 8.3)."""
    groups = [torch.nonzero(strata == s).flatten() for s in strata.unique()]
    return torch.cat([g[torch.randint(len(g), (len(g),), generator=generator)] for g in groups])


def bootstrap_replicates(statistic: Callable[[torch.Tensor], float], strata: torch.Tensor, num_resamples: int,
                         seed: int = 0) -> torch.Tensor:
    """``statistic(indices)`` on ``num_resamples`` stratified resamples of the N samples (strata (N,)), seeded:
    (num_resamples,) float64, the same resamples for every set of the same strata and seed."""
    generator = torch.Generator().manual_seed(seed)
    strata = strata.cpu()
    return torch.tensor([statistic(resample_indices(strata, generator)) for _ in range(num_resamples)],
                        dtype=torch.float64)


def protocol_key(strata: torch.Tensor, seed: int) -> str:
    """What the resamples depend on (the sample count, the strata in sample order, the seed): rows whose keys are
    equal were resampled together, so their replicates pair up; rows of another key (another ``num_per_class``:
    the same seed then draws related, not shared, indices) must not be paired."""
    digest = hashlib.sha1(strata.cpu().to(torch.int64).numpy().tobytes()).hexdigest()[:10]
    return f"n{len(strata)}-seed{seed}-{digest}"


def difference_std(replicates_a, replicates_b) -> float:
    """Paired bootstrap standard deviation of a - b from the replicates of each, drawn on shared resamples."""
    a, b = torch.as_tensor(replicates_a, dtype=torch.float64), torch.as_tensor(replicates_b, dtype=torch.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(f"paired replicates must be two 1-d sequences of the same length >= 2; got shapes "
                         f"{tuple(a.shape)} and {tuple(b.shape)}: measure both rows with the same protocol "
                         "(eval.fid_bootstrap, eval.kid_subsets, seed)")
    return float((a - b).std())
