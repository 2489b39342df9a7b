"""Helpers shared by the modules of mori.ops: the native bindings, the usage error, torch on
first use and the dtype codes. Imports nothing of mori.ops, so every module of the package may
import it."""

from .. import _C


def _native():
    ops = getattr(_C, "ops", None)
    if ops is None:
        raise ImportError(
            "mori._C has no 'ops' submodule: this build of mori lacks the dispatch/combine bindings "
            "(src/pybind/ops_bindings.cpp, RegisterOpsBindings)"
        )
    return ops


def _usage(msg):
    return _C.InvalidUsageError(msg)


def _check_rdma_block_num(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise _usage(f"rdma_block_num must be an int >= -1, got {value!r}")


def _torch():
    import torch

    return torch


_DTYPE_CODES = None


def _dtype_codes(torch):
    """torch dtype -> the native element-type code, from the binding's table (keyed by torch's
    dtype names), so the codes have one source."""
    global _DTYPE_CODES
    if _DTYPE_CODES is None:
        _DTYPE_CODES = {getattr(torch, n): c for n, c in _native().DTYPE_CODES.items() if hasattr(torch, n)}
    return _DTYPE_CODES
