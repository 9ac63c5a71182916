"""Hydra configs, a package so that the console scripts (distill-train, ...) find them by module."""
