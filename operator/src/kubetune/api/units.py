"""How durations and sizes read in messages, tables and Events: one spelling everywhere; and
what a Kubernetes quantity stands for, read the way Kubernetes reads it."""

from __future__ import annotations

from decimal import Decimal


def about(seconds: float) -> str:
    """An estimated duration: minutes under an hour (`44m`), else hours (`2.9h`)."""
    return f"{seconds / 60:.0f}m" if seconds < 3600 else f"{seconds / 3600:.1f}h"


def size(n: float) -> str:
    """A size in bytes, decimal as downloads are counted: `812 MB`, `1.4 GB`."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n:.0f} B"


def quantity_value(quantity: str) -> Decimal:
    """The number a Kubernetes quantity stands for: `200Gi` → 214748364800, `500m` → 0.5,
    `1e9` → 1000000000 (to the API server's precision, a thousandth).

    lightkube's parser reads every form the API server accepts (SI and binary suffixes,
    exponents), so what the operator compares is what the cluster holds. It is imported where
    a quantity is first read, so that importing the pure core loads no Kubernetes client (the
    offline commands never start one).
    """
    from lightkube.utils.quantity import parse_quantity

    try:
        value = parse_quantity(quantity)
    except ValueError:
        value = None
    if value is None:
        raise ValueError(
            f"{quantity!r} is not a Kubernetes quantity: a number with an optional suffix, "
            "such as 4, 500m, 16Gi or 1e9"
        )
    return value
