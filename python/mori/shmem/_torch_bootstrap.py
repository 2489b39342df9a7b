"""shmem init over a torch.distributed process group: the library's bootstrap collectives
(allgather, all-to-all, barrier of small byte buffers) are run with the group's own collectives.
Imported only by shmem_torch_process_group_init, so `import mori` never imports torch."""

import torch
import torch.distributed as dist

from .. import _C

_DEFAULT_NAMES = ("", "default")


def _registered_group(name):
    """The group registered under `name` with c10d (_register_process_group) or named so by
    torch (ProcessGroup.group_name); None if there is none."""
    if not name:
        return None
    try:
        from torch._C._distributed_c10d import _resolve_process_group
    except ImportError:
        _resolve_process_group = None
    if _resolve_process_group is not None:
        try:
            return _resolve_process_group(name)
        except (RuntimeError, ValueError, KeyError):
            pass
    for pg, pg_name in group_names().items():
        if pg_name == name:
            return pg
    return None


def group_names():
    """{ProcessGroup: name} of the groups torch.distributed created (layout differs by version)."""
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if names is None:
        names = getattr(c10d, "_pg_names", {})  # torch < 2.1
    return dict(names)


def resolve_group(group):
    """A ProcessGroup from a ProcessGroup, a registered name, or "default"/"" (WORLD)."""
    if not dist.is_available() or not dist.is_initialized():
        raise _C.InvalidUsageError(
            "shmem_torch_process_group_init: torch.distributed is not initialised "
            "(call torch.distributed.init_process_group first)"
        )
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, str):
        return group
    pg = _registered_group(group)
    if pg is not None:
        return pg
    if group in _DEFAULT_NAMES:
        return dist.group.WORLD
    raise _C.InvalidUsageError(
        f"shmem_torch_process_group_init: no torch process group named {group!r} (register one "
        "with torch._C._distributed_c10d._register_process_group(name, group), pass the "
        "ProcessGroup itself, or use 'default')"
    )


def _to_bytes(t):
    t = t.cpu()
    try:
        return t.numpy().tobytes()
    except (RuntimeError, ImportError):  # torch without numpy
        return bytes(t.tolist())


class TorchBootstrapCallbacks:
    """allgather/alltoall/barrier for _C._init_with_callbacks over one process group."""

    def __init__(self, group):
        self.group = group
        try:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        except (RuntimeError, ValueError):  # a c10d group torch.distributed did not create
            self.rank = group.rank()
            self.world_size = group.size()
        backend = str(dist.get_backend(group)).lower()
        # A group with a CPU backend (gloo, or "cpu:gloo,cuda:nccl") exchanges CPU tensors; an
        # NCCL-only group needs them on the current GPU.
        self.on_gpu = "nccl" in backend and "gloo" not in backend and "cpu" not in backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        self.use_all_to_all = "nccl" in backend or "gloo" in backend

    def _tensor(self, data):
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def allgather(self, send):
        n = len(send)
        if n == 0:
            return b""
        parts = [torch.empty(n, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(parts, self._tensor(send), group=self.group)
        return _to_bytes(torch.cat(parts))

    def alltoall(self, send, bytes_per_peer):
        if bytes_per_peer == 0:
            return b""
        out = torch.empty(len(send), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(out, self._tensor(send), group=self.group)
        return _to_bytes(out)

    def barrier(self):
        if self.on_gpu:
            dist.barrier(group=self.group, device_ids=[self.device.index])
        else:
            dist.barrier(group=self.group)


def init_from_process_group(group):
    pg = resolve_group(group)
    cb = TorchBootstrapCallbacks(pg)
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    # Backends without all-to-all get the library's emulation over allgather.
    alltoall = cb.alltoall if cb.use_all_to_all else None
    _C._init_with_callbacks(cb.rank, cb.world_size, cb.allgather, alltoall, cb.barrier, device)
