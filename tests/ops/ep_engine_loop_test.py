#!/usr/bin/env python3
"""GPU suite: mori.ops dispatch/combine driven the way a serving engine (vLLM, SGLang) drives it,
step after step with no host synchronisation between the steps.

    python3 tests/ops/ep_engine_loop_test.py --nproc 4                       # one node: every kernel type
    python3 tests/ops/ep_engine_loop_test.py --nproc 4 --gpu-per-node 2      # 2 emulated nodes x 2 ranks
    python3 tests/ops/ep_engine_loop_test.py --nproc 8 --gpu-per-node 4      # 2 x 4 (also 4 x 2, 4 x 1)
    python3 tests/ops/ep_engine_loop_test.py --nproc 4 --short               # 30 steps, 10 graph replays
    python3 tests/ops/ep_engine_loop_test.py --nproc 4 --kernel-type AsyncLL -k cuda_graph
    python3 tests/ops/ep_engine_loop_test.py --list [--nproc 4 --gpu-per-node 2]
    torchrun --nproc_per_node=4 tests/ops/ep_engine_loop_test.py --short

Ranks share the GPUs when there are fewer GPUs than ranks. --gpu-per-node below the rank count
emulates nodes (MORI_GPU_PER_NODE, MORI_RDMA_EMULATE=1: other nodes are reached through the
emulated NIC, a process of its own per rank, so nothing queued in the loop can hold it up;
docs/rdma.md). mori is imported from an installation, $MORI_BUILD_DIR/python, or <repo>/build*/python.

Cases, per kernel type (--kernel-type, repeatable; default every type the topology allows:
IntraNode needs one node):

  engine_loop[KT]    --steps steps (default 300; --short 30). Each step: dispatch (or
                     dispatch_send, a matmul, dispatch_recv) -> the experts' torch work on every
                     received row (new tensors, a per-local-expert gain, block matmuls) -> combine
                     (or combine_send, a matmul, combine_recv). The ops are several, as an engine's
                     are: one of 128 tokens per rank (push combine, split phase where the kernel
                     type has it), one of 384 (pull combine; InterNodeV1LL: lists above its
                     256-token single WRITE) and one of 64 with quant_type "fp8_direct_cast".
                     Every call's shape comes from a seeded generator all ranks agree on: the op, a
                     hidden size <= the config's, bf16/fp16/fp8 rows or the fused fp8 quantisation
                     (use_fp8, round_scale, use_ue8m0), the combine dtype, int32/int64 ids, the
                     routing, weights on or off, scales on or off; per rank 0..M tokens (0 and M
                     included), the combine input (registered buffer, external tensor, the dispatch
                     output itself), the weights input, and block/warp overrides of every call.
  cuda_graph[KT]     4 such steps (op of 128 tokens) captured once, replayed --graph-replays times
                     (default 100; --short 10); between replays new inputs are copy_'d into the
                     captured input tensors; every replay's 4 steps are checked.
  bad_expert_id[KT]  the loop of engine_loop on the 128-token op; every --bad-id-every steps
                     (default 50; --short 10) one rank's tokens carry an expert id outside
                     [-1, num_experts). Contract: op.check_device_error() raises
                     mori.InvalidUsageError naming that rank on EVERY rank for that step (the op
                     reports one rank's bad id to every rank in the same call), a second call
                     raises nothing, and the steps after it are right. (Depends on that reporting;
                     select it alone with -k bad_expert_id.)

Inside the loops the host reads nothing: no .item()/.cpu()/.tolist(), no synchronisation, no
barrier, no shape from device data; they run under torch.cuda.set_sync_debug_mode("error"), so a
torch call that synchronises fails the case (--no-sync-check turns that off). The one exception is
the bad-id step, which synchronises to read the error where the op reports device errors. Each
step's inputs, references and checks are queued on the GPU with the step, behind unfinished calls,
and allocate as they go (torch's caching allocator).

Checks run on the GPU, accumulating mismatch counts in GPU tensors read once at the end of the
case, with the IntraNode suite's references (tests/ops/ep_intranode_test.py: verify_dispatch,
verify_combine; ep_test_utils.py): dispatch bit-exact (rows, weights, scales, indices, fp8 codes
and scales of the fused quantisation) in the documented order, source positions, counts; combine
bitwise the ascending-rank fp32 sum (InterNodeV1/V1LL: the two-level sum) and within rounding of
the float64 sum; fp8_direct_cast bitwise its decoded-code sum and within docs/ep.md's bound. The
experts' work is exact (power-of-two gains, float64 matmuls by a signed permutation and its
inverse), so a rank's rows come back as the references' experts produce them: x * (1 + rank/8) in
the combine dtype. A failing case names, per rank, the counters and the first step (its whole
plan) that mismatched.

Every wait is bounded: device waits by MORI_DEVICE_TIMEOUT_MS (30 s here); a rank that makes no
progress for --stall-timeout seconds (default 400) prints "TIMEOUT <case>" with where it was and its
Python stacks and exits, and the launcher stops the others.
Output ends with "N passed, M failed"; the exit code is 1 on failure, 77 without a GPU.
"""

