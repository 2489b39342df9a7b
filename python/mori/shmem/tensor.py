"""Torch views of device memory the library owns (symmetric allocations and their P2P mappings).
torch is imported on first call, never at import."""

import math

from .. import _C


def tensor_from_ptr(ptr, shape, dtype, device=None):
    """A torch tensor viewing `prod(shape)` elements of `dtype` at device address `ptr`.

    No copy and no ownership: the memory stays the library's, so the tensor must not outlive
    shmem_free (or shmem_finalize). `device` (index, torch.device or None = current device) is
    the GPU the tensor is placed on; it is stated rather than derived from the pointer so that a
    peer's buffer mapped into this process (shmem_ptr_p2p) is used as memory of this GPU, which
    is how this process reaches it.
    """
    import torch
    import torch.utils.dlpack

    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
    else:
        index = int(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    raw = torch.utils.dlpack.from_dlpack(_C._dlpack_bytes(int(ptr), nbytes, index))
    if dtype != torch.uint8:
        raw = raw.view(dtype)
    return raw.view(shape)
