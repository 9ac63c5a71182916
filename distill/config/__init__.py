"""Structured config schemas (registered in Hydra's ConfigStore) and validation in one place."""
