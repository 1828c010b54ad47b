"""Sizes in bytes: ``parse_bytes`` reads what a person writes (``6GiB``, ``512MB``, a fraction
of the memory), ``format_size`` writes one back. Standard library only."""

from __future__ import annotations

__all__ = ["format_size", "parse_bytes"]


def format_size(n: int) -> str:
    """``n`` bytes for a person: ``1.5 GiB``, ``400.0 MiB``, ``12 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def parse_bytes(text: str, *, total: int | None = None) -> int:
    """``"6GiB"``, ``"512MB"``, ``"1.5G"``, ``"123456"`` or, with ``total``, a fraction
    (``"0.5"``, ``"50%"``) of it, as bytes. Raises ``ValueError`` naming the accepted forms."""
    raw = text.strip()
    units = {
        "": 1,
        "b": 1,
        "k": 1 << 10,
        "kb": 1000,
        "kib": 1 << 10,
        "m": 1 << 20,
        "mb": 1000**2,
        "mib": 1 << 20,
        "g": 1 << 30,
        "gb": 1000**3,
        "gib": 1 << 30,
        "t": 1 << 40,
        "tb": 1000**4,
        "tib": 1 << 40,
    }
    number = raw.rstrip("bBkKmMgGtTiI% ")
    unit = raw[len(number) :].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = float("nan")
    ok = value == value and value > 0
    if ok and unit == "%" and total is not None:
        return int(total * value / 100)
    if ok and unit == "" and value <= 1 and total is not None and "." in number:
        return int(total * value)
    if ok and unit in units and unit != "%":
        return int(value * units[unit])
    fraction = " or a fraction of the memory (0.5, 50%)" if total is not None else ""
    raise ValueError(f"memory size must look like 6GiB, 512MB or 1048576{fraction}, got {text!r}")
