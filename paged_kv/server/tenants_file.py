"""The tenants file of ``paged-kv serve --api-keys FILE``: who may call the server, as whom,
and how the tenants share the cache.

Two formats:

- ``KEY TENANT`` lines (blank lines and ``#`` skipped): keys only, no policy;
- TOML (a ``.toml`` file, or one whose lines are not all two fields and look like TOML):
  admin keys, and per tenant its keys and limits (`paged_kv.tenants.TenantLimits`)::

      admin_keys = ["sk-admin"]
      [tenants.acme]
      keys = ["sk-acme-1"]
      quota = 4000            # blocks
      reservation = 1000
      priority = 50
      retention_seconds = 600
      retention_budget = 500
      [tenants.acme.tiers.host]
      quota = 20000
      [default]               # limits for tenants not named
      quota = 2000

Every mistake is a ValueError naming the field (``tenants.acme.quota: ...``): ``paged-kv
serve`` prints it as one line and exits 2. Quotas that sum past the pool are found once the
pool's size is known (`TenantPolicy.check`, in the engine core at start-up), and a tier's
reservations past half of it once the tier is open (`TenantPolicy.check_tier`): the file is
never checked against a size it does not know.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..tenants import TenantLimits, TenantPolicy, TierLimits

try:  # the standard library's from Python 3.11; its backport on 3.10
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

__all__ = ["TenantsFile", "parse_tenants_toml", "read_tenants_file"]

_TOP = {"admin_keys", "tenants", "default"}
_LIMITS = {"quota", "reservation", "priority", "retention_seconds", "retention_budget", "tiers"}
_TIER = {"quota", "reservation"}
_TIERS = ("host", "disk", "remote")


@dataclasses.dataclass(frozen=True)
class TenantsFile:
    """A parsed tenants file.

    Parameters
    ----------
    keys : dict
        ``{key: tenant}``: the tenant is the prefix-cache salt of the key's requests.
    admin_keys : frozenset of str
        Keys that act as admin (any tenant's flush, warm-up), with no tenant of their own.
    policy : TenantPolicy, optional
        How the tenants share the cache (None: the two-column format, one global LRU).
    """

    keys: dict[str, str]
    admin_keys: frozenset[str] = frozenset()
    policy: TenantPolicy | None = None

    @property
    def tenant_names(self) -> frozenset[str]:
        """Every tenant the file knows: those with keys and those the policy names."""
        named = set(self.policy.tenants) if self.policy is not None else set()
        return frozenset({*self.keys.values(), *named})


def read_tenants_file(path: str | Path) -> TenantsFile:
    """Read a tenants file in either format (see the module).

    Raises
    ------
    ValueError
        Naming the line or the field at fault.
    OSError
        The file cannot be read.
    """
    text = Path(path).read_text()
    if str(path).endswith(".toml") or _looks_like_toml(text):
        return parse_tenants_toml(text, str(path))
    return TenantsFile(_read_two_columns(text, str(path)))


def _looks_like_toml(text: str) -> bool:
    """Whether a line is not ``KEY TENANT`` but TOML (a table header or an assignment)."""
    for line in _lines(text):
        if len(line.split()) != 2 and (line.startswith("[") or "=" in line):
            return True
    return False


def _lines(text: str) -> list[str]:
    return [s for s in (line.strip() for line in text.splitlines()) if s and s[0] != "#"]


def _read_two_columns(text: str, where: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{where}:{number}: expected 'KEY TENANT', got {len(fields)} fields")
        if fields[0] in keys:
            raise ValueError(f"{where}:{number}: key given twice")
        keys[fields[0]] = fields[1]
    if not keys:
        raise ValueError(f"{where}: no 'KEY TENANT' lines")
    return keys


def parse_tenants_toml(text: str, where: str = "tenants file") -> TenantsFile:
    """The TOML tenants file `text` (`where` names it in a syntax error's message).

    Raises
    ------
    ValueError
        Naming the field: unknown, of the wrong type, out of range, or a key given twice.
    """
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise ValueError(f"{where}: a TOML tenants file needs Python 3.11+ or the tomli "
                         "package")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML: {exc}") from None
    _known("", data, _TOP)
    seen: dict[str, str] = {}  # key -> the field that gave it
    admin = frozenset(_keys("admin_keys", data.get("admin_keys", []), seen))
    tenants = _table("tenants", data.get("tenants", {}))
    keys: dict[str, str] = {}
    limits: dict[str, TenantLimits] = {}
    for name, section in tenants.items():
        where_t = f"tenants.{name}"
        section = _table(where_t, section)
        _known(where_t, section, _LIMITS | {"keys"})
        keys.update(dict.fromkeys(_keys(f"{where_t}.keys", section.get("keys", []), seen), name))
        limits[name] = _limits(where_t, section)
    default = _table("default", data.get("default", {}))
    _known("default", default, _LIMITS)
    policy = TenantPolicy(limits, _limits("default", default))
    # each value on its own, named; the sums need the pool's size (`TenantPolicy.check`
    # at engine start-up), so none is checked here against a pool it does not know
    policy.check_fields()
    if not keys and not admin:
        raise ValueError(f"{where}: no keys: give admin_keys or a tenant's keys")
    return TenantsFile(keys, admin, policy)


def _known(where: str, table: dict, allowed: set[str]) -> None:
    for field in table:
        if field not in allowed:
            raise ValueError(f"{where + '.' if where else ''}{field}: unknown field "
                             f"(expected one of {', '.join(sorted(allowed))})")


def _table(where: str, value: object) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a table, got {_kind(value)}")
    return value


def _keys(where: str, value: object, seen: dict[str, str]) -> list[str]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of keys, got {_kind(value)}")
    for key in value:
        if not isinstance(key, str) or not key or len(key.split()) != 1:
            raise ValueError(f"{where}: expected keys as non-empty strings without spaces, "
                             f"got {key!r}")
        if key in seen:
            raise ValueError(f"{where}: key {key[:4]}... given twice (also in {seen[key]})")
        seen[key] = where
    return value


def _limits(where: str, section: dict) -> TenantLimits:
    fields = {f: _number(f"{where}.{f}", section[f], float if f == "retention_seconds"
                         else int) for f in _LIMITS - {"tiers"} if f in section}
    tiers = {}
    for tier, table in _table(f"{where}.tiers", section.get("tiers", {})).items():
        where_tier = f"{where}.tiers.{tier}"
        if tier not in _TIERS:
            raise ValueError(f"{where_tier}: unknown tier (expected host, disk or remote)")
        table = _table(where_tier, table)
        _known(where_tier, table, _TIER)
        tiers[tier] = TierLimits(**{f: _number(f"{where_tier}.{f}", v, int)
                                    for f, v in table.items()})
        tiers[tier].check(where_tier)
    return TenantLimits(**fields, tiers=tiers)


def _number(where: str, value: object, kind: type) -> int | float:
    """`value` as `kind` (an int; or for float, an int or float), else ValueError."""
    allowed = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, allowed):
        name = "a number" if kind is float else "an integer"
        raise ValueError(f"{where}: expected {name}, got {_kind(value)} {value!r}")
    return kind(value)


def _kind(value: object) -> str:
    return {dict: "a table", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__)
