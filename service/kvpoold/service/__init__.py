"""kvpoold.service."""
