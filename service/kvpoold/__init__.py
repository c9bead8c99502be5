"""kvpoold: the kvpool daemon (configurator, pools, allocators, sharing, gRPC service)."""

__version__ = "0.1.0"
