"""Networks: UNet factories, conditioning encoders, the denoiser wrapper."""
