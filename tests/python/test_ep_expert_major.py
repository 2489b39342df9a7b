"""The expert-major ("standard MoE") layout without a GPU: its buffers in the layout table
(mori.ops.ep_layout, ep_expert_major_bytes), the search its copy kernel uses to find a slot's expert
(EpWordOfPosition over the count prefix, through mori._C._testing), and the references the GPU suite
checks the kernels against (tests/ops/ep_test_utils.py): the layout's invariants, the weighted sum's
rounding, the round trip's formula. The torch forms are checked against the float forms where
torch is installed. The kernels themselves: tests/ops/ep_intranode_test.py -k standard_moe."""

import random
import struct

import pytest

import mori
import mori.ops as ops

import ep_test_utils as U

from conftest import needs_torch


def make(**kw):
    base = dict(rank=0, world_size=4, hidden_dim=7168, scale_dim=56, scale_type_size=4, max_token_type_size=2,
                max_num_inp_token_per_rank=128, num_experts_per_rank=8, num_experts_per_token=8)
    base.update(kw)
    return ops.EpDispatchCombineConfig(**base)


def bits(x):
    return struct.pack("<f", x)


# --- buffers -----------------------------------------------------------------------------------
def test_expert_major_regions_and_size_hint():
    c = make()
    lay = ops.ep_layout(c)["expert_major"]
    regs = {name: (off, n, role) for blk, name, off, n, role in ops.ep_layout(c)["regions"] if blk == "expert_major"}
    E, R, K = 8, 4 * 128, 8
    assert regs["tokens"][1] == E * R * 7168 * 2
    assert regs["scales"][1] == E * R * 56 * 4
    assert regs["counts"][1] == E * 4
    assert regs["src_rows"][1] == regs["src_pos"][1] == E * R * 4
    assert regs["marks"][1] == E * (R // 32) * 4 and regs["marks"][2] == "control"  # never poisoned
    assert regs["row_slot"][1] == R * K * 4
    assert {n for n, (_, _, role) in regs.items() if role == "output"} == {"tokens", "scales", "counts", "src_rows", "src_pos"}
    ends = sorted((off, off + n) for off, n, _ in regs.values() if n > 0)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "regions overlap"
    assert all(off % 256 == 0 for off, _ in ends)
    assert ends[-1][1] <= lay["total_bytes"] == ops.ep_expert_major_bytes(c)
    # not part of what an op allocates at creation
    assert ops.ep_local_bytes(c) < ops.ep_expert_major_bytes(c)


def test_expert_major_sizes_follow_the_receive_cap_and_scales():
    capped = make(world_size=8, max_total_recv_tokens=100, scale_dim=0, scale_type_size=0)
    regs = {name: n for blk, name, _, n, _ in ops.ep_layout(capped)["regions"] if blk == "expert_major"}
    assert regs["tokens"] == 8 * 100 * 7168 * 2
    assert regs["scales"] == 0 and "scales" not in ops.ep_layout(capped)["expert_major"]
    assert regs["marks"] == 8 * 4 * 4  # ceil(100 / 32) words per expert
    with pytest.raises(mori.InvalidUsageError):
        ops.ep_expert_major_bytes(make(num_experts_per_rank=0))


def test_copy_kernel_finds_the_expert_of_each_item():
    # The copy kernel's item g belongs to the expert whose count prefix holds it; experts without
    # rows (equal prefixes) are passed over, whatever their place.
    search = mori._C._testing.ep_word_of_position
    rnd = random.Random(5)
    for _ in range(300):
        counts = [rnd.choice((0, 0, 1, 2, 7)) for _ in range(rnd.randint(1, 12))]
        prefix = [sum(counts[:e]) for e in range(len(counts))]
        items = [(e, s) for e, c in enumerate(counts) for s in range(c)]
        for g, (e, s) in enumerate(items):
            found = search(prefix, len(counts), g)
            assert found == e and g - prefix[found] == s, (counts, g)


# --- the layout reference ----------------------------------------------------------------------
def random_rows(rnd, R, K, E):
    return [[rnd.choice((-1, rnd.randrange(E), rnd.randrange(E))) for _ in range(K)] for _ in range(R)]


def random_routing(rnd):
    """(rank, Epr, K, ids): a rank of 1, 2 or 4 and the rows it received (ids of every rank's experts)."""
    W, Epr, K = rnd.choice((1, 2, 4)), rnd.choice((1, 3, 8)), rnd.choice((1, 2, 8))
    return rnd.randrange(W), Epr, K, random_rows(rnd, rnd.randint(0, 40), K, W * Epr)


def test_layout_invariants():
    rnd = random.Random(1)
    for _ in range(200):
        rank, Epr, K, ids = random_routing(rnd)
        counts, src_rows, row_slot = U.expert_major_layout(ids, rank, Epr)
        first = rank * Epr
        for e in range(Epr):
            naming = [r for r, row in enumerate(ids) if first + e in row]
            assert src_rows[e] == naming and counts[e] == len(naming)  # once per row, row order
        for r, row in enumerate(ids):
            for k, g in enumerate(row):
                if first <= g < first + Epr:
                    assert src_rows[g - first][row_slot[r][k]] == r
                else:
                    assert row_slot[r][k] == -1


def test_layout_duplicate_ids_share_one_slot():
    counts, src_rows, row_slot = U.expert_major_layout([[9, 9, 3], [9, -1, 8]], rank=1, Epr=8)
    assert counts == [1, 2] + [0] * 6
    assert src_rows[1] == [0, 1] and src_rows[0] == [1]
    assert row_slot == [[0, 0, -1], [1, -1, 0]]


# --- the way back ------------------------------------------------------------------------------
def test_weighted_sum_rounds_every_product():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 rounds to 1 + 2^-11 (a tie, to even): the sum with
    # -(1 + 2^-11) is 0. A fused multiply-add would keep 2^-24.
    a = 1.0 + 2.0 ** -12
    assert U.fp32_mul(a, a) == 1.0 + 2.0 ** -11
    assert bits(U.weighted_sum_floats([(a, a), (1.0, -(1.0 + 2.0 ** -11))], "fp32")) == bits(0.0)
    assert U.weighted_sum_floats([(1.0, 3.5)], "bf16") == 3.5
    assert bits(U.weighted_sum_floats([], "bf16")) == bits(0.0)


def test_weighted_sum_order_is_ascending_k():
    # fp32: 1 + 2^-24 + 2^-24 is 1 (each addition a tie to even), 2^-24 + 2^-24 + 1 is 1 + 2^-23
    e = 2.0 ** -24
    assert U.weighted_sum_floats([(1.0, 1.0), (1.0, e), (1.0, e)], "fp32") == 1.0
    assert U.weighted_sum_floats([(1.0, e), (1.0, e), (1.0, 1.0)], "fp32") == 1.0 + 2.0 ** -23


def test_round_trip_weights_before_each_ranks_rounding():
    # bf16: rank 0 returns round(0.5 * 1 + 0.5 * 2^-8) = round(0.5 + 2^-9) = 0.5 (a tie, to even),
    # rank 1 returns 0.5 * 2^-8 = 2^-9; the owner's 0.5 + 2^-9 rounds to 0.5 again, although the
    # whole sum 0.5 + 2^-8 is a bf16 value: each rank rounds its weighted sum once.
    terms = [[(0.5, 1.0), (0.5, 2.0 ** -8)], [(0.5, 2.0 ** -8)]]
    assert U.standard_moe_combine_floats(terms, "bf16") == 0.5
    assert U.standard_moe_combine_floats([None, [(2.0, 3.0)]], "bf16") == 6.0
    assert bits(U.standard_moe_combine_floats([None, None], "fp16")) == bits(0.0)


# --- torch forms = float forms -----------------------------------------------------------------
def random_value(rnd, dtype):
    return U.round_to(dtype, rnd.choice((-1, 1)) * rnd.uniform(1, 2) * 2.0 ** rnd.randint(-10, 10))


@needs_torch
def test_torch_layout_equals_float_layout():
    import torch

    rnd = random.Random(2)
    for _ in range(50):
        rank, Epr, K, ids = random_routing(rnd)
        counts, src_rows, row_slot = U.expert_major_layout(ids, rank, Epr)
        t_counts, t_src, t_slot = U.expert_major_layout_torch(torch, torch.tensor(ids, dtype=torch.int64).view(len(ids), K), rank, Epr)
        assert t_counts.tolist() == counts
        assert [t_src[e, : counts[e]].tolist() for e in range(Epr)] == src_rows
        assert bool((t_src[:, :] == -1).sum() == Epr * len(ids) - sum(counts))
        assert t_slot.tolist() == row_slot


@needs_torch
def test_torch_combine_input_equals_float_form():
    import torch

    rnd = random.Random(3)
    for dtype, cdt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        Epr, K, H, R, rank = 3, 4, 4, 24, 1
        ids = random_rows(rnd, R, K, 2 * Epr)
        counts, src_rows, row_slot = U.expert_major_layout(ids, rank, Epr)
        y = [[[random_value(rnd, dtype) for _ in range(H)] for _ in range(R)] for _ in range(Epr)]
        w = [[U.round_to("fp32", rnd.uniform(0, 1)) for _ in range(K)] for _ in range(R)]
        got = U.expert_major_combine_input_torch(
            torch, torch.tensor(y, dtype=torch.float32).to(cdt), torch.tensor(ids), torch.tensor(w),
            torch.tensor(row_slot), rank, Epr).float()
        for r in range(R):
            terms_k = [(k, ids[r][k] - rank * Epr) for k in range(K) if row_slot[r][k] >= 0]
            for h in range(H):
                want = U.weighted_sum_floats([(w[r][k], y[e][row_slot[r][k]][h]) for k, e in terms_k], dtype)
                assert bits(got[r, h].item()) == bits(want), (dtype, r, h)


@needs_torch
def test_torch_round_trip_equals_float_form():
    import torch

    rnd = random.Random(4)
    W, Epr, K, T, H = 3, 2, 4, 16, 4
    for dtype, cdt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        x = torch.tensor([[random_value(rnd, dtype) for _ in range(H)] for _ in range(T)]).to(cdt)
        ids = torch.tensor(random_rows(rnd, T, K, W * Epr))
        w = torch.tensor([[U.round_to("fp32", rnd.uniform(0, 1)) for _ in range(K)] for _ in range(T)])

        def fn(rows, d, e):
            return (rows.float() * (1.0 + 0.125 * d + e.float() / 64)).to(cdt)

        got = U.standard_moe_combine_torch(torch, x, ids, w, W, Epr, fn, cdt).float()
        for t in range(T):
            for h in range(H):
                by_rank = []
                for d in range(W):
                    ks = [k for k in range(K) if d * Epr <= int(ids[t, k]) < (d + 1) * Epr]
                    by_rank.append([(float(w[t, k]), fn(x[t:t + 1, h:h + 1], d, ids[t, k:k + 1].view(1, 1) - d * Epr).item())
                                    for k in ks] if ks else None)
                assert bits(got[t, h].item()) == bits(U.standard_moe_combine_floats(by_rank, dtype)), (dtype, t, h)
