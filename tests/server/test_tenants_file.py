"""The tenants file of ``paged-kv serve --api-keys``: the TOML format (admin keys, per-tenant
limits), the two-column format unchanged, and every mistake named by its field, at start-up
as one line and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paged_kv.server.serve import read_api_keys
from paged_kv.server.tenants_file import parse_tenants_toml, read_tenants_file
from paged_kv.tenants import TenantLimits, TenantPolicy, TierLimits

from ..conftest import ROOT

GOOD = """
admin_keys = ["sk-admin"]
[tenants.acme]
keys = ["sk-acme-1", "sk-acme-2"]
quota = 4000          # blocks
reservation = 1000
priority = 50
retention_seconds = 600
retention_budget = 500
[tenants.acme.tiers.host]
quota = 20000
[tenants.beta]
keys = ["sk-beta"]
retention_seconds = 1.5
[default]             # limits for tenants not named
quota = 2000
"""


def test_good_toml_gives_keys_admins_and_the_policy():
    parsed = parse_tenants_toml(GOOD)
    assert parsed.keys == {"sk-acme-1": "acme", "sk-acme-2": "acme", "sk-beta": "beta"}
    assert parsed.admin_keys == {"sk-admin"}
    assert parsed.tenant_names == {"acme", "beta"}
    assert parsed.policy == TenantPolicy(
        {"acme": TenantLimits(quota=4000, reservation=1000, priority=50,
                              retention_seconds=600.0, retention_budget=500,
                              tiers={"host": TierLimits(quota=20000)}),
         "beta": TenantLimits(retention_seconds=1.5)},
        TenantLimits(quota=2000))
    assert isinstance(parsed.policy.limits("acme").retention_seconds, float)


def test_toml_is_found_by_suffix_or_by_content(tmp_path):
    by_suffix = tmp_path / "tenants.toml"
    by_suffix.write_text(GOOD)
    by_content = tmp_path / "tenants"
    by_content.write_text(GOOD)
    assert read_tenants_file(by_suffix) == read_tenants_file(by_content)
    assert read_tenants_file(by_content).policy is not None
    # the router's reader takes it too: the tenants' keys
    assert read_api_keys(by_content) == {"sk-acme-1": "acme", "sk-acme-2": "acme",
                                         "sk-beta": "beta"}


def test_two_column_file_still_works(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key tenant\nkey-a alice\n\nkey-b bob\n")
    parsed = read_tenants_file(path)
    assert parsed.keys == {"key-a": "alice", "key-b": "bob"}
    assert parsed.admin_keys == frozenset() and parsed.policy is None
    assert read_api_keys(path) == parsed.keys
    path.write_text("key-a alice extra\n")
    with pytest.raises(ValueError, match=r"keys:1: expected 'KEY TENANT', got 3 fields"):
        read_tenants_file(path)


@pytest.mark.parametrize("text, field", [
    ('[tenants.acme]\nkeys = ["k"]\nquotta = 5\n', "tenants.acme.quotta: unknown field"),
    ('admins = ["k"]\n', "admins: unknown field"),
    ('[tenants.acme]\nkeys = ["k"]\nquota = -1\n', "tenants.acme.quota: expected a block"),
    ('[tenants.acme]\nkeys = ["k"]\nquota = "lots"\n', "tenants.acme.quota: expected an int"),
    ('[tenants.acme]\nkeys = ["k"]\nquota = 1.5\n', "tenants.acme.quota: expected an int"),
    ('[tenants.acme]\nkeys = ["k"]\npriority = 100\n', "tenants.acme.priority: expected an"),
    ('[tenants.acme]\nkeys = ["k"]\npriority = true\n', "tenants.acme.priority: expected an"),
    ('[tenants.acme]\nkeys = ["k"]\nretention_seconds = -2\n',
     "tenants.acme.retention_seconds: expected seconds"),
    ('[tenants.acme]\nkeys = ["k"]\nquota = 4\nreservation = 8\n',
     "tenants.acme.reservation: 8 is above its quota"),
    ('[tenants.acme]\nkeys = ["k"]\n[tenants.acme.tiers.host]\nquota = -3\n',
     "tenants.acme.tiers.host.quota: expected a block"),
    ('[tenants.acme]\nkeys = ["k"]\n[tenants.acme.tiers.tape]\nquota = 3\n',
     "tenants.acme.tiers.tape: unknown tier"),
    ('[tenants.acme]\nkeys = ["k"]\n[tenants.acme.tiers.host]\nsize = 3\n',
     "tenants.acme.tiers.host.size: unknown field"),
    ('[tenants.acme]\nkeys = "k"\n', "tenants.acme.keys: expected a list"),
    ('[tenants.a]\nkeys = ["k"]\n[tenants.b]\nkeys = ["k"]\n', "tenants.b.keys: key k"),
    ('admin_keys = ["k"]\n[default]\nkeys = ["j"]\n', "default.keys: unknown field"),
    ('[default]\nquota = -1\n', "default.quota: expected a block"),
    ("tenants = 3\n", "tenants: expected a table"),
    ("[tenants.acme]\nquota = 3\n", "no keys"),
    ("admin_keys = [\n", "not valid TOML"),
])
def test_each_bad_field_is_named(text, field):
    with pytest.raises(ValueError) as info:
        parse_tenants_toml(text, "t.toml")
    assert field in str(info.value)
    assert "\n" not in str(info.value)


def _serve(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "paged_kv.cli", "serve", "--port", "0",
                           *flags], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=180)


def test_serve_exits_2_with_one_line_naming_the_field(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.acme]\nkeys = ["k"]\nquota = -5\n')
    done = _serve("--api-keys", str(path))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "tenants.acme.quota" in lines[0] and "--api-keys" in lines[0]


def test_serve_exits_2_when_quotas_sum_past_the_pool(tmp_path: Path):
    # 1 MiB of the embedded model's K/V is a few dozen blocks: far fewer than 10**6
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants.a]\nkeys = ["ka"]\nquota = 600000\n'
                    '[tenants.b]\nkeys = ["kb"]\nquota = 600000\n')
    done = _serve("--api-keys", str(path), "--memory-mib", "1")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, done.stderr
    assert "tenants: quota: the quotas sum to 1200000 blocks" in errors[0]
