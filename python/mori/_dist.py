"""The import name ``mori`` is shared by two unrelated distributions.

This project is distributed as ``mori-ep``; ROCm's ``amd-mori`` installs a top-level package
``mori`` as well. Where both are installed, one shadows the other on sys.path or, in the same
site-packages, overwrites the other's files. ``import mori`` calls :func:`collision_message`
and warns with its text.

The check must stay cheap: it lists each sys.path directory once, looking for the metadata
directory of ``amd-mori``, and imports importlib.metadata (about a tenth of a second) only when
one is found.
"""

import os
import sys

DIST_NAME = "mori-ep"
OTHER_DIST_NAME = "amd-mori"


def _metadata_dirs(dist_name):
    """Metadata directories (*.dist-info, *.egg-info) of `dist_name` in the sys.path directories."""
    prefixes = tuple(dist_name.lower().replace("-", sep) + "-" for sep in "-_.")
    found = []
    for entry in sys.path:
        entry = entry or os.curdir
        try:
            with os.scandir(entry) as it:
                names = [e.name for e in it]
        except OSError:  # not a directory (a zip), gone, unreadable
            continue
        for name in names:
            low = name.lower()
            if low.startswith(prefixes) and low.endswith((".dist-info", ".egg-info")):
                found.append(os.path.join(entry, name))
    return found


def _claims(dist, path):
    """Whether `dist`'s record (RECORD / installed-files.txt) lists the file `path`."""
    try:
        files = dist.files or []
    except Exception:  # an unreadable record claims nothing
        return False
    target = os.path.realpath(path)
    return any(os.path.realpath(str(dist.locate_file(f))) == target for f in files if f.name == "__init__.py")


def collision_message(package_init):
    """None where `amd-mori` is not installed; otherwise what collides with what: the file
    `package_init` (this package's __init__.py) that was imported, the distributions whose
    records list it, and where `amd-mori` is installed."""
    others = _metadata_dirs(OTHER_DIST_NAME)
    if not others:
        return None
    import pathlib
    from importlib import metadata

    dists = [(d, metadata.PathDistribution(pathlib.Path(d))) for d in others]
    dists += [(d, metadata.PathDistribution(pathlib.Path(d))) for d in _metadata_dirs(DIST_NAME)]

    def describe(where, dist):
        try:
            return f"{dist.metadata['Name']} {dist.version} ({where})"
        except Exception:  # no readable METADATA: the directory still names it
            return where

    owners = [describe(w, d) for w, d in dists if _claims(d, package_init)]
    if not owners:
        owner = "no installed distribution lists it (a build tree or a PYTHONPATH entry)"
    elif len(owners) == 1:
        owner = f"it belongs to {owners[0]}"
    else:
        owner = f"the records of {' and '.join(owners)} all list it: the later install overwrote the other's files"
    installed = "; ".join(describe(w, d) for w, d in dists[: len(others)])
    return (
        f"mori: ROCm's distribution {OTHER_DIST_NAME} is installed here ({installed}). It is a "
        f"different project that also provides the top-level package `mori`, as this project "
        f"({DIST_NAME}) does; only one of them can be imported. This process imported "
        f"{package_init}: {owner}. Use separate environments, or uninstall one "
        f"(pip uninstall {OTHER_DIST_NAME} / pip uninstall {DIST_NAME}) and reinstall the other."
    )
