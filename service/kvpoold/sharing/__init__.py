"""kvpoold.sharing."""
