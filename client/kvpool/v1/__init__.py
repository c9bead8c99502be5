"""Generated stubs of protos/kvpool/v1/kvpool.proto (regenerate: python protos/generate.py)."""
