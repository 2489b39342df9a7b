"""EpDispatchCombineOp: MORI's Python API over the torch-free native handle (mori._C.ops).

Every argument is checked here, before anything is launched, and a bad one raises
mori.InvalidUsageError (a ValueError); the op stays usable. Returned tensors are views of the
op's buffers: valid until the next call of the same kind (pass copy=True for private copies).
Creating and closing an op are collective (every rank, same config, same order); see docs/ep.md.
"""

import dataclasses
import enum

from .. import _C
from ._common import _check_rdma_block_num, _dtype_codes, _native, _torch, _usage
from .expert_major import ExpertMajorMixin


def _enum_from_binding(name, members):
    """An IntEnum with the binding's names and values (one source: the C++ enum)."""
    return enum.IntEnum(name, [(n, int(v)) for n, v in members], module=__name__)


# MORI's kernel types, names and numbers from the C++ enum (IntraNode 0, InterNode 1, InterNodeV1
# 2, InterNodeV1LL 3, AsyncLL 4, IntraNodeLL 5). Every member exists so that engines written
# against ROCm/mori resolve the names; a type this build has no kernels for (IntraNodeLL) is
# refused when a config is validated (an op created), naming the built ones (KERNEL_TYPE_BUILT).
# AsyncLL runs as IntraNode or InterNode (EpDispatchCombineConfig.runs_as).
EpDispatchCombineKernelType = _enum_from_binding(
    "EpDispatchCombineKernelType",
    _native().EpDispatchCombineKernelType.__members__.items(),
)
KERNEL_TYPE_BUILT = dict(_native().KERNEL_TYPE_BUILT)

# MORI's combine quant types by their config strings (quant_type="none", "fp8_direct_cast"); the
# enum spells "none" as None_ (as ROCm/mori does: None is a Python keyword).
_QUANT_TYPE_CODES = dict(_native().QUANT_TYPE_CODES)
EpDispatchCombineQuantType = _enum_from_binding(
    "EpDispatchCombineQuantType",
    (("None_" if n == "none" else "".join(w.capitalize() for w in n.split("_")), c)
     for n, c in sorted(_QUANT_TYPE_CODES.items(), key=lambda kv: kv[1])),
)


def _quant_type_code(value):
    """The native code of a quant_type given as MORI's string, an EpDispatchCombineQuantType or
    its int value; anything else raises InvalidUsageError listing the known strings."""
    known = sorted(_QUANT_TYPE_CODES, key=_QUANT_TYPE_CODES.get)
    if isinstance(value, EpDispatchCombineQuantType):
        return int(value)
    if isinstance(value, str):
        code = _QUANT_TYPE_CODES.get(value.strip().lower())
        if code is not None:
            return code
    elif isinstance(value, int) and not isinstance(value, bool) and value in _QUANT_TYPE_CODES.values():
        return int(value)
    raise _usage(
        f"EpDispatchCombineConfig.quant_type {value!r} is not a quant type of this build; known: "
        f"{', '.join(repr(k) for k in known)} (ROCm/mori's 'fp8_blockwise' and 'fp4_blockwise' "
        "combines are not provided)"
    )


# Fields without a default in ROCm/mori's dataclass. They carry a None default here only so that
# data_type (optional for existing callers) can come first as in ROCm/mori;
# __post_init__ raises for any of them left out, as a dataclass without defaults would.
_REQUIRED_FIELDS = (
    "rank",
    "world_size",
    "hidden_dim",
    "scale_dim",
    "scale_type_size",
    "max_token_type_size",
    "max_num_inp_token_per_rank",
    "num_experts_per_rank",
    "num_experts_per_token",
)


