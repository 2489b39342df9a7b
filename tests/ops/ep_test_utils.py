"""Shared helpers of the EP (dispatch/combine) GPU tests and the benchmark: importing mori from a
build tree or an installation, process setup under torchrun or torch.multiprocessing, and
deterministic "global" test data (every rank generates every rank's inputs, so references need
no communication)."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_mori():
    """Import mori from an installation, $MORI_BUILD_DIR/python, or <repo>/build*/python."""
    try:
        import mori  # noqa: F401
        import mori._C  # noqa: F401
    except ImportError:
        cands = [os.environ.get("MORI_BUILD_DIR")]
        cands += [os.path.join(REPO, d) for d in sorted(os.listdir(REPO)) if d.startswith("build")]
        for cand in cands:
            if cand and os.path.isdir(os.path.join(cand, "python", "mori")):
                sys.path.insert(0, os.path.join(cand, "python"))
                for m in [m for m in sys.modules if m == "mori" or m.startswith("mori.")]:
                    del sys.modules[m]
                break
        import mori  # noqa: F401
    import mori.ops  # noqa: F401
    import mori.shmem  # noqa: F401

    return sys.modules["mori"]


# Spawned ranks meet through a file store in a fresh temporary folder (launch() sets its path):
# no TCP port is chosen for them, so nothing else on the machine can take it first.
STORE_FILE_ENV = "MORI_TEST_STORE_FILE"


def init_process_group(dist, backend, rank, world):
    """The ranks' process group: the file store of launch() for spawned ranks, else torchrun's
    env:// rendezvous."""
    path = os.environ.get(STORE_FILE_ENV)
    if path:
        dist.init_process_group(backend, init_method="file://" + path, rank=rank, world_size=world)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)


SKIP_EXIT = 77  # the skip exit code CTest and tools/run_gpu_tests.sh report as skipped


def rank_count(nproc):
    """The ranks a suite starts: --nproc when given, 0 under torchrun (its own ranks), else one per
    visible GPU. None when no GPU is visible (it has printed SKIPPED; exit with SKIP_EXIT)."""
    if nproc > 0 or "LOCAL_RANK" in os.environ:
        return nproc
    import torch

    nproc = torch.cuda.device_count()
    if nproc < 1:
        print("SKIPPED: needs a GPU, found none")
        return None
    return nproc


def launch(worker, nproc, args):
    """Run worker(rank, world, local_rank, args) in every rank: under torchrun (env) directly,
    else spawn `nproc` processes. Returns the exit code to use."""
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rc = worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]), args)
        return rc or 0
    import shutil
    import tempfile

    import torch.multiprocessing as mp

    store_dir = tempfile.mkdtemp(prefix="mori-ranks-")
    os.environ[STORE_FILE_ENV] = os.path.join(store_dir, "store")  # the spawned ranks inherit it
    try:
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        procs = [ctx.Process(target=_spawned, args=(worker, r, nproc, args, q)) for r in range(nproc)]
        for p in procs:
            p.start()
        _join_or_stop(procs)
    finally:
        os.environ.pop(STORE_FILE_ENV, None)
        shutil.rmtree(store_dir, ignore_errors=True)
    codes = [p.exitcode for p in procs]
    rcs = []
    while not q.empty():
        rcs.append(q.get())
    if any(c != 0 for c in codes):
        return 1
    return max(rcs) if rcs else 0


def _join_or_stop(procs, grace_s=10.0):
    """Waits for every rank process. A rank that dies (exit code != 0: a crash, or an error before
    or outside the cases) leaves the others waiting for it in a collective; they are stopped
    `grace_s` seconds later, so that a failed start ends the run promptly."""
    import time

    dead_since = None
    while any(p.is_alive() for p in procs):
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead and dead_since is None:
            dead_since = time.monotonic()
            print(f"rank {dead[0][0]} exited with code {dead[0][1]}: stopping the other ranks in "
                  f"{grace_s:.0f} s unless they end", flush=True)
        if dead_since is not None and time.monotonic() - dead_since > grace_s:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
            break
        for p in procs:
            p.join(0.2)
    for p in procs:
        p.join()


