"""An accelerator added from one file: run the network on every ``interval``-th call of a trajectory and hand
the sampler that call's output again on the calls between (the simplest output cache; ``interval=1``: plain).

Selected by kind once the module is imported as a plugin (``distill.utils.registry``)::

    DISTILL_PLUGINS=tests.examples.toy_accelerator python -m distill.evaluate pipeline=<dir> \\
        accelerate.kind=reuse +accelerate.options.interval=2

The reused calls run no network: the sampling context records them as predicted, and the cost meter's NFE
drops to ``ceil(calls / interval)`` per trajectory.
"""

from __future__ import annotations

from distill.accelerate import ACCELERATORS, Accelerator


@ACCELERATORS.register("reuse")
class ReuseOutput(Accelerator):
    """Compute calls 0, N, 2N, ... of each trajectory (``context.call``) and repeat the last computed output on
    the others."""

    name = "reuse"

    def __init__(self, interval: int = 2):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"accelerate.options.interval={interval!r} must be an integer >= 1 (1 = no reuse)")
        self.interval, self.last = interval, None

    def describe(self) -> str:
        return f"reuse(N={self.interval})"

    def begin(self, context, num_calls):
        super().begin(context, num_calls)
        self.last = None  # a new trajectory: nothing to reuse yet

    def call(self, context, forward, *args, **kwargs):
        if self.last is None or context.call % self.interval == 0:
            self.last = forward(*args, **kwargs)
        return self.last

    def passed_calls(self, num_calls):
        return None if num_calls is None else -(-num_calls // self.interval)