import argparse
import collections
import contextlib
import faulthandler
import os
import random
import re
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_intranode_test as E  # noqa: E402
import ep_test_utils as U  # noqa: E402

KERNEL_TYPES = E.KERNEL_TYPES
HIDDEN = 2048  # config hidden_dim of every op
SCALE_DIM = HIDDEN // U.QUANT_GROUP  # fp32 scales per row: the fused quantisation's groups
EPR = 8  # experts per rank (>= every top-k used, so routing "one_rank" has K distinct experts)
BLOCK = 64  # the experts' block matmuls work on groups of BLOCK elements of a row
H_PLAIN = (2048, 1984, 1088, 512, 64)  # call hidden sizes: multiples of BLOCK
H_QUANT = (2048, 1536, 1024, 128)  # the fused quantisation's: multiples of 128
KINDS = ("bf16", "fp16", "fp8", "fp8q", "fp8q_round", "fp8q_ue8m0")  # dispatch rows
QUANT_OF = {"fp8q": "fp8", "fp8q_round": "fp8_round", "fp8q_ue8m0": "fp8_ue8m0"}  # E.Spec's quant
ROUTINGS = ("random_neg", "random", "two_ranks", "duplicates", "one_rank")
MODES = ("zero_copy", "external", "direct")  # combine input: registered buffer, tensor, dispatch output
WMODES = ("external", "registered", "direct")  # combine weights likewise
GRAPH_STEPS = 4
# (max tokens per rank, top-k, combine quant_type) of the engine loop's ops; SMALL_OP also the
# graph's and the bad-id loop's; LARGE_OP above the LL types' 256-token single-WRITE lists
SMALL_OP = (128, 8, None)
LARGE_OP = (384, 6, None)
FP8_COMBINE_OP = (64, 4, "fp8_direct_cast")
CASE_KINDS = ("engine_loop", "cuda_graph", "bad_expert_id")

# What a plan needs to know about an op (plain data, so that plans are pure Python).
OpShape = collections.namedtuple("OpShape", "M K cquant split_dispatch split_combine")


CaseFailure = E.CaseFailure  # also what the suite's helpers (Env.dt) raise


# ---------------------------------------------------------------------------------------------
# Step plans: every choice of a step, from a generator seeded alike on every rank (pure Python)
# ---------------------------------------------------------------------------------------------
def launch_shapes(W, max_warps):
    """(block_num, warp_per_block) overrides a call may get: (-1, -1) is the op's choice; block
    counts below W are raised to W by the op."""
    return [(-1, -1), (W, 1), (W, max_warps), (2 * W + 1, 2), (3 * W + 1, 4), (64, 8), (1, 1)]


