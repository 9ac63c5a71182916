"""Lower-variance noise and time sampling for a training step, shared by the methods (``method.noise``).

- Antithetic noise: the batch's noise comes in pairs (eps, -eps), so that terms odd in eps cancel within a pair.
- Stratified (low-discrepancy) indices: one shared uniform offset, the batch spread evenly over the bins.
- Importance sampling of the time bin: a proposal q over the K bins (lognormal in noise level, or adaptive:
  q proportional to sqrt(E[loss^2]) per bin from a running history, the variance-minimising choice for a
  non-negative loss, Nichol & Dhariwal 2021, sec. 3.3), mixed with the uniform distribution; each example's loss
  is multiplied by (1/K) / q(bin), so that the batch loss stays an unbiased estimate of the uniform-time loss.
"""

from __future__ import annotations

import math

import torch

PROPOSALS = ("uniform", "lognormal", "adaptive")


def antithetic_noise(shape: tuple[int, ...], generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, ...) standard normal noise whose rows i and i + ceil(N/2) are exact negatives (an odd N's middle row,
    the last of the first half, has no partner)."""
    n = shape[0]
    half = torch.randn(((n + 1) // 2, *shape[1:]), generator=generator, dtype=dtype)
    return torch.cat([half, -half])[:n]


def stratified_unit(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) points of [0, 1): (u + i / n) mod 1 with one shared u ~ U[0, 1) (Kingma et al. 2021, app. I.1)."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    return torch.remainder(u + torch.arange(n, dtype=torch.float64) / n, 1.0)


def lognormal_bin_probabilities(sigmas: torch.Tensor, p_mean: float = -1.1, p_std: float = 2.0) -> torch.Tensor:
    """The lognormal N(log sigma; p_mean, p_std^2) mass of each bin of an ascending noise-level grid ``sigmas``
    (bin edges halfway between levels in log sigma; the end bins open), normalised."""
    log_s = sigmas.double().log()
    edges = torch.cat([log_s.new_tensor([-math.inf]), (log_s[1:] + log_s[:-1]) / 2, log_s.new_tensor([math.inf])])
    cdf = 0.5 * (1 + torch.erf((edges - p_mean) / (math.sqrt(2) * p_std)))
    mass = (cdf[1:] - cdf[:-1]).clamp(min=0)
    return mass / mass.sum()


class TimeSampler:
    """Draws time bins in {0, ..., K-1} with their importance weights; ``update`` feeds the adaptive proposal.

    ``proposal``: ``uniform`` (weights 1), ``lognormal`` (fixed ``probs``, e.g. ``lognormal_bin_probabilities``)
    or ``adaptive`` (uniform until every bin has ``history`` losses, then sqrt(E[loss^2]) per bin); the proposal
    used is (1 - uniform_mix) q + uniform_mix / K, which bounds the weights by 1 / uniform_mix.
    ``stratified`` draws the proposal's quantiles at stratified points instead of independently.
    """

    def __init__(self, num_bins: int, proposal: str = "uniform", stratified: bool = False,
                 probs: torch.Tensor | None = None, history: int = 10, uniform_mix: float = 0.1):
        if proposal not in PROPOSALS:
            raise ValueError(f"method.noise.timesteps={proposal!r}; use one of {list(PROPOSALS)}")
        if num_bins < 1:
            raise ValueError(f"{num_bins} time bins; need at least 1")
        if not 0 < uniform_mix <= 1:
            raise ValueError(f"method.noise.uniform_mix={uniform_mix} must be in (0, 1]")
        if proposal == "lognormal" and (probs is None or probs.shape != (num_bins,)):
            raise ValueError("a lognormal proposal needs the probability of each of the bins")
        if history < 1:
            raise ValueError(f"method.noise.history={history} must be >= 1")
        self.num_bins, self.proposal, self.stratified = num_bins, proposal, stratified
        self.uniform_mix, self.history = uniform_mix, history
        self.fixed = None if probs is None else (probs.double() / probs.double().sum())
        self.losses = torch.zeros(num_bins, history, dtype=torch.float64)  # squared losses, ring buffer per bin
        self.counts = torch.zeros(num_bins, dtype=torch.long)

    def probabilities(self) -> torch.Tensor:
        k = self.num_bins
        uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
        if self.proposal == "uniform":
            return uniform
        if self.proposal == "lognormal":
            q = self.fixed
        elif bool((self.counts < self.history).any()):
            return uniform  # adaptive: not warmed up yet
        else:
            q = self.losses.mean(1).sqrt()
            q = q / q.sum() if q.sum() > 0 else uniform
        return (1 - self.uniform_mix) * q + self.uniform_mix * uniform

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(bins, weights): ``n`` bins from the proposal and (1/K) / q(bin) for each (ones when q is uniform)."""
        q = self.probabilities()
        if self.stratified:
            u = stratified_unit(n, generator)
        else:
            u = torch.rand(n, generator=generator, dtype=torch.float64)
        cdf = q.cumsum(0)
        bins = torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=self.num_bins - 1)
        return bins, (1.0 / self.num_bins) / q[bins]

    @torch.no_grad()
    def update(self, bins: torch.Tensor, losses: torch.Tensor) -> None:
        """Record each example's (unweighted) loss in its bin's history (adaptive proposal)."""
        if self.proposal != "adaptive":
            return
        for b, loss in zip(bins.tolist(), losses.detach().double().cpu().tolist()):
            self.losses[b, self.counts[b] % self.history] = loss ** 2
            self.counts[b] += 1

    def state_dict(self) -> dict:
        return {"losses": self.losses.clone(), "counts": self.counts.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.losses.copy_(state["losses"])
        self.counts.copy_(state["counts"])
