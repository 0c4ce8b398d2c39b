"""An example that needs torch says what to install when torch is missing (issue 31
item 7: ``examples/hogwild_torch.py`` failed with a bare ``ModuleNotFoundError``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# torch hidden from the interpreter, as in an environment without it
_RUN_WITHOUT_TORCH = (
    "import runpy, sys; sys.modules['torch'] = None; "
    "runpy.run_path('examples/hogwild_torch.py', run_name='__main__')"
)


def test_hogwild_without_torch_says_what_to_install() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_WITHOUT_TORCH],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("this example needs torch"), proc.stderr
    assert "pip install torch" in proc.stderr and "Traceback" not in proc.stderr
