"""Import-only stand-in for ``triton.runtime`` (see the ``triton`` stub)."""
