"""A Hydra sweeper on current Optuna: single- and multi-objective search, resumable through SQLite storage.

    python -m distill.train -m +exp=consistency hydra/sweeper=distill_optuna objectives=[fid,latency_s] \
        hydra.sweeper.directions=[minimize,minimize] hydra.sweeper.n_trials=8 hydra.sweeper.sampler=nsga2 \
        'method.num_ddim_timesteps=choice(25,50,100)' 'scheduler.guidance_scale=interval(2.0,6.0)' \
        hydra.sweeper.storage=sqlite:///sweep.db

Why not Hydra's own ``hydra-optuna-sweeper``: its newest release (1.3.0) pins ``optuna<3``, a 2021 Optuna whose
samplers, storage schema and SQLAlchemy requirements predate what the rest of this stack installs; this thin
sweeper uses Optuna's current ask-and-tell API and Hydra's override grammar for the search space:

The search space: sweep overrides on the command line (as above), or ``hydra.sweeper.params`` in a config file
(``{key: "interval(2.0,6.0)"}``: on the command line a value there must be quoted, since Hydra refuses sweeps over
its own keys):

- ``choice(a,b,c)`` a categorical; ``range(start,stop[,step])`` integers (stop excluded, as in Hydra);
  ``interval(low,high)`` a float (an int interval when both ends are ints); ``tag(log,interval(...))`` on a log
  scale; a plain value is fixed for every trial.
- The task returns one float per entry of ``directions`` (``distill.train`` returns its ``objectives``).
  Several directions make a multi-objective (Pareto) search; ``sampler=nsga2`` is the usual sampler then.
- ``storage=sqlite:///<file>``: the study lives in that file under ``study_name``; running the same command
  again continues it (trials an interrupted sweep left running are marked failed and asked again) until
  ``n_trials`` trials have completed. A trial whose job fails is marked failed; the sweep goes on.
- ``n_jobs`` trials are launched together (one launcher batch: parallel jobs with a parallel launcher such as
  submitit). The sweep directory gets ``optimization_results.yaml``: the best trial, or the Pareto set.
"""

# no `from __future__ import annotations`: Hydra executes plugin modules outside sys.modules, where dataclass
# fields with string annotations cannot be resolved
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

SAMPLERS = ("tpe", "nsga2", "random", "grid")


@dataclass
class DistillOptunaSweeperConf:
    _target_: str = "hydra_plugins.distill_optuna_sweeper.sweeper.DistillOptunaSweeper"
    params: dict[str, str] = field(default_factory=dict)  # the search space, in Hydra's override grammar
    directions: list[str] = field(default_factory=lambda: ["minimize"])  # one per objective the task returns
    n_trials: int = 8  # completed trials the study should hold
    n_jobs: int = 1  # trials launched together
    sampler: str = "tpe"  # tpe, nsga2 (multi-objective), random, grid (choices only)
    seed: int = 0
    study_name: str = "distill"
    storage: str | None = None  # e.g. sqlite:///sweep.db: resumable; None: in memory


ConfigStore.instance().store(group="hydra/sweeper", name="distill_optuna", node=DistillOptunaSweeperConf,
                             provider="distill")


def distribution(override: Override):
    """The Optuna distribution of a sweep override, or None for a fixed value."""
    import optuna.distributions as d

    if not override.is_sweep_override():
        return None
    value = override.value()
    log_scale = "log" in getattr(value, "tags", set())
    if isinstance(value, ChoiceSweep):
        return d.CategoricalDistribution([v for v in override.sweep_iterator()])
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())
        if all(isinstance(v, int) for v in values) and len(values) > 1 and not value.shuffle:
            step = values[1] - values[0]
            return d.IntDistribution(values[0], values[-1], step=step, log=log_scale and step == 1)
        return d.CategoricalDistribution(values)
    if isinstance(value, IntervalSweep):
        if isinstance(value.start, int) and isinstance(value.end, int):
            return d.IntDistribution(value.start, value.end, log=log_scale)
        return d.FloatDistribution(float(value.start), float(value.end), log=log_scale)
    raise ValueError(f"{override.input_line}: distill_optuna takes choice(), range() and interval() sweeps")


