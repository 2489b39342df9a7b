"""mori.compat: other libraries' Python APIs on top of mori's ops.

  mori.compat.deep_ep   DeepEP's ``Buffer`` (normal and low-latency modes) over EpDispatchCombineOp

Engines written against such an API switch to mori with one import, e.g.
``from mori.compat import deep_ep`` in place of ``import deep_ep``. See docs/compat.md.
"""

import importlib as _importlib

_SUBMODULES = ("deep_ep",)
__all__ = list(_SUBMODULES)


def __getattr__(name):
    if name in _SUBMODULES:
        module = _importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'mori.compat' has no attribute {name!r}")