class Plan:
    """One step: what every rank passes. Per-rank lists are indexed by rank."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    @property
    def out_dname(self):
        """The dtype name of the dispatch output rows."""
        return "fp8" if self.quant else self.dname

    def describe(self, rank=None):
        q = f" use_fp8 ({self.quant})" if self.quant else ""
        split = "+".join(n for n, on in (("dispatch", self.split_d), ("combine", self.split_c)) if on) or "none"
        text = (f"op {self.op}, {self.dname}{q} hidden {self.H} -> combine {self.cname}, ids {self.idx}, "
                f"routing {self.routing}, weights {'on' if self.weights else 'off'}, scales "
                f"{'on' if self.scales else 'off'}, split phase {split}, tokens {self.Ts}")
        if rank is not None:
            text += (f"; rank {rank}: combine input {self.mode[rank]}, weights input {self.wmode[rank]}, launches "
                     f"dispatch {self.d_launch[rank]} recv {self.r_launch[rank]} combine {self.c_launch[rank]}")
        if self.bad is not None:
            b, t, k, v = self.bad
            text += f"; bad expert id {v} on rank {b} (token {t}, slot {k})"
        return text


def step_plan(seed, step, W, max_warps, ops, bad=False, op_index=None):
    """The plan of step `step` for ops (OpShape list): identical on every rank for the same
    arguments. bad: one rank gets one token whose only expert id lies outside [-1, num_experts)."""
    rnd = random.Random(f"mori-ep-engine-loop/{seed}/{step}")
    oi = rnd.randrange(len(ops)) if op_index is None else op_index
    o = ops[oi]
    kind = rnd.choice(KINDS)
    quant = QUANT_OF.get(kind)
    dname = "bf16" if quant else kind
    H = rnd.choice(H_QUANT if quant else H_PLAIN)
    cname = rnd.choice(("bf16", "fp16"))
    idx = rnd.choice(("int32", "int64"))
    routing = rnd.choice(ROUTINGS)
    weights = rnd.random() < 0.7
    scales = quant is None and rnd.random() < 0.5
    split_d = o.split_dispatch and rnd.random() < 0.35
    split_c = o.split_combine and rnd.random() < 0.35
    out_dname = "fp8" if quant else dname
    shapes = launch_shapes(W, max_warps)
    Ts, mode, wmode, d_launch, r_launch, c_launch = [], [], [], [], [], []
    for _ in range(W):
        u = rnd.random()
        Ts.append(0 if u < 0.1 else o.M if u < 0.2 else rnd.randint(1, o.M))
        # the dispatch output is a combine input only in its own dtype (same row size)
        mode.append(rnd.choice(MODES if out_dname == cname else MODES[:2]))
        wmode.append(rnd.choice(WMODES))
        d_launch.append(rnd.choice(shapes))
        r_launch.append(rnd.choice(shapes))
        c_launch.append(rnd.choice(shapes))
    bad_id = None
    if bad:
        b = rnd.randrange(W)
        Ts[b] = max(Ts[b], 1)
        num_experts = W * EPR
        lim = 2**31 if idx == "int32" else 2**63
        v = rnd.choice((num_experts, num_experts + rnd.randrange(1, 1000), lim - 1, -2, -rnd.randrange(3, 1000), -lim))
        bad_id = (b, rnd.randrange(Ts[b]), rnd.randrange(o.K), v)
    return Plan(op=oi, kind=kind, quant=quant, dname=dname, H=H, cname=cname, idx=idx, routing=routing,
                weights=weights, scales=scales, split_d=split_d, split_c=split_c, Ts=Ts, mode=mode, wmode=wmode,
                d_launch=d_launch, r_launch=r_launch, c_launch=c_launch, bad=bad_id)


def bad_steps(steps, every):
    """Steps of the bad-id loop that carry a bad id: the last of every `every`, each followed by a
    step (the one that must be right again)."""
    if every <= 0:
        return []
    return [s for s in range(every - 1, steps - 1, every)]


def kernel_types_for(args, world):
    """(kernel types to run, {type: why not}) for the topology: IntraNode needs one node."""
    multi_node = 0 < args.gpu_per_node and (world <= 0 or args.gpu_per_node < world)
    wanted = list(dict.fromkeys(args.kernel_type or KERNEL_TYPES))
    why = {}
    if multi_node and "IntraNode" in wanted:
        why["IntraNode"] = f"needs one node (--gpu-per-node {args.gpu_per_node} makes several)"
    return [k for k in wanted if k not in why], why


def case_names(kernel_types, ks=()):
    names = [f"{c}[{kt}]" for kt in kernel_types for c in CASE_KINDS]
    return [n for n in names if not ks or any(k in n for k in ks)]


# ---------------------------------------------------------------------------------------------
# Progress watchdog: a rank that makes no progress is stopped, naming the case
# ---------------------------------------------------------------------------------------------
class Heartbeat:
    """beat(where) marks progress. When a case makes none for `bound` seconds, the rank prints
    "TIMEOUT <case>" with where it was and every thread's Python stack, and exits (code 124); the
    launcher then stops the other ranks. A C-level backstop (faulthandler, bound + 60 s) covers a
    native call that holds the interpreter."""

    def __init__(self, rank, bound):
        self.rank, self.bound = rank, float(bound)
        self.case = None
        self.where = ""
        self.t = time.monotonic()
        self.armed = 0.0
        threading.Thread(target=self._watch, daemon=True).start()

    def start(self, case):
        self.case = case
        self.beat("start")

    def beat(self, where):
        self.where = where
        self.t = time.monotonic()
        if self.t - self.armed > 10.0:  # re-arm the backstop now and then, not at every step
            faulthandler.dump_traceback_later(self.bound + 60.0, exit=True)
            self.armed = self.t

    def stop(self):
        self.case = None
        faulthandler.cancel_dump_traceback_later()
        self.armed = 0.0

    def _watch(self):
        while True:
            time.sleep(1.0)
            case = self.case
            if case is not None and time.monotonic() - self.t > self.bound:
                msg = (f"[rank {self.rank}] TIMEOUT {case}: no progress for {self.bound:.0f} s (last: {self.where}); "
                       "stopping this rank")
                print(msg, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                print(msg, file=sys.stderr, flush=True)
                os._exit(124)


# ---------------------------------------------------------------------------------------------
# One kernel type on this rank
# ---------------------------------------------------------------------------------------------
class OpSnapshot:
    """What verify_dispatch / verify_combine read from an op, captured right after one step of a
    CUDA graph (the op's own buffers hold the graph's last step by the time they are checked)."""

    def __init__(self, op, src_pos, expert_count):
        self._op, self._src, self._count = op, src_pos, expert_count

    def get_dispatch_src_token_pos(self, sync=True):
        return self._src

    def get_local_expert_count(self):
        return self._count

    @property
    def combine_fp8_dtype(self):
        return self._op.combine_fp8_dtype


class Loop:
    """State of one kernel type on this rank: the IntraNode suite's Env (config defaults,
    references), the experts' fixed tensors, and the host-synchronisation guards."""

    def __init__(self, rank, world, device_index, args, kernel_type, mori):
        import torch

        self.torch, self.mori, self.args = torch, mori, args
        self.kt = kernel_type
        kt_args = argparse.Namespace(kernel_type=kernel_type, config_kernel_type=kernel_type,
                                     gpu_per_node=args.gpu_per_node, num_qp_per_pe=1)
        env = E.Env(rank, world, device_index, kt_args)
        env.mori = mori
        # the references check what the config runs as (AsyncLL: IntraNode or InterNode)
        kt_args.kernel_type = env.config(rank=rank, world_size=world, hidden_dim=256, scale_dim=0, scale_type_size=0,
                                         max_token_type_size=2, max_num_inp_token_per_rank=8, num_experts_per_rank=1,
                                         num_experts_per_token=1).runs_as.name
        self.env, self.r, self.W, self.dev = env, rank, world, env.dev
        self.mw = E.max_warps(env)
        self.sync_check = not args.no_sync_check and hasattr(torch.cuda, "set_sync_debug_mode")
        # The experts' exact work: a signed permutation of BLOCK elements (P) and its inverse (P^T),
        # and a power-of-two gain per local expert (the last entry: no local expert).
        g = torch.Generator().manual_seed(20240611)
        perm = torch.randperm(BLOCK, generator=g)
        sign = torch.randint(0, 2, (BLOCK,), generator=g) * 2 - 1
        P = torch.zeros((BLOCK, BLOCK), dtype=torch.float64)
        P[torch.arange(BLOCK), perm] = sign.double()
        self.P = P.to(self.dev)
        self.Pt = P.t().contiguous().to(self.dev)
        self.gain = torch.tensor([2.0 ** (e % 3) for e in range(EPR)] + [1.0], dtype=torch.float64, device=self.dev)
        # Work between the halves of a split call (into a tensor of its own).
        self.mm_a = torch.randn((256, 256), device=self.dev)
        self.mm_b = torch.empty_like(self.mm_a)

    # --- ops and data ---------------------------------------------------------------------------
    def new_ops(self, shapes):
        """[(op, OpShape)] for (max tokens, top-k, combine quant_type) tuples, at M tokens per rank
        for every kernel type."""
        out = []
        for M, K, cquant in shapes:
            cfg = self.env.config(rank=self.r, world_size=self.W, hidden_dim=HIDDEN, scale_dim=SCALE_DIM,
                                  scale_type_size=4, max_token_type_size=2, max_num_inp_token_per_rank=M,
                                  num_experts_per_rank=EPR, num_experts_per_token=K, quant_type=cquant or "none",
                                  uncapped=True)
            op = self.env.new_op(cfg)  # check_inputs=True (the default, as engines create ops)
            out.append((op, OpShape(cfg.max_num_inp_token_per_rank, K, cquant, bool(op.split_dispatch_available),
                                    bool(op.split_combine_available))))
        return out

    def spec_of(self, plan, o, seed):
        """The IntraNode suite's Spec of a step (what make_data and the references read)."""
        return E.Spec(H=plan.H, K=o.K, Epr=EPR, M=o.M, dtype=plan.dname, cdtype=plan.cname, idx=plan.idx,
                      scale=(SCALE_DIM, "f32") if plan.scales else None, weights=plan.weights, routing=plan.routing,
                      t_mode="max", quant=plan.quant, cquant=o.cquant, poison=False, seed=seed)

    def gen_data(self, plan, o, it, seed):
        """(spec, every rank's inputs) of a step: make_data's rows for M tokens per rank, cut to the
        plan's token counts (ids past them -1) and, on a bad step, one token whose only id is the
        bad one. Device work only: nothing is read back."""
        spec = self.spec_of(plan, o, seed)
        X, IDX, WT, SC, _ = E.make_data(self.env, spec, it, seed)
        for s, T in enumerate(plan.Ts):
            if T < o.M:
                IDX[s, T:].fill_(-1)
        if plan.bad is not None:
            # fill_ takes the value as a kernel argument; an indexed assignment of a Python
            # number may stage it through host memory, a synchronising copy
            b, t, k, v = plan.bad
            IDX[b, t].fill_(-1)
            IDX[b, t, k].fill_(v)
        return spec, (X, IDX, WT, SC, list(plan.Ts))

    def inputs_of(self, plan, data):
        """This rank's dispatch arguments (x, indices, weights, scales): views of the step's data."""
        X, IDX, WT, SC, Ts = data
        T = Ts[self.r]
        return (X[self.r, :T], IDX[self.r, :T], WT[self.r, :T] if plan.weights else None,
                SC[self.r, :T] if SC is not None else None)

    # --- one step ---------------------------------------------------------------------------------
    def expert_work(self, outs, cdt):
        """The experts' work on every received row (rows past total_recv included: the engine
        does not know the count without reading it). New tensors, a gain per row from its lowest
        local expert id, block matmuls with a signed permutation and its inverse: each operation
        is exact, so the result is bitwise expert_fn(rows, rank, cdt), what the references expect
        this rank to return."""
        torch = self.torch
        out_tok, _, _, out_i, _ = outs
        z = E.expert_fn(out_tok, self.r, cdt)
        lo = self.r * EPR
        ids = out_i.long()
        e = torch.where((ids >= lo) & (ids < lo + EPR), ids - lo, EPR).amin(1)
        g = self.gain[e].unsqueeze(1)
        h = z.double() * g  # exact: a power of two, far from overflow
        h = torch.matmul(h.view(-1, BLOCK), self.P)  # float64 (no TF32): one nonzero product per output
        h = torch.matmul(h, self.Pt)
        return (h.view(z.shape) / g).to(cdt)

    def between_halves(self):
        """Unrelated GPU work between the halves of a split call."""
        self.torch.matmul(self.mm_a, self.mm_a, out=self.mm_b)

    def run_step(self, op, o, plan, spec, inputs, it, cnt=None, data=None, snap=False, after_dispatch=None):
        """dispatch -> experts -> combine with the plan's arguments for this rank. Checked at once
        against `data` into `cnt` (verify_dispatch / verify_combine), or with snap=True (inside a
        CUDA graph) returning clones of what the checks read. after_dispatch(): run right after
        the dispatch (the bad-id check)."""
        r = self.r
        x, idx, w, sc = inputs
        qkw = spec.quant_kw(it)
        db, dw = plan.d_launch[r]
        if plan.split_d:
            op.dispatch_send(x, w, sc, idx, block_num=db, warp_per_block=dw, **qkw)
            self.between_halves()
            rb, rw = plan.r_launch[r]
            outs = op.dispatch_recv(block_num=rb, warp_per_block=rw)
        else:
            outs = op.dispatch(x, w, sc, idx, block_num=db, warp_per_block=dw, **qkw)
        if after_dispatch is not None:
            after_dispatch()
        if snap:
            shot = (tuple(None if t is None else t.clone() for t in outs),
                    op.get_dispatch_src_token_pos(sync=False).clone(), op.get_local_expert_count().clone())
        else:
            E.verify_dispatch(self.env, spec, op, outs, data, cnt, False, it)
        cdt = self.env.dt(plan.cname)
        y = self.expert_work(outs, cdt)
        out_tok, out_w = outs[0], outs[1]
        mode = plan.mode[r]
        if mode == "zero_copy":
            cin = op.get_registered_combine_input_buffer(cdt, plan.H)
            cin.copy_(y)
        elif mode == "external":
            cin = y
        else:  # the dispatch output itself, updated in place
            out_tok.copy_(y)
            cin = out_tok
        cw = None
        if out_w is not None:
            factor = float(r + 1)  # what the references expect rank r to return as weights
            wmode = plan.wmode[r]
            if wmode == "external":
                cw = out_w * factor
            elif wmode == "registered":
                cw = op.get_registered_combine_weights_buffer()
                cw.copy_(out_w * factor)
            else:
                out_w.mul_(factor)
                cw = out_w
        cb, cwp = plan.c_launch[r]
        if plan.split_c:
            op.combine_send(cin, cw, idx, block_num=cb, warp_per_block=cwp)
            self.between_halves()
            out, ow = op.combine_recv()
        else:
            out, ow = op.combine(cin, cw, idx, block_num=cb, warp_per_block=cwp)
        if snap:
            return shot + ((out.clone(), None if ow is None else ow.clone()), cdt)
        E.verify_combine(self.env, spec, op, out, ow, data, cnt, False, it, cdt)
        return None

    def verify_snapshot(self, op, spec, shot, data, cnt, it):
        outs, src, count, (out, ow), cdt = shot
        view = OpSnapshot(op, src, count)
        E.verify_dispatch(self.env, spec, view, outs, data, cnt, False, it)
        E.verify_combine(self.env, spec, view, out, ow, data, cnt, False, it, cdt)

    # --- host-synchronisation guards -------------------------------------------------------------
    @contextlib.contextmanager
    def _sync_debug(self, mode):
        if not self.sync_check:
            yield
            return
        prev = self.torch.cuda.get_sync_debug_mode()
        self.torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            self.torch.cuda.set_sync_debug_mode(prev)

    def no_host_sync(self):
        """Inside, torch raises on any synchronising call (set_sync_debug_mode("error"))."""
        return self._sync_debug("error")

    def allow_sync(self):
        """Inside no_host_sync: a deliberate synchronisation."""
        return self._sync_debug(0)

    # --- after a loop ---------------------------------------------------------------------------
    def finish(self, ops, cnt, hist, describe, what, extra_errors=(), before=None):
        """After a loop: synchronise, read the device errors and the counters (the only reads),
        and raise CaseFailure naming the counters and the first step that mismatched; returns
        the summary otherwise. before: counters of checks made before the loop (the graph's body
        run without the graph)."""
        torch, mori = self.torch, self.mori
        torch.cuda.synchronize()
        errors = list(extra_errors)
        try:
            mori.shmem.shmem_check_device_error()
        except Exception as e:  # noqa: BLE001
            errors.append(f"device error: {type(e).__name__}: {e}")
        for i, (op, _) in enumerate(ops):
            try:
                op.check_device_error()
            except Exception as e:  # noqa: BLE001
                errors.append(f"op {i}: {type(e).__name__}: {e}")
        counts, h = cnt.tolist(), hist.tolist()
        pre = before.tolist() if before is not None else []
        if any(pre):
            bad = ", ".join(f"{E.C_NAMES[i]}={v}" for i, v in enumerate(pre) if v)
            errors.append(f"mismatches before the loop: {bad}")
        if any(counts):
            first = next((i for i, v in enumerate(h) if v), None)
            where = f"; first at {describe(first)}" if first is not None else ""
            bad = ", ".join(f"{E.C_NAMES[i]}={v}" for i, v in enumerate(counts) if v)
            errors.append(f"mismatches over {what}: {bad}{where}")
        if errors:
            raise CaseFailure("; ".join(errors))
        return f"{what}, no mismatch"


