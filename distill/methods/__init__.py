"""One LightningModule per objective; the math they call lives in distill.diffusion."""
