"""The AR service: prompt -> visual prior token rows (GLM-Image's autoregressive stage)."""
