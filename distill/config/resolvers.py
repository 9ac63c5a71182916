"""The OmegaConf resolvers the configs use: ``${distill.wandb_offline:}`` and ``${distill.asset:NAME}``.

They live with the config (what reads them) rather than with the loggers, so that a helper low in the package
need not reach up to the shipped assets.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from distill.utils.loggers import wandb_offline


def _asset(name: str) -> str:
    from distill.worlds import asset_path

    return str(asset_path(name))


def register_resolvers() -> None:
    """``${distill.wandb_offline:}`` and ``${distill.asset:NAME}`` (the folder of an asset a world ships, ``distill.worlds``)."""
    if not OmegaConf.has_resolver("distill.wandb_offline"):
        OmegaConf.register_new_resolver("distill.wandb_offline", lambda: wandb_offline())
    if not OmegaConf.has_resolver("distill.asset"):
        OmegaConf.register_new_resolver("distill.asset", _asset)
