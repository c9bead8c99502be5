"""kvpoold.alloc."""