def _spawned(worker, rank, world, args, q):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    stacks_after = float(os.environ.get("MORI_TEST_STACKS_AFTER_S", "0"))
    if stacks_after > 0:
        # Diagnosis of a stall: every thread's Python stack, every `stacks_after` seconds.
        import faulthandler

        faulthandler.dump_traceback_later(stacks_after, repeat=True)
    rc = worker(rank, world, rank, args) or 0
    q.put(rc)


def fp8_dtype(torch):
    """The e4m3 flavour of this platform: e4m3fnuz on ROCm gfx942, else e4m3fn."""
    if getattr(torch.version, "hip", None) and hasattr(torch, "float8_e4m3fnuz"):
        try:
            arch = torch.cuda.get_device_properties(0).gcnArchName
        except Exception:  # noqa: BLE001
            arch = ""
        if "gfx94" in arch:
            return torch.float8_e4m3fnuz
    return getattr(torch, "float8_e4m3fn", None)


def gen_routing(torch, gen, device, T, E, K, Epr, W, mode):
    """[T, K] int64 expert ids for a routing mode (distinct ids unless the mode says otherwise)."""
    if T == 0:
        return torch.empty((0, K), dtype=torch.int64, device=device)
    if mode in ("random", "random_neg", "duplicates"):
        scores = torch.rand((T, E), generator=gen, device=device)
        idx = scores.topk(K, dim=1).indices
        if mode == "random_neg":
            drop = torch.rand((T, K), generator=gen, device=device) < 0.35
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
            idx[::7] = -1  # some tokens go nowhere
        if mode == "duplicates" and K >= 2:
            dup = torch.rand((T,), generator=gen, device=device) < 0.5
            idx[:, 1] = torch.where(dup, idx[:, 0], idx[:, 1])
        return idx
    if mode == "one_rank":  # every expert of every token on rank 0
        scores = torch.rand((T, Epr), generator=gen, device=device)
        return scores.topk(K, dim=1).indices
    if mode == "two_ranks":  # several experts of one token on the same rank: all K on <= 2 ranks
        scores = torch.rand((T, E), generator=gen, device=device)
        r1 = torch.randint(0, W, (T,), generator=gen, device=device)
        r2 = torch.randint(0, W, (T,), generator=gen, device=device)
        rank_of = torch.arange(E, device=device) // Epr
        boost = (rank_of[None, :] == r1[:, None]) | (rank_of[None, :] == r2[:, None])
        return (scores + boost.float() * 10.0).topk(K, dim=1).indices
    raise ValueError(f"unknown routing mode {mode}")


# --- combine references: IntraNode (flat) and InterNodeV1/V1LL (two-level) ----------------------
#
# What a token's combine returns, given the row each destination rank returns for it (already in
# the combine dtype: the experts' output) in ascending rank order. Every addition is an fp32
# addition, starting from +0.0 (as the kernels' accumulators), and the result is rounded to the
# combine dtype (round to nearest even).
#   IntraNode, InterNode:  out = round(sum over destination ranks d ascending of row_d)
#   InterNodeV1, V1LL:     P_n = round(sum over destination ranks d of node n, ascending, of row_d)
#                          out = round(sum over nodes n ascending that hold a destination of P_n)
# Node n holds ranks [n*G, (n+1)*G). The owner's own node takes its place in the ascending node
# order like any other (its partial is rounded too), so the result does not depend on which node
# owns the token. It equals the flat sum bitwise when there is one node or one GPU per node (a
# rounded value rounds to itself, and adding it to +0.0 changes nothing); otherwise each node adds
# one rounding and the additions are grouped differently. Weights (fp32) follow the same formula
# with fp32 as the combine dtype.

_FP_FORMATS = {"fp32": "f", "fp16": "e"}


