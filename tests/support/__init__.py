"""Test support package: what several test files share, so that no test module imports another.

certs (test-time PKI), cluster (server processes), fake_gateway (the SDK's scripted gateway), net (free ports),
scheduler_model (the scheduler's reference model), servers (in-process AR and denoiser), sim_gateway (the real
gateway in-process over simulated workers). Shared pytest fixtures are in tests/conftest.py.
"""
