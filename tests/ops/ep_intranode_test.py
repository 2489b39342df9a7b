#!/usr/bin/env python3
"""GPU correctness suite of mori.ops IntraNode dispatch/combine (1-8 GPUs of one node; ranks may share a GPU).

    torchrun --nproc_per_node=4 tests/ops/ep_intranode_test.py          # or
    python3 tests/ops/ep_intranode_test.py --nproc 4 [-k substring] [--list]
    python3 tests/ops/ep_intranode_test.py --nproc 4      # on fewer GPUs: ranks share GPUs
    MORI_EP_STRESS_ITERS=10000 torchrun --nproc_per_node=4 tests/ops/ep_intranode_test.py -k stress
    python3 tests/ops/ep_intranode_test.py --nproc 4 --kernel-type AsyncLL   # runs as IntraNode (ops of <= 256 tokens here)
    python3 tests/ops/ep_intranode_test.py --nproc 2 --kernel-type IntraNode --kernel-type AsyncLL
                  # each type's cases in turn in the same ranks (one shmem init): lines name the case
                  # and its type, "[PASS] zero_tokens[AsyncLL] (0.4 s)"; -k matches those names

mori is imported from an installation, $MORI_BUILD_DIR/python, or <repo>/build*/python.

Every rank generates every rank's inputs from fixed seeds, so references need no communication:
  dispatch: received rows bit-exact (tokens, weights, scales, indices) in the documented order
            (source rank, then source token), source positions, total count and per-local-expert
            counts exact; rows past the total stay poisoned (never written).
  combine:  "experts" on rank d return (x * (1 + d/8)) in the combine dtype (weights * (d + 1));
            the result must equal, bitwise, the fp32 sum of those rows in ascending rank order,
            and match a float64 sum within the dtype's rounding; untouched rows stay poisoned.
  standard MoE (-k standard_moe): the expert-major layout (counts, source rows and positions,
            rows, scales) bit-exact, slots past the counts untouched, the weighted combine input
            and the combined result bitwise the references in ep_test_utils.py.
Checks run on the GPU without host synchronisation (so back-to-back loops stay back to back) and
are read once per case. Output ends with "N passed, M failed"; the exit code is 1 on failure.
"""

import argparse
import collections
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_test_utils as U  # noqa: E402

DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp8")
KERNEL_TYPES = ("IntraNode", "InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL")
V1_TYPES = ("InterNodeV1", "InterNodeV1LL")  # node-deduplicated: two-level combine
V1LL_MAX_TOKENS = 256  # InterNodeV1LL's one-WRITE bound per list (kEpV1LLMaxTokens)
# The suite runs the low-latency types at their small-batch sizes: specs and configs of these types
# get at most this many tokens per rank unless a case asks for more (uncapped=True; the types
# accept any count: case ll_types_any_max_tokens).
LL_MAX_TOKENS = {"InterNodeV1LL": V1LL_MAX_TOKENS, "AsyncLL": 256}


class CaseFailure(Exception):
    pass


class PeerFailed(Exception):
    """Raised by Env.fail_together on a rank that found nothing wrong while another rank did: the
    rank leaves the case with the others and reports no failure of its own."""


# ---------------------------------------------------------------------------------------------
# Environment of one rank
# ---------------------------------------------------------------------------------------------
class Env:
    def __init__(self, rank, world, local_rank, args):
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.rank = rank
        self.W = world
        self.dev = torch.device("cuda", local_rank)
        self.args = args
        self.ops = []
        # Some peers are reached through the software RDMA emulator (virtual nodes).
        self.emulated_rdma = os.environ.get("MORI_RDMA_EMULATE") == "1" and 0 < (args.gpu_per_node or world) < world
        self.mori = None

    def config(self, **kw):
        """An EpDispatchCombineConfig of this run's kernel type (--kernel-type, --gpu-per-node)
        unless the case names one."""
        kw.setdefault("kernel_type", getattr(self.args, "config_kernel_type", self.args.kernel_type))
        kw.setdefault("gpu_per_node", self.args.gpu_per_node or self.W)
        kw.setdefault("num_qp_per_pe", self.args.num_qp_per_pe)
        uncapped = kw.pop("uncapped", False)
        if kw["kernel_type"] in LL_MAX_TOKENS and "max_num_inp_token_per_rank" in kw and not uncapped:
            kw["max_num_inp_token_per_rank"] = min(kw["max_num_inp_token_per_rank"], LL_MAX_TOKENS[kw["kernel_type"]])
        return self.mori.ops.EpDispatchCombineConfig(**kw)

    @property
    def v1(self):
        """The run's kernel type is node-deduplicated (two-level combine)."""
        return self.args.kernel_type in V1_TYPES

    @property
    def v1_nodes(self):
        """G for the two-level combine references (InterNodeV1/V1LL), else None (flat sum)."""
        return (self.args.gpu_per_node or self.W) if self.v1 else None

    def dt(self, name):
        t = self.torch
        if name == "fp8":
            d = U.fp8_dtype(t)
            if d is None:
                raise CaseFailure("this torch has no float8_e4m3fn/float8_e4m3fnuz")
            return d
        return {"bf16": t.bfloat16, "fp16": t.float16, "fp32": t.float32}[name]

    def new_op(self, cfg, **kw):
        op = self.mori.ops.EpDispatchCombineOp(cfg, **kw)
        self.ops.append(op)
        return op

    def close_ops(self):
        for op in self.ops:
            try:
                op.close()
            except Exception as e:  # noqa: BLE001
                print(f"[rank {self.rank}] closing an op failed: {e}", flush=True)
        self.ops = []

    def barrier(self):
        self.torch.cuda.synchronize()
        self.dist.barrier()

    def any_rank(self, flag):
        """Whether `flag` holds on some rank (collective: every rank decides alike)."""
        t = self.torch.tensor([1 if flag else 0], dtype=self.torch.int32)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return bool(t.item())

    def fail_together(self, errors):
        """Collective: when some rank has errors, every rank leaves the case here (CaseFailure with
        its errors, PeerFailed on the others), so that no rank goes on to the case's later
        collectives (a round trip, a new op) while another is already in the harness's."""
        if self.any_rank(errors):
            if errors:
                raise CaseFailure("; ".join(errors))
            raise PeerFailed("another rank failed")


# ---------------------------------------------------------------------------------------------
# Specs and data
# ---------------------------------------------------------------------------------------------
class Spec:
    """One round-trip scenario. Fields that may vary per iteration are functions of `it`.
    max_tokens_cap (set by the driver for the low-latency types: LL_MAX_TOKENS) lowers every spec's M
    unless the spec is uncapped."""

    max_tokens_cap = None

    def __init__(self, H=2048, K=8, Epr=8, M=256, dtype="bf16", cdtype=None, idx="int32", scale=None,
                 weights=True, routing="random_neg", t_mode="random", mode="zero_copy", wmode="external",
                 iters=1, seed=0, d_launch=(-1, -1), c_launch=(-1, -1), poison=True, cfg_H=None,
                 cfg_tts=None, cfg_launch=None, check_every=0, quant=None, split=False, cquant=None, egain=1.0,
                 uncapped=False):
        self.H = H if callable(H) else (lambda it, v=H: v)
        self.dtype = dtype if callable(dtype) else (lambda it, v=dtype: v)
        self.mode = mode if callable(mode) else (lambda it, v=mode: v)
        self.routing = routing if callable(routing) else (lambda it, v=routing: v)
        self.d_launch = d_launch if callable(d_launch) else (lambda it, v=d_launch: v)
        self.c_launch = c_launch if callable(c_launch) else (lambda it, v=c_launch: v)
        self.cdtype = cdtype
        self.uncapped = uncapped
        self.K, self.Epr, self.M = K, Epr, (M if Spec.max_tokens_cap is None or uncapped else min(M, Spec.max_tokens_cap))
        self.idx, self.scale, self.weights, self.t_mode = idx, scale, weights, t_mode
        self.wmode, self.iters, self.seed, self.poison = wmode, iters, seed, poison
        self.cfg_H, self.cfg_tts, self.cfg_launch = cfg_H, cfg_tts, cfg_launch
        self.check_every = check_every
        # Fused dispatch quantisation per iteration: None, "fp8", "fp8_round" or "fp8_ue8m0" (bf16
        # input; the config reserves hidden / 128 fp32 scales when any iteration quantises).
        self.quant = quant if callable(quant) else (lambda it, v=quant: v)
        # Per iteration: dispatch as dispatch_send, a matmul, dispatch_recv (split phase).
        self.split = split if callable(split) else (lambda it, v=split: v)
        # The op's combine quant_type (None: "none"), and the gain of the "experts" (expert_fn).
        self.cquant, self.egain = cquant, egain

    def quant_kw(self, it):
        """dispatch's quantisation keywords for iteration `it`."""
        q = self.quant(it)
        if q is None:
            return {}
        return dict(use_fp8=True, round_scale=q == "fp8_round", use_ue8m0=q == "fp8_ue8m0")

    def combine_dtype(self, it):
        if self.cdtype is not None:
            return self.cdtype
        d = self.dtype(it)
        return "bf16" if d == "fp8" else d


