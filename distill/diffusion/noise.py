"""Lower-variance noise and time sampling for a training step, shared by the methods (``method.noise``).

- Antithetic noise: the batch's rows come in pairs that share every draw (the example x0 and its conditioning, t,
  the guidance scale, the condition dropout) but the noise, eps and -eps, so that terms of the loss or its gradient
  odd in eps cancel within a pair. A batch of N rows then holds ceil(N/2) distinct examples (``pair_rows``): the
  cost of a step is unchanged, its data halved.
- Stratified (low-discrepancy) indices: one shared uniform offset, the batch spread evenly over the bins.
- Importance sampling of the time bin: each method defines a target distribution p over its K time bins (uniform
  over its grid, or iCT's lognormal pairs); a proposal q (lognormal in noise level, or adaptive: q proportional to
  p sqrt(E[loss^2]) per bin from a running history, the variance-minimising choice for a non-negative loss,
  Nichol & Dhariwal 2021, sec. 3.3), mixed with p, draws the bins, and each example's loss is multiplied by
  p(bin) / q(bin), so that the batch loss stays an unbiased estimate of the method's own loss.
- EDM preconditioning (Karras et al. 2022, table 1, "network and preconditioning": c_skip, c_out, c_in, c_noise) as a
  student wrapper: ``distill.models.precondition``. EDM's training objective (table 1, "training": lambda(sigma) and
  ln sigma ~ N(P_mean, P_std^2)) is a loss, not a sampler option: ``method.loss_weighting=edm`` of plain diffusion
  training (``distill.diffusion.losses.edm_loss_weight``, ``edm_timestep_probabilities``).
"""

from __future__ import annotations

import dataclasses
import math

import torch

PROPOSALS = ("default", "lognormal", "adaptive")
PRECONDITIONINGS = ("none", "edm")
EDM_P_MEAN, EDM_P_STD = -1.2, 1.2  # EDM's training noise distribution, ln sigma ~ N(P_mean, P_std^2) (table 1)
EDM_SIGMA_DATA = 0.5  # the data std EDM's P_mean was chosen for (table 1)


