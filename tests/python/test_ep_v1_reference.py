"""The InterNodeV1/V1LL combine reference (tests/ops/ep_test_utils.py, no GPU): per node the fp32
sum of its ranks' rows in ascending rank, rounded to the combine dtype, then the fp32 sum of those
partials in ascending node order, rounded. It must equal IntraNode's flat ascending-rank sum
bitwise when there is one node or one GPU per node, and differ in general (cases built so that
rounding matters). The torch form is checked against the float form where torch is installed."""

import random
import struct

import pytest

import ep_test_utils as U

from conftest import needs_torch

DTYPES = ("bf16", "fp16", "fp32")


def bits(x):
    return struct.pack("<f", x)  # every value here is an fp32 value: compare its bits (-0.0 too)


def random_value(rnd, dtype):
    """A dtype value over a wide range of exponents, so that sums round."""
    return U.round_to(dtype, rnd.choice((-1, 1)) * rnd.uniform(1, 2) * 2.0 ** rnd.randint(-12, 12))


def random_rows(rnd, W, dtype, p_dest=0.6):
    return [random_value(rnd, dtype) if rnd.random() < p_dest else None for _ in range(W)]


def test_rounding_helpers():
    assert U.round_to("bf16", 1.0 + 2.0 ** -8) == 1.0               # tie: to the even mantissa
    assert U.round_to("bf16", 1.0 + 3 * 2.0 ** -8) == 1.0 + 2.0 ** -6  # tie: up to the even one
    assert U.round_to("bf16", 1.0 + 2.0 ** -8 + 2.0 ** -20) == 1.0 + 2.0 ** -7
    assert U.round_to("fp16", 1.0 + 2.0 ** -11) == 1.0
    assert U.round_to("fp32", 1.0 + 2.0 ** -24) == 1.0
    assert U.round_to("bf16", 3.4e38) == float("inf") and U.round_to("fp16", -7e4) == float("-inf")
    assert U.fp32_add(1.0, 2.0 ** -24) == 1.0 and U.fp32_add(1.0, 2.0 ** -23) == 1.0 + 2.0 ** -23
    assert bits(U.flat_combine_floats([None, -0.0], "fp32")) == bits(0.0)  # the sum starts at +0.0


def test_equals_intranode_with_one_node_or_one_gpu_per_node():
    rnd = random.Random(1)
    n = 0
    for dtype in DTYPES:
        for W in (1, 2, 4, 8):
            for G in {1, W}:  # one GPU per node; one node
                for _ in range(300):
                    rows = random_rows(rnd, W, dtype)
                    assert bits(U.v1_combine_floats(rows, G, dtype)) == bits(U.flat_combine_floats(rows, dtype))
                    n += 1
    assert n == 3 * 7 * 300


def test_differs_where_a_node_partial_rounds_bf16():
    # node 0: 1 + 2^-8 is a tie in bf16 and rounds to 1; flat, the second 2^-8 lifts it to 1 + 2^-7
    rows = [1.0, 2.0 ** -8, 2.0 ** -8, None]
    assert U.flat_combine_floats(rows, "bf16") == 1.0 + 2.0 ** -7
    assert U.v1_combine_floats(rows, 2, "bf16") == 1.0
    assert U.v1_combine_floats(rows, 4, "bf16") == 1.0 + 2.0 ** -7  # one node: as IntraNode
    assert U.v1_combine_floats(rows, 1, "bf16") == 1.0 + 2.0 ** -7  # one GPU per node: as IntraNode


def test_differs_by_grouping_in_fp32():
    # no partial rounds (fp32 combine), but the grouping does: flat, each 2^-24 is lost against 1
    # (ties to even); two-level, node 1 first adds 2^-24 + 2^-24 = 2^-23, which 1 keeps
    e = 2.0 ** -24
    rows = [1.0, e, e, e]
    assert U.flat_combine_floats(rows, "fp32") == 1.0
    assert U.v1_combine_floats(rows, 2, "fp32") == 1.0 + 2.0 ** -23


def test_node_order_is_ascending_whatever_the_owner():
    # The result takes no owner: the owner's own node is summed at its place in the node order.
    # The order matters: partials 1, 2^-24, 2^-24 (fp32) give 1 ascending, 1 + 2^-23 descending.
    e = 2.0 ** -24
    rows = [1.0, None, e, None, e, None]  # 3 nodes of 2
    assert U.v1_combine_floats(rows, 2, "fp32") == 1.0
    assert U.v1_combine_floats(rows[4:6] + rows[2:4] + rows[0:2], 2, "fp32") == 1.0 + 2.0 ** -23


def test_differs_in_general_random():
    rnd = random.Random(2)
    for dtype in DTYPES:
        diff = sum(U.v1_combine_floats(r, 2, dtype) != U.flat_combine_floats(r, dtype)
                   for r in (random_rows(rnd, 4, dtype, 1.0) for _ in range(2000)))
        assert diff > 0, dtype


def test_no_destination_gives_zero():
    assert bits(U.v1_combine_floats([None] * 4, 2, "bf16")) == bits(0.0)


@needs_torch
def test_torch_form_equals_float_form():
    import torch

    rnd = random.Random(3)
    T, H = 64, 8
    for dtype, cdt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        for W, G in ((4, 2), (8, 4), (6, 3), (4, 1), (4, 4)):
            vals = [[random_rows(rnd, W, dtype) for _ in range(H)] for _ in range(T)]  # [T][H][W]
            masks = [torch.tensor([rnd.random() < 0.6 for _ in range(T)]) for _ in range(W)]
            rows = [torch.tensor([[vals[t][h][d] or 0.0 for h in range(H)] for t in range(T)], dtype=torch.float32).to(cdt)
                    for d in range(W)]
            got = U.v1_combine_reference(torch, rows, masks, G, cdt).float()
            for t in range(T):
                for h in range(H):
                    r = [rows[d][t, h].item() if masks[d][t] else None for d in range(W)]
                    assert bits(got[t, h].item()) == bits(U.v1_combine_floats(r, G, dtype)), (dtype, W, G, t, h)