def token_counts(spec, W, rnd):
    M = spec.M
    out = []
    for s in range(W):
        m = spec.t_mode
        if m == "random":
            t = rnd.randint(M // 2, M)
        elif m == "max":
            t = M
        elif m == "zero_rank":
            t = 0 if s == 1 % W else rnd.randint(M // 2, M)
        elif m == "all_zero":
            t = 0
        elif m == "small":
            t = rnd.randint(1, min(M, 128))
        elif m == "vary":
            t = rnd.choice([0, 1, rnd.randint(0, M), M]) if rnd.random() < 0.3 else rnd.randint(0, M)
        elif isinstance(m, int):
            t = min(m, M)
        else:
            raise ValueError(m)
        out.append(t)
    return out


def make_data(env, spec, it, seed):
    """All ranks' inputs for iteration `it`: X [W,M,H], IDX [W,M,K] (-1 padded), WT [W,M,K],
    SC [W,M,S] or None, Ts."""
    torch = env.torch
    W, M, K, Epr, dev = env.W, spec.M, spec.K, spec.Epr, env.dev
    H = spec.H(it)
    dt = env.dt(spec.dtype(it))
    rnd = random.Random(seed * 1000003 + it * 7919 + 17)
    Ts = token_counts(spec, W, rnd)
    E = W * Epr
    X = torch.zeros((W, M, H * torch.empty((), dtype=dt).element_size()), dtype=torch.uint8, device=dev).view(dt)
    IDX = torch.full((W, M, K), -1, dtype=torch.int64, device=dev)
    WT = torch.zeros((W, M, K), dtype=torch.float32, device=dev)
    SC = None
    if spec.scale is not None:
        sdim, sname = spec.scale
        sdt = {"f32": torch.float32, "u8": torch.uint8}[sname]
        SC = torch.zeros((W, M, sdim), dtype=sdt, device=dev)
    routing = spec.routing(it)
    for s in range(W):
        T = Ts[s]
        if T == 0:
            continue
        g = torch.Generator(device=dev)
        g.manual_seed(seed * 1000003 + it * 131 + s * 7 + 1)
        x = torch.randn((T, H), generator=g, device=dev)
        if spec.dtype(it) == "fp8":
            x = x.clamp(-8, 8)
        if spec.quant(it) is not None and H % 128 == 0:
            # groups of very different magnitudes (scales 2^-24 .. 2^24 apart) and some all-zero
            mag = torch.exp2(torch.randint(-24, 25, (T, H // 128, 1), generator=g, device=dev).float())
            mag = mag * (torch.rand((T, H // 128, 1), generator=g, device=dev) > 0.05).float()
            x = (x.view(T, H // 128, 128) * mag).view(T, H)
        X[s, :T] = x.to(dt)
        IDX[s, :T] = U.gen_routing(torch, g, dev, T, E, K, Epr, W, routing)
        WT[s, :T] = torch.rand((T, K), generator=g, device=dev)
        if SC is not None:
            if SC.dtype == torch.uint8:
                SC[s, :T] = torch.randint(0, 256, (T, SC.shape[2]), generator=g, device=dev, dtype=torch.uint8)
            else:
                SC[s, :T] = torch.rand((T, SC.shape[2]), generator=g, device=dev)
    if spec.idx == "int32":
        IDX = IDX.to(torch.int32)
    return X, IDX, WT, SC, Ts


def expert_fn(x, d, cdt, gain=1.0):
    """What rank d's "experts" return for rows x (any dtype): (x * (1 + d/8) * gain) in cdt."""
    return (x.float() * ((1.0 + 0.125 * d) * gain)).to(cdt)


# Device-side counters (int64), read once per case.
C_TOTAL, C_SRC, C_TOK, C_W, C_IDX, C_SC, C_POISON, C_EXPERT, C_COMB, C_COMB64, C_COMBW, C_CPOISON = range(12)
C_NAMES = ["total_recv", "src_pos", "tokens", "weights", "indices", "scales", "dispatch_poison",
           "expert_count", "combine_bitwise", "combine_vs_fp64", "combine_weights", "combine_poison"]


def quant_reference(env, spec, it, x):
    """(codes, scales) the fused quantisation of iteration `it` must deliver for bf16 rows x."""
    q = spec.quant(it)
    return U.fp8_quantize_reference(env.torch, x, U.fp8_dtype(env.torch), round_scale=q == "fp8_round",
                                    use_ue8m0=q == "fp8_ue8m0")


def verify_dispatch(env, spec, op, outs, data, cnt, poisoned, it):
    torch = env.torch
    X, IDX, WT, SC, Ts = data
    W, M, K, Epr, r = env.W, spec.M, spec.K, spec.Epr, env.rank
    E = W * Epr
    H = spec.H(it)
    rmax = W * M
    out_tok, out_w, out_s, out_i, total = outs
    idx64 = IDX.long()
    dest = torch.where((idx64 >= 0) & (idx64 < E), idx64 // Epr, torch.full_like(idx64, -1))
    flat = (dest == r).any(-1).view(-1)  # [W*M]: token (s, t) comes to us
    exp_total = flat.sum()
    pos = torch.cumsum(flat.long(), 0) - 1
    exp_src = torch.full((rmax + 1,), -1, dtype=torch.int64, device=env.dev)
    exp_src.scatter_(0, torch.where(flat, pos, torch.full_like(pos, rmax)), torch.arange(W * M, device=env.dev))
    exp_src = exp_src[:rmax]
    ar = torch.arange(rmax, device=env.dev)
    valid = ar < exp_total
    cnt[C_TOTAL] += (total[0].long() != exp_total).long()
    src = op.get_dispatch_src_token_pos(sync=False).long()
    cnt[C_SRC] += ((src != exp_src) & valid).sum()
    gi = exp_src.clamp(min=0)
    got = out_tok.view(torch.uint8)
    if spec.quant(it) is not None:
        # codes and scales bit-exact against the torch reference of the same quantisation
        if out_tok.dtype != U.fp8_dtype(torch):
            cnt[C_TOK] += 1
        ref_codes, ref_scales = quant_reference(env, spec, it, X.view(W * M, H)[gi])
        exp = ref_codes.view(torch.uint8)
        cnt[C_SC] += ((out_s.view(torch.int32) != ref_scales.view(torch.int32)).any(1) & valid).sum()
        if poisoned:
            cnt[C_POISON] += ((out_s.view(torch.uint8) != 0xFF).any(1) & ~valid).sum()
    else:
        exp = X.view(torch.uint8).view(W * M, -1)[gi]  # gather bytes (fp8 indexing is not everywhere)
    cnt[C_TOK] += ((got != exp).any(1) & valid).sum()
    if out_w is not None:
        cnt[C_W] += ((out_w.view(torch.int32) != WT.view(W * M, K)[gi].view(torch.int32)).any(1) & valid).sum()
    cnt[C_IDX] += ((out_i.long() != idx64.view(W * M, K)[gi]).any(1) & valid).sum()
    if out_s is not None and spec.quant(it) is None:
        cnt[C_SC] += ((out_s.view(torch.uint8) != SC.view(W * M, -1)[gi].view(torch.uint8)).any(1) & valid).sum()
    if poisoned:
        cnt[C_POISON] += ((got != 0xFF).any(1) & ~valid).sum()
    local = r * Epr + torch.arange(Epr, device=env.dev)
    hit = (idx64.view(W * M, K, 1) == local.view(1, 1, Epr)).any(1) & flat[:, None]
    cnt[C_EXPERT] += (op.get_local_expert_count().long() != hit.long().sum(0)).sum()


def verify_combine(env, spec, op, out, out_w, data, cnt, poisoned, it, cdt):
    torch = env.torch
    X, IDX, WT, SC, Ts = data
    W, M, K, Epr, r = env.W, spec.M, spec.K, spec.Epr, env.rank
    E = W * Epr
    H = spec.H(it)
    T = Ts[r]
    x = X[r, :T]
    if spec.quant(it) is not None:
        x = quant_reference(env, spec, it, x)[0]  # the experts saw the codes
    idx64 = IDX[r, :T].long()
    dest = torch.where((idx64 >= 0) & (idx64 < E), idx64 // Epr, torch.full_like(idx64, -1))
    acc = torch.zeros((T, H), dtype=torch.float32, device=env.dev)
    acc64 = torch.zeros((T, H), dtype=torch.float64, device=env.dev)
    accw = torch.zeros((T, K), dtype=torch.float32, device=env.dev)
    fp8 = spec.cquant == "fp8_direct_cast"
    if fp8:
        f8 = op.combine_fp8_dtype
        absum = torch.zeros((T, H), dtype=torch.float64, device=env.dev)  # sum of |row|
        sat = torch.zeros((T, H), dtype=torch.bool, device=env.dev)  # some row saturated
    rows, wrows, masks = [], [], []
    for d in range(W):
        m = (dest == d).any(1, keepdim=True)
        y = expert_fn(x, d, cdt, spec.egain)
        if fp8:
            # the row travels as e4m3 codes: the sum is over their decoded values
            yq = U.fp8_direct_cast_reference(torch, y, f8)
            acc = acc + torch.where(m, yq, 0.0)
            absum = absum + torch.where(m, y.double().abs(), 0.0)
            sat = sat | (m & (y.float().abs() > float(torch.finfo(f8).max)))
        else:
            acc = acc + torch.where(m, y.float(), 0.0)  # +0.0 for non-members leaves acc unchanged
        acc64 = acc64 + torch.where(m, y.double(), 0.0)
        accw = accw + torch.where(m, WT[r, :T] * float(d + 1), 0.0)
        rows.append(y)
        wrows.append(WT[r, :T] * float(d + 1))
        masks.append(m.view(T))
    ref = acc.to(cdt)
    if env.v1 and T > 0:
        # InterNodeV1/V1LL: per node the ascending fp32 sum rounded to the dtype, then the nodes
        # in ascending order (docs/ep.md); weights the same in fp32. fp8_direct_cast: the nodes
        # sum the rows' decoded codes.
        summed = [U.fp8_direct_cast_reference(torch, y, f8) for y in rows] if fp8 else rows
        ref = U.v1_combine_reference(torch, summed, masks, env.v1_nodes, cdt)
        accw = U.v1_combine_reference(torch, wrows, masks, env.v1_nodes, torch.float32)
    iview = torch.int32 if cdt == torch.float32 else torch.int16
    cnt[C_COMB] += (out.view(iview) != ref.view(iview)).any(1).sum()
    rtol = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[cdt]
    if fp8:
        # docs/ep.md's bound against the exact sum of the unquantised rows, where none saturated
        bound = U.fp8_direct_cast_error_bound(torch, absum, f8, cdt, W,
                                              partials=W // env.v1_nodes if env.v1 else 0)
        cnt[C_COMB64] += ((out.double() - acc64).abs().gt(bound) & ~sat).any(1).sum()
    else:
        cnt[C_COMB64] += (~torch.isclose(out.double(), acc64, rtol=rtol, atol=1e-3)).any(1).sum()
    if out_w is not None:
        cnt[C_COMBW] += (out_w.view(torch.int32) != accw.view(torch.int32)).any(1).sum()
    if poisoned:
        full = op._view("combine_tokens", "combine_out_tokens", (M, H), cdt)  # same cached view
        cnt[C_CPOISON] += (full[T:].view(torch.uint8) != 0xFF).any(1).sum()


def describe_failure(env, spec, op, outs, data, it):
    """Host-side details of the first mismatches (slow path, after a failure)."""
    torch = env.torch
    try:
        out_tok, out_w, out_s, out_i, total = outs
        n = int(total.item())
        src = op.get_dispatch_src_token_pos(sync=False)[: max(n, 0)].tolist()[:8]
        return f"rank {env.rank} it {it}: total_recv={n}, Ts={data[4]}, first src_pos={src}"
    except Exception as e:  # noqa: BLE001
        return f"(no details: {e})"


def spec_op(env, spec):
    """A new op sized for spec (hidden, dtypes of its first iterations, scales, M, Epr, K, launch)."""
    torch = env.torch
    dtypes = {spec.dtype(i) for i in range(min(spec.iters, 8))} | {spec.combine_dtype(i) for i in range(min(spec.iters, 8))}
    tts = spec.cfg_tts or max(torch.empty((), dtype=env.dt(d)).element_size() for d in dtypes)
    sdim, stsz = 0, 0
    if spec.scale is not None:
        sdim = spec.scale[0]
        stsz = 4 if spec.scale[1] == "f32" else 1
    if any(spec.quant(i) is not None for i in range(min(spec.iters, 8))):
        sdim, stsz = max(sdim, (spec.cfg_H or spec.H(0)) // 128), 4
    launch = spec.cfg_launch or (80, 8)
    cfg = env.config(
        rank=env.rank, world_size=env.W, hidden_dim=spec.cfg_H or spec.H(0), scale_dim=sdim, scale_type_size=stsz,
        max_token_type_size=tts, max_num_inp_token_per_rank=spec.M, num_experts_per_rank=spec.Epr,
        num_experts_per_token=spec.K, block_num=launch[0], warp_num_per_block=launch[1],
        use_external_inp_buf=(spec.mode(0) != "zero_copy"), quant_type=spec.cquant or "none", uncapped=spec.uncapped)
    return env.new_op(cfg, check_inputs=False)


def roundtrip(env, spec, op=None, label="", before_call=None):
    """Runs spec.iters dispatch+combine round trips and checks them; raises CaseFailure.
    before_call(), when given, runs on the host right before every dispatch and every combine."""
    torch = env.torch
    r = env.rank
    if op is None:
        op = spec_op(env, spec)
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    last = None
    for it in range(spec.iters):
        data = make_data(env, spec, it, spec.seed)
        X, IDX, WT, SC, Ts = data
        T = Ts[r]
        poisoned = spec.poison
        if poisoned:
            env.barrier()  # nobody is inside a call of this op now
            op.debug_fill_buffers(0xFF)
            env.barrier()
        x = X[r, :T].contiguous()
        idx = IDX[r, :T].contiguous()
        w = WT[r, :T].contiguous() if spec.weights else None
        sc = SC[r, :T].contiguous() if SC is not None else None
        db, dw = spec.d_launch(it)
        qkw = spec.quant_kw(it)
        if before_call is not None:
            before_call()
        if spec.split(it):
            # Work between the halves, on memory allocated before (under the RDMA emulator a
            # cudaMalloc there could hold up the copies the send kernel completes with).
            mm = torch.ones((512, 512), device=env.dev)
            mm_out = torch.matmul(mm, mm)
            op.dispatch_send(x, w, None if qkw else sc, idx, block_num=db, warp_per_block=dw, **qkw)
            torch.matmul(mm, mm, out=mm_out)
            outs = op.dispatch_recv()
            del mm, mm_out
        else:
            outs = op.dispatch(x, w, None if qkw else sc, idx, block_num=db, warp_per_block=dw, **qkw)
        verify_dispatch(env, spec, op, outs, data, cnt, poisoned, it)
        # "experts" on this rank
        cdt = env.dt(spec.combine_dtype(it))
        out_tok, out_w, _, _, total = outs
        mode = spec.mode(it)
        if mode == "direct" and out_tok.dtype != cdt:
            mode = "zero_copy"
        y = expert_fn(out_tok, r, cdt, spec.egain)  # all rows; rows past total are don't-care
        if mode == "zero_copy":
            cin = op.get_registered_combine_input_buffer(cdt, spec.H(it))
            cin.copy_(y)
        elif mode == "external":
            cin = y
        elif mode == "external_exact":
            cin = y[: int(total.item())].clone()
        elif mode == "direct":
            out_tok.copy_(y)
            cin = out_tok
        else:
            raise ValueError(mode)
        cw = None
        if spec.weights and spec.wmode is not None:
            wmode = spec.wmode
            if wmode == "external":
                cw = out_w * float(r + 1)
            elif wmode == "registered":
                cw = op.get_registered_combine_weights_buffer()
                cw.copy_(out_w * float(r + 1))
            elif wmode == "direct":
                out_w.mul_(float(r + 1))
                cw = out_w
            else:
                raise ValueError(wmode)
        cb, cwp = spec.c_launch(it)
        if before_call is not None:
            before_call()
        out, out_w2 = op.combine(cin, cw, idx, block_num=cb, warp_per_block=cwp)
        verify_combine(env, spec, op, out, out_w2, data, cnt, poisoned, it, cdt)
        last = (outs, data, it)
        if spec.check_every and (it + 1) % spec.check_every == 0:
            _raise_on_counters(env, spec, op, cnt, last, label, upto=it + 1)
    _raise_on_counters(env, spec, op, cnt, last, label, upto=spec.iters)
    return op


def _raise_on_counters(env, spec, op, cnt, last, label, upto):
    """Raises on every rank when some rank saw a device error or a mismatch (collective: the ranks
    leave the case together, whatever comes after the round trip)."""
    env.torch.cuda.synchronize()
    err = None
    try:
        env.mori.shmem.shmem_check_device_error()
    except Exception as e:  # noqa: BLE001
        err = e
    c = cnt.tolist()
    if not env.any_rank(err is not None or any(c)):
        return
    if err is not None:
        raise err
    if any(c):
        bad = ", ".join(f"{C_NAMES[i]}={v}" for i, v in enumerate(c) if v)
        detail = describe_failure(env, spec, op, last[0], last[1], last[2]) if last else ""
        raise CaseFailure(f"{label} mismatches after {upto} iterations: {bad}; {detail}")
    raise PeerFailed("another rank failed")


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
def case_random_seeds(env):
    for seed in (0, 1, 2):
        roundtrip(env, Spec(H=7168, K=8, Epr=8, M=256, scale=(56, "f32"), seed=seed), label=f"seed {seed}")
        env.close_ops()


def case_dtypes(env):
    roundtrip(env, Spec(H=4096, dtype="fp16", idx="int64", mode="external", wmode="external", seed=3), label="fp16/int64/external")
    env.close_ops()
    roundtrip(env, Spec(H=2048, dtype="fp32", mode="direct", wmode="direct", seed=4), label="fp32/direct")
    env.close_ops()
    roundtrip(env, Spec(H=7168, dtype="fp8", cdtype="bf16", scale=(56, "f32"), mode="zero_copy", wmode="registered", seed=5),
              label="fp8 dispatch + bf16 combine")
    env.close_ops()
    roundtrip(env, Spec(H=2048, dtype="bf16", scale=(7, "u8"), mode="external_exact", wmode="external", seed=6),
              label="byte scales, exact-size external input")


def case_all_to_one_rank(env):
    roundtrip(env, Spec(H=2048, K=6, Epr=8, routing="one_rank", seed=7), label="all tokens to rank 0")


def case_zero_tokens(env):
    roundtrip(env, Spec(H=2048, t_mode="zero_rank", seed=8), label="rank 1 has no tokens")
    roundtrip(env, Spec(H=2048, t_mode="all_zero", seed=9), op=env.ops[-1], label="no tokens anywhere")


def case_negative_and_duplicates(env):
    roundtrip(env, Spec(H=2048, routing="random_neg", seed=10), label="-1 entries")
    roundtrip(env, Spec(H=2048, routing="duplicates", seed=11), op=env.ops[-1], label="duplicate expert ids")


def case_same_rank_experts(env):
    roundtrip(env, Spec(H=2048, K=8, Epr=8, routing="two_ranks", seed=12), label="top-k on <= 2 ranks")


def case_topk(env):
    W = env.W
    for K, Epr in ((1, 4), (9, max(8, (9 + W - 1) // W)), (16, max(8, (16 + W - 1) // W))):
        roundtrip(env, Spec(H=2048, K=K, Epr=Epr, routing="random", seed=13 + K), label=f"top-{K}")
        env.close_ops()


def case_hidden_sizes(env):
    for H in (2048, 4096, 7168, 2056):  # 2056 bf16 = 4112 B = 257 x 16 B
        roundtrip(env, Spec(H=H, M=192, seed=20 + H), label=f"hidden {H}")
        env.close_ops()
    # a config hidden larger than the call's
    roundtrip(env, Spec(H=1024, cfg_H=4096, M=128, seed=31), label="call hidden < config hidden")


def case_max_tokens(env):
    roundtrip(env, Spec(H=7168, M=1024, t_mode="max", seed=32, scale=(56, "f32")), label="max tokens")


def case_small_batch(env):
    # <= 128 tokens with the small-batch launch defaults (many blocks, warps split rows)
    roundtrip(env, Spec(H=7168, M=128, t_mode="small", dtype="fp8", cdtype="bf16", scale=(56, "f32"),
                        iters=5, poison=True, seed=33), label="small batch fp8")


def case_fp8_dispatch(env):
    """Fused bf16 -> e4m3 quantisation in dispatch (use_fp8, round_scale, use_ue8m0): received codes
    and scales bit-exact against U.fp8_quantize_reference (random rows with groups 2^-24..2^24
    apart and all-zero groups, outputs poisoned first), and the combine of the codes exact."""
    mw = max_warps(env)
    cases = [
        # (label, spec)
        ("fp8, HT shape, 512-thread blocks", Spec(H=7168, M=256, quant="fp8", d_launch=(-1, mw), seed=40)),
        ("fp8 round_scale, int64 ids, 256-thread blocks", Spec(H=4096, M=192, idx="int64", quant="fp8_round",
                                                               d_launch=(-1, 8), seed=41)),
        ("fp8 ue8m0 (14 words)", Spec(H=7168, M=128, quant="fp8_ue8m0", seed=42)),
        ("fp8 ue8m0, 3 groups (one padding byte)", Spec(H=384, M=64, quant="fp8_ue8m0", routing="random", seed=43)),
        ("fp8 small batch (warps share rows)", Spec(H=7168, M=128, t_mode="small", quant="fp8", iters=3, seed=44)),
        ("fp8 one block per destination", Spec(H=2048, M=128, quant="fp8_round", d_launch=(env.W, 1), seed=45)),
    ]
    for label, spec in cases:
        roundtrip(env, spec, label=label)
        env.close_ops()
    # one op: quantised and plain bf16 dispatches (and a smaller hidden) alternating
    modes = [None, "fp8", "fp8_ue8m0", None, "fp8_round"]
    roundtrip(env, Spec(H=lambda it: (2048, 1024)[it % 2], cfg_H=2048, M=128, t_mode="vary",
                        quant=lambda it: modes[it % len(modes)], iters=10, seed=46), label="fp8 and bf16 alternating")


def case_fp8_direct_cast(env):
    """quant_type "fp8_direct_cast": every returned row travels as saturating e4m3 codes; the result
    must equal bitwise the fp32 sum of the decoded codes in ascending rank order, rounded once
    (U.fp8_direct_cast_reference), and lie within docs/ep.md's bound of the unquantised sum where
    no row saturated. Pull combine (M > 256), push combine (M <= 256; across nodes with the
    InterNode family), the suite's kernel type, every input mode (zero-copy, external, exact-size external, dispatch
    output in place), bf16/fp16/fp32, gains that saturate and that reach the subnormal codes, both
    block builds, and the push combine's split phase."""
    torch = env.torch
    mw = max_warps(env)
    F = "fp8_direct_cast"
    cases = [
        ("bf16 zero-copy (M 512: pull)", Spec(H=7168, M=512, cquant=F, wmode="registered", seed=70)),
        ("bf16 external, gain 200 (saturates), 512-thread blocks",
         Spec(H=4096, M=320, cquant=F, mode="external", egain=200.0, c_launch=(-1, mw), seed=71)),
        ("fp32 dispatch output in place, gain 2^-8 (subnormal codes)",
         Spec(H=2048, M=384, dtype="fp32", cquant=F, mode="direct", wmode="direct", egain=2.0**-8, seed=72)),
        ("fp16 exact-size external input", Spec(H=2048, M=300, dtype="fp16", cquant=F, mode="external_exact", seed=73)),
        ("bf16 zero-copy (M 128: push)", Spec(H=7168, M=128, cquant=F, seed=74)),
        ("bf16 external, gain 200, push", Spec(H=2048, M=128, cquant=F, mode="external", egain=200.0, seed=75)),
        ("fp32 dispatch output in place, push", Spec(H=1024, M=64, dtype="fp32", cquant=F, mode="direct", wmode="direct",
                                                    seed=76)),
        ("small batch (warps share rows), 256-thread blocks",
         Spec(H=7168, M=128, t_mode="small", cquant=F, iters=3, c_launch=(-1, 8), seed=77)),
        ("fp8 dispatch (use_fp8), then the bf16 combine as e4m3", Spec(H=7168, M=128, quant="fp8", cquant=F, seed=78)),
        ("call hidden < config hidden, token counts vary",
         Spec(H=lambda it: (2048, 1024)[it % 2], cfg_H=2048, M=256, t_mode="vary", cquant=F, iters=4, seed=79)),
    ]
    for label, spec in cases:
        roundtrip(env, spec, label=label)
        env.close_ops()
    if env.v1:
        return  # InterNodeV1/V1LL have no split-phase combine (case split_phase_combine)
    # split phase (push combine; InterNode: rows for other nodes by RDMA into the parity's
    # landing): the halves give the fused combine's outputs bit-exactly
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    op, spec, data, sel, inputs = combine_inputs_of_one_dispatch(env, 80, cquant=F)
    env.barrier()
    errors = []
    for i, (x, w) in enumerate(inputs):
        fused = kept(env, op.combine(x, w, sel))
        op.combine_send(x, w, sel)
        split = kept(env, op.combine_recv())
        if not same_bits(torch, fused, split):
            errors.append(f"input {i}: combine_send/combine_recv differ from combine")
        if i == 0:
            verify_combine(env, spec, op, fused[0], fused[1], data, cnt, False, 0, torch.bfloat16)
    _raise_on_counters(env, spec, op, cnt, None, "fp8 split phase", upto=1)
    if errors:
        raise CaseFailure("; ".join(errors))


def same_bits(torch, xs, ys):
    """Whether the combine outputs xs and ys (tokens in a 16-bit or fp32 dtype, fp32 weights) are
    bitwise equal, NaN payloads and signed zeros included."""
    def bits(t):
        return t.view(torch.int16 if t.element_size() == 2 else torch.int32)

    return all(torch.equal(bits(a), bits(b)) for a, b in zip(xs, ys))


def max_warps(env):
    o = env.mori._C.ops
    return o.MAX_THREADS_PER_BLOCK // o.WARP_SIZE


def case_launch_shapes(env):
    W = env.W
    mw = max_warps(env)
    shapes = [(W, 1), (W, mw), (3 * W + 1, 4), (2 * W + 1, 2), (132, mw), (1, 1)]

    def dl(it):
        return shapes[it % len(shapes)]

    def cl(it):
        return shapes[(it + 2) % len(shapes)]

    roundtrip(env, Spec(H=2048, M=160, iters=len(shapes) * 2, d_launch=dl, c_launch=cl, poison=True, seed=34),
              label="block/warp overrides")


def case_back_to_back(env):
    modes = ["zero_copy", "external", "direct"]
    shapes = [(-1, -1), (env.W, 4), (2 * env.W + 3, max_warps(env)), (64, 8)]
    # at least 8 experts in all (top-8), also with one rank
    spec = Spec(H=1024, K=8, Epr=max(4, -(-8 // env.W)), M=128, t_mode="vary", routing=lambda it: ("random_neg", "random", "two_ranks")[it % 3],
                mode=lambda it: modes[it % 3], wmode="external", iters=env.args.b2b_iters, poison=False,
                d_launch=lambda it: shapes[it % 4], c_launch=lambda it: shapes[(it + 1) % 4], seed=35)
    roundtrip(env, spec, label="back-to-back")


def case_dispatch_only_loop(env):
    """Many dispatches without combine, then one checked round trip; then many combines."""
    torch = env.torch
    spec = Spec(H=2048, M=128, iters=1, seed=36, poison=False)
    op = roundtrip(env, spec, label="warm-up")
    data = make_data(env, spec, 0, 36)
    X, IDX, WT, SC, Ts = data
    r = env.rank
    for _ in range(50):
        op.dispatch(X[r, : Ts[r]].contiguous(), WT[r, : Ts[r]].contiguous(), None, IDX[r, : Ts[r]].contiguous())
    roundtrip(env, spec, op=op, label="after 50 dispatches")
    # 30 combines of the same rows: each must give the same (reference) result
    spec2 = Spec(H=2048, M=128, iters=1, seed=37, poison=False, mode="external")
    roundtrip(env, spec2, op=op, label="before combine loop")
    data = make_data(env, spec2, 0, 37)
    cdt = torch.bfloat16
    env.barrier()  # peers may still read our registered buffer in the last combine
    outs_tok = op.get_registered_combine_input_buffer(cdt, 2048)
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    # rows of the last dispatch are still in the dispatch output: rebuild the expert output
    out_tok = op._view("dispatch_tokens", "dispatch_out_tokens", (env.W * spec2.M, 2048), cdt)
    outs_tok.copy_(expert_fn(out_tok, r, cdt))
    out_w = op._view("dispatch_weights", "dispatch_out_weights", (env.W * spec2.M, spec2.K), torch.float32)
    cw = out_w * float(r + 1)
    for _ in range(30):
        out, ow = op.combine(outs_tok, cw, IDX[r, : data[4][r]].contiguous())
        verify_combine(env, spec2, op, out, ow, data, cnt, False, 0, cdt)
    _raise_on_counters(env, spec2, op, cnt, None, "combine loop", 30)


def combine_inputs_of_one_dispatch(env, seed, cquant=None):
    """A warmed-up op (H 2048, M 128, external input, combine quant_type cquant), one dispatch of
    seed's data, and two combine inputs of its rows: x = the experts' rows with weights * (rank +
    1), and 2x (the sums scale exactly, also through e4m3 codes far from saturation). Returns (op,
    spec, data, sel = this rank's indices, [(x, w), (2x, 2w)])."""
    torch = env.torch
    spec = Spec(H=2048, M=128, iters=1, seed=seed, poison=False, mode="external", cquant=cquant)
    op = roundtrip(env, spec, label="warm-up")
    data = make_data(env, spec, 0, seed)
    X, IDX, WT, SC, Ts = data
    r = env.rank
    cdt = torch.bfloat16
    sel = IDX[r, : Ts[r]].contiguous()
    op.dispatch(X[r, : Ts[r]].contiguous(), WT[r, : Ts[r]].contiguous(), None, sel)
    out_tok = op._view("dispatch_tokens", "dispatch_out_tokens", (env.W * spec.M, 2048), cdt)
    out_w = op._view("dispatch_weights", "dispatch_out_weights", (env.W * spec.M, spec.K), torch.float32)
    inputs = [(expert_fn(out_tok, r, cdt), out_w * float(r + 1))]
    inputs.append((inputs[0][0] * 2, inputs[0][1] * 2))
    return op, spec, data, sel, inputs


def case_push_combine_beside_full_gpu(env):
    """A push combine finishes while another kernel holds every SM of the GPU but one
    (mori._C._testing.SmOccupier): blocks claim the push work, so the block that is resident pushes
    all of it before it waits (docs/ep.md "Residency"). quant_type fp8_direct_cast, so that a PE
    also waits for the rows it pushes to itself (one rank included). The outputs equal bitwise the
    same combine on a free GPU. Not run where ranks share a GPU or the RDMA emulator serves
    peers (NOT_APPLICABLE); tools/run_gpu_tests.sh and tests/python/test_ep_gpu.py run it with one
    rank."""
    torch = env.torch
    op, spec, data, sel, inputs = combine_inputs_of_one_dispatch(env, 81, cquant="fp8_direct_cast")
    x, w = inputs[0]
    ref = kept(env, op.combine(x, w, sel))
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(env.dev).multi_processor_count
    side = torch.cuda.Stream(device=env.dev)
    done = torch.cuda.Event()
    env.barrier()
    occupier = env.mori._C._testing.SmOccupier(sms - 1, 10000.0, side.cuda_stream)
    # Every rank's GPU is held before any rank combines. A host-only barrier: env.barrier()
    # synchronises the device, which would wait for the occupier.
    env.dist.barrier()
    try:
        got = op.combine(x, w, sel)
        done.record()
        t0 = time.monotonic()
        while not done.query() and time.monotonic() - t0 < 5.0:
            time.sleep(0.001)
        finished = done.query()
        took = time.monotonic() - t0
    finally:
        occupier.release()
    torch.cuda.synchronize()
    errors = []
    if not finished:
        errors.append(f"the combine did not finish in {took:.1f} s beside a kernel holding {sms - 1} of {sms} SMs")
    elif not same_bits(torch, ref, got):
        errors.append("the combine beside the held SMs differs from the same combine on a free GPU")
    if errors:
        raise CaseFailure("; ".join(errors))


def case_combine_back_to_back(env):
    """40 combines of one dispatch's rows, launched back to back (no host sync, no other work
    between them), alternating the input x and 2x (the sums scale exactly): a PE may run one call
    ahead of another, and its rows must not land in the buffers the other is still summing."""
    torch = env.torch
    cdt = torch.bfloat16
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    op, spec, data, sel, inputs = combine_inputs_of_one_dispatch(env, 38)
    env.barrier()
    results = []
    for i in range(40):
        x, w = inputs[i % 2]
        out, ow = op.combine(x, w, sel)
        results.append((out.clone(), ow.clone()))
    for i, (out, ow) in enumerate(results):
        scale = 1.0 if i % 2 == 0 else 0.5
        verify_combine(env, spec, op, out * scale, ow * scale, data, cnt, False, 0, cdt)
    _raise_on_counters(env, spec, op, cnt, None, "back-to-back combines", 40)


def kept(env, outs):
    """Clones of a combine's outputs."""
    return tuple(t.clone() for t in outs)


def host_steps(env):
    """step(it, what): with MORI_TEST_TRACE_ITERS=1, prints each rank's host steps (for a stalled
    run: the last line of each rank says where it waits); otherwise does nothing."""
    on = os.environ.get("MORI_TEST_TRACE_ITERS", "") not in ("", "0")
    t0 = time.monotonic()

    def step(it, what):
        if on:
            print(f"[rank {env.rank}] {time.monotonic() - t0:8.3f} s it {it}: {what}", flush=True)

    return step


def capture_on_side_stream(env, body):
    """(graph, body's result): body() captured on a side stream once every rank's work is done."""
    torch = env.torch
    s = torch.cuda.Stream(device=env.dev)
    s.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    env.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        result = body()
    return g, result


def case_split_phase_combine(env):
    """combine_send / combine_recv (push combine): the halves with a matmul between them give the
    fused combine's outputs bit-exactly, back to back (alternating x and 2x) and replayed from a
    CUDA graph holding send, matmul and receive; misuse raises InvalidUsageError on every rank and
    the op stays usable. Across nodes (InterNode, AsyncLL) the rows for other nodes' ranks travel
    by RDMA into the landing of the call's parity; InterNodeV1/V1LL ops refuse combine_send."""
    torch = env.torch
    mori = env.mori
    errors = []
    op, spec, data, sel, inputs = combine_inputs_of_one_dispatch(env, 39)
    X, IDX, WT, SC, Ts = data
    r = env.rank
    cdt = torch.bfloat16
    if not op.split_combine_available:
        # only InterNodeV1/V1LL and MORI_EP_COMBINE_PUSH=0 have no push combine for this M 128 op
        if not env.v1 and os.environ.get("MORI_EP_COMBINE_PUSH", "1") != "0":
            errors.append("an op of 128 tokens per rank has no push combine with MORI_EP_COMBINE_PUSH on")
        expect_usage_error(mori, errors, f"combine_send on an {env.args.kernel_type} op without the push combine",
                           lambda: op.combine_send(*inputs[0], sel), "needs the push combine")
        if errors:
            raise CaseFailure("; ".join(errors))
        return
    a = torch.randn((1024, 1024), device=env.dev)
    b = a @ a

    env.barrier()
    fused = [kept(env, op.combine(x, w, sel)) for x, w in inputs]
    split = []
    for i in range(6):
        x, w = inputs[i % 2]
        op.combine_send(x, w, sel)
        torch.matmul(a, a, out=b)  # any work between the halves
        split.append(kept(env, op.combine_recv()))
    # a temporary input (its only reference is the op's, until combine_recv) and the receive on
    # another stream (it waits for the send half)
    other = torch.cuda.Stream(device=env.dev)
    tmp = [t.clone() for t in inputs[0]]
    op.combine_send(*tmp, sel)
    del tmp
    junk = [torch.full((1 << 20,), 7.0, device=env.dev) for _ in range(8)]  # reuses freed memory
    other.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(other):
        got = op.combine_recv()
    torch.cuda.current_stream().wait_stream(other)
    split.append(kept(env, got))
    del junk
    # misuse: every rank makes the same calls, so every rank raises (nothing is launched)
    expect_usage_error(mori, errors, "combine_recv without combine_send", lambda: op.combine_recv(), "no combine_send")
    op.combine_send(*inputs[0], sel)
    expect_usage_error(mori, errors, "combine_send twice", lambda: op.combine_send(*inputs[0], sel), "pending")
    expect_usage_error(mori, errors, "combine while a send is pending", lambda: op.combine(*inputs[0], sel), "pending")
    expect_usage_error(mori, errors, "dispatch while a send is pending",
                       lambda: op.dispatch(X[r, : Ts[r]].contiguous(), None, None, sel), "pending")
    split.append(kept(env, op.combine_recv()))
    # a CUDA graph of send, matmul, receive (the receive half's outputs are the op's buffers)
    def body():
        op.combine_send(*inputs[1], sel)
        torch.matmul(a, a, out=b)
        return op.combine_recv()

    g, (gout, gow) = capture_on_side_stream(env, body)
    for _ in range(3):
        env.barrier()
        g.replay()
        torch.cuda.synchronize()
        split.append((gout.clone(), gow.clone()))
    del g
    torch.cuda.synchronize()
    mori.shmem.shmem_check_device_error()
    for i, (out, ow) in enumerate(split):
        # 0-5 alternate x, 2x; 6: temporary x on another stream; 7: x (after the misuse checks);
        # 8-10: graph replays of 2x
        want = fused[1] if (i < 6 and i % 2 == 1) or i > 7 else fused[0]
        if not (torch.equal(out.view(torch.int16), want[0].view(torch.int16)) and torch.equal(ow, want[1])):
            errors.append(f"split-phase combine {i} differs from the fused combine")
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    verify_combine(env, spec, op, fused[0][0], fused[0][1], data, cnt, False, 0, cdt)
    _raise_on_counters(env, spec, op, cnt, None, "fused combine (reference of the split ones)", 1)
    if errors:
        raise CaseFailure("; ".join(errors[:6]))


def _dispatch_state(env, op, outs):
    """Clones of the valid rows of every dispatch output, the source positions and the
    per-expert counts (what a split dispatch must reproduce bit for bit)."""
    n = int(outs[4].item())
    got = [None if t is None else t[:n].clone().view(env.torch.uint8) for t in outs[:4]]
    return got + [outs[4].clone(), op.get_dispatch_src_token_pos().clone(), op.get_local_expert_count().clone()]


def case_split_phase_dispatch(env):
    """dispatch_send / dispatch_recv: rows, metadata, counts and the combine that follows equal the
    fused dispatch's bit for bit (the same inputs dispatched both ways, with a matmul between the
    halves), mixed with fused calls in random round trips (routings, dtypes, fp8 quantisation,
    int64 ids, scales, no weights, poisoned outputs); a temporary input whose memory is reused
    between the halves; the receive on another stream; a CUDA graph of send, matmul and receive,
    replayed; misuse raises InvalidUsageError on every rank and the op stays usable. Both kernel
    types (InterNode: other nodes' rows by RDMA into the staging); an IntraNode or InterNode op of
    more than 256 tokens per rank refuses dispatch_send, an AsyncLL op of 512 splits."""
    torch = env.torch
    mori = env.mori
    errors = []
    r = env.rank
    if env.v1:
        # InterNodeV1/V1LL have no split-phase dispatch: dispatch_send refuses (every rank).
        sp = Spec(H=1024, M=128, iters=1, seed=51, t_mode="small")
        sop = spec_op(env, sp)
        X, IDX, WT, SC, Ts = make_data(env, sp, 0, 51)
        if sop.split_dispatch_available:
            errors.append("split_dispatch_available on an InterNodeV1/V1LL op")
        expect_usage_error(mori, errors, f"dispatch_send on {env.args.kernel_type}",
                           lambda: sop.dispatch_send(X[r, : Ts[r]].contiguous(), None, None, IDX[r, : Ts[r]].contiguous()),
                           "(use dispatch)")
        env.close_ops()
        if errors:
            raise CaseFailure("; ".join(errors))
        return
    if env.args.config_kernel_type == "AsyncLL":
        # AsyncLL splits at any tokens per rank (its staging and push buffers are sized for them)
        roundtrip(env, Spec(H=1024, M=512, iters=2, seed=51, split=True, uncapped=True),  # 256..512 tokens
                  label="split, AsyncLL of 512 tokens per rank")
    else:
        big = Spec(H=1024, M=512, iters=1, seed=51, t_mode="small")
        bop = spec_op(env, big)
        X, IDX, WT, SC, Ts = make_data(env, big, 0, 51)
        expect_usage_error(mori, errors, "dispatch_send with 512 tokens per rank",
                           lambda: bop.dispatch_send(X[r, : Ts[r]].contiguous(), None, None, IDX[r, : Ts[r]].contiguous()),
                           "<= 256")
    env.close_ops()
    # Round trips with split and fused calls mixed (verify_dispatch / verify_combine check both).
    roundtrip(env, Spec(H=2048, M=256, iters=6, seed=52, split=lambda it: it % 3 != 2,
                        routing=lambda it: ("random_neg", "one_rank", "two_ranks")[it % 3]), label="split mixed")
    roundtrip(env, Spec(H=4096, M=64, iters=2, seed=53, dtype="fp16", idx="int64", scale=(32, "f32"), weights=False,
                        wmode=None, routing="duplicates", split=True), label="split fp16/int64/scales/no weights")
    roundtrip(env, Spec(H=2048, M=64, iters=2, seed=57, dtype="fp8", cdtype="bf16", scale=(7, "u8"), split=True),
                        label="split fp8 rows, byte scales")
    roundtrip(env, Spec(H=2048, M=128, iters=3, seed=54, dtype="bf16", quant=lambda it: (None, "fp8", "fp8_ue8m0")[it],
                        split=True), label="split fp8")
    zop = roundtrip(env, Spec(H=1024, M=32, iters=2, seed=55, t_mode="zero_rank", split=True), label="split, rank 1 idle")
    roundtrip(env, Spec(H=1024, M=32, iters=2, seed=58, t_mode="all_zero", split=True), op=zop, label="split, no tokens")
    roundtrip(env, Spec(H=2048, M=256, iters=4, seed=59, t_mode="vary", split=lambda it: it % 2 == 0,
                        d_launch=lambda it: ((-1, -1), (env.W, 1), (3 * env.W, 4), (-1, 16))[it]),
              label="split, launch shapes and token counts")
    env.close_ops()

    # Bit-exact against the fused dispatch of the same inputs, then the combine of each.
    spec = Spec(H=2048, M=128, iters=1, seed=56, poison=False, scale=(16, "f32"))
    op = spec_op(env, spec)
    data = make_data(env, spec, 0, 56)
    X, IDX, WT, SC, Ts = data
    x, idx, w, sc = (X[r, : Ts[r]].contiguous(), IDX[r, : Ts[r]].contiguous(), WT[r, : Ts[r]].contiguous(),
                     SC[r, : Ts[r]].contiguous())
    cdt = torch.bfloat16
    a = torch.randn((1024, 1024), device=env.dev)
    bm = a @ a

    def combined(outs):
        y = expert_fn(outs[0], r, cdt)
        got = op.combine(y, outs[1] * float(r + 1), idx)
        return [t.clone() for t in got]

    step = host_steps(env)
    env.barrier()
    step(0, "fused dispatch")
    outs = op.dispatch(x, w, sc, idx)
    fused = _dispatch_state(env, op, outs)
    fused_c = combined(outs)
    results = []
    for i in range(4):
        step(i, "split dispatch")
        op.dispatch_send(x, w, sc, idx)
        torch.matmul(a, a, out=bm)
        outs = op.dispatch_recv()
        results.append((f"split {i}", _dispatch_state(env, op, outs), combined(outs)))
    # A temporary input (only the op references it until dispatch_recv) and the receive on another
    # stream (it waits for the send half).
    inputs = (x, w, sc, idx)
    other = torch.cuda.Stream(device=env.dev)
    # Blocks of the temporaries' sizes, cached for them and for `junk` (nothing allocates between
    # the halves): twice over, so junk finds them also while the op keeps the temporaries alive.
    warm = [torch.empty_like(t) for t in inputs + inputs]
    zeros = torch.zeros_like(fused_c[0])  # for the misuse checks below (also between halves)
    del warm
    step(0, "temporary input, receive on another stream")
    op.dispatch_send(*(t.clone() for t in inputs))
    junk = [torch.full_like(t, 3) for t in inputs]  # takes the temporaries' memory if the op let go
    other.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(other):
        outs = op.dispatch_recv()
        state = _dispatch_state(env, op, outs)
    torch.cuda.current_stream().wait_stream(other)
    del junk
    results.append(("temporary input, receive on another stream", state, combined(outs)))
    # misuse: every rank makes the same calls, so every rank raises (nothing is launched)
    step(0, "misuse checks")
    expect_usage_error(mori, errors, "dispatch_recv without dispatch_send", lambda: op.dispatch_recv(),
                       "no dispatch_send")
    op.dispatch_send(x, w, sc, idx)
    expect_usage_error(mori, errors, "dispatch_send twice", lambda: op.dispatch_send(x, w, sc, idx), "pending")
    expect_usage_error(mori, errors, "dispatch between the halves", lambda: op.dispatch(x, w, sc, idx), "pending")
    expect_usage_error(mori, errors, "combine between the halves",
                       lambda: op.combine(zeros, None, idx), "pending")
    expect_usage_error(mori, errors, "combine_send between the halves",
                       lambda: op.combine_send(zeros, None, idx), "pending")
    expect_usage_error(mori, errors, "convert_dispatch_output between the halves",
                       lambda: op.convert_dispatch_output(), "pending")
    expect_usage_error(mori, errors, "debug_fill_buffers between the halves", lambda: op.debug_fill_buffers(),
                       "pending")
    expect_usage_error(mori, errors, "native dispatch between the halves",
                       lambda: op._h().dispatch(x.data_ptr(), 0, int(x.shape[0]), 2048, 0, 0, idx.data_ptr(), 0,
                                                -1, -1, torch.cuda.current_stream().cuda_stream), "pending")
    outs = op.dispatch_recv()
    results.append(("after the misuse checks", _dispatch_state(env, op, outs), combined(outs)))
    # A CUDA graph of send, matmul, receive (the receive's outputs are the op's buffers).
    def body():
        op.dispatch_send(x, w, sc, idx)
        torch.matmul(a, a, out=bm)
        return op.dispatch_recv()

    step(0, "graph capture")
    g, gouts = capture_on_side_stream(env, body)
    for i in range(3):
        env.barrier()
        step(i, "graph replay")
        g.replay()
        torch.cuda.synchronize()
        step(i, "graph replayed")
        results.append((f"graph replay {i}", _dispatch_state(env, op, gouts), combined(gouts)))
    del g
    torch.cuda.synchronize()
    mori.shmem.shmem_check_device_error()
    names = ("tokens", "weights", "scales", "indices", "total", "src_pos", "expert_count")
    for label, state, comb in results:
        for n, f, got in zip(names, fused, state):
            if (f is None) != (got is None) or (f is not None and not torch.equal(f, got)):
                errors.append(f"{label}: {n} differs from the fused dispatch")
        if not all(torch.equal(f.view(torch.uint8), g_.view(torch.uint8)) for f, g_ in zip(fused_c, comb)):
            errors.append(f"{label}: the combine after it differs from the one after the fused dispatch")
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    env.barrier()
    outs = op.dispatch(x, w, sc, idx)
    verify_dispatch(env, spec, op, outs, data, cnt, False, 0)
    _raise_on_counters(env, spec, op, cnt, None, "fused dispatch (reference of the split ones)", 1)
    if errors:
        raise CaseFailure("; ".join(errors[:6]))


def captured_round_trip(env, op, T, H, K, cdt, data):
    """A round trip captured in a CUDA graph on static inputs of T tokens (hidden H, top-K):
    dispatch, this rank's "experts" into the registered combine input (dtype cdt), combine. It runs
    once outside the graph first, on the capture stream, with make_data's `data` loaded. Returns
    (graph, (dispatch outputs, combine output, combine weights), load): load(data) copies this
    rank's rows of a make_data result into the static inputs."""
    torch, r = env.torch, env.rank
    sx = torch.zeros((T, H), dtype=cdt, device=env.dev)
    sidx = torch.full((T, K), -1, dtype=torch.int32, device=env.dev)
    sw = torch.zeros((T, K), dtype=torch.float32, device=env.dev)
    buf = op.get_registered_combine_input_buffer(cdt, H)

    def body():
        outs = op.dispatch(sx, sw, None, sidx)
        buf.copy_(expert_fn(outs[0], r, cdt))
        out, ow = op.combine(buf, outs[1] * float(r + 1), sidx)
        return outs, out, ow

    def load(d):
        X, IDX, WT, SC, Ts = d
        sx.copy_(X[r, :T])
        sidx.copy_(IDX[r, :T])
        sw.copy_(WT[r, :T])

    load(data)
    s = torch.cuda.Stream(device=env.dev)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    env.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = body()
    env.barrier()
    return g, captured, load


def case_cuda_graph(env):
    torch = env.torch
    r, W = env.rank, env.W
    T = 100
    spec = Spec(H=2048, K=8, Epr=8, M=128, t_mode=T, routing="random_neg", poison=False, seed=40)
    cfg = env.config(rank=r, world_size=W, hidden_dim=2048, scale_dim=0, scale_type_size=0,
                                           max_token_type_size=2, max_num_inp_token_per_rank=128,
                                           num_experts_per_rank=8, num_experts_per_token=8, use_external_inp_buf=False)
    op = env.new_op(cfg)  # check_inputs=True: nothing is read on the host while capturing
    cdt = torch.bfloat16
    g, (outs, out, ow), load = captured_round_trip(env, op, T, 2048, 8, cdt, make_data(env, spec, 0, 40))
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    last = None
    for it in range(1, 6):
        data = make_data(env, spec, it, 40)
        load(data)
        env.barrier()
        g.replay()
        verify_dispatch(env, spec, op, outs, data, cnt, False, it)
        verify_combine(env, spec, op, out, ow, data, cnt, False, it, cdt)
        last = (outs, data, it)
    _raise_on_counters(env, spec, op, cnt, last, "graph replay", 5)
    del g


def expect_usage_error(mori, errors, what, fn, needle=None):
    """Calls fn(); appends to `errors` unless it raised mori.InvalidUsageError (whose message holds
    `needle`, when given)."""
    try:
        fn()
    except mori.InvalidUsageError as e:
        if needle is not None and needle not in str(e):
            errors.append(f"{what}: message lacks {needle!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        errors.append(f"{what}: raised {type(e).__name__}: {e}")
        return
    errors.append(f"{what}: no error")


def case_bad_inputs(env):
    """Each bad call raises InvalidUsageError (a ValueError) before launching; the op stays usable."""
    torch = env.torch
    mori = env.mori
    r, W = env.rank, env.W
    H, K, Epr, M = 256, 4, 2, 64
    mk = lambda **kw: env.config(**{**dict(  # noqa: E731
        rank=r, world_size=W, hidden_dim=H, scale_dim=0, scale_type_size=0, max_token_type_size=2,
        max_num_inp_token_per_rank=M, num_experts_per_rank=Epr, num_experts_per_token=K), **kw})
    errors = []

    def expect(what, fn):
        expect_usage_error(mori, errors, what, fn)

    # config errors (every rank raises; nothing is allocated)
    expect("kernel_type IntraNodeLL (not built)",
           lambda: env.new_op(mk(kernel_type=mori.ops.EpDispatchCombineKernelType.IntraNodeLL)))
    G = env.args.gpu_per_node or W
    if env.args.kernel_type == "IntraNode" and W > 1:
        expect("InterNode with gpu_per_node 1 on one node", lambda: env.new_op(mk(kernel_type="InterNode", gpu_per_node=1)))
    if env.args.kernel_type != "IntraNode" and G < W:
        expect("IntraNode across nodes", lambda: env.new_op(mk(kernel_type="IntraNode")))
        expect("gpu_per_node other than shmem's", lambda: env.new_op(mk(gpu_per_node=W)))
    expect("world_size mismatch", lambda: env.new_op(mk(world_size=W + 1)))
    expect("top-k 0", lambda: env.new_op(mk(num_experts_per_token=0)))
    op = env.new_op(mk())
    T = 32
    dev = env.dev
    x = torch.randn((T, H), device=dev).to(torch.bfloat16)
    idx = torch.randint(0, W * Epr, (T, K), device=dev, dtype=torch.int32)
    w = torch.rand((T, K), device=dev)
    expect("combine before dispatch", lambda: op.combine(x, None, idx))
    expect("int32 tokens", lambda: op.dispatch(x.to(torch.int32), w, None, idx))
    expect("CPU tokens", lambda: op.dispatch(x.cpu(), w, None, idx))
    expect("non-contiguous tokens", lambda: op.dispatch(torch.randn((H, T), device=dev).to(torch.bfloat16).t(), w, None, idx))
    expect("3-D tokens", lambda: op.dispatch(x.view(T, 2, H // 2), w, None, idx))
    expect("too many tokens", lambda: op.dispatch(torch.zeros((M + 1, H), device=dev, dtype=torch.bfloat16), None, None,
                                                   torch.zeros((M + 1, K), device=dev, dtype=torch.int32)))
    expect("hidden too large", lambda: op.dispatch(torch.zeros((T, 2 * H), device=dev, dtype=torch.bfloat16), w, None, idx))
    expect("fp32 tokens with max_token_type_size 2", lambda: op.dispatch(x.float(), w, None, idx))
    expect("row not a multiple of 16 B", lambda: op.dispatch(x[:, :12].contiguous(), w, None, idx))
    expect("indices shape", lambda: op.dispatch(x, w, None, idx[:, :-1].contiguous()))
    expect("indices dtype", lambda: op.dispatch(x, w, None, idx.float()))
    expect("weights shape", lambda: op.dispatch(x, w[:, :-1].contiguous(), None, idx))
    expect("weights dtype", lambda: op.dispatch(x, w.half(), None, idx))
    expect("scales with scale_dim 0", lambda: op.dispatch(x, w, torch.zeros((T, 4), device=dev), idx))
    expect("tokens/indices row mismatch", lambda: op.dispatch(x[:T - 1].contiguous(), w, None, idx))
    # fused fp8 quantisation: bad combinations
    expect("use_fp8 without scales reserved (scale_dim 0)", lambda: op.dispatch(x, w, None, idx, use_fp8=True))
    expect("round_scale without use_fp8", lambda: op.dispatch(x, w, None, idx, round_scale=True))
    expect("use_ue8m0 without use_fp8", lambda: op.dispatch(x, w, None, idx, use_ue8m0=True))
    expect("fp8_dtype without use_fp8", lambda: op.dispatch(x, w, None, idx, fp8_dtype=torch.bfloat16))
    qop = env.new_op(mk(scale_dim=H // 128, scale_type_size=4))
    expect("use_fp8 with fp16 input", lambda: qop.dispatch(x.half(), w, None, idx, use_fp8=True))
    expect("use_fp8 with scales passed", lambda: qop.dispatch(x, w, torch.ones((T, H // 128), device=dev), idx, use_fp8=True))
    expect("use_fp8 with hidden 192", lambda: qop.dispatch(x[:, :192].contiguous(), w, None, idx, use_fp8=True))
    expect("use_fp8 with fp8_dtype bf16", lambda: qop.dispatch(x, w, None, idx, use_fp8=True, fp8_dtype=torch.bfloat16))
    small = env.new_op(mk(scale_dim=H // 128 - 1, scale_type_size=4))
    expect("use_fp8 with scale_dim too small", lambda: small.dispatch(x, w, None, idx, use_fp8=True))
    bytes_op = env.new_op(mk(scale_dim=4 * (H // 128), scale_type_size=1))
    expect("use_fp8 with 1-byte scale_type_size", lambda: bytes_op.dispatch(x, w, None, idx, use_fp8=True))
    # the quantising op still works after the refused calls (checked against the reference)
    qouts = qop.dispatch(x, w, None, idx, use_fp8=True, use_ue8m0=True, copy=True)
    qref = U.fp8_quantize_reference(torch, x, U.fp8_dtype(torch), use_ue8m0=True)
    pos = qop.get_dispatch_src_token_pos()
    mine = (pos // M) == r  # rows this rank sent itself: compare with our own reference rows
    t_of = (pos % M).long()[mine]
    # compared as bytes: indexing fp8 tensors is not supported everywhere
    if not (torch.equal(qouts[0].view(torch.uint8)[mine], qref[0].view(torch.uint8)[t_of])
            and torch.equal(qouts[2][mine], qref[1][t_of])):
        errors.append("fp8 dispatch after refused calls: codes or scales differ from the reference")
    # A round trip (collective) proves the op is still usable. Its ids include some outside
    # [-1, E): the kernel treats them as -1 (the reference below does too) and records the first
    # one, which check_device_error raises (then the record is clear).
    E = W * Epr
    bad_ids = {E, E + 77, -2, -9}
    g = torch.Generator().manual_seed(97 + r)
    where = torch.rand((T, K), generator=g) < 0.1
    where[3, 1] = True
    vals = torch.tensor(sorted(bad_ids), dtype=torch.int32)[torch.randint(0, len(bad_ids), (T, K), generator=g)]
    idx = torch.where(where, vals, idx.cpu()).to(dev)
    outs = op.dispatch(x, w, None, idx)
    torch.cuda.synchronize()
    try:
        op.check_device_error()
        errors.append("out-of-range expert ids: check_device_error raised nothing")
    except mori.InvalidUsageError as e:
        msg = str(e)
        if "expert id" not in msg or not any(f"expert id {v} " in msg for v in bad_ids):
            errors.append(f"out-of-range expert ids: message names no offending id: {msg}")
    op.check_device_error()  # cleared
    # float8 rows are a valid combine input (widened first: tests/python/test_compat_mori.py)
    expect("combine int input", lambda: op.combine(torch.zeros((W * M, H), device=dev, dtype=torch.int16), None, idx))
    expect("combine hidden too large", lambda: op.combine(torch.zeros((W * M, 2 * H), device=dev, dtype=torch.bfloat16), None, idx))
    expect("combine weights columns", lambda: op.combine(outs[0], torch.zeros((W * M, K + 1), device=dev), idx))
    expect("combine indices shape", lambda: op.combine(outs[0], None, idx[:5].contiguous()))
    expect("combine input on CPU", lambda: op.combine(outs[0].cpu(), None, idx))
    buf = op.get_registered_combine_input_buffer(torch.bfloat16, H)
    buf.copy_(expert_fn(outs[0], r, torch.bfloat16))
    out, ow = op.combine(buf, outs[1] * float(r + 1), idx)
    torch.cuda.synchronize()
    mori.shmem.shmem_check_device_error()
    # compare with the reference
    dest = torch.where((idx >= 0) & (idx < E), idx.long() // Epr, -1)
    acc = torch.zeros((T, H), device=dev)
    rows, masks = [], []
    for d in range(W):
        m = (dest == d).any(1, keepdim=True)
        acc = acc + torch.where(m, expert_fn(x, d, torch.bfloat16).float(), 0.0)
        rows.append(expert_fn(x, d, torch.bfloat16))
        masks.append(m.view(T))
    ref = acc.to(torch.bfloat16)
    if env.v1:
        ref = U.v1_combine_reference(torch, rows, masks, env.v1_nodes, torch.bfloat16)
    if not torch.equal(out.view(torch.int16), ref.view(torch.int16)):
        errors.append("round trip after bad calls: combine mismatch")
    # Without a check, the next call raises the report after it launched (every rank does: the
    # report is every rank's); that call's own bad ids are reported by the next check.
    op.dispatch(x, w, None, idx)
    torch.cuda.synchronize()
    expect("dispatch after one with out-of-range ids", lambda: op.dispatch(x, w, None, idx))
    torch.cuda.synchronize()
    expect("check_device_error after that dispatch", op.check_device_error)
    op.dispatch(x, w, None, torch.where(where.to(dev), -1, idx))
    torch.cuda.synchronize()
    op.check_device_error()
    op.close()
    expect("dispatch after close", lambda: op.dispatch(x, w, None, idx))
    # check_inputs=False: the ids are not checked (still treated as -1 by the kernel)
    unchecked = env.new_op(mk(), check_inputs=False)
    unchecked.dispatch(x, w, None, idx)
    torch.cuda.synchronize()
    unchecked.check_device_error()
    unchecked.close()
    if errors:
        raise CaseFailure("; ".join(errors))


def case_bad_expert_id_on_one_rank(env):
    """One rank's expert ids outside [-1, E) are known to every rank in the same dispatch: the call
    completes everywhere (such an id counts as -1: rows, counts and the combine are the
    reference's), and every rank raises the same mori.InvalidUsageError, once, naming the lowest
    offending rank and its first bad id (lowest token, then top-k slot): at check_device_error()
    after synchronising; or, with no check, at the end of the next call, which launches first (its
    result is right); never between the halves of a split call. The next round trip is bit-exact on
    every rank. Forms: fused dispatch (int32 and int64 ids; every rank in turn the offender; two
    offenders), split-phase dispatch and combine where the op splits, a CUDA graph replay (nothing is
    read during capture), and a pending device abort with a report (one check reports and clears
    both)."""
    torch, mori = env.torch, env.mori
    r, W = env.rank, env.W
    errors = []
    cdt = torch.bfloat16
    E = W * 4

    def checked_op(spec):  # check_inputs=True (spec_op's ops do not check)
        return env.new_op(env.config(rank=r, world_size=W, hidden_dim=spec.H(0), scale_dim=0, scale_type_size=0,
                                     max_token_type_size=2, max_num_inp_token_per_rank=spec.M,
                                     num_experts_per_rank=spec.Epr, num_experts_per_token=spec.K))

    def with_bad_ids(data, bad):
        """data with the ids of `bad` ({rank: [(token, slot, id), ...]}) put in."""
        IDX = data[1]
        for b, entries in bad.items():
            for t, k, v in entries:
                IDX[b, t, k] = v
        return data

    def expected(bad):
        """The report every rank must name: the lowest offending rank's first bad id."""
        b = min(bad)
        t, k, v = min(bad[b], key=lambda e: (e[0], e[1]))
        return f"PE {b}'s dispatch had expert id {v} for token {t} (top-k slot {k})"

    def same_everywhere(label, msg, bad):
        """Every rank raised, naming the same report (the clause after it names the raising rank)."""
        msgs = [None] * W
        env.dist.all_gather_object(msgs, msg)
        want = expected(bad)
        if msg is None:
            errors.append(f"{label}: no InvalidUsageError on rank {r}")
        elif want not in msg:
            errors.append(f"{label}: rank {r}'s message lacks {want!r}: {msg}")
        cores = {m.split(" (raised on PE")[0] if m else None for m in msgs}
        if len(cores) != 1:
            errors.append(f"{label}: the ranks raised different errors: {msgs}")

    def raised_by(fn):
        """(result, message of the InvalidUsageError fn raised or None)."""
        try:
            return fn(), None
        except mori.InvalidUsageError as e:
            return None, str(e)

    def check_cleared(label):
        _, again = raised_by(op.check_device_error)
        if again is not None:
            errors.append(f"{label}: a second check_device_error raised again: {again}")

    def combine_checked(op, spec, data, outs, cnt, it, split=False):
        """Combine of this rank's received rows (zero-copy), checked; returns the message of an
        InvalidUsageError raised after it launched (the result is then read from the op's view)."""
        X, IDX, WT, SC, Ts = data
        T, H = Ts[r], spec.H(it)
        cin = op.get_registered_combine_input_buffer(cdt, H)
        cin.copy_(expert_fn(outs[0], r, cdt))
        cw = outs[1] * float(r + 1)
        idx = IDX[r, :T].contiguous()
        if split:
            op.combine_send(cin, cw, idx)  # a send never raises: its receive half must follow
            got, msg = raised_by(lambda: op.combine_recv())
        else:
            got, msg = raised_by(lambda: op.combine(cin, cw, idx))
        if got is None:  # it launched, then raised: the result is in the op's buffers
            got = (op._view("combine_tokens", "combine_out_tokens", (spec.M, H), cdt)[:T],
                   op._view("combine_weights", "combine_out_weights", (spec.M, spec.K), torch.float32)[:T])
        verify_combine(env, spec, op, got[0], got[1], data, cnt, False, it, cdt)
        return msg

    def dispatch_checked(op, spec, data, cnt, it, split=False):
        X, IDX, WT, SC, Ts = data
        T = Ts[r]
        x, idx, w = X[r, :T].contiguous(), IDX[r, :T].contiguous(), WT[r, :T].contiguous()
        if split:
            op.dispatch_send(x, w, None, idx)
            outs = op.dispatch_recv()
        else:
            outs = op.dispatch(x, w, None, idx)
        verify_dispatch(env, spec, op, outs, data, cnt, False, it)
        return outs

    # --- check_device_error after synchronising: every rank in turn the offender ---------------
    for idx_t in ("int32", "int64"):
        spec = Spec(H=1024, K=4, Epr=4, M=64, t_mode="max", idx=idx_t, routing="random_neg", poison=False, seed=81)
        op = checked_op(spec)
        cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
        for it, b in enumerate(range(W)):
            bad = {b: [(5 + it, 2, E + 3 + it), (9, 0, -2 - it), (5 + it, 3, E)]}
            if it == 1 and W > 2:
                bad[W - 1] = [(0, 0, E + 100)]  # a second offender, higher: the report names b
            data = with_bad_ids(make_data(env, spec, it, spec.seed), bad)
            outs = dispatch_checked(op, spec, data, cnt, it)
            torch.cuda.synchronize()
            _, msg = raised_by(op.check_device_error)
            same_everywhere(f"{idx_t} ids, offender {b}", msg, bad)
            check_cleared(f"{idx_t} ids, offender {b}")
            if combine_checked(op, spec, data, outs, cnt, it) is not None:
                errors.append(f"{idx_t} ids, offender {b}: the combine after the check raised")
        _raise_on_counters(env, spec, op, cnt, None, f"{idx_t} ids with bad ids", W)
        roundtrip(env, spec, op=op, label=f"{idx_t} ids: the round trip after the reports")
        env.close_ops()
        env.fail_together(errors)

    # --- no check (engines): the next call launches, then raises; never between the halves -----
    spec = Spec(H=1024, K=4, Epr=4, M=64, t_mode="max", routing="random_neg", poison=False, seed=82)
    op = checked_op(spec)
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    b = W - 1
    bad = {b: [(7, 1, E + 9)]}
    data = with_bad_ids(make_data(env, spec, 0, spec.seed), bad)
    outs = dispatch_checked(op, spec, data, cnt, 0)
    torch.cuda.synchronize()  # the report has arrived on every rank before the combine starts
    same_everywhere("the combine after a bad dispatch", combine_checked(op, spec, data, outs, cnt, 0), bad)
    check_cleared("after the combine raised")
    if op.split_dispatch_available:
        data = with_bad_ids(make_data(env, spec, 1, spec.seed), bad)
        outs = dispatch_checked(op, spec, data, cnt, 1, split=True)  # the receive half records it
        torch.cuda.synchronize()
        _, msg = raised_by(op.check_device_error)
        same_everywhere("split-phase dispatch", msg, bad)
        if combine_checked(op, spec, data, outs, cnt, 1) is not None:
            errors.append("split-phase dispatch: the combine after the check raised")
    if op.split_combine_available:
        data = with_bad_ids(make_data(env, spec, 2, spec.seed), bad)
        outs = dispatch_checked(op, spec, data, cnt, 2)
        torch.cuda.synchronize()
        same_everywhere("combine_recv after a bad dispatch", combine_checked(op, spec, data, outs, cnt, 2, split=True),
                        bad)
        check_cleared("after combine_recv raised")
    _raise_on_counters(env, spec, op, cnt, None, "calls after a bad dispatch", 3)
    roundtrip(env, Spec(H=1024, K=4, Epr=4, M=64, iters=2, routing="random_neg", poison=False, seed=83), op=op,
              label="round trips after the reports")

    # --- a device abort and a report: one check reports both and clears both --------------------
    data = with_bad_ids(make_data(env, spec, 3, spec.seed), bad)
    outs = dispatch_checked(op, spec, data, cnt, 3)
    env.barrier()  # every rank's dispatch is done (and its report recorded)
    mori.shmem.shmem_abort_device_waits()
    try:
        op.check_device_error()
        errors.append("abort + report: check_device_error raised nothing")
    except mori.TimeoutError as e:
        if expected(bad) not in str(e):
            errors.append(f"abort + report: the TimeoutError does not name the report: {e}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"abort + report: raised {type(e).__name__}: {e}")
    if mori.shmem.shmem_device_error_pending() is not None:
        errors.append("abort + report: the abort is still pending after check_device_error")
    check_cleared("abort + report")
    env.barrier()
    env.fail_together(errors)
    roundtrip(env, Spec(H=1024, K=4, Epr=4, M=64, iters=1, routing="random_neg", poison=False, seed=84), op=op,
              label="round trip after abort + report")
    env.close_ops()

    # --- a CUDA graph: the bad id in a replay is reported like an eager call's ------------------
    spec = Spec(H=1024, K=4, Epr=4, M=64, t_mode="max", routing="random_neg", poison=False, seed=85)
    op = checked_op(spec)
    g, (gouts, gout, gow), load = captured_round_trip(env, op, spec.M, 1024, 4, cdt,
                                                      make_data(env, spec, 0, spec.seed))
    bad = {0: [(3, 2, E + 1)]}
    load(with_bad_ids(make_data(env, spec, 1, spec.seed), bad))
    g.replay()
    torch.cuda.synchronize()
    _, msg = raised_by(op.check_device_error)
    same_everywhere("CUDA graph replay", msg, bad)
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    for it in (2, 3):  # clean replays after the report: exact
        data = make_data(env, spec, it, spec.seed)
        load(data)
        env.barrier()
        g.replay()
        verify_dispatch(env, spec, op, gouts, data, cnt, False, it)
        verify_combine(env, spec, op, gout, gow, data, cnt, False, it, cdt)
    _raise_on_counters(env, spec, op, cnt, None, "graph replays after the report", 2)
    check_cleared("graph replays")
    del g
    torch.cuda.synchronize()
    env.fail_together(errors)


def case_ll_types_any_max_tokens(env):
    """No kernel type caps max_num_inp_token_per_rank: an op of 4096 tokens per rank (SGLang's and
    vLLM's default) of the run's type (InterNodeV1LL: its LL path for lists of up to 256 records,
    V1's chunks above; AsyncLL: split-phase dispatch and combine at any size) round-trips calls of
    0, 1, 128, 256, 257 and 4096 tokens per rank bit-exact, fused and, where the op splits, split."""
    M = 4096
    spec0 = Spec(H=1024, K=4, Epr=4, M=M, uncapped=True, seed=86)
    op = spec_op(env, spec0)
    if op.config.max_num_inp_token_per_rank != M:
        raise CaseFailure(f"the op has {op.config.max_num_inp_token_per_rank} tokens per rank, not {M}")
    if env.args.config_kernel_type == "AsyncLL" and not op.split_dispatch_available:
        raise CaseFailure("an AsyncLL op of 4096 tokens per rank has no dispatch_send")
    for i, T in enumerate((0, 1, 128, 256, 257, M)):
        for split in ((False, True) if op.split_dispatch_available else (False,)):
            roundtrip(env, Spec(H=1024, K=4, Epr=4, M=M, uncapped=True, t_mode=T, iters=1, poison=False,
                                routing="random_neg", split=split, seed=87 + i),
                      op=op, label=f"{T} tokens per rank{' (split)' if split else ''}")
    # mixed counts in one call: some ranks above the LL bound, some below, one with none
    roundtrip(env, Spec(H=1024, K=4, Epr=4, M=M, uncapped=True, t_mode="vary", iters=4, poison=False, seed=95),
              op=op, label="mixed token counts")
    env.close_ops()


def small_cfg(env, **kw):
    """An IntraNode config for the lifecycle cases (H 2048 bf16, top-8 of 8 experts per rank)."""
    base = dict(rank=env.rank, world_size=env.W, hidden_dim=2048, scale_dim=0, scale_type_size=0,
                max_token_type_size=2, max_num_inp_token_per_rank=128, num_experts_per_rank=8,
                num_experts_per_token=8)
    base.update(kw)
    return env.config(**base)


def sleep_ms(env, ms):
    """Keeps the current stream busy for about `ms` milliseconds (GPU clock cycles, ~1.5-2 GHz)."""
    env.torch.cuda._sleep(int(ms * 2e6))


def case_config_mismatch_across_ranks(env):
    """A config that differs on one rank, a rank whose own config is invalid, and heap offsets out of
    step all raise InvalidUsageError on every rank, naming the rank and field; nothing stays
    allocated, nothing hangs, and a good op works afterwards."""
    mori = env.mori
    r, W = env.rank, env.W
    if W < 2:
        raise SkipCase("needs 2 ranks (a mismatch across ranks)")
    errors = []
    free0 = mori.shmem.shmem_heap_free_bytes()

    def expect(what, cfg, needle):
        expect_usage_error(mori, errors, what, lambda: env.new_op(cfg), needle)

    last = W - 1
    expect("hidden_dim differs on the last rank", small_cfg(env, hidden_dim=1024 if r == last else 2048),
           f"PE {last} has hidden_dim = 1024 but PE 0 has 2048")
    expect("top-k differs on rank 1", small_cfg(env, num_experts_per_token=4 if r == 1 else 8),
           "PE 1 has num_experts_per_token = 4 but PE 0 has 8")
    expect("max tokens differ on rank 0", small_cfg(env, max_num_inp_token_per_rank=64 if r == 0 else 128),
           "has max_num_inp_token_per_rank = 128 but PE 0 has 64")
    expect("quant_type differs on rank 1", small_cfg(env, quant_type="fp8_direct_cast" if r == 1 else "none"),
           "PE 1 has quant_type = 1 but PE 0 has 0")
    # rank 1's own config is invalid: it raises its own error, the others name it
    expect("invalid config on rank 1", small_cfg(env, num_experts_per_token=0 if r == 1 else 8),
           "num_experts_per_token" if r == 1 else "PE 1 cannot create the EP op")
    if mori.shmem.shmem_heap_free_bytes() != free0:
        errors.append(f"heap free bytes changed: {free0} -> {mori.shmem.shmem_heap_free_bytes()}")
    # launch defaults may differ per rank
    op = env.new_op(small_cfg(env, block_num=20 + r, warp_num_per_block=4 + (r % 2)))
    op.close()
    # heap offsets out of step: rank 0 alone holds an extra allocation
    extra = mori.shmem.shmem_malloc(1 << 20) if r == 0 else None
    expect("heap offsets differ", small_cfg(env), "symmetric heap offset")
    if extra is not None:
        mori.shmem.shmem_free(extra)
    if mori.shmem.shmem_heap_free_bytes() != free0:
        errors.append(f"heap free bytes changed after the offset check: {free0} -> {mori.shmem.shmem_heap_free_bytes()}")
    env.close_ops()
    env.fail_together(errors)
    roundtrip(env, Spec(H=2048, M=128, seed=50), label="good op after the mismatches")


def case_copy_on_side_stream(env):
    """copy=True with stream=<a side stream whose kernel finishes late>: the copies, made on the
    current stream, see the finished outputs (not the poison written before the call)."""
    torch = env.torch
    r = env.rank
    spec = Spec(H=2048, K=8, Epr=8, M=128, seed=51, poison=True)
    op = env.new_op(small_cfg(env), check_inputs=False)
    data = make_data(env, spec, 0, spec.seed)
    X, IDX, WT, SC, Ts = data
    T = Ts[r]
    x, idx, w = X[r, :T].contiguous(), IDX[r, :T].contiguous(), WT[r, :T].contiguous()
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    errors = []
    env.barrier()
    op.debug_fill_buffers(0xFF)
    env.barrier()
    side = torch.cuda.Stream(device=env.dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sleep_ms(env, 300)
    c_tok, c_w, _, c_idx, c_total = op.dispatch(x, w, None, idx, copy=True, stream=side)
    views = (op._view("dispatch_tokens", "dispatch_out_tokens", (env.W * spec.M, 2048), torch.bfloat16),
             op._view("dispatch_weights", "dispatch_out_weights", (env.W * spec.M, 8), torch.float32), None,
             op._view("dispatch_indices", "dispatch_out_indices", (env.W * spec.M, 8), torch.int32),
             op.total_recv_token_num)
    torch.cuda.synchronize()
    n = int(views[4].item())
    if int(c_total.item()) != n or c_tok.shape[0] != n:
        errors.append(f"dispatch copy: total {int(c_total.item())}, {c_tok.shape[0]} rows; the op has {n}")
    elif not (torch.equal(c_tok.view(torch.int16), views[0][:n].view(torch.int16)) and torch.equal(c_w, views[1][:n])
              and torch.equal(c_idx, views[3][:n])):
        errors.append("dispatch copy differs from the finished output")
    verify_dispatch(env, spec, op, views, data, cnt, True, 0)
    # combine: registered input written on the current stream; the kernel on the side stream starts late
    cdt = torch.bfloat16
    cin = op.get_registered_combine_input_buffer(cdt, 2048)
    cin.copy_(expert_fn(views[0], r, cdt))
    cw = views[1] * float(r + 1)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sleep_ms(env, 300)
    c_out, c_ow = op.combine(cin, cw, idx, copy=True, stream=side)
    out_view = op._view("combine_tokens", "combine_out_tokens", (spec.M, 2048), cdt)[:T]
    ow_view = op._view("combine_weights", "combine_out_weights", (spec.M, 8), torch.float32)[:T]
    torch.cuda.synchronize()
    if not (torch.equal(c_out.view(torch.int16), out_view.view(torch.int16)) and torch.equal(c_ow, ow_view)):
        errors.append("combine copy differs from the finished output")
    verify_combine(env, spec, op, c_out, c_ow, data, cnt, False, 0, cdt)
    _raise_on_counters(env, spec, op, cnt, None, "copy on a side stream", 1)
    if errors:
        raise CaseFailure("; ".join(errors))


def case_receive_cap(env):
    """max_total_recv_tokens below what rank 0 receives (every token goes to rank 0): rank 0's
    dispatch raises an error naming the cap (from the device record) instead of writing past its
    buffers; senders whose rows would not fit report it too and write nothing. A new op works."""
    mori = env.mori
    W, r = env.W, env.rank
    if W < 2:
        raise SkipCase("needs 2 ranks (rank 0 must receive more than one rank's tokens)")
    M = 64
    spec = Spec(H=1024, M=M, routing="one_rank", t_mode="max", seed=61, poison=False, weights=True)
    cfg = env.config(rank=r, world_size=W, hidden_dim=1024, scale_dim=0, scale_type_size=0, max_token_type_size=2,
                     max_num_inp_token_per_rank=M, num_experts_per_rank=spec.Epr, num_experts_per_token=spec.K,
                     max_total_recv_tokens=M + M // 2)
    op = env.new_op(cfg, check_inputs=False)
    X, IDX, WT, SC, Ts = make_data(env, spec, 0, spec.seed)
    env.barrier()
    op.dispatch(X[r, :M].contiguous(), WT[r, :M].contiguous(), None, IDX[r, :M].contiguous())
    msg = None
    kind = None
    try:
        env.torch.cuda.synchronize()
        mori.shmem.shmem_check_device_error()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        kind = type(e)
    errors = []
    # rank 0 receives W * M rows > cap; senders s >= 2 start beyond the cap (s * M + M > cap).
    # InterNodeV1/V1LL: the rows of another node's sender are placed (and refused) by its rail peer
    # on rank 0's node, so exactly the ranks of that node report it; they record it when their
    # dispatch ends, after every signal of the call (the other node's ranks finish without error).
    must_fail = r == 0 or r * M + M > M + M // 2
    if env.v1:
        must_fail = r // env.v1_nodes == 0
    if must_fail and (msg is None or "max_total_recv_tokens" not in msg):
        errors.append(f"expected an error naming max_total_recv_tokens, got {msg!r}")
    if must_fail and kind is not mori.InvalidUsageError:
        errors.append(f"a usage violation found on the device must raise InvalidUsageError, got {kind}: {msg}")
    if not must_fail and msg is not None:
        errors.append(f"unexpected error: {msg}")
    env.barrier()
    env.close_ops()
    env.fail_together(errors)
    roundtrip(env, Spec(H=1024, M=M, seed=62), label="after the receive-cap error")


def case_combine_input_too_short(env):
    """Combine input with fewer rows than the last dispatch received (external input, one row
    short on every rank): the kernel finds it and shmem_check_device_error raises
    mori.InvalidUsageError (not a TimeoutError) naming the check, the rows found and required,
    and no wait. Every token goes to every rank, so every rank receives rows and fails alike
    (nobody waits for a peer that gave up). A new op works afterwards."""
    torch = env.torch
    mori = env.mori
    W, r = env.W, env.rank
    H, K, Epr, T = 1024, 8, 8, 32
    if W > K:
        raise SkipCase(f"needs world size <= top-k ({K}) so that every rank receives rows")
    cfg = env.config(rank=r, world_size=W, hidden_dim=H, scale_dim=0, scale_type_size=0, max_token_type_size=2,
                     max_num_inp_token_per_rank=T, num_experts_per_rank=Epr, num_experts_per_token=K,
                     use_external_inp_buf=True)
    op = env.new_op(cfg, check_inputs=False)
    t = torch.arange(T, device=env.dev).view(T, 1)
    k = torch.arange(K, device=env.dev).view(1, K)
    idx = (((t + k) % W) * Epr + k).to(torch.int32)  # K distinct experts, every rank among them (W <= K)
    x = torch.randn((T, H), device=env.dev).to(torch.bfloat16)
    env.barrier()
    outs = op.dispatch(x, None, None, idx)
    total = int(outs[4].item())
    errors = []
    if total != W * T:
        errors.append(f"dispatch received {total} rows, expected {W * T}")
    short = outs[0][: total - 1].clone()
    op.combine(short, None, idx)
    kind, msg = None, None
    torch.cuda.synchronize()
    pending = mori.shmem.shmem_device_error_pending()
    try:
        mori.shmem.shmem_check_device_error()
    except Exception as e:  # noqa: BLE001
        kind, msg = type(e), str(e)
    if kind is not mori.InvalidUsageError:
        errors.append(f"expected mori.InvalidUsageError, got {kind.__name__ if kind else 'no error'}: {msg}")
    elif "fewer rows than dispatch received" not in msg or f"found {total - 1}, required >= {total}" not in msg:
        errors.append(f"message does not name the check and its values: {msg}")
    elif "wait" in msg:
        errors.append(f"a violated check reads like a wait: {msg}")
    if pending is None or "fewer rows" not in pending:
        errors.append(f"shmem_device_error_pending did not describe it: {pending!r}")
    if mori.shmem.shmem_device_error_pending() is not None:
        errors.append("the error is still pending after it was read")
    env.barrier()
    env.close_ops()  # the failed combine left this op's signals out of step
    env.fail_together(errors)
    roundtrip(env, Spec(H=1024, M=T, seed=63, mode="external_exact"), label="after the short combine input")


def case_refused_after_device_abort(env):
    """While a device abort is pending, dispatch and combine raise mori.TimeoutError before
    launching; once the error is read, the op works again."""
    mori = env.mori
    spec = Spec(H=2048, M=128, seed=52, poison=False)
    op = roundtrip(env, spec, label="before the abort")
    data = make_data(env, spec, 0, spec.seed)
    X, IDX, WT, SC, Ts = data
    r = env.rank
    x, idx = X[r, : Ts[r]].contiguous(), IDX[r, : Ts[r]].contiguous()
    errors = []
    env.barrier()
    mori.shmem.shmem_abort_device_waits()  # what an expired host wait does
    if mori.shmem.shmem_device_error_pending() is None:
        errors.append("no pending error after shmem_abort_device_waits")
    for what, call in (("dispatch", lambda: op.dispatch(x, None, None, idx)),
                       ("combine", lambda: op.combine(op.get_registered_combine_input_buffer(env.torch.bfloat16), None, idx))):
        try:
            call()
            errors.append(f"{what}: launched while an abort was pending")
        except mori.TimeoutError as e:
            if "refused" not in str(e):
                errors.append(f"{what}: unexpected message: {e}")
        except Exception as e:  # noqa: BLE001
            errors.append(f"{what}: raised {type(e).__name__}: {e}")
    if mori.shmem.shmem_device_error_pending() is None:
        errors.append("a refused call cleared the pending error")
    try:
        op.check_device_error()
        errors.append("check_device_error did not raise")
    except mori.TimeoutError:
        pass
    if mori.shmem.shmem_device_error_pending() is not None:
        errors.append("the error is still pending after it was read")
    env.barrier()
    env.fail_together(errors)
    roundtrip(env, spec, op=op, label="after the error was read")


def case_destroy_while_peers_combine(env):
    """20 times: create an op, dispatch, combine, destroy (close() and the destructor, alternately).
    Rank 0 has no tokens and every other rank sends all its tokens to rank 0's experts and combines
    with one warp, so the peers still read rank 0's combine input (and then write its inboxes) for
    tens of milliseconds after rank 0's own combine ended. Destruction must wait for them: the
    symmetric block every rank allocates next (same offset) must not be read or written by a
    combine, every combine must be right, and neither the symmetric heap nor device memory may
    grow."""
    torch = env.torch
    mori = env.mori
    r = env.rank
    if env.W < 2:
        raise SkipCase("needs 2 ranks (peers still combining)")
    H, M = 7168, 2048
    spec = Spec(H=H, K=8, Epr=8, M=M, t_mode=M, routing="one_rank", seed=53, poison=False)
    X, IDX, WT, SC, Ts = make_data(env, spec, 0, spec.seed)
    Ts = [0] + Ts[1:]  # rank 0 dispatches nothing (its combine has nothing to read)
    data = (X, IDX, WT, SC, Ts)
    T = Ts[r]
    x, idx, w = X[r, :T].contiguous(), IDX[r, :T].contiguous(), WT[r, :T].contiguous()
    cdt = torch.bfloat16
    c_launch = (-1, -1) if r == 0 else (1, 1)  # launch shapes may differ per rank
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    errors = []
    free0 = mori.shmem.shmem_heap_free_bytes()
    mem_warm = None
    local_bytes = 0
    # Free memory is per GPU: ranks that share one (--nproc above the GPU count) measure it at the
    # same point, between barriers, and the bound scales with their number.
    share = sum(1 for q in range(env.W) if q % torch.cuda.device_count() == env.dev.index)

    def gpu_free():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        env.barrier()
        free = torch.cuda.mem_get_info(env.dev)[0]
        env.barrier()
        return free

    step = host_steps(env)

    for it in range(20):
        step(it, "create")
        op = mori.ops.EpDispatchCombineOp(small_cfg(env, hidden_dim=H, max_num_inp_token_per_rank=M), check_inputs=False)
        step(it, "created")
        local_bytes, symm_bytes = op.local_bytes, op.symmetric_bytes
        outs = op.dispatch(x, w, None, idx)
        cin = op.get_registered_combine_input_buffer(cdt, H)
        cin.copy_(expert_fn(outs[0], r, cdt))
        cw = outs[1] * float(r + 1)
        step(it, "dispatch launched")
        out, ow = op.combine(cin, cw, idx, block_num=c_launch[0], warp_per_block=c_launch[1])
        step(it, "combine launched")
        out, ow = out.clone(), ow.clone()
        del outs, cin, cw
        if it % 2 == 0:
            op.close()
        del op  # odd iterations: the destructor releases
        step(it, "released")
        block = mori.shmem.shmem_malloc(symm_bytes)
        pattern = mori.shmem.tensor_from_ptr(block, (symm_bytes,), torch.uint8, env.dev)
        pattern.fill_(0x5A)
        env.barrier()  # every rank's combine has finished by now
        if not bool((pattern == 0x5A).all().item()):
            errors.append(f"iteration {it}: a combine wrote into memory freed by a destroyed op")
        del pattern
        mori.shmem.shmem_free(block)
        verify_combine(env, spec, None, out, ow, data, cnt, False, 0, cdt)
        if it == 0:
            mem_warm = gpu_free()
        if env.any_rank(errors):  # every rank leaves the loop together (collectives follow)
            break
    mem_end = gpu_free()
    if mori.shmem.shmem_heap_free_bytes() != free0:
        errors.append(f"symmetric heap free bytes {free0} -> {mori.shmem.shmem_heap_free_bytes()}")
    if mem_warm is not None and mem_end < mem_warm - share * (2 * local_bytes + (4 << 20)):
        errors.append(f"device memory shrank by {(mem_warm - mem_end) / 2**20:.1f} MiB over 19 create/destroy "
                      f"cycles (an op has {local_bytes / 2**20:.1f} MiB local)")
    _raise_on_counters(env, spec, None, cnt, None, "combines before destruction", 20)
    if errors:
        raise CaseFailure("; ".join(errors))


# ---------------------------------------------------------------------------------------------
# Failure modes: ranks out of step, a peer that never calls, an RDMA request that fails
# ---------------------------------------------------------------------------------------------
SHORT_DEVICE_TIMEOUT_MS = 3000  # device wait bound of the one op whose call is made to fail


def _gpu_delay(env):
    """A function queueing about `ms` milliseconds of GPU work on the current stream without
    allocating: torch.cuda._sleep, else fp32 matmuls into tensors allocated (and cuBLAS set up)
    here, before any op call is in flight."""
    torch = env.torch
    if hasattr(torch.cuda, "_sleep"):
        return lambda ms: sleep_ms(env, ms)
    a = torch.ones((4096, 4096), device=env.dev)
    out = torch.empty_like(a)
    torch.matmul(a, a, out=out)
    torch.cuda.synchronize()

    def busy(ms):
        for _ in range(max(1, int(ms) // 2)):  # a 4096^3 fp32 matmul takes a few ms
            torch.matmul(a, a, out=out)

    return busy


def case_skewed_ranks(env):
    """Round trips with the ranks out of step. Before call c (dispatches and combines counted
    together, the same on every rank), rank c % W sleeps on the host (20-200 ms) and rank
    (c + 1) % W queues 40-200 ms of GPU work ahead of the call, so every phase has a peer that
    starts late, on the host or on the GPU, and a different one each time. Dispatch bit-exact and
    combine bitwise as in roundtrip, for an op with M 128 (push combine) and zero-copy
    input, and one with M 384 (pull) and external input. Under the RDMA emulator the delays stay
    host sleeps between calls and GPU work on memory allocated before (docs/rdma.md, "Host
    run-ahead")."""
    W, r = env.W, env.rank
    if W < 2:
        raise SkipCase("needs 2 ranks (one late for the others)")
    host_ms = (20, 200, 60, 140, 100, 30, 180)
    gpu_ms = (150, 40, 200, 80, 120)
    gpu_delay = _gpu_delay(env)
    calls = [0]

    def skew():
        c = calls[0]
        calls[0] += 1
        if r == c % W:
            time.sleep(host_ms[c % len(host_ms)] / 1000.0)
        if r == (c + 1) % W:
            gpu_delay(gpu_ms[c % len(gpu_ms)])

    specs = [("M 128, zero-copy input", Spec(H=2048, M=128, t_mode="vary", poison=False, iters=4, seed=90)),
             ("M 384, external input", Spec(H=4096, M=384, mode="external", poison=False, iters=4, seed=91))]
    for label, spec in specs:
        roundtrip(env, spec, label=f"skewed ranks, {label}", before_call=skew)
        env.close_ops()


def _timeout_fields(msg):
    """(peer, waited ms) of a device wait timeout's message; None where the message has none."""
    import re

    peer = re.search(r"on peer (-?\d+)", msg or "")
    waited = re.search(r"waited ([0-9.]+) ms", msg or "")
    return (int(peer.group(1)) if peer else None, float(waited.group(1)) if waited else None)


def _bounded_barrier(env, seconds, what):
    """dist.barrier that raises CaseFailure after `seconds` instead of waiting for ever."""
    work = env.dist.barrier(async_op=True)
    deadline = time.monotonic() + seconds
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise CaseFailure(f"{what}: the other ranks did not reach the barrier within {seconds:.0f} s")
        time.sleep(0.01)
    work.wait()


def _sync_error(env):
    """(exception type, message) raised by a bounded synchronisation of the current stream (it
    raises the recorded device error and clears it), (None, None) without error."""
    try:
        env.mori.shmem.shmem_stream_synchronize()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, None


def _check_timeout(env, errors, kind, msg, allowed, what):
    """A device wait timeout at the op's short bound, attributed to a peer in `allowed`. Returns
    the peer named (None if there is none)."""
    mori = env.mori
    if kind is not mori.TimeoutError:
        errors.append(f"{what}: expected mori.TimeoutError, got {kind.__name__ if kind else 'no error'}: {msg}")
        return None
    peer, waited = _timeout_fields(msg)
    if "device wait timed out" not in msg or peer is None or waited is None:
        errors.append(f"{what}: not an attributed device wait timeout: {msg}")
        return None
    if peer not in allowed:
        errors.append(f"{what}: the wait that expired names peer {peer}, expected {sorted(allowed)}: {msg}")
    # The op's bound, not the job's (the shmem default's), ended the wait.
    job_ms = int(os.environ.get("MORI_DEVICE_TIMEOUT_MS", "60000"))
    if waited < SHORT_DEVICE_TIMEOUT_MS or (job_ms > SHORT_DEVICE_TIMEOUT_MS and waited >= job_ms):
        errors.append(f"{what}: waited {waited} ms, expected the op's bound of {SHORT_DEVICE_TIMEOUT_MS} ms "
                      f"(the job's is {job_ms} ms)")
    return peer


def case_missing_peer(env):
    """The highest rank does not make a dispatch call that the other ranks make. Their dispatch
    must end with a device timeout after this op's wait bound (SHORT_DEVICE_TIMEOUT_MS, set for
    this op alone with mori._C._testing.ep_set_device_timeout; the job's MORI_DEVICE_TIMEOUT_MS
    stays long), raised by shmem_stream_synchronize as mori.TimeoutError whose peer waited for is
    the missing rank (InterNodeV1/V1LL, ranks on its node: or one of its rail peers, whose counts
    reach that node only through the missing rank), and cleared once read. The missing rank waits
    at a host barrier bounded by the others' worst case and has no error. Then every rank destroys
    the op, and a new op's round trip is exact (recovery without re-initialising shmem)."""
    mori = env.mori
    W, r = env.W, env.rank
    if W < 2:
        raise SkipCase("needs 2 ranks (one stays away)")
    missing = W - 1
    allowed = {missing}
    if env.v1:
        G = env.v1_nodes
        if r // G == missing // G:
            allowed |= {p for p in range(W) if p % G == missing % G and p // G != missing // G}
    spec = Spec(H=2048, M=128, t_mode="max", routing="random", seed=92, poison=False)
    op = roundtrip(env, spec, label="before the missing call")
    X, IDX, WT, SC, Ts = make_data(env, spec, 0, spec.seed)
    x, idx, w = X[r, : Ts[r]].contiguous(), IDX[r, : Ts[r]].contiguous(), WT[r, : Ts[r]].contiguous()
    mori._C._testing.ep_set_device_timeout(op._h(), SHORT_DEVICE_TIMEOUT_MS)
    host_ms = int(os.environ.get("MORI_HOST_TIMEOUT_MS", "120000"))
    errors = []
    env.barrier()
    if r != missing:
        op.dispatch(x, w, None, idx)
        kind, msg = _sync_error(env)
        _check_timeout(env, errors, kind, msg, allowed, f"dispatch without rank {missing}")
        try:
            op.check_device_error()  # read already: nothing left
        except Exception as e:  # noqa: BLE001
            errors.append(f"check_device_error after the error was read raised {type(e).__name__}: {e}")
    # The others come once their dispatch timed out, or at worst once the host timeout of their
    # synchronisation aborted it.
    _bounded_barrier(env, (SHORT_DEVICE_TIMEOUT_MS + host_ms) / 1000.0 + 60, f"rank {r}")
    pending = mori.shmem.shmem_device_error_pending()
    if pending is not None:
        errors.append(f"a device error is pending after the timeout was read: {pending}")
    try:
        op.close()  # collective: every rank destroys the op whose epochs now disagree
    except Exception as e:  # noqa: BLE001
        errors.append(f"destroying the op after the timeout: {type(e).__name__}: {e}")
    env.close_ops()
    env.fail_together(errors)
    roundtrip(env, Spec(H=2048, M=128, seed=93), label="a new op after the missing call")


def _blame_reaches(named, start, culprit):
    """Whether following the peers named by timed-out ranks (named: rank -> peer) from `start`
    reaches `culprit` (every rank on the way timed out, no cycle)."""
    seen = set()
    q = start
    while q != culprit:
        if q in seen or q not in named:
            return False
        seen.add(q)
        q = named[q]
    return True


def case_bad_rdma_key(env):
    """Rank 0's RDMA requests to its first peer on another node (the victim) carry a wrong heap
    key (mori._C._testing.shmem_exchange_rdma_peer_key) during one dispatch. Rank 0's must end
    with mori.RemoteError: an RDMA error completion on a QP to the victim, syndrome 0x13 (remote
    access). The victim's must end with mori.TimeoutError (this op's short bound) naming rank 0;
    every other rank finishes without error or times out on a wait whose peer, followed from rank
    to timed-out rank, leads to rank 0 (rows and counts that only rank 0's failed QP carries).
    The QP stays failed, so the recovery is a new shmem session (finalize, init on every rank)
    in which a new op's round trip is exact. Needs a peer reached by RDMA (InterNode family)."""
    mori = env.mori
    testing = mori._C._testing
    W, r = env.W, env.rank
    culprit = 0
    victims = [p for p in range(W) if mori.shmem.shmem_node_of(p) != mori.shmem.shmem_node_of(culprit)]
    if not victims:  # NOT_APPLICABLE keeps this case to the InterNode family, which has several nodes
        raise CaseFailure(f"{env.args.kernel_type} with one node: no peer is reached by RDMA")
    victim = victims[0]
    spec = Spec(H=2048, M=128, t_mode="max", routing="random", seed=94, poison=False)
    op = roundtrip(env, spec, label="before the bad key")
    X, IDX, WT, SC, Ts = make_data(env, spec, 0, spec.seed)
    x, idx, w = X[r, : Ts[r]].contiguous(), IDX[r, : Ts[r]].contiguous(), WT[r, : Ts[r]].contiguous()
    testing.ep_set_device_timeout(op._h(), SHORT_DEVICE_TIMEOUT_MS)
    errors = []
    good_key = None
    env.barrier()  # no kernel of this rank runs while the key changes
    if r == culprit:
        if mori.shmem.shmem_transport_type(victim) != "rdma":
            errors.append(f"rank {victim} is on another node but not reached by RDMA "
                          f"({mori.shmem.shmem_transport_type(victim)})")
        else:
            good_key = testing.shmem_exchange_rdma_peer_key(victim, 0)
            testing.shmem_exchange_rdma_peer_key(victim, good_key ^ 0x00FFFF00)
    env.barrier()
    kind, msg = None, None
    try:
        op.dispatch(x, w, None, idx)
        kind, msg = _sync_error(env)
    except Exception as e:  # noqa: BLE001
        kind, msg = type(e), str(e)
    results = [None] * W
    env.dist.all_gather_object(results, (kind.__name__ if kind else None, msg))
    if r == culprit:
        import re

        to_pe = re.search(r"to pe (\d+)", msg or "")
        if kind is not mori.RemoteError:
            errors.append(f"expected mori.RemoteError, got {kind.__name__ if kind else 'no error'}: {msg}")
        elif ("RDMA error completion" not in msg or "QP 0x" not in msg or "syndrome 0x13" not in msg
              or to_pe is None or int(to_pe.group(1)) != victim):
            errors.append(f"the error does not name the QP to pe {victim} and syndrome 0x13: {msg}")
    else:
        named = {}
        for q, (kname, m) in enumerate(results):
            if kname == "TimeoutError":
                named[q] = _timeout_fields(m)[0]
        if r == victim:
            _check_timeout(env, errors, kind, msg, {culprit}, "the victim's dispatch")
        elif kind is not None:
            _check_timeout(env, errors, kind, msg, set(range(W)), "dispatch")
            if r in named and not _blame_reaches(named, r, culprit):
                errors.append(f"the peers named by timed-out ranks (rank: peer) do not lead from rank {r} "
                              f"to rank {culprit}: {named}")
    env.barrier()  # every rank's dispatch has ended
    if good_key is not None:
        testing.shmem_exchange_rdma_peer_key(victim, good_key)
    # The QP stays failed: every drain (the op's release here) records it again on rank 0.
    try:
        op.close()
    except Exception as e:  # noqa: BLE001
        errors.append(f"destroying the op after the RDMA error: {type(e).__name__}: {e}")
    env.close_ops()
    try:
        mori.shmem.shmem_check_device_error()
    except mori.RemoteError as e:
        if r != culprit:
            errors.append(f"a remote error on a rank whose keys were right: {e}")
    except Exception as e:  # noqa: BLE001
        errors.append(f"after closing the op: {type(e).__name__}: {e}")
    try:
        mori.shmem.shmem_finalize()
    except Exception as e:  # noqa: BLE001
        errors.append(f"shmem_finalize after the RDMA error: {type(e).__name__}: {e}")
    mori.shmem.shmem_torch_process_group_init("default")
    env.fail_together(errors)
    roundtrip(env, Spec(H=2048, M=128, seed=95), label="a new shmem session after the RDMA error")


def case_stress(env):
    iters = int(os.environ.get("MORI_EP_STRESS_ITERS", "0") or 0)
    if iters <= 0:
        raise SkipCase("set MORI_EP_STRESS_ITERS=N to run N randomized iterations")
    W = env.W
    dts = ["bf16", "fp16", "fp32", "fp8"]
    Hs = [2048, 1040, 512]
    modes = ["zero_copy", "external", "direct"]
    shapes = [(-1, -1), (W, 4), (2 * W + 3, max_warps(env)), (64, 8), (W + 1, 1)]
    spec = Spec(H=lambda it: Hs[(it // 4) % 3], dtype=lambda it: dts[it % 4], cdtype=None, K=8, Epr=max(4, -(-8 // env.W)), M=128,
                t_mode="vary", routing=lambda it: ("random_neg", "random", "two_ranks", "duplicates")[(it // 2) % 4],
                mode=lambda it: modes[(it // 3) % 3], wmode="external", iters=iters, poison=False,
                d_launch=lambda it: shapes[it % 5], c_launch=lambda it: shapes[(it + 3) % 5], cfg_H=2048, cfg_tts=4,
                check_every=500, seed=99)
    # fp8 iterations combine in bf16
    spec.combine_dtype = lambda it: "bf16" if dts[it % 4] == "fp8" else dts[it % 4]
    roundtrip(env, spec, label="stress")


# ---------------------------------------------------------------------------------------------
# Expert-major ("standard MoE") layout: convert_dispatch_output / dispatch_standard_moe and
# convert_combine_input / combine_standard_moe, against the torch references of ep_test_utils
# ---------------------------------------------------------------------------------------------
EM_NAMES = ["em_counts", "em_vs_local_expert_count", "em_src_rows", "em_src_pos", "em_tokens", "em_scales",
            "em_poison", "em_combine_input", "em_round_trip"]


def moe_expert_fn(cdt):
    """What local expert e of rank d returns for rows x: (x * (1 + d/8 + e/64)) in cdt (the factor is
    exact in fp32, so every rank computes the same products). e: a tensor broadcastable to x's rows."""
    def fn(x, d, e):
        return (x.float() * (1.0 + 0.125 * d + e.float() / 64)).to(cdt)

    return fn


def dispatch_views(env, op, x, w, sc, idx):
    """The dispatch outputs op.dispatch returns, for calls that did not return them."""
    torch = env.torch
    R, K = op.max_num_tokens_to_recv(), op.config.num_experts_per_token
    return (op._view("dispatch_tokens", "dispatch_out_tokens", (R, int(x.shape[1])), x.dtype),
            None if w is None else op._view("dispatch_weights", "dispatch_out_weights", (R, K), torch.float32),
            None if sc is None else op._view("dispatch_scales", "dispatch_out_scales", (R, op.config.scale_dim), sc.dtype),
            op._view("dispatch_indices", "dispatch_out_indices", (R, K), idx.dtype),
            op.total_recv_token_num)


def verify_expert_major(env, op, em, outs, cnt, poisoned):
    """em (an ExpertMajorOutput) against the layout reference of the dispatch outputs `outs` (which
    verify_dispatch checks against the inputs). Returns (ids [Rmax, K] with rows past total_recv
    set to -1, row_slot [Rmax, K]) for the way back."""
    torch = env.torch
    out_tok, out_w, out_s, out_i, total = outs
    R, Epr = out_i.shape[0], op.config.num_experts_per_rank
    valid_row = (torch.arange(R, device=env.dev) < total[0]).view(R, 1)
    ids = torch.where(valid_row, out_i.long(), torch.full_like(out_i.long(), -1))
    counts, src_rows, row_slot = U.expert_major_layout_torch(torch, ids, env.rank, Epr)
    got = em.counts.long()
    cnt[0] += (got != counts).sum()
    cnt[1] += (got != op.get_local_expert_count().long()).sum()
    valid = torch.arange(R, device=env.dev).view(1, R) < counts.view(Epr, 1)  # [Epr, Rmax]
    cnt[2] += ((em.src_rows.long() != src_rows) & valid).sum()
    g = src_rows.clamp(min=0)
    cnt[3] += ((em.src_pos.long() != op.get_dispatch_src_token_pos(sync=False).long()[g]) & valid).sum()
    tok = em.tokens.view(torch.uint8)  # [Epr, Rmax, row bytes]
    cnt[4] += ((tok != out_tok.view(torch.uint8)[g]).any(2) & valid).sum()
    if out_s is not None:
        cnt[5] += ((em.scales.view(torch.uint8) != out_s.view(torch.uint8)[g]).any(2) & valid).sum()
    if poisoned:  # slots past the counts are never written
        cnt[6] += ((tok != 0xFF).any(2) & ~valid).sum()
        cnt[6] += ((em.src_rows != -1) & ~valid).sum() + ((em.src_pos != -1) & ~valid).sum()
    return ids, row_slot


def standard_moe_roundtrip(env, spec, op=None, label="", external_weights=False):
    """spec.iters rounds of dispatch -> expert-major -> experts -> weighted way back -> combine,
    alternating the split calls (dispatch + convert_dispatch_output, convert_combine_input + combine)
    and the fused ones (dispatch_standard_moe, combine_standard_moe). Poisoned outputs; the layout,
    the converted combine input and the result bit-exact against the references. With
    external_weights the way back takes 2 x the dispatch's weights as a tensor (exact scaling)."""
    torch = env.torch
    W, r, Epr = env.W, env.rank, spec.Epr
    if op is None:
        op = spec_op(env, spec)
    cnt = torch.zeros(len(C_NAMES), dtype=torch.int64, device=env.dev)
    cnt_em = torch.zeros(len(EM_NAMES), dtype=torch.int64, device=env.dev)
    experts = torch.arange(Epr, device=env.dev).view(Epr, 1, 1)
    wscale = 2.0 if external_weights else 1.0
    for it in range(spec.iters):
        data = make_data(env, spec, it, spec.seed)
        X, IDX, WT, SC, Ts = data
        T = Ts[r]
        poisoned = spec.poison
        em_poisoned = poisoned and op._handle.expert_major_base != 0  # allocated by an earlier round
        if poisoned:
            env.barrier()
            op.debug_fill_buffers(0xFF)
            env.barrier()
        x, idx, w = X[r, :T].contiguous(), IDX[r, :T].contiguous(), WT[r, :T].contiguous()
        sc = SC[r, :T].contiguous() if SC is not None else None
        db, dw = spec.d_launch(it)
        cb, cw = spec.c_launch(it)
        split = it % 2 == 0
        if split:
            outs = op.dispatch(x, w, sc, idx, block_num=db, warp_per_block=dw)
            em = op.convert_dispatch_output(block_num=db, warp_per_block=dw)
        else:
            em = op.dispatch_standard_moe(x, w, sc, idx, block_num=db, warp_per_block=dw)
            outs = dispatch_views(env, op, x, w, sc, idx)
        verify_dispatch(env, spec, op, outs, data, cnt, poisoned, it)
        ids, row_slot = verify_expert_major(env, op, em, outs, cnt_em, em_poisoned)
        cdt = env.dt(spec.combine_dtype(it))
        fn = moe_expert_fn(cdt)
        y = fn(em.tokens, r, experts)  # slots past the counts hold poison (NaN): never to be read
        wts = outs[1] * 2.0 if external_weights else None
        if split:
            buf = op.convert_combine_input(y, wts, block_num=cb, warp_per_block=cw)
            out, out_w = op.combine(buf, None, idx, block_num=cb, warp_per_block=cw)
        else:
            out, out_w = op.combine_standard_moe(y, wts, idx, block_num=cb, warp_per_block=cw)
            buf = op.get_registered_combine_input_buffer(cdt, spec.H(it))
        iview = torch.int32 if cdt == torch.float32 else torch.int16
        ref_in = U.expert_major_combine_input_torch(torch, y, ids, outs[1] * wscale, row_slot, r, Epr)
        valid_row = torch.arange(ids.shape[0], device=env.dev) < outs[4][0]
        cnt_em[7] += ((buf.view(iview) != ref_in.view(iview)).any(1) & valid_row).sum()
        ref = U.standard_moe_combine_torch(torch, x, idx, w * wscale, W, Epr, fn, cdt, G=env.v1_nodes)
        cnt_em[8] += (out.view(iview) != ref.view(iview)).any(1).sum()
        if out_w is not None:
            cnt_em[8] += 1  # combine_standard_moe passes no weights to combine
    _raise_on_counters(env, spec, op, cnt, None, label, upto=spec.iters)
    bad = ", ".join(f"{EM_NAMES[i]}={v}" for i, v in enumerate(cnt_em.tolist()) if v)
    env.fail_together([f"{label} expert-major mismatches after {spec.iters} iterations: {bad}"] if bad else [])
    return op


def case_standard_moe(env):
    W = env.W
    rt = ("random_neg", "random", "duplicates", "two_ranks")
    standard_moe_roundtrip(env, Spec(H=2048, K=8, Epr=8, M=128, scale=(56, "f32"), routing=lambda it: rt[it % 4],
                                     iters=4, seed=70), label="bf16, f32 scales")
    env.close_ops()
    standard_moe_roundtrip(env, Spec(H=7168, K=8, Epr=max(4, -(-8 // W)), M=64, dtype="fp8", cdtype="bf16", scale=(56, "f32"),
                                     routing="two_ranks", t_mode="small", iters=2, seed=71), label="fp8 dispatch, bf16 experts")
    env.close_ops()
    mw = max_warps(env)
    standard_moe_roundtrip(env, Spec(H=1024, K=6, Epr=8, M=96, dtype="fp16", idx="int64", scale=(7, "u8"),
                                     routing="duplicates", iters=2, seed=72, d_launch=(W, 1), c_launch=(2 * W + 1, mw)),
                           label="fp16, int64 ids, byte scales, external weights", external_weights=True)
    env.close_ops()
    standard_moe_roundtrip(env, Spec(H=512, K=4, Epr=max(4, -(-4 // W)), M=256, dtype="fp32", routing="one_rank",
                                     t_mode="max", iters=2, seed=73), label="fp32, every token to rank 0")
    env.close_ops()
    op = standard_moe_roundtrip(env, Spec(H=1024, M=64, t_mode="zero_rank", iters=2, seed=74), label="a rank without tokens")
    standard_moe_roundtrip(env, Spec(H=1024, M=64, t_mode="all_zero", iters=1, seed=75), op=op, label="no tokens anywhere")
    standard_moe_roundtrip(env, Spec(H=1024, M=64, t_mode="vary", routing=lambda it: rt[it % 4], iters=6, poison=False,
                                     seed=76), op=op, label="back to back, no poison")


def case_standard_moe_column_major_scales(env):
    """convert_dispatch_output(column_major_scales=True): the same scales as the row-major
    conversion of the same dispatch (reference: the row-major result, transposed in the test), in
    DeepEP's layout: shape [Epr, Rmax, S], strides (S * Rmax, 1, Rmax); fp32 scales of a fused FP8
    dispatch (plain and UE8M0-packed int32) and byte scales of a plain dispatch; tokens, counts
    and sources unchanged; the row-major layout is the default again afterwards."""
    torch = env.torch
    r = env.rank
    errors = []
    specs = [
        ("fp8, fp32 scales", Spec(H=7168, M=64, quant="fp8", seed=82), {}),
        ("fp8 ue8m0, packed int32", Spec(H=7168, M=64, quant="fp8_ue8m0", seed=83), {}),
        ("bf16, byte scales", Spec(H=1024, M=96, scale=(7, "u8"), routing="duplicates", seed=84), {}),
    ]
    for label, spec, _ in specs:
        op = spec_op(env, spec)
        X, IDX, WT, SC, Ts = make_data(env, spec, 0, spec.seed)
        T = Ts[r]
        qkw = spec.quant_kw(0)
        sc = None if qkw or SC is None else SC[r, :T].contiguous()
        op.dispatch(X[r, :T].contiguous(), WT[r, :T].contiguous(), sc, IDX[r, :T].contiguous(), **qkw)
        row = op.convert_dispatch_output()
        ref = [t.clone() for t in (row.tokens, row.scales, row.counts, row.src_rows)]
        col = op.convert_dispatch_output(column_major_scales=True)
        E, R, S = ref[1].shape
        if tuple(col.scales.shape) != (E, R, S) or col.scales.stride() != (S * R, 1, R):
            errors.append(f"{label}: scales shape {tuple(col.scales.shape)} strides {col.scales.stride()}")
        if col.scales.dtype != ref[1].dtype:
            errors.append(f"{label}: scales dtype {col.scales.dtype} != {ref[1].dtype}")
        # the reference: the row-major scales, transposed to [E, S, Rmax] and back (a copy)
        want = ref[1].transpose(1, 2).contiguous().transpose(1, 2)
        valid = (torch.arange(R, device=env.dev).view(1, R) < ref[2].view(E, 1).long())  # [E, Rmax]
        ibits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ref[1].element_size()]
        bad = ((col.scales.view(ibits) != want.view(ibits)).any(2) & valid).sum().item() if E * R * S else 0
        if bad:
            errors.append(f"{label}: {bad} slots' column-major scales differ from the row-major ones")
        for name, a, b in (("counts", col.counts, ref[2]), ("src_rows", col.src_rows, ref[3])):
            if not torch.equal(a, b):
                errors.append(f"{label}: {name} changed")
        tok_bad = ((col.tokens.view(torch.uint8) != ref[0].view(torch.uint8)).any(2) & valid).sum().item()
        if tok_bad:
            errors.append(f"{label}: {tok_bad} token slots changed")
        again = op.convert_dispatch_output()
        if not again.scales.is_contiguous() or not torch.equal(
                (again.scales.view(ibits) != ref[1].view(ibits)).any(2) & valid, torch.zeros_like(valid)):
            errors.append(f"{label}: the row-major default after a column-major conversion differs")
        env.close_ops()
    if errors:
        raise CaseFailure("; ".join(errors))


def case_standard_moe_graph(env):
    """dispatch_standard_moe + experts + combine_standard_moe captured in one CUDA graph (after one
    eager round: the first conversion allocates), replayed with new inputs."""
    torch = env.torch
    r, W, T, Epr = env.rank, env.W, 100, 8
    spec = Spec(H=2048, K=8, Epr=Epr, M=128, t_mode=T, routing="random_neg", poison=False, seed=77)
    op = spec_op(env, spec)
    cdt = torch.bfloat16
    fn = moe_expert_fn(cdt)
    experts = torch.arange(Epr, device=env.dev).view(Epr, 1, 1)
    sx = torch.zeros((T, 2048), dtype=cdt, device=env.dev)
    sidx = torch.full((T, 8), -1, dtype=torch.int32, device=env.dev)
    sw = torch.zeros((T, 8), dtype=torch.float32, device=env.dev)

    def body():
        em = op.dispatch_standard_moe(sx, sw, None, sidx)
        out, _ = op.combine_standard_moe(fn(em.tokens, r, experts), indices=sidx)
        return em, out

    def load(it):
        X, IDX, WT, SC, Ts = make_data(env, spec, it, spec.seed)
        sx.copy_(X[r, :T])
        sidx.copy_(IDX[r, :T])
        sw.copy_(WT[r, :T])

    load(0)
    s = torch.cuda.Stream(device=env.dev)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    env.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        em, out = body()
    env.barrier()
    cnt = torch.zeros(len(EM_NAMES), dtype=torch.int64, device=env.dev)
    for it in range(1, 5):
        load(it)
        env.barrier()
        g.replay()
        outs = dispatch_views(env, op, sx, sw, None, sidx)
        verify_expert_major(env, op, em, outs, cnt, False)
        ref = U.standard_moe_combine_torch(torch, sx, sidx, sw, W, Epr, fn, cdt, G=env.v1_nodes)
        cnt[8] += (out.view(torch.int16) != ref.view(torch.int16)).any(1).sum()
    torch.cuda.synchronize()
    env.mori.shmem.shmem_check_device_error()
    bad = ", ".join(f"{EM_NAMES[i]}={v}" for i, v in enumerate(cnt.tolist()) if v)
    del g
    if bad:
        raise CaseFailure(f"graph replay mismatches: {bad}")


def case_standard_moe_bad_inputs(env):
    """Each bad expert-major call raises InvalidUsageError before launching; the op stays usable (a
    checked round trip follows). Also: the first conversion of an op inside a graph capture."""
    torch = env.torch
    mori = env.mori
    W = env.W
    spec = Spec(H=256, K=4, Epr=4, M=64, seed=78)
    op = spec_op(env, spec)
    T, H, K, Epr, R = 32, 256, 4, 4, op.max_num_tokens_to_recv()
    dev = env.dev
    x = torch.randn((T, H), device=dev).to(torch.bfloat16)
    idx = torch.randint(0, W * Epr, (T, K), device=dev, dtype=torch.int32)
    w = torch.rand((T, K), device=dev)
    y = torch.zeros((Epr, R, H), device=dev, dtype=torch.bfloat16)
    errors = []

    def expect(what, fn, needle=None):
        expect_usage_error(mori, errors, what, fn, needle)

    expect("convert_dispatch_output before dispatch", lambda: op.convert_dispatch_output(), "no dispatch yet")
    expect("convert_combine_input before dispatch", lambda: op.convert_combine_input(y), "no dispatch yet")
    expect("combine_standard_moe before dispatch", lambda: op.combine_standard_moe(y), "no dispatch yet")
    op.dispatch(x, None, None, idx)  # no weights
    expect("convert_combine_input before convert_dispatch_output", lambda: op.convert_combine_input(y, torch.zeros((R, K), device=dev)),
           "was not converted")
    op.convert_dispatch_output()
    expect("no weights anywhere", lambda: op.convert_combine_input(y), "no weights")
    op.dispatch(x, w, None, idx)
    expect("a dispatch since the conversion", lambda: op.convert_combine_input(y), "was not converted")
    op.convert_dispatch_output()
    expect("expert_out 2-D", lambda: op.convert_combine_input(y[0]))
    expect("expert_out experts", lambda: op.convert_combine_input(y[:1].contiguous()), "must have shape")
    expect("expert_out rows < max_num_tokens_to_recv", lambda: op.convert_combine_input(y[:, : R - 1].contiguous()), "must have shape")
    expect("expert_out int16", lambda: op.convert_combine_input(y.view(torch.int16)))
    if U.fp8_dtype(torch) is not None:
        expect("expert_out fp8", lambda: op.convert_combine_input(torch.zeros((Epr, R, H), device=dev, dtype=torch.uint8).view(U.fp8_dtype(torch))))
    expect("expert_out on the CPU", lambda: op.convert_combine_input(y.cpu()))
    expect("expert_out not contiguous", lambda: op.convert_combine_input(y.transpose(0, 1).contiguous().transpose(0, 1)))
    expect("expert_out hidden too large", lambda: op.convert_combine_input(torch.zeros((Epr, R, 2 * H), device=dev, dtype=torch.bfloat16)))
    expect("expert_out row not a multiple of 16 B", lambda: op.convert_combine_input(y[:, :, :12].contiguous()))
    expect("weights float16", lambda: op.convert_combine_input(y, torch.zeros((R, K), device=dev, dtype=torch.float16)))
    expect("weights columns", lambda: op.convert_combine_input(y, torch.zeros((R, K + 1), device=dev)))
    expect("weights rows", lambda: op.convert_combine_input(y, torch.zeros((R - 1, K), device=dev)), "must have shape")
    expect("combine_standard_moe indices shape", lambda: op.combine_standard_moe(y, indices=idx[:5].contiguous()))
    expect("combine_standard_moe rdma_block_num", lambda: op.combine_standard_moe(y, rdma_block_num=-7))
    # the first conversion of an op cannot be captured (it allocates)
    op2 = spec_op(env, spec)
    op2.dispatch(x, w, None, idx)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    refused = [None]
    try:
        with torch.cuda.graph(g):
            try:
                op2.convert_dispatch_output()
            except mori.InvalidUsageError as e:
                refused[0] = str(e)
    except Exception as e:  # noqa: BLE001
        errors.append(f"ending the capture after the refused conversion failed: {type(e).__name__}: {e}")
    if refused[0] is None or "graph capture" not in refused[0]:
        errors.append(f"first conversion during a capture: not refused as expected ({refused[0]})")
    del g
    env.barrier()
    env.fail_together(errors)
    # both ops still work: checked round trips
    standard_moe_roundtrip(env, spec, op=op2, label="after a refused capture")
    standard_moe_roundtrip(env, spec, op=op, label="after the bad calls")


def _check_phase_trace(env, tr, kind, grid):
    """One dumped launch of this rank (Chrome-trace dict): returns (epoch, start ns, end ns,
    clock uncertainty ns) of the launch; raises CaseFailure naming what is wrong."""
    L = env.mori.ops.trace.layout()
    r, W = env.rank, env.W
    meta = tr["otherData"]["mori_trace"]
    ev = tr["traceEvents"]
    pid, base = r + 1, meta["tid_base"]
    bad = []
    if len(meta["launches"]) != 1 or meta["launches"][0]["grid"] != grid or not meta["launches"][0]["complete"]:
        raise CaseFailure(f"{kind}: expected one complete launch of {grid} blocks, got {meta['launches']}")
    if not meta["clock"]["aligned"] or not 0 <= meta["clock"]["uncertainty_ns"] < 1_000_000:
        bad.append(f"clock sample missing or implausible: {meta['clock']}")
    if any(e.get("pid") != pid for e in ev):
        bad.append(f"an event not in process {pid}")
    procs = [e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"]
    if procs != [f"rank {r}"]:
        bad.append(f"process names {procs}")
    threads = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    want = {base: f"{kind} launches", **{base + 1 + b: f"{kind} block {b}" for b in range(grid)}}
    if threads != want:
        bad.append(f"thread names {sorted(threads.items())[:4]}... differ from one track per block")
    phases = [n for _, n in L["phases"][kind]]
    if not env.v1:  # phases only the InterNodeV1/V1LL kernels stamp (trace.hpp)
        phases = [n for n in phases if not n.startswith("v1_")]
    ns = lambda us: int(round(us * 1000))  # noqa: E731  (Perfetto's reading of a ts in us)
    arrivals = []
    first_ts, last_end = None, None
    for b in range(grid):
        tid = base + 1 + b
        xs = sorted((e for e in ev if e["ph"] == "X" and e["tid"] == tid), key=lambda e: e["ts"])
        names = [e["name"] for e in xs]
        expect = phases if kind == "dispatch" else [n for n in phases if n != "tail"]
        last_block = xs and xs[0]["args"]["arrival"] == grid
        if kind == "combine" and last_block:
            expect = phases
        if names != expect:
            bad.append(f"block {b}: phases {names}, expected {expect}")
            continue
        for a, c in zip(xs, xs[1:]):
            if ns(a["ts"]) + ns(a["dur"]) != ns(c["ts"]):
                bad.append(f"block {b}: {a['name']} and {c['name']} are not contiguous")
        if any(e["dur"] < 0 for e in xs):
            bad.append(f"block {b}: negative duration")
        if any(e["args"]["block"] != b or e["args"]["epoch"] != meta["launches"][0]["epoch"] for e in xs):
            bad.append(f"block {b}: args name another block or epoch")
        arrivals.append(xs[0]["args"]["arrival"])
        first_ts = ns(xs[0]["ts"]) if first_ts is None else min(first_ts, ns(xs[0]["ts"]))
        end = ns(xs[-1]["ts"]) + ns(xs[-1]["dur"])
        last_end = end if last_end is None else max(last_end, end)
        if kind == "combine":
            peers = [e["args"]["peer"] for e in ev if e["ph"] == "i" and e["tid"] == tid]
            if len(set(peers)) != len(peers) or any(not 0 <= p < min(W, L["peers"]) for p in peers):
                bad.append(f"block {b}: peer instants {peers}")
            if env.args.kernel_type == "IntraNode" and W <= L["peers"] and len(peers) < W - 1:
                bad.append(f"block {b}: {len(peers)} peer instants, expected >= {W - 1}")
    if sorted(arrivals) != list(range(1, grid + 1)):
        bad.append(f"arrival orders {sorted(arrivals)} are not 1..{grid}")
    spans = [e for e in ev if e["ph"] == "X" and e["tid"] == base]
    if len(spans) != 1 or (first_ts is not None and (ns(spans[0]["ts"]) != first_ts or
                                                      ns(spans[0]["ts"]) + ns(spans[0]["dur"]) != last_end)):
        bad.append("the launch slice does not span the blocks' slices")
    if bad:
        raise CaseFailure(f"{kind} trace: " + "; ".join(bad[:6]))
    origin = meta["origin_unix_ns"]
    return meta["launches"][0]["epoch"], origin + first_ts, origin + last_end, meta["clock"]["uncertainty_ns"]


def _v1_combine_waits_for(env, s):
    """Whether an InterNodeV1/V1LL combine on this rank waits for a signal of rank s's same combine:
    the ranks of its node (ready) and, V1LL, its rail peers (every channel's landing tail; V1 waits
    only for the channels that carry partials)."""
    G = env.v1_nodes
    same_node = s // G == env.rank // G
    rail = s % G == env.rank % G and env.args.kernel_type == "InterNodeV1LL"
    return same_node or rail


def case_profiler_kernel_names(env):
    """What a profiler shows of a call (torch.profiler's table, which ROCm/mori's and DeepEP's own
    tests read): for round trips of 512 tokens (pull combine; the LL types: 256) and of 128 (small
    batches: push combine), fused and split where the op has both halves, exactly one table row names
    EpDispatch<F>Kernel and one EpCombine<F>Kernel (F: the family the op runs as, InterNodeV1 for
    V1LL), exactly one row holds "dispatch" and one "combine" in lower case (the kernels'
    namespaces) and none "notify"; each row counts one launch per fused call and two per split
    call (its halves are launches of one kernel). Names: src/ops/dispatch_combine/kernel_args.hpp."""
    torch = env.torch
    from torch.profiler import ProfilerActivity, profile

    r = env.rank
    errors = []
    iters = 2
    family = {"InterNodeV1LL": "InterNodeV1"}.get(env.args.kernel_type, env.args.kernel_type)
    for M, t_mode in ((512, "max"), (128, "small")):  # the LL types: 256 and 128 (LL_MAX_TOKENS)
        cfg = small_cfg(env, max_num_inp_token_per_rank=M)
        M = cfg.max_num_inp_token_per_rank
        op = env.new_op(cfg, check_inputs=False)
        spec = Spec(H=2048, K=8, Epr=8, M=M, t_mode=t_mode, iters=1, poison=False, seed=67 + M)
        roundtrip(env, spec, op=op, label=f"warm-up M={M}")
        X, IDX, WT, _, Ts = make_data(env, spec, 0, spec.seed)
        x, w, sel = (t[r, : Ts[r]].contiguous() for t in (X, WT, IDX))
        ways = ["fused"] + (["split"] if op.split_dispatch_available and op.split_combine_available else [])
        for way in ways:
            torch.cuda.synchronize()
            env.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    if way == "split":
                        op.dispatch_send(x, w, None, sel)
                        outs = op.dispatch_recv()
                        op.combine_send(outs[0], outs[1], sel)
                        op.combine_recv()
                    else:
                        outs = op.dispatch(x, w, None, sel)
                        op.combine(outs[0], outs[1], sel)
                torch.cuda.synchronize()
            rows = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
            counts = {e.key: e.count for e in prof.key_averages()}
            what = f"M={M} {way} ({env.args.kernel_type})"
            for name in (f"EpDispatch{family}Kernel", f"EpCombine{family}Kernel", "dispatch", "combine"):
                hits = [line.strip()[:110] for line in rows if name in line]
                if len(hits) != 1:
                    errors.append(f"{what}: {len(hits)} profiler rows hold {name!r}: {hits}")
                    continue
                n = sum(c for k, c in counts.items() if name in k[:100])
                if n != iters * (2 if way == "split" else 1):
                    errors.append(f"{what}: the row holding {name!r} counts {n} launches for {iters} "
                                  f"{way} round trips")
            notify = [line.strip()[:110] for line in rows if "notify" in line]
            if notify:
                errors.append(f"{what}: rows hold 'notify': {notify}")
        env.close_ops()
    if errors:
        raise CaseFailure("; ".join(errors))


def case_phase_trace(env):
    """enable_trace, checked round trips (pull combine: 512 tokens; push combine: small batches),
    dump_dispatch_trace / dump_combine_trace: one track per block with the layout's phases in
    order, contiguous and non-negative, every arrival order once; on the common clock no rank's
    launch ends before another rank's same launch began (each waits for every rank's signal).
    Disabled, nothing more is recorded; bad trace arguments raise and the op stays usable."""
    import json
    import tempfile

    mori = env.mori
    r, W = env.rank, env.W
    for M, t_mode in ((512, "max"), (128, "small")):
        op = env.new_op(small_cfg(env, max_num_inp_token_per_rank=M), check_inputs=False)
        if env.any_rank(op.trace_enabled):
            raise CaseFailure("a new op traces before enable_trace")
        op.enable_trace(slots=8)
        spec = Spec(H=2048, K=8, Epr=8, M=M, t_mode=t_mode, iters=3, poison=False, seed=61 + M)
        roundtrip(env, spec, op=op, label=f"traced M={M}")
        T = op._handle.last_num_tokens
        with tempfile.TemporaryDirectory(prefix=f"mori_trace_rank{r}_") as d:
            pd = op.dump_dispatch_trace(os.path.join(d, "dispatch_rank{rank}.json"))
            pc = op.dump_combine_trace(d)
            if pd != os.path.join(d, f"dispatch_rank{r}.json") or pc != os.path.join(d, f"mori_combine_trace_rank{r}.json"):
                raise CaseFailure(f"dump paths {pd}, {pc}")
            with open(pd) as f:
                td = json.load(f)
            with open(pc) as f:
                tc = json.load(f)
            spans = [_check_phase_trace(env, td, "dispatch", op.resolve_launch(T, -1, -1, True)[0]),
                     _check_phase_trace(env, tc, "combine", op.resolve_launch(T, -1, -1, False)[0])]
            every = [None] * W
            env.dist.all_gather_object(every, spans)
            for k, kind in enumerate(("dispatch", "combine")):
                if len({every[s][k][0] for s in range(W)}) != 1:
                    raise CaseFailure(f"{kind}: ranks dumped different launches: {[every[s][k][0] for s in range(W)]}")
                for s in range(W):
                    if env.v1 and kind == "combine" and not _v1_combine_waits_for(env, s):
                        continue
                    _, start_s, _, unc_s = every[s][k]
                    _, _, end_me, unc_me = every[r][k]
                    slack = unc_s + unc_me + 5000
                    if end_me + slack < start_s:
                        raise CaseFailure(f"{kind}: on the common clock rank {r}'s launch ended "
                                          f"{(start_s - end_me) / 1e3:.1f} us before rank {s}'s began")
            all_d = op.dump_dispatch_trace(os.path.join(d, "all.json"), launches="all")
            with open(all_d) as f:
                recorded = json.load(f)["otherData"]["mori_trace"]["recorded_epochs"]
            if len(recorded) != spec.iters:
                raise CaseFailure(f"{spec.iters} traced dispatches, {len(recorded)} recorded: {recorded}")
            op.disable_trace()
            roundtrip(env, Spec(H=2048, K=8, Epr=8, M=M, t_mode=t_mode, iters=1, poison=False, seed=71), op=op,
                      label="after disable_trace")
            with open(op.dump_dispatch_trace(os.path.join(d, "after.json"), launches="all")) as f:
                after = json.load(f)["otherData"]["mori_trace"]["recorded_epochs"]
            if after != recorded or op.trace_enabled:
                raise CaseFailure(f"recorded after disable_trace: {recorded} -> {after}")
            for bad in (lambda: op.enable_trace(slots=0), lambda: op.dump_combine_trace(d, launches="bogus"),
                        lambda: op.dump_combine_trace(d, launches=10**6)):
                try:
                    bad()
                    raise CaseFailure("a bad trace argument was accepted")
                except mori.InvalidUsageError:
                    pass
        roundtrip(env, Spec(H=2048, K=8, Epr=8, M=M, t_mode=t_mode, iters=1, poison=False, seed=72), op=op,
                  label="after bad trace arguments")
        env.close_ops()


class SkipCase(Exception):
    pass


CASES = [
    ("random_topk_seeds", case_random_seeds),
    ("dtypes_and_combine_modes", case_dtypes),
    ("all_tokens_to_one_rank", case_all_to_one_rank),
    ("zero_tokens", case_zero_tokens),
    ("negative_and_duplicate_ids", case_negative_and_duplicates),
    ("several_experts_same_rank", case_same_rank_experts),
    ("topk_1_9_16", case_topk),
    ("hidden_sizes", case_hidden_sizes),
    ("max_tokens_exactly", case_max_tokens),
    ("small_batch_path", case_small_batch),
    ("fp8_dispatch_quantisation", case_fp8_dispatch),
    ("launch_shapes", case_launch_shapes),
    ("dispatch_only_and_combine_only_loops", case_dispatch_only_loop),
    ("combine_back_to_back", case_combine_back_to_back),
    ("push_combine_beside_full_gpu", case_push_combine_beside_full_gpu),
    ("ranks_skewed_by_sleeps", case_skewed_ranks),
    ("split_phase_combine", case_split_phase_combine),
    ("split_phase_dispatch", case_split_phase_dispatch),
    ("cuda_graph_replay", case_cuda_graph),
    ("bad_inputs", case_bad_inputs),
    ("bad_expert_id_on_one_rank", case_bad_expert_id_on_one_rank),
    ("ll_types_any_max_tokens", case_ll_types_any_max_tokens),
    ("config_mismatch_across_ranks", case_config_mismatch_across_ranks),
    ("fp8_direct_cast_combine", case_fp8_direct_cast),
    ("copy_on_side_stream", case_copy_on_side_stream),
    ("receive_cap_overflow", case_receive_cap),
    ("combine_input_too_short", case_combine_input_too_short),
    ("refused_after_device_abort", case_refused_after_device_abort),
    ("destroy_while_peers_combine", case_destroy_while_peers_combine),
    ("standard_moe_layout_and_way_back", case_standard_moe),
    ("standard_moe_column_major_scales", case_standard_moe_column_major_scales),
    ("standard_moe_cuda_graph", case_standard_moe_graph),
    ("standard_moe_bad_inputs", case_standard_moe_bad_inputs),
    ("phase_trace", case_phase_trace),
    ("profiler_kernel_names", case_profiler_kernel_names),
    ("back_to_back_iterations", case_back_to_back),
    ("missing_peer_times_out", case_missing_peer),
    ("bad_rdma_key_remote_error", case_bad_rdma_key),
    ("stress", case_stress),
]


# Cases that apply only to some runs: where a case's function gives a reason for the run's Topology,
# the case is not run, and the run lists it with the reason.
NOT_APPLICABLE = {
    "bad_rdma_key_remote_error": lambda t: "IntraNode has no RDMA" if t.runs_as == "IntraNode" else None,
    "push_combine_beside_full_gpu": lambda t: (
        f"{t.runs_as} has no push combine" if t.runs_as in ("InterNodeV1", "InterNodeV1LL")
        else "ranks share a GPU, so other ranks' kernels hold SMs too (run it with --nproc 1)"
        if t.world > t.gpus
        else "the RDMA emulator's copies need free SMs" if t.emulated_rdma else None),
}

# What decides which cases apply to a run: the kernel type its configs run as
# (EpDispatchCombineConfig.runs_as), its ranks, the GPUs they share, and whether the RDMA emulator
# serves peers.
Topology = collections.namedtuple("Topology", "runs_as world gpus emulated_rdma")

# The cases a run reports before and after those of CASES: before shmem_init, after shmem_finalize.
BEFORE_INIT, AFTER_FINALIZE = "use_before_shmem_init", "use_after_finalize"


def selected_cases(ks):
    """The names of the cases -k `ks` selects (a name containing one of them; every case without
    -k), in the order a run of one kernel type reports them."""
    return [n for n in (BEFORE_INIT, *(n for n, _ in CASES), AFTER_FINALIZE) if not ks or any(k in n for k in ks)]


def not_applicable(names, topology):
    """{name: why not} of the cases of `names` that do not apply to `topology`: a run lists them
    and does not run them."""
    why = {n: NOT_APPLICABLE[n](topology) for n in names if n in NOT_APPLICABLE}
    return {n: r for n, r in why.items() if r is not None}


def reported_name(name, kernel_type, kernel_types):
    """The name under which a run of `kernel_types` reports case `name` of `kernel_type`: the name
    itself where the run has one kernel type, `name[kernel_type]` where it has several."""
    return name if len(kernel_types) == 1 else f"{name}[{kernel_type}]"


def run_cases(ks, kernel_types):
    """[(reported name, case name, kernel type)] of the cases -k `ks` selects in a run of
    `kernel_types` (a reported name containing one of them; every case without -k), in the order
    the run reports them: use_before_shmem_init of each type, the cases of CASES of each type in
    turn, use_after_finalize of each type."""
    order = ([(BEFORE_INIT, kt) for kt in kernel_types] + [(n, kt) for kt in kernel_types for n, _ in CASES] +
             [(AFTER_FINALIZE, kt) for kt in kernel_types])
    named = [(reported_name(n, kt, kernel_types), n, kt) for n, kt in order]
    return [c for c in named if not ks or any(k in c[0] for k in ks)]


def case_names(ks, kernel_types):
    """The reported names of the cases -k `ks` selects in a run of `kernel_types`, in the order the
    run reports them (what --list prints)."""
    return [c[0] for c in run_cases(ks, kernel_types)]


def run_not_applicable(cases, topology_of):
    """{reported name: why not} of `cases` (run_cases' entries) that do not apply to the Topology
    topology_of(kernel type) of their kernel type."""
    why = {}
    for kt in dict.fromkeys(c[2] for c in cases):
        mine = {n: rep for rep, n, t in cases if t == kt}
        why.update({mine[n]: r for n, r in not_applicable(list(mine), topology_of(kt)).items()})
    return {c[0]: why[c[0]] for c in cases if c[0] in why}


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def worker(rank, world, local_rank, args):
    os.environ.setdefault("MORI_DEVICE_TIMEOUT_MS", "30000")
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "6G")
    import torch
    import torch.distributed as dist

    # --nproc above the GPU count puts several ranks on one GPU (shmem maps such peers as plain
    # device memory): the protocol runs, nothing crosses a link, kernels of different processes
    # take turns on the GPU (time slices), so it is slow.
    local_rank %= max(1, torch.cuda.device_count())
    torch.cuda.set_device(local_rank)
    U.init_process_group(dist, "gloo", rank, world)
    env = Env(rank, world, local_rank, args)
    mori = U.import_mori()
    env.mori = mori
    kernel_types = args.kernel_types

    def small_config(kernel_type):
        return env.config(kernel_type=kernel_type, rank=rank, world_size=world, hidden_dim=256, scale_dim=0,
                          scale_type_size=0, max_token_type_size=2, max_num_inp_token_per_rank=8,
                          num_experts_per_rank=1, num_experts_per_token=1)

    # Configs name the kernel type under test; the cases check the kernels it runs as (AsyncLL:
    # IntraNode on one node, InterNode across nodes; the config's runs_as).
    runs_as = {kt: small_config(kt).runs_as.name for kt in kernel_types}

    def switch_to(kt):
        """Makes `kt` the kernel type the cases test: args.config_kernel_type (env.config's default),
        args.kernel_type (what it runs as) and the specs' token cap (LL_MAX_TOKENS)."""
        args.config_kernel_type = kt
        args.kernel_type = runs_as[kt]
        Spec.max_tokens_cap = LL_MAX_TOKENS.get(kt)

    switch_to(kernel_types[0])
    results = []  # (name, status, message, seconds)

    def record(name, status, msg, secs):
        results.append((name, status, msg, secs))
        if rank == 0:
            line = f"[{status}] {name} ({secs:.1f} s)"
            if msg:
                line += f": {msg}"
            print(line, flush=True)

    cases = run_cases(args.k, kernel_types)
    reasons = run_not_applicable(
        cases, lambda kt: Topology(runs_as[kt], world, torch.cuda.device_count(), env.emulated_rdma))
    cases = [c for c in cases if c[0] not in reasons]
    if reasons and rank == 0:
        print("(not applicable here, not run: " + "; ".join(f"{n}: {r_}" for n, r_ in reasons.items()) + ")",
              flush=True)

    # --- use before shmem init (local) ---
    for name, _, kt in [c for c in cases if c[1] == BEFORE_INIT]:
        t0 = time.time()
        msg = None
        try:
            cfg = small_config(kt)
            try:
                mori.ops.EpDispatchCombineOp(cfg)
                msg = "no error"
            except mori.InvalidUsageError:
                pass
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
        _collect(env, record, name, msg, time.time() - t0)

    mori.shmem.shmem_torch_process_group_init("default")
    if rank == 0:
        under_test = ", ".join(kt + (f" (runs as {runs_as[kt]})" if runs_as[kt] != kt else "") for kt in kernel_types)
        print(f"mori EP {under_test} suite: {world} ranks, gpu_per_node {args.gpu_per_node or world}, {torch.cuda.get_device_name(local_rank)}, "
              f"backend {mori.backend() if callable(getattr(mori, 'backend', None)) else '?'}", flush=True)
        for kt in kernel_types:
            if kt in LL_MAX_TOKENS:
                print(f"note: the suite runs {kt} ops at up to {LL_MAX_TOKENS[kt]} tokens per rank (the cases "
                      "written for larger ops run at that size; ll_types_any_max_tokens runs 4096)", flush=True)
        if world > torch.cuda.device_count():
            print(f"note: {world} ranks share {torch.cuda.device_count()} GPU(s): the protocol runs between "
                  "processes, but no row crosses a link (peers on one GPU are plain device memory)", flush=True)

    functions = dict(CASES)
    for name, case, kt in [c for c in cases if c[1] in functions]:
        switch_to(kt)
        t0 = time.time()
        msg = None
        skip = None
        try:
            functions[case](env)
        except SkipCase as e:
            skip = str(e)
        except PeerFailed:
            pass  # another rank failed the case and reports it; this one left with it
        except CaseFailure as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
            if args.verbose:
                traceback.print_exc()
        try:
            torch.cuda.synchronize()
            mori.shmem.shmem_check_device_error()
        except Exception as e:  # noqa: BLE001
            msg = msg or f"device error: {type(e).__name__}: {e}"
        env.close_ops()
        if skip is not None:
            skips = [None] * world
            dist.all_gather_object(skips, skip)
            if rank == 0:
                print(f"[SKIP] {name}: {skip}", flush=True)
            results.append((name, "SKIP", skip, 0.0))
            continue
        _collect(env, record, name, msg, time.time() - t0)

    # --- use after finalize: an op of each type made before the one shmem_finalize refuses to
    # dispatch after it; each type's case takes the whole block's time ---
    after = [c for c in cases if c[1] == AFTER_FINALIZE]
    if after:
        t0 = time.time()
        msgs = {}
        ops = {}
        try:
            for name, _, kt in after:
                ops[name] = mori.ops.EpDispatchCombineOp(small_config(kt))
            torch.cuda.synchronize()
            dist.barrier()
            mori.shmem.shmem_finalize()
            x = torch.zeros((4, 256), dtype=torch.bfloat16, device=env.dev)
            idx = torch.zeros((4, 1), dtype=torch.int32, device=env.dev)
            for name, op in ops.items():
                try:
                    op.dispatch(x, None, None, idx)
                    msgs[name] = "no error"
                except mori.InvalidUsageError:
                    pass
                except Exception as e:  # noqa: BLE001
                    msgs[name] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            for name, _, _ in after:
                msgs.setdefault(name, f"{type(e).__name__}: {e}")
        ops.clear()
        secs = time.time() - t0
        for name, _, _ in after:
            _collect(env, record, name, msgs.get(name), secs)
    elif mori.shmem.shmem_is_initialized():
        mori.shmem.shmem_finalize()

    passed = sum(1 for r_ in results if r_[1] == "PASS")
    failed = sum(1 for r_ in results if r_[1] == "FAIL")
    skipped = sum(1 for r_ in results if r_[1] == "SKIP")
    if rank == 0:
        if skipped:
            print(f"({skipped} skipped)", flush=True)
        print(f"{passed} passed, {failed} failed", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def _collect(env, record, name, msg, secs):
    msgs = [None] * env.W
    env.dist.all_gather_object(msgs, msg)
    bad = [f"rank {i}: {m}" for i, m in enumerate(msgs) if m]
    record(name, "FAIL" if bad else "PASS", " | ".join(bad), secs)


def main(argv=None, default_kernel_type="IntraNode"):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0, help="spawn this many ranks (default: all GPUs) when not under torchrun")
    p.add_argument("-k", action="append", default=[],
                   help="run cases whose name (case[type] with several kernel types) contains this (repeatable)")
    p.add_argument("--b2b-iters", type=int, default=1000, help="iterations of back_to_back_iterations")
    p.add_argument("--kernel-type", action="append", choices=KERNEL_TYPES,
                   help=f"kernel family under test (default {default_kernel_type}); repeated, the run tests "
                        "each in turn in the same ranks and names each case line case[type]")
    p.add_argument("--gpu-per-node", type=int, default=0,
                   help="PEs per (virtual) node; InterNode with fewer than the ranks emulates RDMA between "
                        "nodes (MORI_GPU_PER_NODE, MORI_RDMA_EMULATE=1)")
    p.add_argument("--num-qp-per-pe", type=int, default=1,
                   help="config num_qp_per_pe, and shmem's QPs per RDMA peer (MORI_NUM_QP_PER_PE) unless set")
    p.add_argument("--list", action="store_true", help="print the names of the cases -k selects and exit")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.kernel_types = list(dict.fromkeys(args.kernel_type or [default_kernel_type]))
    args.kernel_type = args.kernel_types[0]
    if args.num_qp_per_pe != 1:
        os.environ.setdefault("MORI_NUM_QP_PER_PE", str(args.num_qp_per_pe))
    if args.gpu_per_node > 0:
        # Nodes are emulated: shmem's topology (and the emulated NIC between nodes) come from these,
        # set before any rank initialises CUDA.
        os.environ["MORI_GPU_PER_NODE"] = str(args.gpu_per_node)
        os.environ.setdefault("MORI_RDMA_EMULATE", "1")
    if args.list:
        for n in case_names(args.k, args.kernel_types):
            print(n)
        return 0
    nproc = U.rank_count(args.nproc)
    if nproc is None:
        return U.SKIP_EXIT
    if args.nproc <= 0 and nproc == 1:
        print("note: one GPU, so one rank: the kernels run, nothing crosses a link, and the cases "
              "about several ranks are skipped")
    return U.launch(worker, nproc, args)


if __name__ == "__main__":
    sys.exit(main())
