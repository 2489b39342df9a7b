"""`import mori` explains the collision with ROCm's amd-mori (same import name, another project)
when that distribution is installed too; otherwise it says nothing. The other distribution is
faked with a metadata directory on sys.path, in a child process."""

import os

import mori
from conftest import MORI_PYTHON_PATH

IMPORT = "import warnings; warnings.simplefilter('always'); import mori; print('FILE', mori.__file__)"


def _fake_dist(site, name, version, record_lines):
    meta = os.path.join(site, f"{name.replace('-', '_')}-{version}.dist-info")
    os.makedirs(meta)
    with open(os.path.join(meta, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    with open(os.path.join(meta, "RECORD"), "w") as f:
        f.write("".join(line + ",,\n" for line in record_lines))
    return meta


def _installed_by_pip():
    """Whether this mori is an installed mori-ep (its metadata directory beside the package)."""
    return any(n.startswith("mori_ep-") and n.endswith(".dist-info") for n in os.listdir(MORI_PYTHON_PATH))


def _run(run_python, site):
    path = os.pathsep.join([MORI_PYTHON_PATH, site])  # mori itself first: it is what gets imported
    r = run_python(IMPORT, {"PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    imported = r.stdout.split("FILE ", 1)[1].strip()
    return imported, r.stderr


def test_no_warning_without_amd_mori(run_python, tmp_path):
    imported, err = _run(run_python, str(tmp_path))
    assert "amd-mori" not in err, err
    assert "RuntimeWarning" not in err, err


def test_warns_with_amd_mori_installed(run_python, tmp_path):
    # amd-mori's files live in its own site directory (which has no mori/ here): this mori is
    # imported, and only mori-ep's record (where it is pip-installed) lists its file.
    meta = _fake_dist(str(tmp_path), "amd-mori", "9.8.7", ["mori/__init__.py", "mori/_C.so"])
    imported, err = _run(run_python, str(tmp_path))
    assert "RuntimeWarning" in err, err
    assert "ROCm's distribution amd-mori is installed here" in err, err
    assert f"amd-mori 9.8.7 ({meta})" in err, err
    assert f"This process imported {imported}" in err, err
    if _installed_by_pip():
        assert "it belongs to mori-ep " in err, err
    else:
        assert "no installed distribution lists it" in err, err
    assert "pip uninstall amd-mori" in err and "pip uninstall mori-ep" in err, err


def test_names_the_owners_of_the_imported_file(run_python, tmp_path):
    # Both records list the imported __init__.py (absolute RECORD paths): one install overwrote the
    # other's files, and the warning says so.
    init = os.path.join(MORI_PYTHON_PATH, "mori", "__init__.py")
    _fake_dist(str(tmp_path), "amd-mori", "9.8.7", [init])
    ours = _fake_dist(str(tmp_path), "mori-ep", "0.0.1", [init])
    imported, err = _run(run_python, str(tmp_path))
    assert os.path.realpath(imported) == os.path.realpath(init)
    assert f"mori-ep 0.0.1 ({ours})" in err, err
    assert "the later install overwrote the other's files" in err, err


def test_distribution_name_matches_pyproject():
    from conftest import REPO_ROOT

    with open(os.path.join(REPO_ROOT, "pyproject.toml")) as f:
        toml = f.read()
    project = toml[toml.index("[project]"):]
    assert f'\nname = "{mori._dist.DIST_NAME}"\n' in project.split("\n[", 1)[0], "pyproject.toml [project] name"
