"""Byte sizes as people type them (``40GiB``, ``1.5GB``, ``512MiB``) and as they read them back."""

from __future__ import annotations

import re
from decimal import Decimal

from kvpool.contract.errors import InvalidArgument

# Above this a size is a typo, not a budget (matches PlanOptions' limit).
MAX_SIZE_BYTES = 1 << 50  # 1 PiB

UNITS: dict[str, int] = {
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}
# Units in any case: "gb" is GB (10**9), "gib" GiB (2**30); the two never collide.
_UNIT_OF = {name.lower(): name for name in UNITS}
# digits, an optional fraction, one optional space, an optional unit; nothing else
_SIZE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?) ?(?P<unit>[A-Za-z]+)?")
_ACCEPTED = "an integer number of bytes, or a number with a unit: " + ", ".join(UNITS)


def parse_size(text: str, *, field: str = "budget") -> int:
    """Parse a byte count: ``42949672960``, ``40GiB``, ``512MiB``, ``1.5GB``, ``2 TiB``.

    Units are read in any case; ``GiB`` (``gib``) is 2**30 and ``GB`` (``gb``) 10**9, as the
    plan prints back in bytes. A fractional number needs a unit above ``B`` and is rounded
    down to a whole byte.

    Args:
        text: what the user typed.
        field: the option named in errors (``budget``).

    Returns:
        The size in bytes, 0 to 1 PiB.

    Raises:
        InvalidArgument: negative, malformed, an unknown unit, fractional bytes, or over 1 PiB.
    """
    raw = text.strip()
    if raw.startswith("-"):
        raise InvalidArgument(f"size {text!r} is negative; give {_ACCEPTED}", field=field)
    match = _SIZE.fullmatch(raw)
    if match is None:
        raise InvalidArgument(f"cannot read size {text!r}; give {_ACCEPTED}", field=field)
    unit = _UNIT_OF.get((match["unit"] or "B").lower())
    if unit is None:
        raise InvalidArgument(
            f"unknown unit {match['unit']!r} in {text!r} (accepted, in any case: "
            f"{', '.join(UNITS)}; KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of 1000)",
            field=field,
        )
    number = Decimal(match["number"])
    if unit == "B" and number != number.to_integral_value():
        raise InvalidArgument(f"size {text!r} is not a whole number of bytes", field=field)
    size = int(number * UNITS[unit])  # Decimal keeps 1.1GiB exact before the floor
    if size > MAX_SIZE_BYTES:
        raise InvalidArgument(
            f"size {text!r} = {size:,} B exceeds the 1 PiB limit ({MAX_SIZE_BYTES:,} B)",
            field=field,
        )
    return size


def format_size(nbytes: int) -> str:
    """``42949672960`` -> ``"40.00 GiB"``; below 1 KiB, plain bytes (``"576 B"``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
