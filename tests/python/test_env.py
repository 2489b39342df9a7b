"""env_entries() is the one env table: same names, types and defaults as docs/env.md; values and
sources follow the environment."""

import json
import os
import re

import pytest

import mori
from conftest import REPO_ROOT

ROW = re.compile(r"^\|\s*`(MORI_[A-Z0-9_]+)`\s*\|\s*([A-Za-z]+)\s*\|\s*([^|]*?)\s*\|")


def doc_table():
    path = os.path.join(REPO_ROOT, "docs", "env.md")
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: the env table must be documented there")
    rows = {}
    with open(path) as f:
        for line in f:
            m = ROW.match(line)
            if m:
                default = m.group(3).strip()
                default = "" if default == "(empty)" else default.strip("`")
                rows[m.group(1)] = (m.group(2).lower(), default)
    assert rows, f"no `MORI_*` table rows found in {path}"
    return rows


def test_entries_shape():
    entries = mori.env_entries()
    assert entries, "env_entries() is empty"
    for e in entries:
        assert set(e) == {"name", "type", "value", "default", "source", "help"}, e
        assert e["name"].startswith("MORI_")
        assert e["type"] in ("bool", "int", "size", "string")
        assert e["source"] in ("env", "default")
        assert e["help"]


def test_names_types_defaults_match_docs():
    doc = doc_table()
    entries = {e["name"]: e for e in mori.env_entries()}
    assert sorted(entries) == sorted(doc), "docs/env.md and the env table list different variables"
    for name, (typ, default) in doc.items():
        assert entries[name]["type"] == typ, name
        assert entries[name]["default"] == default, name


def _entries_in_child(run_python, env):
    r = run_python("import json, mori; print(json.dumps(mori.env_entries()))", env)
    assert r.returncode == 0, r.stderr
    return {e["name"]: e for e in json.loads(r.stdout)}


def test_defaults_when_unset(run_python):
    for e in _entries_in_child(run_python, {}).values():
        assert e["source"] == "default", e


def test_value_and_source_from_environment(run_python):
    entries = _entries_in_child(run_python, {"MORI_LOG_LEVEL": "INFO", "MORI_SHMEM_HEAP_SIZE": "512M"})
    assert entries["MORI_LOG_LEVEL"]["source"] == "env"
    assert entries["MORI_LOG_LEVEL"]["value"] == "INFO"
    heap = entries["MORI_SHMEM_HEAP_SIZE"]
    assert heap["source"] == "env"
    assert heap["value"] == str(512 * 1024 * 1024)
    assert entries["MORI_DISABLE_P2P"]["source"] == "default"


def test_bad_value_raises_invalid_usage_naming_the_variable(run_python):
    code = (
        "import mori\n"
        "try:\n"
        "    mori.env_entries()\n"
        "except mori.InvalidUsageError as e:\n"
        "    print('raised', e)\n"
    )
    r = run_python(code, {"MORI_SHMEM_HEAP_SIZE": "12X"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("raised") and "MORI_SHMEM_HEAP_SIZE" in r.stdout, r.stdout
