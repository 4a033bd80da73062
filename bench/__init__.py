"""Benchmarks behind `make bench`. Each module writes bench/results/<name>.json; BENCHMARKS.md quotes them."""
