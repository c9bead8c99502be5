"""kvpoold: the kvpool daemon (configurator, pools, allocators, sharing, gRPC service)."""

__version__ = "1.0.0"
