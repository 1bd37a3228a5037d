"""Sizes as people write them."""

from __future__ import annotations


def parse_size(text: str) -> int:
    """'8GB', '7.5GiB', '500MB', '1e9' → bytes."""
    units = {
        "": 1,
        "b": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("kmgtib")
    unit = cleaned[len(number) :]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError) as error:
        raise ValueError(f"not a size: {text!r} (examples: 8GB, 7.5GiB, 500MB)") from error
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return int(value)


DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """'90s', '5m', '1.5h', '30' (seconds) → seconds."""
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("smh")
    unit = cleaned[len(number) :]
    try:
        value = float(number) * DURATION_UNITS[unit]
    except (ValueError, KeyError) as error:
        raise ValueError(f"not a duration: {text!r} (examples: 90s, 5m, 1h)") from error
    if not value > 0 or value == float("inf"):
        raise ValueError(f"a duration must be positive, got {text!r}")
    return value
