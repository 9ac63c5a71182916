"""KID (Binkowski et al. 2018): the unbiased MMD^2 between feature sets with the cubic polynomial kernel
k(x, y) = (x.y / D + 1)^3, averaged over random subsets, in any feature space.

torchmetrics' ``KernelInceptionDistance`` computes the same thing but keeps its own feature extractor and
draws its subsets from the global RNG; here the features come from the FID's network (computed once per
sample set) and the subsets from a seeded generator. The formula is torchmetrics' ``poly_mmd``.
"""

from __future__ import annotations

import torch
from torchmetrics.image.kid import poly_mmd


def kid_subset_values(real: torch.Tensor, fake: torch.Tensor, subsets: int = 100, subset_size: int = 1000,
                      seed: int = 0) -> torch.Tensor:
    """The ``subsets`` unbiased MMD^2 estimates (subsets,) float64 of ``fake`` (M, D) against ``real`` (N, D), each on
    ``subset_size`` samples of each set drawn without replacement (Binkowski et al. 2018, sec. 3).

    The subset size is capped at half the smaller set, so that a small evaluation set still gives a value and
    the subsets still differ (a subset holding a whole set would repeat it, and its spread would vanish). The
    subsets depend only on the seed and the set sizes: two sample sets of the same prompts and seeds get the same
    subsets, so their estimates pair up (``distill.metrics.bootstrap.difference_std``).
    """
    size = min(subset_size, len(real) // 2, len(fake) // 2)
    if size < 2:
        raise ValueError(f"KID needs at least 4 samples on each side; got {len(real)} reference and {len(fake)} "
                         "generated; evaluate more samples (num_per_class) or a larger reference set")
    generator = torch.Generator().manual_seed(seed)
    real, fake = real.double(), fake.double()
    values = []
    for _ in range(subsets):
        r = real[torch.randperm(len(real), generator=generator)[:size]]
        f = fake[torch.randperm(len(fake), generator=generator)[:size]]
        values.append(poly_mmd(r, f))
    return torch.stack(values)


def kernel_inception_distance(real: torch.Tensor, fake: torch.Tensor, subsets: int = 100, subset_size: int = 1000,
                              seed: int = 0) -> tuple[float, float]:
    """KID of ``fake`` (M, D) against ``real`` (N, D) features: the mean and the (population) standard deviation
    of ``kid_subset_values`` (torchmetrics' ``kid_mean``, ``kid_std``).

    The std is the spread of one subset's estimate: the mean over subsets varies less, so it is a conservative
    uncertainty for comparing two rows.
    """
    values = kid_subset_values(real, fake, subsets, subset_size, seed)
    return float(values.mean()), float(values.std(unbiased=False))
