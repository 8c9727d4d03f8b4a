"""How durations and sizes read in messages, tables and Events: one spelling everywhere."""

from __future__ import annotations


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
