"""The tenants file (gateway/tenants.py): the documented form loads, every bad file is refused whole with its line and
field named, keys resolve to their tenant (plain or SHA-256), the key flags are tenants default/admin, and a reload
keeps the tenants in force when the new file is bad."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.priority import BATCH, DEFAULT, INTERACTIVE
from runtime.tenants import (
    ADMIN,
    USER,
    TenantsError,
    TenantsFile,
    load_tenants,
    parse_tenants,
    tenants_from_keys,
)

ROOT = Path(__file__).resolve().parents[1]

# The form the issue and docs/operating.md show, as is.
DOCUMENTED = """\
[tenants.alpha]
keys = ["sk-alpha-1"]            # or keys_sha256 = ["<hex>"], so the file need not hold secrets
weight = 1                       # its share of both stages when several tenants wait
role = "user"                    # or "admin"
max_priority = "interactive"     # the highest class its requests may ask for

[tenants.beta]
keys = ["sk-beta-1"]
weight = 2
requests_per_minute = 30         # optional quotas; absent: no quota
images_per_minute = 60
max_inflight_images = 8
"""


def test_the_documented_form_loads() -> None:
    tenants = parse_tenants(DOCUMENTED)
    alpha, beta = tenants.by_name["alpha"], tenants.by_name["beta"]
    assert (alpha.weight, alpha.role, alpha.max_priority, alpha.has_quotas) == (1.0, USER, INTERACTIVE, False)
    assert (beta.weight, beta.max_priority, beta.requests_per_minute, beta.images_per_minute,
            beta.max_inflight_images, beta.has_quotas) == (2.0, DEFAULT, 30, 60, 8, True)
    assert tenants.lookup(b"sk-alpha-1") is alpha and tenants.lookup(b"sk-beta-1") is beta
    assert tenants.lookup(b"sk-beta-2") is None and tenants.lookup(None) is None
    assert not tenants.open and not tenants.open_users and not tenants.has_admin


def test_the_operating_docs_show_the_form_that_loads() -> None:
    text = (ROOT / "docs" / "operating.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert blocks, "docs/operating.md shows the tenants file"
    for block in blocks:
        parse_tenants(block, "docs/operating.md")


def test_the_example_file_the_readme_runs_loads() -> None:
    readme = (ROOT / "README.md").read_text()
    assert 'STACK_ARGS="--tenants docs/tenants.example.toml"' in readme
    tenants = load_tenants(ROOT / "docs" / "tenants.example.toml")
    assert set(tenants.by_name) == {"alpha", "beta", "ops"} and tenants.has_admin
    for key in ("sk-alpha-1", "sk-beta-1", "sk-ops-1"):
        assert f"`{key}`" in readme and tenants.lookup(key.encode()) is not None


def test_a_digest_stands_for_its_key_and_the_priority_classes_order() -> None:
    hexed = hashlib.sha256(b"sk-secret").hexdigest()
    text = f'[tenants.ops]\nkeys_sha256 = ["{hexed.upper()}"]\nrole = "admin"\nmax_priority = "batch"\n'
    tenants = parse_tenants(text)
    ops = tenants.lookup(b"sk-secret")
    assert ops is not None and ops.role == ADMIN and ops.holds(USER) and ops.holds(ADMIN) and tenants.has_admin
    assert ops.allows(BATCH) and not ops.allows(DEFAULT) and not ops.allows(INTERACTIVE)


BAD = [
    ("[tenants.a]\nkeys = [\"k\"]\nweight = 0\n", 3, "tenants.a.weight", "above 0"),
    ("[tenants.a]\nkeys = [\"k\"]\nweight = -1.5\n", 3, "tenants.a.weight", "above 0"),
    ("[tenants.a]\nkeys = [\"k\"]\nweight = nan\n", 3, "tenants.a.weight", "above 0"),
    ("[tenants.a]\nkeys = [\"k\"]\nweight = true\n", 3, "tenants.a.weight", "above 0"),
    ("[tenants.a]\nkeys = [\"k\"]\nweight = 5e-324\n", 3, "tenants.a.weight", "from 0.001"),
    ("[tenants.a]\nkeys = [\"k\"]\nweight = 1e7\n", 3, "tenants.a.weight", "to 1e+06"),
    ("[tenants.a]\nkeys = [\"k\"]\n\nwieght = 1\n", 4, "tenants.a.wieght", "unknown field"),
    ("[tenants.a]\nkeys = [\"k\"]\n[tenants.b]\n# b\nkeys = [\"j\", \"k\"]\n", 5, "tenants.b.keys",
     "tenant 'a' has it"),
    ("[tenants.a]\nkeys = [\"k\", \"k\"]\n", 2, "tenants.a.keys", "listed twice"),
    (f"[tenants.a]\nkeys = [\"k\"]\n[tenants.b]\nkeys_sha256 = [\"{hashlib.sha256(b'k').hexdigest()}\"]\n", 4,
     "tenants.b.keys_sha256", "tenant 'a' has it"),
    ("[tenants.a]\nkeys_sha256 = [\"abc\"]\n", 2, "tenants.a.keys_sha256", "64 hex digits"),
    ("[tenants.a]\nkeys = \"k\"\n", 2, "tenants.a.keys", "list of strings"),
    ("[tenants.a]\nkeys = [\"a key\"]\n", 2, "tenants.a.keys", "without spaces"),
    ("[tenants.a]\nweight = 1\n", 1, "tenants.a", "at least one key"),
    ("[tenants.a]\nkeys = [\"k\"]\nrole = \"root\"\n", 3, "tenants.a.role", "'user', 'admin'"),
    ("[tenants.a]\nkeys = [\"k\"]\nmax_priority = \"urgent\"\n", 3, "tenants.a.max_priority", "'interactive'"),
    ("[tenants.a]\nkeys = [\"k\"]\nrequests_per_minute = 0\n", 3, "tenants.a.requests_per_minute", "whole number"),
    ("[tenants.a]\nkeys = [\"k\"]\nimages_per_minute = 2.5\n", 3, "tenants.a.images_per_minute", "whole number"),
    ("[tenants.a]\nkeys = [\"k\"]\nmax_inflight_images = \"8\"\n", 3, "tenants.a.max_inflight_images", "whole number"),
    ("[tenants.\"a b\"]\nkeys = [\"k\"]\n", 1, "tenants.a b", "tenant name"),
    ("[tenants]\n", 1, "tenants", "names no tenant"),
    ("", 1, "tenants", "names no tenant"),
    ("[tenant.a]\nkeys = [\"k\"]\n", 1, "tenant", "unknown top-level key"),
    ("[tenants.a]\nkeys = [\"k\"\n", 2, "", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "line", "where", "why"), BAD)
def test_a_bad_file_is_refused_with_its_line_and_field(text: str, line: int, where: str, why: str) -> None:
    with pytest.raises(TenantsError) as err:
        parse_tenants(text, "t.toml")
    message = str(err.value)
    assert message.startswith(f"t.toml:{line}: {where}"), message
    assert why in message


@given(st.text(max_size=300))
def test_any_text_is_tenants_or_a_tenants_error(text: str) -> None:
    try:
        parse_tenants(text, "t.toml")
    except TenantsError as exc:
        assert str(exc).startswith("t.toml:")


def test_the_key_flags_are_tenants_default_and_admin() -> None:
    flags = tenants_from_keys(["u1", "u2"], ["a1"])
    assert flags.lookup(b"u1").name == flags.lookup(b"u2").name == "default"
    assert flags.lookup(b"a1").name == "admin" and flags.lookup(b"a1").role == ADMIN
    assert flags.caller(None) is None and not flags.open_users
    none = tenants_from_keys([], [])
    assert none.open and none.open_users and none.caller(None).name == "default"
    assert none.caller(b"whatever").name == "default" and not none.has_admin
    admin_only = tenants_from_keys([], ["a1"])
    assert admin_only.open_users and admin_only.caller(b"a1").name == "admin"
    assert admin_only.caller(None).name == "default"


def test_a_reload_takes_a_good_file_and_keeps_the_old_one_for_a_bad_file(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(DOCUMENTED)
    holder = TenantsFile(path, tenants_from_keys([], []))
    kept = holder.current
    assert set(kept.by_name) == {"alpha", "beta"}
    path.write_text(DOCUMENTED.replace('keys = ["sk-beta-1"]', 'keys = ["sk-beta-2"]'))
    assert holder.reload() and holder.current.lookup(b"sk-beta-1") is None
    assert holder.current.lookup(b"sk-beta-2").name == "beta"
    good = holder.current
    path.write_text(DOCUMENTED + "\n[tenants.gamma]\nkeys = [\"sk-alpha-1\"]\n")
    assert not holder.reload() and holder.current is good
    assert f"{path}:15: tenants.gamma.keys" in caplog.text
    assert kept.lookup(b"sk-beta-1").name == "beta"  # a request admitted under the old tenants keeps its tenant


def test_a_missing_file_is_a_tenants_error(tmp_path: Path) -> None:
    with pytest.raises(TenantsError, match="cannot read the tenants file"):
        load_tenants(tmp_path / "absent.toml")


@pytest.mark.parametrize("module", ["gateway", "rest"])
def test_a_bad_file_stops_the_server_at_start_up_with_one_line(tmp_path: Path, module: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nkeys = [\"k\"]\nweight = 0\n")
    proc = subprocess.run([sys.executable, "-m", module, "--tenants", str(path), "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"{path}:3: tenants.a.weight" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_gateway_refuses_tenants_beside_key_flags(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(DOCUMENTED)
    proc = subprocess.run([sys.executable, "-m", "gateway", "--tenants", str(path), "--api-key", "k", "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--tenants names every key" in proc.stderr and "Traceback" not in proc.stderr
