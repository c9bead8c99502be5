"""Import-only stand-in for ``IPython`` used by kvpool's SGLang differential test.

``sglang.utils`` imports ``IPython.display`` at module level for notebook helpers
that pool sizing never calls.
"""