class DistillOptunaSweeper(Sweeper):
    def __init__(self, params: dict[str, str] | None = None, directions: list[str] | None = None,
                 n_trials: int = 8, n_jobs: int = 1, sampler: str = "tpe", seed: int = 0,
                 study_name: str = "distill", storage: str | None = None):
        self.params = dict(params or {})
        self.directions = list(directions or ["minimize"])
        bad = [x for x in self.directions if x not in ("minimize", "maximize")]
        if bad or not self.directions:
            raise ValueError(f"hydra.sweeper.directions={self.directions}: each must be minimize or maximize")
        if sampler not in SAMPLERS:
            raise ValueError(f"hydra.sweeper.sampler={sampler!r} is unknown; use one of {list(SAMPLERS)}")
        if n_trials < 1 or n_jobs < 1:
            raise ValueError(f"hydra.sweeper.n_trials={n_trials} and n_jobs={n_jobs} must be >= 1")
        self.n_trials, self.n_jobs, self.sampler_name, self.seed = n_trials, n_jobs, sampler, seed
        self.study_name, self.storage = study_name, storage
        self.job_idx = 0

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def _space(self, arguments: list[str]) -> tuple[dict[str, Any], list[str]]:
        """(name -> distribution, fixed overrides) of ``params`` and the command line's sweep overrides."""
        parser = OverridesParser.create()
        lines = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        space, fixed = {}, []
        for override in parser.parse_overrides(lines):
            dist = distribution(override)
            if dist is None:
                fixed.append(override.input_line)
            else:
                space[override.get_key_element()] = dist
        if not space:
            raise ValueError("distill_optuna: nothing to search; give hydra.sweeper.params or sweep overrides "
                             "such as method.lr=interval(1e-5,1e-3)")
        return space, fixed

    def _sampler(self, space: dict):
        import optuna

        if self.sampler_name == "grid":
            if not all(isinstance(d, optuna.distributions.CategoricalDistribution) for d in space.values()):
                raise ValueError("sampler=grid takes choice() / range() parameters only")
            return optuna.samplers.GridSampler({k: list(d.choices) for k, d in space.items()}, seed=self.seed)
        return {"tpe": optuna.samplers.TPESampler, "nsga2": optuna.samplers.NSGAIISampler,
                "random": optuna.samplers.RandomSampler}[self.sampler_name](seed=self.seed)

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        space, fixed = self._space(arguments)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        sampler = self._sampler(space)
        study = optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=sampler,
                                    directions=self.directions, load_if_exists=True)
        states = optuna.trial.TrialState
        for trial in study.get_trials(deepcopy=False, states=(states.RUNNING,)):  # left by an interrupted sweep
            study.tell(trial.number, state=states.FAIL)
            log.warning("trial %d was left running by an interrupted sweep: marked failed", trial.number)
        self.job_idx = len(study.trials)
        while (done := len(study.get_trials(deepcopy=False, states=(states.COMPLETE,)))) < self.n_trials:
            if isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study):
                log.warning("the grid is exhausted after %d completed trials (of n_trials=%d)", done, self.n_trials)
                break
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - done))]
            batch = [fixed + [f"{k}={_format(v)}" for k, v in t.params.items()] for t in trials]
            returns = self.launcher.launch(batch, initial_job_idx=self.job_idx)
            self.job_idx += len(batch)
            for trial, ret, overrides in zip(trials, returns, batch):
                try:
                    values = ret.return_value  # raises the job's exception if it failed
                    values = [float(v) for v in (values if isinstance(values, (list, tuple)) else [values])]
                    if len(values) != len(self.directions):
                        raise ValueError(f"the task returned {len(values)} value(s) for {len(self.directions)} "
                                         "direction(s); set objectives to match hydra.sweeper.directions")
                except Exception as err:  # noqa: BLE001 - a failed trial fails alone
                    log.warning("trial %d (%s) failed: %s", trial.number, " ".join(overrides), err)
                    study.tell(trial, state=states.FAIL)
                    continue
                with contextlib.suppress(RuntimeError):  # a grid sampler's study.stop() outside optimize()
                    study.tell(trial, values)
        results = {"name": "distill_optuna", "study_name": self.study_name, "directions": self.directions,
                   "n_trials": len(study.trials)}
        if len(self.directions) == 1:
            results.update(best_params=study.best_params, best_value=study.best_value, best_trial=study.best_trial.number)
            log.info("best: %s = %s", study.best_params, study.best_value)
        else:
            results["pareto"] = [{"trial": t.number, "params": t.params, "values": t.values} for t in study.best_trials]
            log.info("Pareto set: %s", [(t.params, t.values) for t in study.best_trials])
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")


def _format(value) -> str:
    """A value as a Hydra override accepts it back."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str) and any(c in value for c in " ,[]{}()='\"\\"):
        return "'" + value.replace("'", "\\'") + "'"
    return str(value)