# ---------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------
def engine_loop(lp, hb, ops, steps, seed, bad_every=0):
    """`steps` planned steps without host synchronisation (see the module docstring)."""
    torch, r = lp.torch, lp.r
    mori = lp.mori
    shapes = [o for _, o in ops]
    bad_at = set(bad_steps(steps, bad_every))
    if bad_every and not bad_at:
        raise CaseFailure(f"{steps} steps hold no bad-id step every {bad_every} (use --steps > --bad-id-every)")
    cnt = torch.zeros(len(E.C_NAMES), dtype=torch.int64, device=lp.dev)
    hist = torch.zeros(steps, dtype=torch.int64, device=lp.dev)
    plans = []
    bad_results = []  # host-side outcomes of the bad-id steps

    def check_bad_id(op, plan, s):
        """Where the op reports device errors: every rank must raise InvalidUsageError naming
        the rank with the bad id, and nothing the second time."""
        b, _, _, v = plan.bad
        got = again = None
        with lp.allow_sync():
            torch.cuda.synchronize()
            try:
                op.check_device_error()
            except Exception as e:  # noqa: BLE001
                got = e
            try:
                op.check_device_error()
            except Exception as e:  # noqa: BLE001
                again = e
        what = f"step {s} (rank {b} passed expert id {v})"
        if not isinstance(got, mori.InvalidUsageError):
            got_s = "nothing" if got is None else f"{type(got).__name__}: {got}"
            bad_results.append(f"{what}: check_device_error raised {got_s}, expected InvalidUsageError naming rank {b}")
        elif not re.search(rf"\b(?:PE|[Rr]ank) {b}\b", str(got)):
            bad_results.append(f"{what}: the InvalidUsageError does not name rank {b}: {got}")
        if again is not None:
            bad_results.append(f"{what}: a second check_device_error raised {type(again).__name__}: {again} "
                               "(the first should have cleared it)")

    with lp.no_host_sync():
        for s in range(steps):
            hb.beat(f"step {s} of {steps}")
            plan = step_plan(seed, s, lp.W, lp.mw, shapes, bad=s in bad_at)
            plans.append(plan)
            op, o = ops[plan.op]
            spec, data = lp.gen_data(plan, o, s, seed)
            after = (lambda op=op, plan=plan, s=s: check_bad_id(op, plan, s)) if plan.bad is not None else None
            lp.run_step(op, o, plan, spec, lp.inputs_of(plan, data), s, cnt=cnt, data=data, after_dispatch=after)
            hist[s] = cnt.sum()
    hb.beat("reading the results")

    def describe(i):
        after_bad = " (the step after a bad id)" if i - 1 in bad_at else ""
        return f"step {i}{after_bad}: {plans[i].describe(r)}"

    what = f"{steps} steps" + (f", bad ids at steps {sorted(bad_at)}" if bad_at else "")
    return lp.finish(ops, cnt, hist, describe, what, bad_results)


