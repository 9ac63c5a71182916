"""Sampling: scheduler factory, guided sampling loop."""
