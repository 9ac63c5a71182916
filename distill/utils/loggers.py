"""Logger helpers: wandb goes offline by itself when no API key is configured."""

from __future__ import annotations

import netrc
import os

from omegaconf import OmegaConf


def wandb_offline() -> bool:
    """Offline unless WANDB_MODE=online, or an API key is in WANDB_API_KEY or ~/.netrc."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "disabled", "dryrun"):
        return True
    if mode == "online":
        return False
    if os.environ.get("WANDB_API_KEY"):
        return False
    try:
        rc = netrc.netrc()
        if rc.authenticators("api.wandb.ai"):
            return False
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    os.environ.setdefault("WANDB_MODE", "offline")
    return True


def _asset(name: str) -> str:
    from distill.assets import asset_path

    return str(asset_path(name))


def register_resolvers() -> None:
    """``${distill.wandb_offline:}`` and ``${distill.asset:NAME}`` (path of a shipped digits asset)."""
    if not OmegaConf.has_resolver("distill.wandb_offline"):
        OmegaConf.register_new_resolver("distill.wandb_offline", lambda: wandb_offline())
    if not OmegaConf.has_resolver("distill.asset"):
        OmegaConf.register_new_resolver("distill.asset", _asset)
