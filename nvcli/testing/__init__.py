"""Helpers for tests and benchmarks: tiny random checkpoints that need no model hub."""
