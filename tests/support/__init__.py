"""Test support package: the scheduler's reference model and helpers shared by several test files."""
