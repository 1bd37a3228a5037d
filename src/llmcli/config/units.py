"""Sizes and durations as people write them."""

from __future__ import annotations

SIZE_UNITS = {
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
DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_size(text: str) -> int:
    """'8GB', '7.5GiB', '500MB', '1e9' → bytes."""
    return int(_quantity(text, SIZE_UNITS, "kmgtib", "size", "8GB, 7.5GiB, 500MB"))


def parse_duration(text: str) -> float:
    """'90s', '5m', '1.5h', '30' (seconds) → seconds."""
    return _quantity(text, DURATION_UNITS, "smh", "duration", "90s, 5m, 1h")


def _quantity(text: str, units: dict[str, float], letters: str, what: str, examples: str) -> float:
    """A positive, finite number followed by one of `units` (made of `letters`)."""
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip(letters)
    unit = cleaned[len(number) :]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError) as error:
        raise ValueError(f"not a {what}: {text!r} (examples: {examples})") from error
    if not value > 0 or value == float("inf"):
        raise ValueError(f"a {what} must be positive, got {text!r}")
    return value
