"""Shared pytest setup: make ``tests.factories`` importable."""
