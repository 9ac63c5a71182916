"""distill: make diffusion models fast, and measure quality and cost."""

__version__ = "0.1.0"