def case_engine_loop(lp, args, hb):
    specs = [SMALL_OP, LARGE_OP, FP8_COMBINE_OP]  # every type: no kernel type caps the token count
    return engine_loop(lp, hb, lp.new_ops(specs), args.steps, args.seed * 10 + 1)


def case_bad_expert_id(lp, args, hb):
    return engine_loop(lp, hb, lp.new_ops([SMALL_OP]), args.steps, args.seed * 10 + 3, bad_every=args.bad_id_every)


def case_cuda_graph(lp, args, hb):
    """GRAPH_STEPS planned steps captured in one CUDA graph, replayed with new inputs copied into
    the captured input tensors; every replay's steps checked from snapshots the graph takes."""
    torch, env, r = lp.torch, lp.env, lp.r
    seed = args.seed * 10 + 2
    replays = args.graph_replays
    ops = lp.new_ops([SMALL_OP])
    op, o = ops[0]
    plans = [step_plan(f"graph/{seed}", j, lp.W, lp.mw, [o], op_index=0) for j in range(GRAPH_STEPS)]
    specs = [lp.spec_of(p, o, seed) for p in plans]
    statics = []  # the captured input tensors of each step (this rank's token count is fixed)
    for p in plans:
        T = p.Ts[r]
        in_dt = env.dt(p.dname)
        x = torch.zeros((T, p.H * torch.empty((), dtype=in_dt).element_size()), dtype=torch.uint8,
                        device=lp.dev).view(in_dt)
        idx = torch.full((T, o.K), -1, dtype=torch.int32 if p.idx == "int32" else torch.int64, device=lp.dev)
        w = torch.zeros((T, o.K), dtype=torch.float32, device=lp.dev) if p.weights else None
        sc = torch.zeros((T, SCALE_DIM), dtype=torch.float32, device=lp.dev) if p.scales else None
        statics.append((x, idx, w, sc))

    def load(i):
        """Replay i's inputs (every rank's) into the captured tensors; returns them for the checks."""
        datas = []
        for j, p in enumerate(plans):
            _, data = lp.gen_data(p, o, i * GRAPH_STEPS + j, seed)
            for dst, src in zip(statics[j], lp.inputs_of(p, data)):
                if dst is not None:
                    dst.copy_(src)
            datas.append(data)
        return datas

    def body():
        return [lp.run_step(op, o, plans[j], specs[j], statics[j], 0, snap=True) for j in range(GRAPH_STEPS)]

    def check(shots, datas, cnt, hist=None, base=0):
        for j in range(GRAPH_STEPS):
            lp.verify_snapshot(op, specs[j], shots[j], datas[j], cnt, 0)
            if hist is not None:
                hist[base + j] = cnt.sum()

    # The body once without the graph, on the capture stream (torch's advice before a capture),
    # checked like the replays.
    before = torch.zeros(len(E.C_NAMES), dtype=torch.int64, device=lp.dev)
    side = torch.cuda.Stream(device=lp.dev)
    datas = load(0)
    side.wait_stream(torch.cuda.current_stream())
    hb.beat("the graph's body without the graph")
    with torch.cuda.stream(side):
        shots = body()
    torch.cuda.current_stream().wait_stream(side)
    check(shots, datas, before)
    hb.beat("capture")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        shots = body()
    cnt = torch.zeros(len(E.C_NAMES), dtype=torch.int64, device=lp.dev)
    hist = torch.zeros(replays * GRAPH_STEPS, dtype=torch.int64, device=lp.dev)
    try:
        with lp.no_host_sync():
            for i in range(1, replays + 1):
                hb.beat(f"replay {i} of {replays}")
                datas = load(i)
                graph.replay()
                check(shots, datas, cnt, hist, (i - 1) * GRAPH_STEPS)
        hb.beat("reading the results")

        def describe(k):
            i, j = divmod(k, GRAPH_STEPS)
            return f"replay {i + 1}, graph step {j}: {plans[j].describe(r)}"

        return lp.finish(ops, cnt, hist, describe, f"{replays} replays of {GRAPH_STEPS} steps", before=before)
    finally:
        torch.cuda.synchronize()  # the graph (and its memory) goes before the op it calls
        del graph, shots