@dataclasses.dataclass
class NoiseOptions:
    """``method.noise``: how a training step draws its noise and times (the same options for every method).

    ``antithetic``: training rows in pairs (i, i + ceil(N/2)) that share the example, its conditioning, t and w and
    differ only in the sign of the noise (eps, -eps): N rows hold ceil(N/2) distinct examples. ``stratified``: the batch's times at stratified quantiles of
    their distribution. ``timesteps``: the proposal of the time bins (``default``: the method's own distribution,
    weights 1; ``lognormal``: log sigma ~ N(p_mean, p_std^2) over the bins' noise levels; ``adaptive``: from the
    last ``history`` losses of each bin), mixed with the method's distribution by ``uniform_mix`` and re-weighted
    to stay unbiased. ``preconditioning``: ``edm`` wraps a freshly initialised student in EDM's c_in, c_out,
    c_skip and c_noise (``sigma_data``), the network's parametrisation only: each method keeps its own loss
    (EDM's loss weighting and noise distribution: plain diffusion's ``method.loss_weighting=edm``, which reads
    ``sigma_data`` too)."""

    antithetic: bool = False
    stratified: bool = False
    timesteps: str = "default"
    p_mean: float = -1.1
    p_std: float = 2.0
    history: int = 10
    uniform_mix: float = 0.1
    preconditioning: str = "none"
    sigma_data: float = 1.0  # EDM's data std: SD-format latents are scaled to unit variance (the VAE's scaling_factor)

    def __post_init__(self):
        if self.timesteps not in PROPOSALS:
            raise ValueError(f"method.noise.timesteps={self.timesteps!r}; use one of {list(PROPOSALS)}")
        if self.preconditioning not in PRECONDITIONINGS:
            raise ValueError(f"method.noise.preconditioning={self.preconditioning!r}; use one of {list(PRECONDITIONINGS)}")
        if self.p_std <= 0 or self.sigma_data <= 0:
            raise ValueError(f"method.noise.p_std={self.p_std}, method.noise.sigma_data={self.sigma_data}: both must be > 0")
        if self.history < 1:
            raise ValueError(f"method.noise.history={self.history} must be >= 1")
        if not 0 < self.uniform_mix <= 1:
            raise ValueError(f"method.noise.uniform_mix={self.uniform_mix} must be in (0, 1]")

    @classmethod
    def of(cls, value: NoiseOptions | dict | None) -> NoiseOptions:
        """The options from a config mapping (plain strings), an instance, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"method.noise has no option(s) {sorted(unknown)}; use {[f.name for f in dataclasses.fields(cls)]}")
        return cls(**{k: (v.value if hasattr(v, "value") else v) for k, v in dict(value).items()})

    @property
    def plain(self) -> bool:
        """Whether the options draw exactly as the methods did without them (i.i.d. noise and times)."""
        return not (self.antithetic or self.stratified) and self.timesteps == "default"


def distinct_rows(n: int) -> int:
    """How many distinct examples a batch of ``n`` antithetic rows holds: ceil(n / 2)."""
    return (n + 1) // 2


def pair_rows(x, n: int | None = None):
    """The rows of an antithetic batch of ``n`` rows (default ``len(x)``) from the first ``distinct_rows(n)`` rows of
    ``x`` (a tensor or a list): those rows, then its first floor(n / 2) rows again, so that row i + ceil(n/2) repeats
    row i (an odd n's middle row, the last of the first half, has no partner)."""
    n = len(x) if n is None else n
    m = distinct_rows(n)
    if len(x) < m:
        raise ValueError(f"pairing {n} rows needs at least {m} drawn rows; got {len(x)}")
    if isinstance(x, torch.Tensor):
        return torch.cat([x[:m], x[:n - m]])
    return [*x[:m], *x[:n - m]]


def antithetic_noise(shape: tuple[int, ...], generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, ...) standard normal noise whose rows i and i + ceil(N/2) are exact negatives (an odd N's middle row,
    the last of the first half, has no partner): the noise of the rows that ``pair_rows`` pairs."""
    n = shape[0]
    half = torch.randn((distinct_rows(n), *shape[1:]), generator=generator, dtype=dtype)
    return torch.cat([half, -half])[:n]


def stratified_unit(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) points of [0, 1): (u + i / n) mod 1 with one shared u ~ U[0, 1) (Kingma et al. 2021, app. I.1), in
    float64 from a float32 u (the draw ``distill.diffusion.sample_timesteps`` makes)."""
    u = torch.rand((), generator=generator).double()
    return torch.remainder(u + torch.arange(n, dtype=torch.float64) / n, 1.0)


def lognormal_bin_probabilities(sigmas: torch.Tensor, p_mean: float = -1.1, p_std: float = 2.0) -> torch.Tensor:
    """The lognormal N(log sigma; p_mean, p_std^2) mass of each bin of an ascending noise-level grid ``sigmas``,
    normalised over the grid's range: bin edges halfway between levels in log sigma, the outer edges half a step
    beyond the end levels (the mass outside the grid is not piled onto its end bins)."""
    log_s = sigmas.double().log()
    if len(log_s) == 1:
        return torch.ones(1, dtype=torch.float64)
    mid = (log_s[1:] + log_s[:-1]) / 2
    lo, hi = log_s[:1] - (log_s[1] - log_s[0]) / 2, log_s[-1:] + (log_s[-1] - log_s[-2]) / 2
    edges = torch.cat([lo, mid, hi])
    cdf = 0.5 * (1 + torch.erf((edges - p_mean) / (math.sqrt(2) * p_std)))
    mass = (cdf[1:] - cdf[:-1]).clamp(min=0)
    if float(mass.sum()) <= 0:  # the grid lies far in a tail: the nearest end bin
        mass = torch.zeros_like(mass)
        mass[0 if float(log_s[0]) > p_mean else -1] = 1.0
    return mass / mass.sum()


def edm_timestep_probabilities(sigmas: torch.Tensor, sigma_data: float = EDM_SIGMA_DATA) -> torch.Tensor:
    """EDM's training noise distribution ln sigma ~ N(-1.2, 1.2^2) (Karras et al. 2022, table 1) on a discrete
    schedule's ascending noise levels ``sigmas`` (sigma_t = sqrt((1 - abar_t) / abar_t), the VE level of
    x_t / alpha_t): each timestep gets the distribution's mass between the log-midpoints to its neighbours
    (``lognormal_bin_probabilities``), normalised over the schedule's range. EDM's P_mean is for data of std
    sigma_data = 0.5; only sigma / sigma_data matters, so data of another ``sigma_data`` gets the same distribution
    relative to it, P_mean + ln(sigma_data / 0.5) (as rescaling the data to EDM's 0.5 would)."""
    return lognormal_bin_probabilities(sigmas, EDM_P_MEAN + math.log(sigma_data / EDM_SIGMA_DATA), EDM_P_STD)


class TimeSampler:
    """Draws time bins in {0, ..., K-1} with their importance weights; ``update`` feeds the adaptive proposal.

    ``target``: the method's own distribution p over the bins (default uniform). ``proposal``: ``default``
    (q = p, weights 1; uniform draws are ``torch.randint`` and a non-uniform p ``torch.multinomial``, the draws the
    methods make without options), ``lognormal`` (fixed ``probs``, e.g. ``lognormal_bin_probabilities``) or
    ``adaptive`` (p sqrt(E[loss^2]) per bin over its last ``history`` losses; a bin with fewer, the mean over the
    full bins, weighted by p; p until a bin is full); the proposal used is (1 - uniform_mix) q + uniform_mix p,
    which bounds the weights p / q by 1 / uniform_mix. Non-finite losses are not recorded.
    ``stratified`` draws the proposal's quantiles at stratified points instead of independently.
    """

    def __init__(self, num_bins: int, proposal: str = "default", stratified: bool = False,
                 probs: torch.Tensor | None = None, history: int = 10, uniform_mix: float = 0.1,
                 target: torch.Tensor | None = None):
        if proposal not in PROPOSALS:
            raise ValueError(f"method.noise.timesteps={proposal!r}; use one of {list(PROPOSALS)}")
        if num_bins < 1:
            raise ValueError(f"{num_bins} time bins; need at least 1")
        if not 0 < uniform_mix <= 1:
            raise ValueError(f"method.noise.uniform_mix={uniform_mix} must be in (0, 1]")
        if proposal == "lognormal" and (probs is None or probs.shape != (num_bins,)):
            raise ValueError("a lognormal proposal needs the probability of each of the bins")
        if target is not None and (target.shape != (num_bins,) or bool((target < 0).any()) or float(target.sum()) <= 0):
            raise ValueError(f"the target distribution needs {num_bins} non-negative probabilities")
        if history < 1:
            raise ValueError(f"method.noise.history={history} must be >= 1")
        self.num_bins, self.proposal, self.stratified = num_bins, proposal, stratified
        self.uniform_mix, self.history = uniform_mix, history
        self.fixed = None if probs is None else (probs.double() / probs.double().sum())
        self.target = None if target is None else target.double() / target.double().sum()
        self.losses = torch.zeros(num_bins, history, dtype=torch.float64)  # squared losses, ring buffer per bin
        self.counts = torch.zeros(num_bins, dtype=torch.long)

    def target_probabilities(self) -> torch.Tensor:
        if self.target is not None:
            return self.target
        return torch.full((self.num_bins,), 1.0 / self.num_bins, dtype=torch.float64)

    def probabilities(self) -> torch.Tensor:
        """The proposal q the next draw uses."""
        p = self.target_probabilities()
        if self.proposal == "default":
            return p
        if self.proposal == "lognormal":
            q = self.fixed
        else:
            warm = self.counts >= self.history
            if not bool(warm.any()):
                return p  # adaptive: no bin full yet
            second = self.losses.mean(1)
            fill = (p[warm] * second[warm]).sum() / p[warm].sum() if float(p[warm].sum()) > 0 else second[warm].mean()
            q = p * torch.where(warm, second, fill).sqrt()
            if not bool(torch.isfinite(q).all()) or float(q.sum()) <= 0:
                return p
            q = q / q.sum()
        return (1 - self.uniform_mix) * q + self.uniform_mix * p

    def sample(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(bins, weights): ``n`` bins from the proposal and p(bin) / q(bin) for each (ones when q = p)."""
        k = self.num_bins
        if self.proposal == "default" and not self.stratified:
            if self.target is None:
                return torch.randint(0, k, (n,), generator=generator), torch.ones(n, dtype=torch.float64)
            bins = torch.multinomial(self.target, n, replacement=True, generator=generator)
            return bins, torch.ones(n, dtype=torch.float64)
        u = stratified_unit(n, generator) if self.stratified else torch.rand(n, generator=generator, dtype=torch.float64)
        if self.proposal == "default" and self.target is None:  # floor(K u): the stratified timesteps as before
            return (u * k).long().clamp(max=k - 1), torch.ones(n, dtype=torch.float64)
        q = self.probabilities()
        cdf = q.cumsum(0)
        last = int((q > 0).nonzero().max())  # u * cdf[-1] rounding up to cdf[-1] lands on the last live bin
        bins = torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=last)
        return bins, self.target_probabilities()[bins] / q[bins]

    @torch.no_grad()
    def update(self, bins: torch.Tensor, losses: torch.Tensor) -> None:
        """Record each example's (unweighted) loss in its bin's history (adaptive proposal)."""
        if self.proposal != "adaptive":
            return
        for b, loss in zip(bins.tolist(), losses.detach().double().cpu().tolist()):
            if not math.isfinite(loss):  # a step the non-finite guard skips: no evidence about the bin
                continue
            self.losses[b, self.counts[b] % self.history] = loss ** 2
            self.counts[b] += 1

    def state_dict(self) -> dict:
        return {"losses": self.losses.clone(), "counts": self.counts.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.losses.copy_(state["losses"])
        self.counts.copy_(state["counts"])
