"""The PagedKVCache suites again, with every op forced through the Triton kernels.

Runs in a subprocess because the interpreter must be switched on before Triton is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from ..conftest import ROOT

SUITES = ["tests/core/test_bad_input.py", "tests/core/test_accounting.py",
          "tests/core/test_page_table.py", "tests/core/test_cache_state_machine.py"]


def test_cache_suites_pass_on_the_triton_backend():
    env = dict(os.environ, PAGED_KV_BACKEND="triton", TRITON_INTERPRET="1",
               PAGED_KV_HYPOTHESIS_PROFILE="paged_kv_interpreter")
    command = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-x",
               *SUITES]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
