"""Elastic pools (issue 23): the arbiter of the device budget, and the sparse backing."""
