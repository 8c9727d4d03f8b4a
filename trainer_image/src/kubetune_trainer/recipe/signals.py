"""The signals a trainer obeys: the loop asks at every step start and between micro-batches."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any


class SignalFlags:
    """SIGTERM/SIGINT: preempt (checkpoint, exit 42). SIGUSR1: stop (checkpoint, exit 44)."""

    def __init__(self) -> None:
        self.term = False
        self.stop = False
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in (
            (signal.SIGTERM, self._on_term),
            (signal.SIGINT, self._on_term),
            (signal.SIGUSR1, self._on_stop),
        ):
            self._previous[sig] = signal.signal(sig, handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_term(self, signum: int, _frame: Any) -> None:
        if self.term and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        self.term = True
        self.received_at = self.received_at or time.monotonic()

    def _on_stop(self, _signum: int, _frame: Any) -> None:
        self.stop = True
        self.received_at = self.received_at or time.monotonic()
