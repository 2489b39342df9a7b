"""C++ errors arrive as the matching mori exception class, message (file:line) intact."""

import builtins
import re

import pytest

import mori
from mori import _C

KINDS = {
    "invalid_usage": mori.InvalidUsageError,
    "timeout": mori.TimeoutError,
    "system": mori.SystemError,
    "gpu_runtime": mori.GpuRuntimeError,
    "remote": mori.RemoteError,
    "internal": mori.InternalError,
}


def test_hierarchy():
    assert issubclass(mori.MoriError, RuntimeError)
    for cls in KINDS.values():
        assert issubclass(cls, mori.MoriError)
    assert issubclass(mori.InvalidUsageError, ValueError)
    assert issubclass(mori.TimeoutError, builtins.TimeoutError)
    assert issubclass(mori.SystemError, OSError)
    assert not issubclass(mori.SystemError, builtins.SystemError)
    assert mori.TimeoutError is not builtins.TimeoutError
    for cls in (mori.MoriError, *KINDS.values()):
        assert cls.__module__ == "mori"


def test_star_import_keeps_the_builtins():
    # `from mori import *` must not rebind TimeoutError / SystemError to mori's classes, which
    # stay reachable as attributes; every other name of __all__ resolves.
    ns = {}
    exec("from mori import *", ns)
    assert "TimeoutError" not in ns and "SystemError" not in ns
    exec("t, s = TimeoutError, SystemError", ns)
    assert ns["t"] is builtins.TimeoutError and ns["s"] is builtins.SystemError
    assert ns["MoriError"] is mori.MoriError and ns["RemoteError"] is mori.RemoteError
    assert not {"TimeoutError", "SystemError"} & set(mori.__all__)
    for name in mori.__all__:
        assert getattr(mori, name) is not None, name
    assert mori.TimeoutError.__name__ == "TimeoutError" and mori.SystemError.__name__ == "SystemError"


def test_package_is_typed():
    # PEP 561 marker, mirrored into the build tree and packed into the wheel with the sources.
    import os

    assert os.path.isfile(os.path.join(os.path.dirname(mori.__file__), "py.typed"))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_translation_keeps_message(kind):
    with pytest.raises(KINDS[kind]) as info:
        _C._raise_for_test(kind, f"boom {kind}")
    e = info.value
    assert type(e) is KINDS[kind]
    assert e.kind == kind
    assert e.file == "pybind_errors.cpp"
    assert isinstance(e.line, int) and e.line > 0
    assert e.detail == f"boom {kind}"
    assert re.match(rf"pybind_errors\.cpp:{e.line}: .+: boom {kind}$", str(e)), str(e)


def test_builtin_except_clauses_catch_mori_errors():
    with pytest.raises(ValueError):
        _C._raise_for_test("invalid_usage", "x")
    with pytest.raises(builtins.TimeoutError):
        _C._raise_for_test("timeout", "x")
    with pytest.raises(RuntimeError):
        _C._raise_for_test("remote", "x")


def test_python_raised_instances_have_fields():
    e = mori.InvalidUsageError("from python")
    assert e.kind == "invalid_usage" and e.file is None and e.line is None
    assert str(e) == "from python"


@pytest.mark.parametrize(
    "call",
    [
        lambda: mori.shmem.shmem_malloc(1024),
        lambda: mori.shmem.shmem_mype(),
        lambda: mori.shmem.shmem_npes(),
        lambda: mori.shmem.shmem_free(4096),
        lambda: mori.shmem.shmem_barrier_all(),
        lambda: mori.shmem.shmem_ptr_p2p(0, 0, 0),
        lambda: mori.shmem.shmem_heap_free_bytes(),
    ],
    ids=["malloc", "mype", "npes", "free", "barrier_all", "ptr_p2p", "heap_free_bytes"],
)
def test_shmem_before_init_is_invalid_usage(call):
    assert not mori.shmem.shmem_is_initialized()
    with pytest.raises(mori.InvalidUsageError) as info:
        call()
    msg = str(info.value)
    assert "not initialised" in msg, msg
    assert re.match(r"[\w.]+\.(cpp|hpp):\d+: ", msg), f"file:line prefix lost: {msg}"
    assert info.value.file and info.value.line


def test_bad_init_arguments():
    with pytest.raises(mori.InvalidUsageError, match="unknown flags"):
        mori.shmem.shmem_init_attr(7, 0, 1, b"\0" * 128)
    with pytest.raises(mori.InvalidUsageError, match="128 bytes"):
        mori.shmem.shmem_init_attr(mori.shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1, b"short")
    with pytest.raises(mori.InvalidUsageError, match="needs unique_id"):
        mori.shmem.shmem_init_attr(mori.shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, 0, 1)
    with pytest.raises(mori.InvalidUsageError):
        mori.shmem.shmem_barrier_on_stream("not a stream")


# Device error records (filled as a kernel fills them, raised as shmem_check_device_error raises
# them): the kind picks the class; a record that is not a wait never reads "waited".
@pytest.mark.parametrize(
    "kind,cmp,cls",
    [
        ("timeout", ">=", mori.TimeoutError),
        ("usage", ">=", mori.InvalidUsageError),
        ("usage", "detail", mori.InvalidUsageError),
        ("remote", "rdma_cqe", mori.RemoteError),
        ("none", "==", mori.InternalError),
    ],
)
def test_device_error_record_kind_picks_class(kind, cmp, cls):
    with pytest.raises(mori.MoriError) as info:
        _C._raise_device_error_for_test(kind, cmp, "EP combine: input has fewer rows than dispatch received",
                                        peer=-1, expected=141, seen=100, elapsed_ns=2_000_000)
    assert type(info.value) is cls, f"{kind}/{cmp}: {type(info.value).__name__}: {info.value}"
    assert ("waited" in str(info.value)) == (kind == "timeout"), str(info.value)
    assert "rank 3 (block 5, thread 7)" in str(info.value)


def test_device_usage_error_names_values_and_address():
    with pytest.raises(mori.InvalidUsageError) as info:
        _C._raise_device_error_for_test("usage", "==", "EP combine: PEs called combine with different dtype/hidden",
                                        peer=1, addr=0x7F0012345678, expected=5, seen=9)
    msg = str(info.value)
    assert "(peer 1): found 9, required == 5 (8-byte word at 0x7f0012345678)" in msg, msg
    assert isinstance(info.value, ValueError)
