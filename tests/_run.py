"""Running a script, an example or ``-c`` code in a fresh interpreter, from the repo's root."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_python(
    *argv: str,
    timeout: float = 60,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python *argv`` in the repository's root (``input`` on its stdin), its output
    captured as text; asserts that it exited 0 (the assertion's message is its output)."""
    proc = subprocess.run(
        [sys.executable, *argv],
        input=input,
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc
