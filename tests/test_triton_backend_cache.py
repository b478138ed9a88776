"""The PagedKVCache suites again, with every op forced through the Triton kernels.

Runs in a subprocess because the interpreter must be switched on before Triton is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SUITES = ["tests/test_bad_input.py", "tests/test_accounting.py", "tests/test_page_table.py",
          "tests/test_cache_state_machine.py"]


def test_cache_suites_pass_on_the_triton_backend():
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PAGED_KV_BACKEND="triton", TRITON_INTERPRET="1",
               PAGED_KV_HYPOTHESIS_PROFILE="paged_kv_interpreter")
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-x",
               *SUITES]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
