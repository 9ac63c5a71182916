"""Config checks that several methods share, called from their ``check_config(cfg)`` (``distill.methods``).

Each raises ``ValueError`` naming the key and the fix; ``distill.config.validate`` reports it (exit code 2).
"""

from __future__ import annotations


def check_probability(method, key: str) -> None:
    """``method.<key>`` is a probability, in [0, 1]."""
    if not 0.0 <= method[key] <= 1.0:
        raise ValueError(f"method.{key}={method[key]} must be in [0, 1]")


def check_guidance_range(method) -> None:
    """The classifier-free guidance scales a method draws: ``guidance_scale_min <= guidance_scale_max``, both >= 1."""
    if method.guidance_scale_min > method.guidance_scale_max:
        raise ValueError(
            f"method.guidance_scale_min={method.guidance_scale_min} > method.guidance_scale_max={method.guidance_scale_max}; "
            "the guidance range needs min <= max"
        )
    if method.guidance_scale_min < 1.0:
        raise ValueError(f"method.guidance_scale_min={method.guidance_scale_min} must be >= 1 (1 = no guidance)")


def is_sharded(cfg) -> bool:
    """Whether the trainer shards the networks (``trainer=fsdp``: ``distill.utils.sharding.ShardedStrategy``)."""
    strategy = cfg.trainer.get("strategy")
    return hasattr(strategy, "get") and str(strategy.get("_target_", "")).endswith(".ShardedStrategy")


def check_resolution(cfg) -> None:
    """``method.resolution``, where a method has it, is the training images' (``data.resolution``): on a
    resolution-shifted teacher (Flux) the student's time grid and its export's default size are built at it."""
    resolution, data_resolution = cfg.method.get("resolution"), cfg.get("data", {}).get("resolution")
    if resolution is not None and data_resolution is not None and resolution != data_resolution:
        raise ValueError(f"method.resolution={resolution} differs from data.resolution={data_resolution}: on a "
                         "resolution-shifted teacher (Flux) the student's time grid is built at the shift of the "
                         "training images' resolution; leave method.resolution=${data.resolution}")
