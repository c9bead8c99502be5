"""kvpoold.server."""
