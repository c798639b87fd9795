"""Test helper: stop a background process with SIGTERM once it has done some work."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable


def terminate_when(proc: subprocess.Popen, ready: Callable[[], bool], wait: float = 120.0) -> int:
    """Send SIGTERM to ``proc`` as soon as ``ready()`` holds (at the latest after ``wait``
    seconds) and return its exit status; a process still alive 60 s later is killed."""
    try:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not ready():
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
