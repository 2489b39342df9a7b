"""mori: GPU communication for MoE expert parallelism.

``import mori`` loads the native module ``mori._C`` (which links libmori, never libtorch) and
nothing else: torch is imported only by the helpers that need it, on first use.

Submodules (imported on first attribute access):
  mori.shmem  symmetric memory: init (unique id, MPI, torch process group), malloc, barriers
  mori.ops    expert-parallel dispatch/combine (EpDispatchCombineConfig, EpDispatchCombineOp)
  mori.info   the ``mori-info`` report
  mori.compat DeepEP-compatible Buffer (mori.compat.deep_ep), see docs/compat.md

Errors raised by the library are ``mori.MoriError`` subclasses (see ``help(mori.MoriError)``):
InvalidUsageError (also a ValueError), TimeoutError (also the builtin TimeoutError), SystemError
(an OSError, not the builtin SystemError), GpuRuntimeError, RemoteError, InternalError. Each
carries ``kind``, ``file``, ``line`` and ``detail``; ``str(e)`` is "file:line: kind: detail".
``from mori import *`` leaves TimeoutError and SystemError out, so that it does not shadow the
builtins of those names: write ``mori.TimeoutError`` and ``mori.SystemError``.
"""

import importlib as _importlib
import warnings as _warnings

from . import _dist

# ROCm's amd-mori installs a package of the same name: say which one this is (mori/_dist.py).
_collision = _dist.collision_message(__file__)
if _collision is not None:
    _warnings.warn(_collision, RuntimeWarning, stacklevel=2)

try:
    from . import _C
except ImportError as _e:  # pragma: no cover - exercised only on broken setups
    raise ImportError(
        f"mori: cannot load the native module mori._C from {__path__[0]!r} ({_e}). Install with "
        "`pip install --no-build-isolation .`, or build with CMake and put <build>/python on "
        "PYTHONPATH (the source tree's python/ has no native module)."
        + (f" {_collision}" if _collision else "")
    ) from _e

from ._C import (  # noqa: F401  (re-exported)
    GpuRuntimeError,
    InternalError,
    InvalidUsageError,
    MoriError,
    RemoteError,
    SystemError,
    TimeoutError,
    backend,
    device_info,
    env_entries,
    rdma_devices,
)

__version__ = _C.version()

_SUBMODULES = ("shmem", "ops", "info", "compat")

# Not TimeoutError and SystemError: a star import would shadow the builtins of those names.
__all__ = [
    "__version__",
    "MoriError",
    "InvalidUsageError",
    "GpuRuntimeError",
    "RemoteError",
    "InternalError",
    "backend",
    "device_info",
    "env_entries",
    "rdma_devices",
    *_SUBMODULES,
]


def __getattr__(name):
    if name in _SUBMODULES:
        module = _importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'mori' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
