"""How durations read in messages, tables and Events: one spelling everywhere."""

from __future__ import annotations


def about(seconds: float) -> str:
    """An estimated duration: minutes under an hour (`44m`), else hours (`2.9h`)."""
    return f"{seconds / 60:.0f}m" if seconds < 3600 else f"{seconds / 3600:.1f}h"
