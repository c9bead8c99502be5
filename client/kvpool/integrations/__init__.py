"""Integrations of kvpool into serving engines (optional extras: ``kvpool[sglang]``)."""
