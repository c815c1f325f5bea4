"""bench/gpu_check.py's deadline: the seconds left, and a watchdog that ends the process at the deadline
itself, whatever is running (an ORT call cannot be interrupted), after its callback has written the report
with that item marked "skipped: time (stopped at the deadline)"."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable


class Clock:
    """The run's deadline (time.perf_counter seconds) and its watchdog."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.end = self.start + seconds
        self._timer: threading.Timer | None = None

    def left(self) -> float:
        return self.end - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def watch(self, at_deadline: Callable[[], int]) -> None:
        """At the deadline, call `at_deadline` (it writes the report and says the exit status), then end the
        process with that status: the main thread may be inside an ORT call that nothing can interrupt."""

        def fire() -> None:
            code = 1
            try:
                code = at_deadline()
            finally:
                os._exit(code)

        self._timer = threading.Timer(max(self.left(), 0.0), fire)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
