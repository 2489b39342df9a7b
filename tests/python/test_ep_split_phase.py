"""Split-phase dispatch/combine (dispatch_send/dispatch_recv, combine_send/combine_recv): the call
surface, the refusals that need no GPU, the staging regions, and mori.compat.deep_ep's receive
hooks. No GPU or torch needed; the GPU cases are `split_phase_dispatch` / `split_phase_combine`
in tests/ops/ep_intranode_test.py and `low_latency_recv_hook` in test_compat_deep_ep.py."""

import inspect

import pytest

import mori
import mori.ops as ops
from mori.compat import deep_ep


def make(**kw):
    base = dict(rank=0, world_size=4, hidden_dim=7168, scale_dim=56, scale_type_size=4, max_token_type_size=2,
                max_num_inp_token_per_rank=128, num_experts_per_rank=64, num_experts_per_token=8)
    base.update(kw)
    return ops.EpDispatchCombineConfig(**base)


def detached_op(**kw):
    """An op object with a config but no native handle: what needs no GPU can be called."""
    op = ops.EpDispatchCombineOp.__new__(ops.EpDispatchCombineOp)
    op.config = make(**kw)
    op._handle = None
    return op


# --- call surface ----------------------------------------------------------------------------------
def _params(fn):
    return inspect.signature(fn).parameters


def test_dispatch_send_takes_dispatch_arguments():
    send, fused = _params(ops.EpDispatchCombineOp.dispatch_send), _params(ops.EpDispatchCombineOp.dispatch)
    positional = [n for n, p in send.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == [n for n, p in fused.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert {n: p.default for n, p in send.items()} == {n: p.default for n, p in fused.items() if n != "copy"}
    for n in ("use_fp8", "round_scale", "use_ue8m0", "fp8_dtype", "stream"):
        assert send[n].kind == send[n].KEYWORD_ONLY


def test_dispatch_recv_signature_is_rocm_s():
    p = _params(ops.EpDispatchCombineOp.dispatch_recv)
    positional = [n for n, q in p.items() if q.kind == q.POSITIONAL_OR_KEYWORD and n != "self"]
    assert positional == ["block_num", "warp_per_block", "call_local_expert_count"]
    assert (p["block_num"].default, p["warp_per_block"].default, p["call_local_expert_count"].default) == (-1, -1, False)
    assert p["copy"].kind == p["copy"].KEYWORD_ONLY and p["stream"].kind == p["stream"].KEYWORD_ONLY


def test_native_handle_has_the_split_calls():
    h = mori._C.ops.EpDispatchCombineHandle
    for name in ("dispatch_send", "dispatch_recv", "dispatch_pending", "split_dispatch_available",
                 "split_combine_available", "combine_send", "combine_recv"):
        assert hasattr(h, name), name


# --- refusals that need no GPU ---------------------------------------------------------------------
def test_recv_without_send_raises():
    op = detached_op()
    assert not op.dispatch_pending and not op.combine_pending
    with pytest.raises(mori.InvalidUsageError, match="no dispatch_send is pending"):
        op.dispatch_recv()
    with pytest.raises(mori.InvalidUsageError, match="no combine_send is pending"):
        op.combine_recv()


@pytest.mark.parametrize("kind", ["dispatch", "combine"])
def test_calls_between_the_halves_raise(kind):
    op = detached_op()
    if kind == "dispatch":
        op._pending_dispatch = ("description", ())
        needle = "dispatch_send is pending; call dispatch_recv first"
    else:
        op._pending_combine = ("description",)
        needle = "combine_send is pending; call combine_recv first"
    calls = {
        "dispatch": lambda: op.dispatch("x", None, None, "ids"),
        "dispatch_send": lambda: op.dispatch_send("x", None, None, "ids"),
        "combine": lambda: op.combine("y", None, None),
        "combine_send": lambda: op.combine_send("y", None, None),
    }
    for name, call in calls.items():
        with pytest.raises(mori.InvalidUsageError, match=needle):
            call()
    with pytest.raises(mori.InvalidUsageError, match="pending"):
        op.debug_fill_buffers()
    # the state is untouched: the receive half is still the one call accepted
    assert op.dispatch_pending == (kind == "dispatch") and op.combine_pending == (kind == "combine")


def test_argument_checks_come_first():
    op = detached_op()
    op._pending_dispatch = ("description", ())
    with pytest.raises(mori.InvalidUsageError, match="rdma_block_num must be an int >= -1"):
        op.dispatch_send("x", None, None, "ids", -1, -2)


# --- staging regions -------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 128, 256])
def test_split_staging_for_small_intranode_configs(m):
    # Per call parity and source PE: M row slots with their weights, scales, indices and source
    # positions, and an arrival counter per (parity, source). (test_ep_config checks that no two
    # regions overlap.)
    c = make(max_num_inp_token_per_rank=m, world_size=3, num_experts_per_token=9, max_token_type_size=4)
    rows = {name: (nbytes, role) for blk, name, _, nbytes, role in ops.ep_layout(c)["regions"] if blk == "symmetric"}
    slots = 2 * 3 * m  # parity x source x row
    want = dict(split_arrived=2 * 3 * 8, split_tokens=slots * 7168 * 4, split_weights=slots * 9 * 4,
                split_scales=slots * 56 * 4, split_indices=slots * 9 * 8, split_src_pos=slots * 4)
    for name, nbytes in want.items():
        assert rows[name][0] == nbytes, name
        assert rows[name][1] == ("control" if name == "split_arrived" else "staging"), name


@pytest.mark.parametrize("kt", ["IntraNode", "InterNode"])
def test_no_split_staging_above_256_tokens(kt):
    sym = ops.ep_layout(make(max_num_inp_token_per_rank=257, kernel_type=kt, gpu_per_node=2))["symmetric"]
    assert not any(name.startswith("split_") for name in sym)


def test_internode_split_tail_words():
    # InterNode: another node's rows arrive by RDMA followed by a tagged tail word per (parity, source)
    inter = ops.ep_layout(make(kernel_type="InterNode", gpu_per_node=2))["symmetric"]
    intra = ops.ep_layout(make())["symmetric"]
    assert "split_tokens" in inter and "split_tail" in inter
    assert "split_tokens" in intra and "split_tail" not in intra
    rows = {name: nbytes for blk, name, _, nbytes, _ in ops.ep_layout(make(kernel_type="InterNode", gpu_per_node=2))
            ["regions"] if blk == "symmetric"}
    assert rows["split_tail"] == 2 * 4 * 8


# --- mori.compat.deep_ep receive hooks ------------------------------------------------------------
def test_receive_hook_runs_once():
    ran = []
    hook = deep_ep._ReceiveHook("low_latency_dispatch", lambda: ran.append(1))
    hook()
    assert ran == [1]
    with pytest.raises(mori.InvalidUsageError, match="already called"):
        hook()
    assert ran == [1]
    assert deep_ep._no_hook() is None