CASES = {"engine_loop": case_engine_loop, "cuda_graph": case_cuda_graph, "bad_expert_id": case_bad_expert_id}


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def worker(rank, world, local_rank, args):
    os.environ.setdefault("MORI_SHMEM_HEAP_SIZE", "2G")
    # MORI_DEVICE_TIMEOUT_MS 30 s unless set; ranks share the GPUs round-robin when there are fewer
    # (time slices: nothing crosses a link); a gloo process group.
    torch, dist, mori = U.setup_case_rank(rank, world, local_rank)
    local_rank = torch.cuda.current_device()
    kernel_types, why_not = kernel_types_for(args, world)
    names = case_names(kernel_types, args.k)
    mori.shmem.shmem_torch_process_group_init("default")
    hb = Heartbeat(rank, args.stall_timeout)
    if rank == 0:
        nodes = "one node"
        if 0 < args.gpu_per_node < world:
            nodes = f"{world // args.gpu_per_node} emulated nodes x {args.gpu_per_node}"
        print(f"mori EP engine-loop suite: {world} ranks ({nodes}), {torch.cuda.get_device_name(local_rank)}; "
              f"{args.steps} steps, {args.graph_replays} graph replays, a bad id every {args.bad_id_every} steps",
              flush=True)
        if why_not:
            print("(not applicable here, not run: " + "; ".join(f"{k}: {v}" for k, v in why_not.items()) + ")",
                  flush=True)
        if world > torch.cuda.device_count():
            print(f"note: {world} ranks share {torch.cuda.device_count()} GPU(s)", flush=True)
    loops = {}
    passed = failed = 0
    for name in names:
        kind, kt = name[:-1].split("[")
        t0 = time.time()
        msg = summary = None
        lp = None
        hb.start(name)
        try:
            lp = loops.get(kt)
            if lp is None:
                lp = loops[kt] = Loop(rank, world, local_rank, args, kt, mori)
            summary = CASES[kind](lp, args, hb)
        except CaseFailure as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001
            # Where it was raised: the innermost frames of this repository's files.
            here = [f for f in traceback.extract_tb(e.__traceback__) if "/tests/" in f.filename or "/mori/" in f.filename]
            where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(here[-3:]))
            msg = f"{type(e).__name__}: {e}" + (f" (at {where})" if where else "")
            if args.verbose:
                traceback.print_exc()
        hb.beat("closing the case's ops")
        try:
            torch.cuda.synchronize()
            mori.shmem.shmem_check_device_error()
        except Exception as e:  # noqa: BLE001
            msg = msg or f"device error: {type(e).__name__}: {e}"
        if lp is not None:
            lp.env.close_ops()
        hb.beat("gathering the ranks' results")
        results = [None] * world
        dist.all_gather_object(results, (msg, summary))
        hb.stop()
        bad = [f"rank {i}: {m}" for i, (m, _) in enumerate(results) if m]
        failed += bool(bad)
        passed += not bad
        if rank == 0:
            line = f"[{'FAIL' if bad else 'PASS'}] {name} ({time.time() - t0:.1f} s)"
            if bad:
                line += ": " + " | ".join(bad)
            else:
                notes = sorted({s for _, s in results if s})
                line += ": " + (f"{notes[0]} (each of the {world} ranks)" if len(notes) == 1 else
                                " | ".join(f"rank {i}: {s}" for i, (_, s) in enumerate(results)))
            print(line, flush=True)
    if mori.shmem.shmem_is_initialized():
        mori.shmem.shmem_finalize()
    if rank == 0:
        print(f"{passed} passed, {failed} failed", flush=True)
    return U.finish_case_rank(dist, failed)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=0,
                   help="spawn this many ranks (default: all GPUs) when not under torchrun")
    p.add_argument("--gpu-per-node", type=int, default=0,
                   help="ranks per (emulated) node; below the rank count the nodes are emulated (RDMA emulator)")
    p.add_argument("--kernel-type", action="append", choices=KERNEL_TYPES,
                   help="kernel type to run (repeatable; default every type the topology allows)")
    p.add_argument("-k", action="append", default=[], help="run cases whose name contains this (repeatable)")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--short", action="store_true",
                   help="the short form: 30 steps, 10 graph replays, a bad id every 10 steps (unless given)")
    p.add_argument("--steps", type=int, default=None, help="steps of engine_loop and bad_expert_id (default 300)")
    p.add_argument("--graph-replays", type=int, default=None, help="replays of the captured graph (default 100)")
    p.add_argument("--bad-id-every", type=int, default=None, help="bad_expert_id: a bad id every N steps (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of every step's plan and data")
    p.add_argument("--stall-timeout", type=float, default=400.0,
                   help="seconds without progress after which a rank reports TIMEOUT <case> and exits")
    p.add_argument("--no-sync-check", action="store_true",
                   help="do not run the loops under torch.cuda.set_sync_debug_mode('error')")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    short = args.short
    if args.steps is None:
        args.steps = 30 if short else 300
    if args.graph_replays is None:
        args.graph_replays = 10 if short else 100
    if args.bad_id_every is None:
        args.bad_id_every = 10 if short else 50
    if args.steps < 1 or args.graph_replays < 1 or args.bad_id_every < 1:
        p.error("--steps, --graph-replays and --bad-id-every must be positive")
    return p, args


