"""Model loading shared by the AR and denoiser services: the tiny default checkpoint, devices, dtypes."""
