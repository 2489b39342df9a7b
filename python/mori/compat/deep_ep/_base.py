"""What every module of mori.compat.deep_ep shares: limits, the usage error, argument checks and
the lazy imports of torch and mori.ops. The other modules call _torch() and _ops() through this
module (`_base._torch()`), so that a test replaces them for the whole package in one place."""

from ... import _C

_DEFAULT_NUM_SMS = 20
_QUANT_GROUP = 128
_MAX_TOKENS_PER_RANK = 65536
_MAX_WORLD = 32
_DUMMY_HIDDEN = 8  # bf16 elements of the routing-only dispatches (16-byte rows, the minimum)
_NOMINAL_TOPK = 8  # top-k the size hints assume (DeepEP's hints do not take one)
_NOMINAL_TOKENS_PER_RANK = 4096  # Config's default capacity for the normal-mode size hints
_NOTIFY_ROW_WORDS = 4  # int32 words of 16 bytes, the unit of the notify op's rows


def _usage(msg):
    return _C.InvalidUsageError(msg)


def _torch():
    import torch

    return torch


def _ops():
    from ... import ops

    return ops


def _check_int(what, value, lo=None, hi=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise _usage(f"{what} must be an int, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _usage(f"{what} must be {bounds}, got {value}")
    return value


def _refuse_if(cond, msg):
    if cond:
        raise _usage(msg)


def _int_types(torch):
    return (torch.int32, torch.int64)
