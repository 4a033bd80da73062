"""Torch-free plumbing shared by every gRPC server of the suite (AR, denoiser and gateway).

Health, reflection, the error interceptor, request-id logging and graceful shutdown live here once.
"""