@dataclasses.dataclass
class EpDispatchCombineConfig:
    """MORI's fields in ROCm/mori's order, so positional construction means the same in both:
    EpDispatchCombineConfig(data_type, rank, world_size, hidden_dim, scale_dim, scale_type_size,
    max_token_type_size, max_num_inp_token_per_rank, num_experts_per_rank, num_experts_per_token,
    warp_num_per_block, block_num, max_total_recv_tokens, use_external_inp_buf, kernel_type,
    gpu_per_node, rdma_block_num, num_qp_per_pe, quant_type).

    `hidden_dim` and `max_token_type_size` size the buffers (a call may use a smaller hidden size
    or element type); `max_num_inp_token_per_rank` bounds the tokens of one call;
    `max_total_recv_tokens` (0: no cap) caps the rows one rank receives per dispatch. `data_type`
    is accepted for MORI compatibility and ignored (the dtype comes from the tensors).
    `kernel_type`: an EpDispatchCombineKernelType, its name or value; AsyncLL (the type for the
    split phase, any max_num_inp_token_per_rank) runs as IntraNode when
    gpu_per_node >= world_size and as InterNode otherwise (`runs_as`). `quant_type`: "none" (combine
    rows travel in the input dtype) or "fp8_direct_cast" (each row travels as saturating e4m3
    codes, the token's rank sums the decoded values in fp32 and rounds once to the input dtype;
    hidden_dim a multiple of 16; every rank must agree; docs/ep.md). `num_qp_per_pe` (0: the default, 1) is range-checked; InterNode posts on one QP per peer in this build and warns
    when it is above 1 (docs/ep.md).
    `rdma_block_num` is range-checked; InterNode has no separate RDMA blocks (each block posts
    its own destination's writes), so it has no effect in this build. `data_type` (optional) is
    the token dtype: its element size must fit max_token_type_size; each call's dtype is its
    input tensor's."""

    data_type: object = None
    rank: int = None
    world_size: int = None
    hidden_dim: int = None
    scale_dim: int = None
    scale_type_size: int = None
    max_token_type_size: int = None
    max_num_inp_token_per_rank: int = None
    num_experts_per_rank: int = None
    num_experts_per_token: int = None
    warp_num_per_block: int = 8
    block_num: int = 80
    max_total_recv_tokens: int = 0
    use_external_inp_buf: bool = True
    kernel_type: EpDispatchCombineKernelType = EpDispatchCombineKernelType.IntraNode
    gpu_per_node: int = 8
    rdma_block_num: int = 0
    num_qp_per_pe: int = 1
    quant_type: str = "none"

    def __post_init__(self):
        missing = [n for n in _REQUIRED_FIELDS if getattr(self, n) is None]
        if missing:
            raise TypeError(
                f"EpDispatchCombineConfig() missing required argument(s): {', '.join(missing)}"
            )

    def to_native(self):
        def as_int(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                if name == "kernel_type" and isinstance(v, enum.Enum):
                    return int(v.value)
                try:
                    import numbers

                    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
                        return int(v)
                except ImportError:  # pragma: no cover
                    pass
                raise _usage(f"EpDispatchCombineConfig.{name} must be an int, got {v!r}")
            return int(v)

        dt = self.data_type
        if dt is not None:  # the token dtype: its elements must fit the buffers' row size
            size = getattr(dt, "itemsize", None)
            if isinstance(size, bool) or not isinstance(size, int):
                raise _usage(f"EpDispatchCombineConfig.data_type must be a torch dtype or None, got {dt!r}")
            mtts = as_int("max_token_type_size")
            if size > mtts:
                raise _usage(
                    f"EpDispatchCombineConfig.data_type {dt} has {size}-byte elements but "
                    f"max_token_type_size is {mtts}"
                )
        kt = self.kernel_type
        if isinstance(kt, str):
            try:
                kt = EpDispatchCombineKernelType[kt]
            except KeyError:
                raise _usage(f"EpDispatchCombineConfig.kernel_type {kt!r} is not a kernel type") from None
        kernel_type = int(kt.value) if isinstance(kt, enum.Enum) else as_int("kernel_type")
        return _native().EpDispatchCombineConfig(
            rank=as_int("rank"),
            world_size=as_int("world_size"),
            hidden_dim=as_int("hidden_dim"),
            scale_dim=as_int("scale_dim"),
            scale_type_size=as_int("scale_type_size"),
            max_token_type_size=as_int("max_token_type_size"),
            max_num_inp_token_per_rank=as_int("max_num_inp_token_per_rank"),
            num_experts_per_rank=as_int("num_experts_per_rank"),
            num_experts_per_token=as_int("num_experts_per_token"),
            warp_num_per_block=as_int("warp_num_per_block"),
            block_num=as_int("block_num"),
            use_external_inp_buf=bool(self.use_external_inp_buf),
            kernel_type=kernel_type,
            gpu_per_node=as_int("gpu_per_node"),
            rdma_block_num=as_int("rdma_block_num"),
            num_qp_per_pe=as_int("num_qp_per_pe") or 1,  # 0 (ROCm/mori's one-node examples): the default
            max_total_recv_tokens=as_int("max_total_recv_tokens"),
            quant_type=_quant_type_code(self.quant_type),
        )

    def validate(self):
        """Raise mori.InvalidUsageError naming the first bad field."""
        self.to_native().validate()

    @property
    def num_experts(self):
        return self.world_size * self.num_experts_per_rank

    @property
    def runs_as(self):
        """The kernel type whose kernels and buffers this config gets: AsyncLL runs as IntraNode
        when all ranks are one node (gpu_per_node >= world_size) and as InterNode otherwise; every
        other type runs as itself. `kernel_type` stays what was given."""
        return EpDispatchCombineKernelType(self.to_native().runs_as)

    @property
    def max_num_recv_tokens(self):
        """Receive capacity in rows (world_size * max_num_inp_token_per_rank, or
        max_total_recv_tokens when set and smaller)."""
        return self.to_native().max_num_recv_tokens()


def ep_symmetric_bytes(config):
    """Bytes of symmetric heap (MORI_SHMEM_HEAP_SIZE) an op for `config` allocates per rank."""
    return _native().ep_symmetric_bytes(config.to_native())


def ep_local_bytes(config):
    """Bytes of ordinary device memory an op for `config` allocates per rank."""
    return _native().ep_local_bytes(config.to_native())


def ep_layout(config):
    """Offsets of every buffer (see docs/ep.md)."""
    return _native().ep_layout(config.to_native())


# --- torch helpers ------------------------------------------------------------------------------
def _default_fp8_dtype(torch, device_index):
    """The e4m3 flavour of the GPU's FP8 hardware and frameworks: float8_e4m3fnuz on AMD gfx94x
    (MI300), float8_e4m3fn elsewhere (NVIDIA, and AMD's OCP-FP8 GPUs)."""
    if getattr(torch.version, "hip", None) and hasattr(torch, "float8_e4m3fnuz"):
        arch = getattr(torch.cuda.get_device_properties(device_index), "gcnArchName", "")
        if "gfx94" in arch:
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _dispatch_quant(use_fp8, round_scale, use_ue8m0):
    """The native EpDispatchQuant code of dispatch's quantisation keywords (DeepEP's meaning)."""
    codes = _native().DISPATCH_QUANT_CODES
    if not use_fp8:
        if round_scale or use_ue8m0:
            raise _usage("dispatch: round_scale and use_ue8m0 need use_fp8=True")
        return codes["none"]
    if use_ue8m0:
        return codes["fp8 (use_ue8m0)"]  # UE8M0 scales are powers of two: round_scale implied
    return codes["fp8 (round_scale)"] if round_scale else codes["fp8"]


_FP8_DTYPE_NAMES = ("float8_e4m3fn", "float8_e4m3fnuz")


def _index_code(torch, dtype):
    return _native().INDEX_TYPE_CODES[str(dtype).replace("torch.", "")]


def _tensor_from_ptr(ptr, shape, dtype, device_index):
    from ..shmem import tensor_from_ptr

    return tensor_from_ptr(ptr, shape, dtype, device_index)


class EpDispatchCombineOp(ExpertMajorMixin):
    """One expert-parallel group (collective: create it on every rank, after shmem init).

    dispatch(input, weights, scales, indices) sends each token once to every distinct rank that
    owns one of its top-k experts and returns, on each rank, the received rows (ordered by source
    rank, then source token): (out_tokens, out_weights, out_scales, out_indices, total_recv).
    combine(input, weights, indices) sums, for each token of the last dispatch, the rows its
    destination ranks return (rows in dispatch-output order) in fp32, ascending rank order
    (bitwise reproducible), and returns (out_tokens [num_tokens, hidden], out_weights).
    The expert-major layout (convert_dispatch_output, dispatch_standard_moe,
    convert_combine_input, combine_standard_moe) comes from ExpertMajorMixin (expert_major.py).
    """

    _pending_combine = None  # per object once set (class defaults for objects built without __init__)
    _pending_dispatch = None
    # dispatch, dispatch_recv, combine and combine_recv raise, after they launched, an agreed
    # input-error report that was here before they launched (_input_error_pending);
    # mori.compat.deep_ep turns this off for its ops and does the same around its own calls, which
    # make several op calls each.
    _input_errors_after_calls = True

    def __init__(self, config, check_inputs=True):
        """Collective: every rank creates the op with the same config. The native handle checks
        the config (and every rank's config against rank 0's) before allocating, so a bad or
        mismatched config raises mori.InvalidUsageError on every rank.
        check_inputs: the dispatch kernel checks every expert id against [-1, num_experts)
        (on the device: no synchronisation, also in CUDA graphs). An id outside is treated as -1
        on every rank, and every rank learns of it in the same dispatch (the rank's first
        offender travels with its counts): every rank raises the same mori.InvalidUsageError,
        naming the rank, token, top-k slot and id, once, at its next check: check_device_error()
        (after synchronising with that dispatch), or the end of a dispatch, dispatch_recv, combine
        or combine_recv that began after the report arrived; those calls launch first (no rank
        skips a call its peers wait for). The op stays usable."""
        torch = _torch()
        if not isinstance(config, EpDispatchCombineConfig):
            raise _usage(f"EpDispatchCombineOp needs an EpDispatchCombineConfig, got {type(config).__name__}")
        native_cfg = config.to_native()
        self.config = config
        self.check_inputs = bool(check_inputs)
        self._handle = _native().EpDispatchCombineHandle(native_cfg)
        self._device_index = self._handle.device
        self.device = torch.device("cuda", self._device_index)
        self._K = config.num_experts_per_token
        self._M = config.max_num_inp_token_per_rank
        self._rmax = config.max_num_recv_tokens
        self._num_experts = config.num_experts
        self._views = {}
        self._last = None  # (num_tokens, dtype, hidden, index dtype, scales dtype, has weights)
        self._pending_combine = None  # (dtype, hidden, has weights, input, weights) of a combine_send
        self._pending_dispatch = None  # (output description, the send's tensors) of a dispatch_send
        self._last_dispatch_stream = None  # (handle, torch stream or None) of the last dispatch
        self._trace = None  # mori.ops.trace.OpTrace once enable_trace was called

    # --- lifecycle ------------------------------------------------------------------------------
    def close(self):
        """Collective (every rank closes its op, in the same order): waits for this GPU's work and
        for every rank's, then frees the buffers (peers' kernels use them until then). Dropping
        the last reference does the same, with failures logged instead of raised. Later calls
        raise. If a rank did not finish its work or never answered, the buffers are kept (freed
        at shmem finalize) and this raises."""
        handle, self._handle = self._handle, None
        self._views.clear()
        self._trace = None  # its buffer stays alive with the native handle until that is destroyed
        if handle is not None:
            handle.release()

    def _h(self):
        if self._handle is None:
            raise _usage("EpDispatchCombineOp: the op was closed")
        return self._handle

    @property
    def symmetric_bytes(self):
        return self._h().symmetric_bytes

    @property
    def local_bytes(self):
        return self._h().local_bytes

    @property
    def combine_fp8_dtype(self):
        """The torch dtype whose codes quant_type "fp8_direct_cast" combine rows travel as
        (float8_e4m3fnuz on AMD gfx94x, float8_e4m3fn elsewhere); None with quant_type "none"."""
        if _quant_type_code(self.config.quant_type) == 0:
            return None
        torch = _torch()
        return torch.float8_e4m3fnuz if self._h().combine_fp8_format == 1 else torch.float8_e4m3fn

    def resolve_launch(self, num_tokens, block_num=-1, warp_per_block=-1, for_dispatch=True):
        """(blocks, warps per block) a call would use."""
        return self._h().resolve_launch(int(num_tokens), int(block_num), int(warp_per_block), bool(for_dispatch))

    def get_launch_config(self, is_dispatch=True, block_num=-1, rdma_block_num=-1, warp_per_block=-1, *, num_tokens=None):
        """MORI's launch query: (block_num, rdma_block_num, warp_per_block) a dispatch
        (is_dispatch) or combine of `num_tokens` tokens (default max_num_inp_token_per_rank) would
        use with these arguments. rdma_block_num is returned as given, or the config's when < 1:
        this build's kernels do not use it."""
        _check_rdma_block_num(rdma_block_num)
        n = self.config.max_num_inp_token_per_rank if num_tokens is None else int(num_tokens)
        blocks, warps = self.resolve_launch(n, block_num, warp_per_block, bool(is_dispatch))
        rdma = int(rdma_block_num) if int(rdma_block_num) > 0 else int(self.config.rdma_block_num)
        return blocks, rdma, warps

    # --- sizes (MORI's names; from the config, no GPU involved) ---------------------------------
    def max_num_tokens_to_recv(self):
        """Rows of the dispatch outputs: every row one dispatch can deliver to this rank
        (world_size * max_num_inp_token_per_rank, or max_total_recv_tokens when set and smaller)."""
        return self.config.max_num_recv_tokens

    def max_num_tokens_to_recv_per_rank(self):
        """Most rows one source rank can deliver to this rank in one dispatch (a token reaches a
        rank at most once): max_num_inp_token_per_rank, or the receive cap when smaller."""
        return min(self.config.max_num_inp_token_per_rank, self.config.max_num_recv_tokens)

    def max_num_tokens_to_send(self):
        """Most rows this rank sends in one dispatch: each of its tokens to every rank at most once
        (world_size * max_num_inp_token_per_rank)."""
        return self.config.world_size * self.config.max_num_inp_token_per_rank

    def max_num_tokens_to_send_per_rank(self):
        """Most rows this rank sends to one rank in one dispatch: max_num_inp_token_per_rank."""
        return self.config.max_num_inp_token_per_rank

    # --- views ----------------------------------------------------------------------------------
    def _view(self, name, ptr_attr, shape, dtype):
        key = (name, shape, dtype)
        t = self._views.get(key)
        if t is None:
            ptr = getattr(self._h(), ptr_attr)
            t = _tensor_from_ptr(ptr, shape, dtype, self._device_index)
            self._views[key] = t
        return t

    def _total_recv_view(self):
        return self._view("total", "total_recv_token_num", (1,), _torch().int32)

    # --- checks ---------------------------------------------------------------------------------
    def _check_tensor(self, name, t, ndim):
        torch = _torch()
        if not isinstance(t, torch.Tensor):
            raise _usage(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda" or t.device.index != self._device_index:
            raise _usage(f"{name} is on {t.device}, but the op lives on cuda:{self._device_index}")
        if t.dim() != ndim:
            raise _usage(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise _usage(f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")

    def _stream(self, stream):
        """(raw handle, torch stream object or None) of the stream a call launches on."""
        torch = _torch()
        if stream is None:
            cur = torch.cuda.current_stream(self.device)
            return int(cur.cuda_stream), cur
        if isinstance(stream, int):
            return stream, None
        return int(stream.cuda_stream), stream

    def _follow_launch(self, launch):
        """Make torch's current stream wait for the work enqueued so far on the launch stream
        `launch` ((handle, stream or None) from _stream). Returns the launch stream object when it
        differs from the current stream (the caller then makes it wait for the current stream's
        reads of the op's buffers), else None."""
        torch = _torch()
        cur = torch.cuda.current_stream(self.device)
        if launch[0] == int(cur.cuda_stream):
            return None
        obj = self._launch_stream(launch)
        cur.wait_stream(obj)
        return obj

    def _launch_stream(self, launch):
        """The torch stream object of `launch` ((handle, stream or None) from _stream)."""
        torch = _torch()
        handle, obj = launch
        if obj is not None:
            return obj
        cur = torch.cuda.current_stream(self.device)
        if handle == int(cur.cuda_stream):
            return cur
        return torch.cuda.default_stream(self.device) if handle == 0 else torch.cuda.ExternalStream(handle, device=self.device)

    def _check_indices(self, indices, num_tokens, what):
        torch = _torch()
        self._check_tensor(f"{what}: indices", indices, 2)
        if indices.dtype not in (torch.int32, torch.int64):
            raise _usage(f"{what}: indices must be int32 or int64, got {indices.dtype}")
        if tuple(indices.shape) != (num_tokens, self._K):
            raise _usage(
                f"{what}: indices must have shape [{num_tokens}, {self._K}] (tokens, num_experts_per_token), "
                f"got {tuple(indices.shape)}"
            )

    def _check_combine_indices(self, indices, what):
        """combine's `indices` (never read: the op keeps the last dispatch's routing). Accepted:
        None; this rank's own [num_tokens, K] top-k ids of the last dispatch's input (checked as
        dispatch checks them); or exactly the indices tensor the last dispatch returned, ROCm/mori's
        usage (the [max_num_tokens_to_recv(), K] view of the op's buffer, recognised by its
        address, shape, dtype and device). Anything else raises InvalidUsageError naming both."""
        if indices is None:
            return
        torch = _torch()
        num_tokens, index_dtype = self._last[0], self._last[3]
        returned = (self._rmax, self._K)
        if (isinstance(indices, torch.Tensor) and indices.device == self.device and indices.dtype == index_dtype
                and tuple(indices.shape) == returned and indices.data_ptr() == self._h().dispatch_out_indices):
            return
        try:
            self._check_indices(indices, num_tokens, what)
        except _C.InvalidUsageError as e:
            got = (f"shape {tuple(indices.shape)}, {indices.dtype}" if isinstance(indices, torch.Tensor)
                   else type(indices).__name__)
            raise _usage(
                f"{what}: indices must be this rank's top-k ids of the last dispatch's input ([{num_tokens}, "
                f"{self._K}] int32/int64, contiguous, on {self.device}), the indices tensor that dispatch "
                f"returned ([{returned[0]}, {returned[1]}] {index_dtype}, the op's own buffer, not a copy), or "
                f"None; got {got} ({e})"
            ) from None

    # --- dispatch -------------------------------------------------------------------------------
    def dispatch(self, input, weights, scales, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                 call_local_expert_count=False, *, use_fp8=False, round_scale=False, use_ue8m0=False,
                 fp8_dtype=None, copy=False, stream=None):
        """Returns (out_tokens [R, hidden], out_weights [R, K] float32 or None, out_scales
        [R, scale_dim] or None, out_indices [R, K], total_recv_token_num [1] int32 on the GPU),
        R = max_num_tokens_to_recv(); rows [0, total_recv) are valid. The positional arguments
        are ROCm/mori's: block_num and warp_per_block (< 1: the config's or the small-batch
        default), rdma_block_num (>= -1; accepted for MORI compatibility and unused by this
        build's kernels), call_local_expert_count (accepted; every
        dispatch refreshes local_expert_count). Keyword-only: copy=True synchronises and returns
        private copies of the valid rows; stream= launches on that stream (default: torch's
        current stream).

        use_fp8=True (DeepEP's keywords): bfloat16 input, hidden a multiple of 128, scales None;
        the rows arrive as e4m3 codes (fp8_dtype: float8_e4m3fn, or float8_e4m3fnuz on gfx94x by
        default) with one scale per 128 elements, computed while the rows are sent (formula:
        docs/ep.md, "FP8 dispatch"): out_scales is [R, hidden / 128] float32, or with use_ue8m0
        [R, ceil(hidden / 512)] int32 words of 4 UE8M0 exponent bytes. round_scale rounds scales
        up to powers of two (implied by use_ue8m0). The config must reserve the scales:
        scale_type_size 4 and scale_dim >= the columns of out_scales."""
        prep = self._prepare_dispatch("dispatch", input, weights, scales, indices, rdma_block_num, use_fp8,
                                      round_scale, use_ue8m0, fp8_dtype)
        launch = self._stream(stream)
        report = self._input_error_pending(launch)
        self._h().dispatch(*prep[0][:8], int(block_num), int(warp_per_block), launch[0], *prep[0][8:])
        outs = self._dispatch_outputs(prep[1], launch, copy)
        self._raise_input_error("dispatch", report)
        return outs

    def dispatch_send(self, input, weights, scales, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                      call_local_expert_count=False, *, use_fp8=False, round_scale=False, use_ue8m0=False,
                      fp8_dtype=None, stream=None):
        """First half of a split-phase dispatch (ROCm/mori's name; arguments as dispatch()): this
        rank's counts and rows are posted to their destination ranks' staging and the call returns
        with no SM waiting for a peer; any GPU work may run before dispatch_recv(), which
        completes it. The op keeps input, weights, scales and indices alive until dispatch_recv;
        they must stay unchanged until then (the send kernel reads them). Needs kernel_type
        AsyncLL, or IntraNode or InterNode with max_num_inp_token_per_rank <= 256 (other ops raise
        mori.InvalidUsageError naming what works). Until dispatch_recv, dispatch, dispatch_send, combine, combine_send, the
        expert-major conversions and debug_fill_buffers raise. Every rank of a call uses the same
        form (split or fused). Returns None."""
        prep = self._prepare_dispatch("dispatch_send", input, weights, scales, indices, rdma_block_num, use_fp8,
                                      round_scale, use_ue8m0, fp8_dtype)
        launch = self._stream(stream)
        self._h().dispatch_send(*prep[0][:8], int(block_num), int(warp_per_block), launch[0], *prep[0][8:])
        # The send kernel reads them, possibly after work between the halves has started on
        # another stream: a temporary's memory must not be reused before the pair completes.
        self._pending_dispatch = (prep[1], (input, weights, scales, indices))

    def dispatch_recv(self, block_num=-1, warp_per_block=-1, call_local_expert_count=False, *, copy=False,
                      stream=None):
        """Second half of a split-phase dispatch: waits for every rank's rows and returns exactly
        what dispatch() would have returned for dispatch_send's arguments. block_num and
        warp_per_block (< 1: dispatch_send's) shape the receive kernel; call_local_expert_count
        is accepted (local_expert_count is always refreshed). stream: default torch's current
        stream; it waits for dispatch_send's stream."""
        pending = self._pending_dispatch
        if pending is None:
            raise _usage("dispatch_recv: no dispatch_send is pending")
        h = self._h()
        launch = self._stream(stream)
        report = self._input_error_pending(launch)
        self._pending_dispatch = None
        h.dispatch_recv(int(block_num), int(warp_per_block), launch[0])
        outs = self._dispatch_outputs(pending[0], launch, copy)
        self._raise_input_error("dispatch_recv", report)
        return outs

    @property
    def split_dispatch_available(self):
        """Whether dispatch_send/dispatch_recv work on this op (AsyncLL, or IntraNode/InterNode
        of <= 256 tokens per rank)."""
        return bool(self._h().split_dispatch_available)

    @property
    def split_combine_available(self):
        """Whether combine_send/combine_recv work on this op (the push combine)."""
        return bool(self._h().split_combine_available)

    @property
    def dispatch_pending(self):
        """A dispatch_send waits for its dispatch_recv."""
        return self._pending_dispatch is not None

    @property
    def combine_pending(self):
        """A combine_send waits for its combine_recv."""
        return self._pending_combine is not None

    def _refuse_while_pending(self, what):
        """The native handle refuses these too; raising here first names the Python call."""
        if self._pending_dispatch is not None:
            raise _usage(f"{what}: a dispatch_send is pending; call dispatch_recv first")
        if self._pending_combine is not None:
            raise _usage(f"{what}: a combine_send is pending; call combine_recv first")

    def _prepare_dispatch(self, what, input, weights, scales, indices, rdma_block_num, use_fp8, round_scale,
                          use_ue8m0, fp8_dtype):
        """The checks only tensors can answer. Returns (native arguments: the 8 before block_num and
        the 3 after stream, output description for _dispatch_outputs)."""
        _check_rdma_block_num(rdma_block_num)
        self._refuse_while_pending(what)
        torch = _torch()
        self._h()  # raises once the op is closed
        cfg = self.config
        self._check_tensor(f"{what}: input", input, 2)
        if scales is not None and cfg.scale_dim == 0 and isinstance(scales, torch.Tensor) and scales.numel() == 0:
            scales = None  # ROCm/mori's callers pass a [num_tokens, 0] tensor when the config has no scales
        quant = _dispatch_quant(use_fp8, round_scale, use_ue8m0)
        codes = _dtype_codes(torch)
        code = codes.get(input.dtype)
        out_dtype = input.dtype
        if quant:
            group = _native().QUANT_GROUP
            if input.dtype != torch.bfloat16:
                raise _usage(f"{what}(use_fp8=True) quantises bfloat16 input, got {input.dtype}")
            if scales is not None:
                raise _usage(f"{what}(use_fp8=True) computes the scales: pass scales=None")
            if int(input.shape[1]) % group != 0:
                raise _usage(
                    f"{what}(use_fp8=True) needs a hidden size that is a multiple of {group} (one scale "
                    f"per {group} elements), got {int(input.shape[1])}"
                )
            out_dtype = _default_fp8_dtype(torch, self._device_index) if fp8_dtype is None else fp8_dtype
            if out_dtype not in codes or torch.empty((), dtype=out_dtype).element_size() != 1:
                raise _usage(
                    f"{what}(use_fp8=True): fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, "
                    f"got {fp8_dtype!r}"
                )
        elif fp8_dtype is not None:
            raise _usage(f"{what}: fp8_dtype needs use_fp8=True")
        if code is None:
            raise _usage(
                f"{what}: input dtype {input.dtype} is not supported (bfloat16, float16, float32, "
                "float8_e4m3fn, float8_e4m3fnuz)"
            )
        # Sizes, counts and alignment are checked by the native handle (one place); here only what
        # a tensor alone carries: device, layout, dtype and the shapes of the tensors together.
        num_tokens, hidden = int(input.shape[0]), int(input.shape[1])
        self._check_indices(indices, num_tokens, what)
        if weights is not None:
            self._check_tensor(f"{what}: weights", weights, 2)
            if weights.dtype != torch.float32:
                raise _usage(f"{what}: weights must be float32, got {weights.dtype}")
            if tuple(weights.shape) != (num_tokens, self._K):
                raise _usage(f"{what}: weights must have shape [{num_tokens}, {self._K}], got {tuple(weights.shape)}")
        if scales is not None and cfg.scale_dim > 0:  # scale_dim 0: the native handle refuses scales
            self._check_tensor(f"{what}: scales", scales, 2)
            if tuple(scales.shape) != (num_tokens, cfg.scale_dim):
                raise _usage(f"{what}: scales must have shape [{num_tokens}, {cfg.scale_dim}], got {tuple(scales.shape)}")
            if scales.element_size() != cfg.scale_type_size:
                raise _usage(
                    f"{what}: scales have {scales.element_size()}-byte elements ({scales.dtype}) but "
                    f"scale_type_size is {cfg.scale_type_size}"
                )
        index_code = _index_code(torch, indices.dtype)
        native = (
            input.data_ptr() if num_tokens > 0 else 0,
            code,
            num_tokens,
            hidden,
            weights.data_ptr() if (weights is not None and num_tokens > 0) else 0,
            scales.data_ptr() if (scales is not None and num_tokens > 0) else 0,
            indices.data_ptr() if num_tokens > 0 else 0,
            index_code,
            quant,
            codes[out_dtype],
            self.check_inputs,
        )
        if quant:
            groups = hidden // _native().QUANT_GROUP
            scales_out = ((groups + 3) // 4, torch.int32) if use_ue8m0 else (groups, torch.float32)
        elif scales is not None:
            scales_out = (cfg.scale_dim, scales.dtype)
        else:
            scales_out = None
        return native, (num_tokens, out_dtype, hidden, indices.dtype, scales_out, weights is not None)

    def _dispatch_outputs(self, meta, launch, copy):
        """The outputs of a dispatch (or dispatch_recv) launched on `launch`, as dispatch() returns
        them; records the call for combine."""
        torch = _torch()
        num_tokens, out_dtype, hidden, index_dtype, scales_out, has_weights = meta
        self._last_dispatch_stream = launch
        out = self._view("dispatch_tokens", "dispatch_out_tokens", (self._rmax, hidden), out_dtype)
        out_w = self._view("dispatch_weights", "dispatch_out_weights", (self._rmax, self._K), torch.float32) if has_weights else None
        out_s = None
        if scales_out is not None:
            out_s = self._view("dispatch_scales", "dispatch_out_scales", (self._rmax, scales_out[0]), scales_out[1])
        self._last = (num_tokens, out_dtype, hidden, index_dtype, None if out_s is None else out_s.dtype, has_weights)
        out_i = self._view("dispatch_indices", "dispatch_out_indices", (self._rmax, self._K), index_dtype)
        total = self._total_recv_view()
        if copy:
            # The copies run on the current stream after the kernel (launched on `stream`), and
            # the launch stream's next call waits for them before overwriting the buffers.
            other = self._follow_launch(launch)
            n = int(total.item())
            outs = (
                out[:n].clone(),
                None if out_w is None else out_w[:n].clone(),
                None if out_s is None else out_s[:n].clone(),
                out_i[:n].clone(),
                total.clone(),
            )
            if other is not None:
                other.wait_stream(torch.cuda.current_stream(self.device))
            return outs
        return out, out_w, out_s, out_i, total

    # --- combine --------------------------------------------------------------------------------
    def combine(self, input, weights, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                use_external_inp_buf=-1, call_reset=False, *, copy=False, stream=None):
        """input: rows in dispatch-output order ([>= total_recv, hidden] bf16/fp16/fp32): the
        registered buffer (get_registered_combine_input_buffer: zero-copy), the dispatch output
        itself (read in place), or any tensor (copied into the registered buffer first). float8
        rows (float8_e4m3fn/fnuz) are widened to float32 on the launch stream first and the sum
        is rounded once to their dtype (a fresh tensor; bfloat16 is the wide type where float32
        rows do not fit hidden_dim * max_token_type_size). weights: [>= total_recv, K] float32 or
        None. indices: never read (the op keeps the last dispatch's routing); None, this rank's
        own [num_tokens, K] ids of the last dispatch, or the indices tensor that dispatch
        returned (ROCm/mori's usage); anything else raises.
        The positional arguments are ROCm/mori's: block_num, rdma_block_num (>= -1, unused),
        warp_per_block, use_external_inp_buf (-1, 0/False or 1/True: informative, the mode is
        chosen by the input's address), call_reset (reset() first: a no-op). Keyword-only: copy,
        stream as in dispatch. With the config's quant_type "fp8_direct_cast" the rows travel as
        e4m3 codes (combine_fp8_dtype) and the output is the fp32 sum of the decoded codes,
        rounded once to the input dtype (docs/ep.md, "FP8 combine").
        Returns (out_tokens [num_tokens, hidden], out_weights [num_tokens, K] or None)."""
        args = self._combine_args("combine", input, weights, indices, rdma_block_num, use_external_inp_buf,
                                  call_reset)
        launch = self._stream(stream)
        input, args, fp8_dtype = self._widen_fp8_rows("combine", input, args, launch)
        report = self._input_error_pending(launch)
        self._h().combine(*args, int(block_num), int(warp_per_block), launch[0])
        outs = self._combine_outputs(input.dtype, int(input.shape[1]), weights is not None, launch, copy)
        self._raise_input_error("combine", report)
        return self._fp8_combine_result(outs, fp8_dtype, launch)

    def combine_send(self, input, weights, indices, block_num=-1, rdma_block_num=-1, warp_per_block=-1,
                     use_external_inp_buf=-1, call_reset=False, *, stream=None):
        """First half of a split-phase combine (ROCm/mori's name): this rank's rows go to their
        tokens' ranks and the call returns without any SM waiting for a peer; any GPU work may
        run before combine_recv(), which completes it. Arguments as combine(). The input and
        weights must stay unchanged until combine_recv has run. Needs the push combine (kernel_type
        AsyncLL, or IntraNode or InterNode with max_num_inp_token_per_rank <= 256); other ops raise
        mori.InvalidUsageError.
        Until combine_recv, dispatch/combine/combine_send raise. Returns None."""
        args = self._combine_args("combine_send", input, weights, indices, rdma_block_num,
                                  use_external_inp_buf, call_reset)
        launch = self._stream(stream)
        input, args, fp8_dtype = self._widen_fp8_rows("combine_send", input, args, launch)
        self._h().combine_send(*args, int(block_num), int(warp_per_block), launch[0])
        # The receive half reads this rank's own rows from input/weights: keep them alive (their
        # memory must not be reused by work between the halves).
        self._pending_combine = (input.dtype, int(input.shape[1]), weights is not None, input, weights, fp8_dtype)

    def combine_recv(self, *, copy=False, stream=None):
        """Second half of a split-phase combine: waits for every rank's rows and returns what
        combine() would have returned for combine_send's arguments."""
        pending = self._pending_combine
        if pending is None:
            raise _usage("combine_recv: no combine_send is pending")
        h = self._h()
        launch = self._stream(stream)
        report = self._input_error_pending(launch)
        self._pending_combine = None
        h.combine_recv(launch[0])
        outs = self._combine_outputs(*pending[:3], launch, copy)
        self._raise_input_error("combine_recv", report)
        return self._fp8_combine_result(outs, pending[5], launch)

    def _input_error_pending(self, launch):
        """Before a call launches: whether an input-error report (of an earlier dispatch, which
        every rank recorded alike) is here, to be raised once the call has launched (False while
        the launch stream captures a graph). No host synchronisation."""
        return self._input_errors_after_calls and self._h().input_error_pending(launch[0])

    def _raise_input_error(self, what, pending):
        """After the call launched (never instead of launching it, so no rank skips a call its
        peers wait for): raise, and clear, the report _input_error_pending saw, as
        mori.InvalidUsageError."""
        if pending:
            self._h().take_expert_id_error(what, True)

    def _combine_args(self, what, input, weights, indices, rdma_block_num, use_external_inp_buf, call_reset):
        """The checks only a tensor can answer, then the native combine's leading arguments."""
        _check_rdma_block_num(rdma_block_num)
        self._refuse_while_pending(what)
        if isinstance(use_external_inp_buf, bool):
            use_external_inp_buf = int(use_external_inp_buf)
        if not isinstance(use_external_inp_buf, int) or use_external_inp_buf not in (-1, 0, 1):
            raise _usage(f"{what}: use_external_inp_buf must be -1, 0 or 1 (or a bool), got {use_external_inp_buf!r}")
        torch = _torch()
        h = self._h()
        if self._last is None:
            raise _usage(f"{what}: no dispatch yet (combine returns the tokens of the last dispatch)")
        self._check_tensor(f"{what}: input", input, 2)
        # Which dtypes combine sums, sizes and alignment: checked by the native handle.
        if input.dtype not in _dtype_codes(torch):
            raise _usage(
                f"{what}: input dtype {input.dtype} is not supported; combine sums bfloat16, float16 or "
                "float32 rows (float8 rows are widened to float32 first)"
            )
        rows, hidden = int(input.shape[0]), int(input.shape[1])
        weight_rows = 0
        if weights is not None:
            self._check_tensor(f"{what}: weights", weights, 2)
            if weights.dtype != torch.float32:
                raise _usage(f"{what}: weights must be float32, got {weights.dtype}")
            if int(weights.shape[1]) != self._K:
                raise _usage(f"{what}: weights must have {self._K} columns, got shape {tuple(weights.shape)}")
            weight_rows = int(weights.shape[0])
        self._check_combine_indices(indices, what)
        if call_reset:
            self.reset()
        # An empty tensor may have no address: pass any other valid one (the kernel copies 0 rows,
        # and reports an error if the last dispatch received more rows than the tensor has).
        input_ptr = input.data_ptr() if rows > 0 else h.combine_out_tokens
        weights_ptr = 0
        if weights is not None:
            weights_ptr = weights.data_ptr() if weight_rows > 0 else h.combine_out_weights
        return input_ptr, _dtype_codes(torch)[input.dtype], hidden, rows, weights_ptr, weight_rows

    def _widen_fp8_rows(self, what, input, args, launch):
        """Combine of float8 rows (ROCm/mori's callers combine fp8 tokens): combine sums rows in
        float32, so float8 rows are widened first, on the launch stream, to float32 (bfloat16 where
        float32 rows exceed hidden_dim * max_token_type_size bytes; then each sum is rounded to
        bfloat16 before float8), and _fp8_combine_result rounds the sum to the float8 dtype.
        Returns (the rows the op reads, _combine_args' tuple for them, the float8 dtype or None)."""
        torch = _torch()
        if input.dtype not in [getattr(torch, n, None) for n in _FP8_DTYPE_NAMES]:
            return input, args, None
        hidden, room = int(input.shape[1]), self.config.hidden_dim * self.config.max_token_type_size
        if hidden * 4 <= room:
            wide = torch.float32
        elif hidden * 2 <= room:
            wide = torch.bfloat16
        else:
            raise _usage(
                f"{what}: {input.dtype} rows are summed in float32 (or bfloat16), which needs hidden * 4 (or * 2) "
                f"<= hidden_dim * max_token_type_size = {room} bytes; got hidden {hidden} (raise max_token_type_size)"
            )
        with torch.cuda.stream(self._launch_stream(launch)):
            rows = input.to(wide)
        ptr = rows.data_ptr() if int(rows.shape[0]) > 0 else args[0]
        return rows, (ptr, _dtype_codes(torch)[wide]) + tuple(args[2:]), input.dtype

    def _fp8_combine_result(self, outs, fp8_dtype, launch):
        """combine's (out, out_weights) with out rounded to fp8_dtype (a fresh tensor, made on the
        launch stream) when the input rows were float8 (_widen_fp8_rows); unchanged otherwise."""
        if fp8_dtype is None:
            return outs
        torch = _torch()
        with torch.cuda.stream(self._launch_stream(launch)):
            return outs[0].to(fp8_dtype), outs[1]

    def _combine_outputs(self, dtype, hidden, has_weights, launch, copy):
        torch = _torch()
        num_tokens = self._last[0]
        out = self._view("combine_tokens", "combine_out_tokens", (self._M, hidden), dtype)[:num_tokens]
        out_w = None
        if has_weights:
            out_w = self._view("combine_weights", "combine_out_weights", (self._M, self._K), torch.float32)[:num_tokens]
        if copy:
            # Copied on the current stream after the kernel; the launch stream waits for the copy.
            other = self._follow_launch(launch)
            outs = out.clone(), None if out_w is None else out_w.clone()
            if other is not None:
                other.wait_stream(torch.cuda.current_stream(self.device))
            return outs
        return out, out_w

    def reset(self, stream=None):
        """MORI compatibility: the kernels reset their own counters, so this does nothing."""
        self._h().reset(0)

    # --- buffers --------------------------------------------------------------------------------
    def get_registered_combine_input_buffer(self, dtype, hidden_dim=None):
        """[world_size * max_num_inp_token_per_rank, hidden] view of the zero-copy combine input:
        write expert outputs into rows [0, total_recv) (dispatch-output order) and pass it to
        combine. Valid while the op lives."""
        torch = _torch()
        hidden = self.config.hidden_dim if hidden_dim is None or hidden_dim < 0 else int(hidden_dim)
        if dtype not in _dtype_codes(torch):  # float8 rows are widened by combine (_widen_fp8_rows)
            raise _usage(f"get_registered_combine_input_buffer: dtype {dtype} cannot be combined")
        esize = torch.empty((), dtype=dtype).element_size()
        if hidden > self.config.hidden_dim or esize > self.config.max_token_type_size:
            raise _usage(
                f"get_registered_combine_input_buffer: {hidden} x {dtype} exceeds the config "
                f"(hidden_dim {self.config.hidden_dim}, max_token_type_size {self.config.max_token_type_size})"
            )
        return self._view("combine_in", "combine_input_buffer", (self._rmax, hidden), dtype)

    def get_registered_combine_weights_buffer(self):
        """[world_size * max_num_inp_token_per_rank, K] float32 view of the zero-copy combine weights."""
        return self._view("combine_in_w", "combine_input_weights", (self._rmax, self._K), _torch().float32)

    def get_dispatch_src_token_pos(self, sync=True):
        """Source position (src_rank * max_num_inp_token_per_rank + src_token) of each received
        row of the last dispatch: waits for the last dispatch (on its stream) and the current
        stream and returns the valid rows, or with sync=False the whole
        [world_size * max_num_inp_token_per_rank] view."""
        torch = _torch()
        pos = self._view("src_pos", "dispatch_src_token_pos", (self._rmax,), torch.int32)
        if not sync:
            return pos
        if self._last_dispatch_stream is not None:
            self._follow_launch(self._last_dispatch_stream)
        torch.cuda.current_stream(self.device).synchronize()
        n = int(self._total_recv_view().item())
        return pos[:n]

    @property
    def total_recv_token_num(self):
        """[1] int32 on the GPU: rows received by the last dispatch."""
        return self._total_recv_view()

    def get_local_expert_count(self):
        """[num_experts_per_rank] int32 on the GPU: tokens received by the last dispatch per local
        expert (a token counts once per local expert in its top-k)."""
        return self._view("expert_count", "local_expert_count", (self.config.num_experts_per_rank,), _torch().int32)

    @property
    def local_expert_count(self):
        return self.get_local_expert_count()

    def debug_fill_buffers(self, value=0xFF):
        """Test helper: fill every output buffer (dispatch outputs, source positions, counts,
        combine outputs, expert-major outputs once allocated) with the byte `value`, on the
        current stream. Only while no rank is
        inside a call of this op (e.g. after a host barrier): peers write and read these buffers
        during calls."""
        if self._pending_combine is not None:
            raise _usage("debug_fill_buffers: a combine_send is pending (its receive half reads these buffers)")
        if self._pending_dispatch is not None:
            raise _usage("debug_fill_buffers: a dispatch_send is pending (its receive half writes these buffers)")
        torch = _torch()
        h = self._h()
        bases = {"symmetric": h.symmetric_base, "local": h.local_base, "expert_major": h.expert_major_base}
        for block, _name, offset, nbytes, role in ep_layout(self.config)["regions"]:
            if role == "output" and nbytes > 0 and bases[block] != 0:  # expert_major: 0 until used
                t = _tensor_from_ptr(bases[block] + offset, (nbytes,), torch.uint8, self._device_index)
                t.fill_(value & 0xFF)

    # --- phase trace (mori.ops.trace; docs/ep.md "Phase trace") ------------------------------------
    def enable_trace(self, slots=64, max_blocks=None):
        """Kernels launched (or graph-captured) from now on record per-block phase times into a
        fresh device buffer of `slots` launches per kind and `max_blocks` blocks (default: the
        GPU's SMs; blocks past it are not recorded). Takes a host/GPU clock sample. Calls of the op
        stay collective as ever; tracing itself is per rank. Costs a little time per launch."""
        from .trace import OpTrace

        t = self._trace if self._trace is not None else OpTrace()
        t.enable(self, slots, max_blocks)
        self._trace = t

    def disable_trace(self):
        """Kernels launched from now on record nothing; the records so far can still be dumped."""
        if self._trace is not None:
            self._trace.disable(self)

    @property
    def trace_enabled(self):
        return self._trace is not None and self._trace.enabled

    def dump_dispatch_trace(self, path, launches="last"):
        """Waits for this GPU's work and writes this rank's dispatch trace as Chrome-trace JSON
        (open it in https://ui.perfetto.dev): "{rank}" in `path` becomes the rank; a directory gets
        mori_dispatch_trace_rank<rank>.json. launches: "last" (newest fully recorded launch),
        "all" (every launch still in the buffer), an epoch or a list of epochs. Returns the path."""
        return self._trace_or_raise("dump_dispatch_trace").dump(self, "dispatch", path, launches)

    def dump_combine_trace(self, path, launches="last"):
        """As dump_dispatch_trace, for combine (with each block's per-peer ready times)."""
        return self._trace_or_raise("dump_combine_trace").dump(self, "combine", path, launches)

    def trace_phase_summary(self, kind, launches="all"):
        """Waits for this GPU's work and returns mori.ops.trace.phase_summary of this rank's
        recorded launches of `kind` ("dispatch" or "combine"): the median launch span and, per
        phase, the median over launches of the longest block's time in it (us)."""
        if kind not in ("dispatch", "combine"):
            raise _usage(f"trace_phase_summary: kind must be 'dispatch' or 'combine', got {kind!r}")
        return self._trace_or_raise("trace_phase_summary").summary(self, kind, launches)

    def _trace_or_raise(self, what):
        self._h()
        if self._trace is None:
            raise _usage(f"{what}: tracing was never enabled on this op (op.enable_trace())")
        return self._trace

    def check_device_error(self):
        """Raise the recorded device-side error, if any, and clear the record: mori.TimeoutError
        if a wait expired (e.g. a peer never called), mori.InvalidUsageError if a kernel found a
        usage or protocol violation (e.g. combine input with fewer rows than dispatch received,
        ranks passing different dtypes), mori.RemoteError for an RDMA error completion. While
        one is pending, dispatch and combine raise mori.TimeoutError before launching anything.
        Also the input-error report of a finished dispatch (check_inputs: an expert id outside
        [-1, num_experts) on some rank), as mori.InvalidUsageError, the same on every rank; with
        both, the device error's message names the report too. Both are cleared. No
        synchronisation: after the dispatch has finished on this GPU (e.g.
        torch.cuda.synchronize()), every rank raises the report here."""
        self._h().check_device_error()


__all__ = [
    "EpDispatchCombineConfig",
    "EpDispatchCombineKernelType",
    "EpDispatchCombineOp",
    "EpDispatchCombineQuantType",
    "KERNEL_TYPE_BUILT",
    "ep_layout",
    "ep_local_bytes",
    "ep_symmetric_bytes",
]
