"""The denoiser service: one prior-token row + the prompt's glyphs -> one image (GLM-Image's DiT + VAE)."""