def round_to(dtype, x):
    """x (a Python float) rounded to dtype ("fp32", "bf16", "fp16"), nearest even, as a Python
    float; overflow gives inf. Exact: struct's fp32/fp16 packing rounds to nearest even, and bf16
    keeps the high half of the fp32 bits after adding the rounding bias to the low half."""
    import math
    import struct

    if dtype == "bf16":
        x = round_to("fp32", x)
        if math.isnan(x) or math.isinf(x):
            return x
        bits = struct.unpack("<I", struct.pack("<f", x))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        if (bits >> 23) & 0xFF == 0xFF:  # rounded past the largest bf16
            return math.copysign(math.inf, x)
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    fmt = "<" + _FP_FORMATS[dtype]
    try:
        return struct.unpack(fmt, struct.pack(fmt, x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def fp32_add(a, b):
    """a + b in fp32 for fp32 values a, b: the double sum is exact or rounded once more finely, and
    rounding it to fp32 then gives the correctly rounded fp32 sum (53 >= 2 * 24 + 2 bits)."""
    return round_to("fp32", a + b)


def flat_combine_floats(rows, dtype):
    """IntraNode's combine of one element: rows[d] = rank d's returned value (a dtype value), or
    None when d is not a destination of the token."""
    acc = 0.0
    for v in rows:
        if v is not None:
            acc = fp32_add(acc, v)
    return round_to(dtype, acc)


def v1_combine_floats(rows, G, dtype):
    """InterNodeV1/V1LL's combine of one element: rows as flat_combine_floats, nodes of G ranks."""
    acc = 0.0
    for n in range(len(rows) // G):
        node_rows = [v for v in rows[n * G:(n + 1) * G] if v is not None]
        if node_rows:
            acc = fp32_add(acc, flat_combine_floats(node_rows, dtype))
    return round_to(dtype, acc)


def v1_combine_reference(torch, rows, masks, G, cdt):
    """InterNodeV1/V1LL's combine, for the GPU suite: rows[d] = [T, H] tensor in the combine dtype
    `cdt` (what rank d returns for each token; read only where masks[d], a [T] bool tensor, says d
    is a destination), nodes of G ranks. Returns [T, H] in cdt: the two-level formula above (the
    same fp32 additions in the same order as v1_combine_floats)."""
    T, H = rows[0].shape
    out = torch.zeros((T, H), dtype=torch.float32, device=rows[0].device)
    for n in range(len(rows) // G):
        part = torch.zeros_like(out)
        has = torch.zeros((T, 1), dtype=torch.bool, device=out.device)
        for d in range(n * G, (n + 1) * G):
            m = masks[d].view(T, 1)
            part = part + torch.where(m, rows[d].float(), 0.0)  # +0.0 leaves part unchanged
            has = has | m
        out = out + torch.where(has, part.to(cdt).float(), 0.0)
    return out.to(cdt)


# --- expert-major ("standard MoE") layout references ---------------------------------------------
#
# Received rows r = 0 .. R-1 in dispatch-output order, ids[r] = their K global expert ids; local
# expert e of rank `rank` has global id rank * Epr + e.
#   Layout: the slots of local expert e are the rows naming e (once per row, however often the
#           row names it) in ascending r; counts[e] is their number.
#   Way back (convert_combine_input): row r = round(sum over k ascending whose id is local of
#           fp32(weights[r][k] * y[e_k][slot of r under e_k])): each product rounded to fp32,
#           every addition an fp32 addition from +0.0, one rounding to y's dtype at the end.
#   Round trip (combine_standard_moe): token t's result = round(sum over its destination ranks d
#           ascending of the converted row rank d holds for it): the plain combine of the rows
#           above, so the routing weights are applied once, before each rank's rounding.


def fp32_mul(a, b):
    """a * b in fp32 for fp32 values a, b: their double product is exact (48 bits), rounded once."""
    return round_to("fp32", a * b)


def expert_major_layout(ids, rank, Epr):
    """Float form of the layout: ids = R lists of K ints. Returns (counts [Epr], src_rows = Epr
    lists of row indices, row_slot = R lists of K slots, -1 where the k-th id is not local)."""
    first = rank * Epr
    src_rows = [[] for _ in range(Epr)]
    row_slot = []
    for r, row in enumerate(ids):
        slot_of = {}
        for g in row:
            e = g - first
            if 0 <= e < Epr and e not in slot_of:
                slot_of[e] = len(src_rows[e])
                src_rows[e].append(r)
        row_slot.append([slot_of.get(g - first, -1) for g in row])
    return [len(s) for s in src_rows], src_rows, row_slot


def weighted_sum_floats(terms, dtype):
    """One element of convert_combine_input: terms = (weight, value) of the row's local experts in
    ascending k (values of `dtype`, weights fp32)."""
    acc = 0.0
    for w, v in terms:
        acc = fp32_add(acc, fp32_mul(w, v))
    return round_to(dtype, acc)


def standard_moe_combine_floats(terms_by_rank, dtype):
    """One element of combine_standard_moe: terms_by_rank[d] = the token's weighted_sum_floats terms
    on rank d, or None when d is not a destination."""
    return flat_combine_floats([None if t is None else weighted_sum_floats(t, dtype) for t in terms_by_rank], dtype)


def expert_major_layout_torch(torch, ids, rank, Epr):
    """Torch form of expert_major_layout: ids [R, K] (any int dtype; rows of no local expert, e.g.
    all -1, take no slot). Returns (counts [Epr] int64, src_rows [Epr, R] int64 (-1 past counts),
    row_slot [R, K] int64)."""
    ids = ids.long()
    R, K = ids.shape
    e = ids - rank * Epr
    local = (e >= 0) & (e < Epr)
    ec = torch.where(local, e, torch.zeros_like(e))
    experts = torch.arange(Epr, device=ids.device)
    hit = ((e.view(R, K, 1) == experts.view(1, 1, Epr)) & local.view(R, K, 1)).any(1)  # [R, Epr]
    slot = torch.cumsum(hit.long(), 0) - 1
    row_slot = torch.where(local, slot.gather(1, ec), torch.full_like(ec, -1))
    src_rows = torch.full((Epr, R), -1, dtype=torch.int64, device=ids.device)
    rows = torch.arange(R, device=ids.device).view(R, 1).expand(R, Epr)
    src_rows[experts.view(1, Epr).expand(R, Epr)[hit], slot[hit]] = rows[hit]
    return hit.long().sum(0), src_rows, row_slot


def expert_major_combine_input_torch(torch, y, ids, weights, row_slot, rank, Epr):
    """Torch form of convert_combine_input: y [Epr, S, H] (the experts' outputs), ids/weights/
    row_slot [R, K] (weights fp32). Returns [R, H] in y's dtype (weighted_sum_floats per element)."""
    R, K = ids.shape
    e = (ids.long() - rank * Epr).clamp(0, Epr - 1)
    acc = torch.zeros((R, y.shape[2]), dtype=torch.float32, device=y.device)
    for k in range(K):
        m = (row_slot[:, k] >= 0).view(R, 1)
        v = y[e[:, k], row_slot[:, k].clamp(min=0)].float()
        acc = acc + torch.where(m, weights[:, k:k + 1] * v, 0.0)  # + 0.0 leaves acc unchanged
    return acc.to(y.dtype)


def standard_moe_combine_torch(torch, x, ids, weights, W, Epr, expert_fn, cdt, G=None):
    """Torch form of combine_standard_moe on the tokens' own rank: x [T, H] its tokens, ids/weights
    [T, K] their routing; expert_fn(x, d, e) = what local expert e of rank d returns for rows x
    (e: a tensor of local expert ids broadcastable against x's rows), in cdt. Returns [T, H] cdt.
    G (InterNodeV1/V1LL, nodes of G ranks): the ranks' rows are combined by v1_combine_reference."""
    T, K = ids.shape
    ids = ids.long()
    out = torch.zeros((T, x.shape[1]), dtype=torch.float32, device=x.device)
    rows, masks = [], []
    for d in range(W):
        part = torch.zeros_like(out)
        dest = torch.zeros((T, 1), dtype=torch.bool, device=x.device)
        for k in range(K):
            m = ((ids[:, k] >= d * Epr) & (ids[:, k] < (d + 1) * Epr)).view(T, 1)
            y = expert_fn(x, d, (ids[:, k] - d * Epr).clamp(0, Epr - 1).view(T, 1))
            part = part + torch.where(m, weights[:, k:k + 1] * y.float(), 0.0)
            dest = dest | m
        out = out + torch.where(dest, part.to(cdt).float(), 0.0)
        rows.append(part.to(cdt))
        masks.append(dest.view(T))
    if G is not None:
        return v1_combine_reference(torch, rows, masks, G, cdt)
    return out.to(cdt)


# --- FP8 dispatch quantisation reference (docs/ep.md, "FP8 dispatch") -------------------------
#
# Per group of 128 elements of a bf16 row:
#   amax  = max |x|
#   scale = fp32(max(amax, fp8max * 2^-126) / fp8max)          (so 1/scale is finite)
#   round_scale / use_ue8m0: scale = 2^ceil(log2(scale))
#   inv   = fp32(1 / scale)
#   code  = e4m3(clamp(fp32(x * inv), -fp8max, fp8max))        (round to nearest even)
#   use_ue8m0: the scale's exponent byte (scale = 2^(byte - 127)), 4 per int32 word, little-endian,
#   unused bytes of a row's last word 0.
# fp8max is 448 (float8_e4m3fn) or 240 (float8_e4m3fnuz). Two forms: Python floats (exact, with the
# codes found by a nearest-value search), and torch (what the GPU suites compare the kernels with).

FP8_FORMATS = {"e4m3fn": (7, 448.0), "e4m3fnuz": (8, 240.0)}
QUANT_GROUP = 128


def fp8_decode_float(code, fmt):
    """Value of an e4m3 code (fmt "e4m3fn" or "e4m3fnuz"), NaN for the NaN codes."""
    import math

    bias, _ = FP8_FORMATS[fmt]
    sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 0x7
    if (fmt == "e4m3fn" and exp == 0xF and man == 0x7) or (fmt == "e4m3fnuz" and code == 0x80):
        return math.nan
    mag = man / 8.0 * 2.0 ** (1 - bias) if exp == 0 else (1.0 + man / 8.0) * 2.0 ** (exp - bias)
    return -mag if sign else mag


_FP8_TABLES = {}


def _fp8_table(fmt):
    if fmt not in _FP8_TABLES:
        _, fmax = FP8_FORMATS[fmt]
        codes = [c for c in range(0x80) if fp8_decode_float(c, fmt) <= fmax]  # NaN compares False
        _FP8_TABLES[fmt] = ([fp8_decode_float(c, fmt) for c in codes], codes)
    return _FP8_TABLES[fmt]


def fp8_encode_float(x, fmt):
    """x (a Python float) as an e4m3 code: the nearest value (ties to the even code), |x| beyond
    fp8max saturating, NaN to the NaN code, -0 kept by e4m3fn (0x80) and not by e4m3fnuz."""
    import bisect
    import math

    if math.isnan(x):
        return 0x7F if fmt == "e4m3fn" else 0x80
    _, fmax = FP8_FORMATS[fmt]
    neg = math.copysign(1.0, x) < 0
    a = min(abs(x), fmax)
    values, codes = _fp8_table(fmt)
    i = bisect.bisect_left(values, a)
    if i == len(values):
        i -= 1
    elif i > 0 and values[i] != a:
        lo, hi = a - values[i - 1], values[i] - a
        if lo < hi or (lo == hi and codes[i - 1] % 2 == 0):
            i -= 1
    code = codes[i]
    if neg and (code != 0 or fmt == "e4m3fn"):
        code |= 0x80
    return code


def pow2_ceil_float(s):
    """2^ceil(log2 s) for a positive float s."""
    import math

    m, e = math.frexp(s)  # s = m * 2^e, 0.5 <= m < 1
    return s if m == 0.5 else 2.0 ** e


def fp8_quantize_row_floats(xs, fmt, round_scale=False, use_ue8m0=False):
    """One row (Python floats, bf16 values, a multiple of 128 of them) -> (codes, scales): codes a
    list of ints; scales a list of fp32 values, or (use_ue8m0) a list of 32-bit words (ints)."""
    import math

    _, fmax = FP8_FORMATS[fmt]
    floor = fmax * 2.0 ** -126
    codes, scales, exps = [], [], []
    for g in range(0, len(xs), QUANT_GROUP):
        group = xs[g:g + QUANT_GROUP]
        amax = max(abs(v) for v in group)
        s = round_to("fp32", max(amax, floor) / fmax)
        if round_scale or use_ue8m0:
            s = pow2_ceil_float(s)
        inv = round_to("fp32", 1.0 / s)
        codes += [fp8_encode_float(round_to("fp32", v * inv), fmt) for v in group]
        scales.append(s)
        exps.append(math.frexp(s)[1] - 1 + 127)  # s = 2^(byte - 127)
    if not use_ue8m0:
        return codes, scales
    exps += [0] * (-len(exps) % 4)
    words = [exps[i] | exps[i + 1] << 8 | exps[i + 2] << 16 | exps[i + 3] << 24 for i in range(0, len(exps), 4)]
    return codes, words


def fp8_quantize_reference(torch, x, fp8_dtype, round_scale=False, use_ue8m0=False):
    """x: [N, H] bfloat16 (H a multiple of 128) -> (codes [N, H] fp8_dtype, scales): scales
    [N, H/128] float32, or (use_ue8m0) [N, ceil(H/512)] int32. Every step is one correctly rounded
    fp32 operation (divisions by tensors, not scalars, which torch may turn into a multiplication
    by the reciprocal), so the result is bit-exact on CPU and GPU."""
    N, H = x.shape
    G = H // QUANT_GROUP
    fmax = float(torch.finfo(fp8_dtype).max)
    xf = x.float().reshape(N, G, QUANT_GROUP)
    amax = xf.abs().amax(dim=-1)
    s = torch.maximum(amax, torch.full_like(amax, fmax * 2.0 ** -126)) / torch.full_like(amax, fmax)
    if round_scale or use_ue8m0:
        b = s.view(torch.int32)
        b = torch.where((b & 0x7FFFFF) != 0, (b & -0x800000) + 0x800000, b)
        s = b.view(torch.float32)
    inv = torch.ones_like(s) / s
    codes = (xf * inv.unsqueeze(-1)).clamp(-fmax, fmax).to(fp8_dtype).reshape(N, H)
    if not use_ue8m0:
        return codes, s
    words = (G + 3) // 4
    exps = torch.zeros((N, words * 4), dtype=torch.uint8, device=x.device)
    exps[:, :G] = (s.view(torch.int32) >> 23).to(torch.uint8)
    return codes, exps.view(torch.int32)


# --- quant_type "fp8_direct_cast" combine (docs/ep.md) -------------------------------------------
def fp8_direct_cast_reference(torch, y, fp8_dtype):
    """The fp32 values combine sums for rows y (bf16/fp16/fp32) under quant_type
    "fp8_direct_cast": each element cast to e4m3 (nearest, ties to even, saturating at +-fp8max:
    torch's cast alone turns out-of-range values into NaN, so clamp first) and decoded exactly."""
    fmax = float(torch.finfo(fp8_dtype).max)
    return y.float().clamp(-fmax, fmax).to(fp8_dtype).float()


def fp8_direct_cast_combine_reference(torch, rows, fp8_dtype, out_dtype):
    """rows: the [N, H] rows of one token set, one tensor per returning rank in ascending rank
    order (None: that rank returns none). The combine's result: the decoded codes summed in fp32
    from +0.0 in that order, rounded once to out_dtype."""
    acc = None
    for y in rows:
        if y is None:
            continue
        q = fp8_direct_cast_reference(torch, y, fp8_dtype)
        acc = torch.zeros_like(q) + q if acc is None else acc + q
    if acc is None:
        raise ValueError("no rows")
    return acc.to(out_dtype)


def fp8_direct_cast_bound(absum, fmt, out, n_rows, partials=0):
    """Bound on |combine result - exact sum of the unquantised rows| per element (docs/ep.md) for
    rows within +-fp8max: absum = sum of |row| over the n_rows summed rows (a float, or a float64
    tensor), fmt "e4m3fn" / "e4m3fnuz", out "bf16" / "fp16" / "fp32". partials: sums rounded to
    `out` before the result (InterNodeV1/V1LL: one per node)."""
    bias = FP8_FORMATS[fmt][0]
    u_out = {"bf16": 2.0**-8, "fp16": 2.0**-11, "fp32": 2.0**-24}[out]
    tiny = 2.0**-25 if out == "fp16" else 0.0  # half of fp16's subnormal step
    # cast: half an e4m3 step (2^-4 relative; 2^(-3-bias) absolute below the smallest normal);
    # the fp32 sums (n_rows + partials roundings of at most 2^-24 relative); the partials'
    # roundings to `out` (together at most u_out of the rows' |sum|), the result's rounding
    rel = ((2.0**-4 + (n_rows + partials) * 2.0**-23) * (1 + 2.0**-4) +
           (2 if partials else 1) * u_out * (1 + 2.0**-3))
    return absum * rel + n_rows * 2.0 ** (-3 - bias) + (1 + partials) * tiny


def fp8_direct_cast_error_bound(torch, absum, fp8_dtype, out_dtype, n_rows, partials=0):
    """fp8_direct_cast_bound for torch dtypes (the GPU suites)."""
    fnuz = fp8_dtype == getattr(torch, "float8_e4m3fnuz", None)
    out = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[out_dtype]
    return fp8_direct_cast_bound(absum, "e4m3fnuz" if fnuz else "e4m3fn", out, n_rows, partials)


# --- case tables run by spawned ranks (tests/python/test_engine_call_sequences.py, test_compat_deep_ep.py)
def run_case_table(dist, rank, world, cases, run_one):
    """Run run_one(fn) for each (name, fn) of `cases` on every rank; a case passes when no rank
    raised. Rank 0 prints "[PASS] name" / "[FAIL] name: rank r: error | ..." per case and
    "N passed, M failed" at the end. Returns the number of failed cases."""
    passed = failed = 0
    for name, fn in cases:
        msg = None
        try:
            run_one(fn)
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
        msgs = [None] * world
        dist.all_gather_object(msgs, msg)
        bad = [f"rank {r}: {m}" for r, m in enumerate(msgs) if m]
        passed += not bad
        failed += bool(bad)
        if rank == 0:
            print(f"[{'FAIL' if bad else 'PASS'}] {name}" + (": " + " | ".join(bad) if bad else ""), flush=True)
    if rank == 0:
        print(f"{passed} passed, {failed} failed", flush=True)
    return failed


def case_script_main(worker, argv=None, doc=None):
    """`script --nproc N`: spawn N ranks (sharing the GPUs) running worker(rank, world, local_rank, args)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (they share GPUs when there are fewer)")
    return launch(worker, p.parse_args(argv).nproc, None)


def setup_case_rank(rank, world, local_rank):
    """A spawned rank of a case table: MORI_DEVICE_TIMEOUT_MS 30 s unless set, its GPU (ranks share
    them round-robin), a gloo process group, mori imported. Returns (torch, torch.distributed, mori)."""
    os.environ.setdefault("MORI_DEVICE_TIMEOUT_MS", "30000")
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
    init_process_group(dist, "gloo", rank, world)
    return torch, dist, import_mori()


def finish_case_rank(dist, failed):
    """End of a case-table rank: barrier, destroy the process group; the exit code (1 on failure)."""
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0
