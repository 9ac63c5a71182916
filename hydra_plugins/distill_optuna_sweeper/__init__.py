"""distill's Optuna sweeper for Hydra (``hydra/sweeper=distill_optuna``); see ``sweeper.py``."""
