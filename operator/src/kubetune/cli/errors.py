"""The error every command raises: kubetune's messages already say what to fix, so click
prints them as they are."""

from __future__ import annotations

import click


class Abort(click.ClickException):
    """An error printed as-is (our messages already say how to fix them)."""

    def format_message(self) -> str:
        return self.message
