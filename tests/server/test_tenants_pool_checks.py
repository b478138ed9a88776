"""``paged-kv serve`` refuses a tenants file whose limits the pool or a tier cannot honour,
once their sizes are known, with one line naming the field and the real size (issue 38):
never a stand-in pool's 4611686018427387903 blocks, and never a tier reservation that pins
the whole tier."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT


def _serve(tmp_path: Path, tenants: str, *flags: str) -> subprocess.CompletedProcess:
    path = tmp_path / "tenants.toml"
    path.write_text(tenants)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:  # a refusal comes within seconds; a server that starts serves until killed
        return subprocess.run([sys.executable, "-m", "paged_kv.cli", "serve", "--port", "0",
                               "--api-keys", str(path), "--memory-mib", "1", *flags],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("paged-kv serve started instead of refusing the tenants file")


@pytest.mark.parametrize("tenants, flags, expected", [
    ('[tenants.a]\nkeys = ["ka"]\nquota = 5000000000000000000\n', (),
     r"tenants: quota: the quotas sum to 5000000000000000000 blocks, past the pool's "
     r"(?P<usable>\d+) \((?P<blocks>\d+) blocks less the null block\)"),
    ('[tenants.a]\nkeys = ["ka"]\n[tenants.a.tiers.host]\nreservation = 100000000\n',
     ("--kv-host-mib", "1"),
     r"tenants\.a\.tiers\.host\.reservation: 100000000 blocks take the host tier's "
     r"reservations to 100000000, past half of its (?P<blocks>\d+) blocks \((?P<half>\d+)\)"),
], ids=["a quota past the pool", "a host reservation past the tier"])
def test_serve_names_the_real_size_a_limit_is_past(tmp_path: Path, tenants, flags, expected):
    """Fault: the quota checked against a made-up pool of 2**62 blocks as the file is read;
    a tier's reservation accepted whatever the tier's size."""
    done = _serve(tmp_path, tenants, *flags)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, done.stderr
    found = re.search(expected, errors[0])
    assert found is not None, errors[0]
    sizes = {name: int(value) for name, value in found.groupdict().items()}
    assert 0 < sizes["blocks"] < 10_000, "1 MiB of the embedded model: a few dozen blocks"
    assert sizes.get("usable", sizes["blocks"] - 1) == sizes["blocks"] - 1
    assert sizes.get("half", sizes["blocks"] // 2) == sizes["blocks"] // 2
