"""The InterNodeV1/V1LL kernels' arithmetic on the host (mori._C._testing binds the functions the
kernels call; no GPU): record and partial layouts against docs/ep_internode_v1.md §2 and the
wire-count bench's formula, chunk sizes, node slots, the landing tail value, and the block groups
(EpV1Serves: every item gets a complete group, every block a role while there are enough)."""

import pytest

import ep_test_utils as U

mori = U.import_mori()
T = mori._C._testing


def align(v, a):
    return (v + a - 1) // a * a


@pytest.mark.parametrize("row,k,scale,idx,g", [(7168 * 2, 8, 224, 4, 8), (7168, 8, 224, 4, 8),
                                               (2048 * 2, 8, 0, 8, 2), (384, 4, 7, 8, 4), (16, 1, 3, 4, 1)])
def test_record_layout(row, k, scale, idx, g):
    r = T.ep_v1_record_layout(row, k, scale, idx, g)
    assert r["weights"] == row and r["scales"] == row + 4 * k
    assert r["indices"] == align(row + 4 * k + scale, 8) and r["indices"] % 8 == 0
    assert r["src_pos"] == r["indices"] + k * idx and r["header"] == r["src_pos"] + 4
    assert r["bytes"] == align(r["header"] + 4 * g, 16)
    # the bench's ideal (tools/bench/ep_internode_bench.py v1_ideal) uses the same size
    assert r["bytes"] == align(align(row + 4 * k + scale, 8) + k * idx + 4 + 4 * g, 16)


def test_design_sizes():
    # docs/ep_internode_v1.md §2: BF16 / FP8 records at H 7168, K 8, 56 fp32 scales, int32, G 8
    assert T.ep_v1_record_layout(7168 * 2, 8, 224, 4, 8)["bytes"] == 14672
    assert T.ep_v1_record_layout(7168, 8, 224, 4, 8)["bytes"] == 7504
    assert T.ep_v1_partial_bytes(7168 * 2, 8) == 14368
    assert T.ep_v1_chunk_records(14672) == 36 and T.ep_v1_chunk_records(7504) == 70
    assert T.ep_v1_count_words(8, 16) == 2 + 8 + 8 * 16


@pytest.mark.parametrize("N", [1, 2, 3, 4, 8])
def test_node_slots(N):
    for me in range(N):
        slots = [T.ep_v1_node_slot(n, me, N) for n in range(N) if n != me]
        assert sorted(slots) == list(range(N - 1))
        for m in range(N - 1):
            n = T.ep_v1_slot_node(m, me, N)
            assert n != me and T.ep_v1_node_slot(n, me, N) == m


def test_land_value():
    fmt = 0 | ((7168 * 2) << 8)  # EpReadyFormat: bf16 (0), row bytes from bit 8
    v = T.ep_v1_land_value(0, False, fmt)
    assert v & 0x3FFFF == 0 and v != 0
    assert T.ep_v1_land_value(65536, True, fmt) == v | 65536 | (1 << 17)
    assert T.ep_v1_land_value(5, False, fmt | 2) != T.ep_v1_land_value(5, False, fmt)  # dtype counts


@pytest.mark.parametrize("nb", [1, 2, 3, 5, 7, 8, 13, 16, 33, 64, 131])
@pytest.mark.parametrize("items", [1, 2, 3, 7])
def test_serves_complete_groups(nb, items):
    groups = {i: [] for i in range(items)}
    per_block = [0] * nb
    for b in range(nb):
        for i in range(items):
            serves, g, gs = T.ep_v1_serves(b, nb, items, i)
            if serves:
                groups[i].append((g, gs))
                per_block[b] += 1
    for i, members in groups.items():
        gs = members[0][1]
        assert sorted(g for g, _ in members) == list(range(gs)) and all(s == gs for _, s in members)
    if nb >= items:
        assert all(n == 1 for n in per_block)  # every block serves exactly one item
    else:
        assert sum(per_block) == items and all(len(m) == 1 for m in groups.values())
