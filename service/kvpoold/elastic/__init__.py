"""Elastic pools (issue 23): the arbiter of the device budget, the sparse backing, and their
Prometheus families."""