def main(argv=None):
    p, args = parse_args(argv)
    world = args.nproc if args.nproc > 0 else int(os.environ.get("WORLD_SIZE", "0") or 0)
    if args.list:
        kts, why = kernel_types_for(args, world)
        for n in case_names(kts, args.k):
            print(n)
        for k, v in why.items():
            print(f"(not applicable here: {k}: {v})")
        return 0
    try:
        import torch
    except ImportError as e:
        print(f"SKIPPED: needs torch ({e})")
        return U.SKIP_EXIT
    nproc = U.rank_count(args.nproc)
    if nproc is None:
        return U.SKIP_EXIT
    world = nproc if nproc > 0 else int(os.environ["WORLD_SIZE"])
    if 0 < args.gpu_per_node < world and world % args.gpu_per_node:
        p.error(f"{world} ranks do not make nodes of --gpu-per-node {args.gpu_per_node}")
    kts, _ = kernel_types_for(args, world)
    if not case_names(kts, args.k):
        p.error(f"no case selected (kernel types {kts}, -k {args.k})")
    if args.gpu_per_node > 0:
        # Nodes are emulated: shmem's topology and the emulated NIC come from these (the ranks
        # inherit them).
        os.environ["MORI_GPU_PER_NODE"] = str(args.gpu_per_node)
        os.environ.setdefault("MORI_RDMA_EMULATE", "1")
    return U.launch(worker, nproc, args)


if __name__ == "__main__":
    sys.exit(main())
