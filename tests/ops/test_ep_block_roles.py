"""No-GPU model of the dispatch block roles (EpDispatchBlockRole in
src/ops/dispatch_combine/intranode_device.hpp): every destination has exactly one leader and a
complete group, block 0 leads the local destination, and with those roles every (source, token)
row still lands exactly once at its documented slot. Reuses the kernel-arithmetic model of
tests/python/test_ep_kernel_model.py.

    python3 -m pytest -q tests/ops/test_ep_block_roles.py
"""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import test_ep_kernel_model as M  # noqa: E402


def block_role(b, nb, W, me):
    """(dest, g, G) of dispatch block b of nb on PE me; mirrors EpDispatchBlockRole."""
    if W <= 1 or nb < 3 * W:
        return (b + me) % W, b // W, (nb - 1 - (b % W)) // W + 1
    n_local = max(1, nb // (2 * W))
    if b < n_local:
        return me, b, n_local
    r, n_remote = b - n_local, nb - n_local
    q = r % (W - 1)
    return (me + 1 + q) % W, r // (W - 1), (n_remote - 1 - q) // (W - 1) + 1


def simulate(W, epr, routing, grid, warp, n_warps):
    num_experts = W * epr
    count = [[M.popcount_sum(M.membership_words(routing[s], d, epr, num_experts, warp)) for d in range(W)]
             for s in range(W)]
    placed = [dict() for _ in range(W)]
    slot_table = [dict() for _ in range(W)]
    for s in range(W):
        T = len(routing[s])
        for b in range(grid):
            dest, g, G = block_role(b, grid, W, s)
            words = M.membership_words(routing[s], dest, epr, num_experts, warp)
            prefix = M.exclusive_prefix(words)
            count_d = prefix[len(words)]
            send_base = sum(count[x][dest] for x in range(s))
            for t in range(T * g // G, T * (g + 1) // G):
                w, bit = t // warp, t % warp
                slot = -1
                if (words[w] >> bit) & 1:
                    slot = send_base + prefix[w] + M.popcount(words[w] & ((1 << bit) - 1))
                assert (t, dest) not in slot_table[s]
                slot_table[s][(t, dest)] = slot
            for p in range(count_d * g // G, count_d * (g + 1) // G):
                t = M.position_to_token(words, prefix, p, warp)
                slot = send_base + p
                assert slot not in placed[dest], ("row written twice", dest, slot)
                placed[dest][slot] = (s, t)
        for t in range(T):
            for d in range(W):
                assert (t, d) in slot_table[s], ("slot never written", s, t, d)
    return placed


def check(W, epr, K, Ts, grid, warp, n_warps, mode, seed):
    rnd = random.Random(seed)
    routing = [M.random_routing(rnd, W, epr, K, T, mode) for T in Ts]
    placed = simulate(W, epr, routing, grid, warp, n_warps)
    ref = M.reference(W, epr, routing)
    for d in range(W):
        assert [placed[d].get(i) for i in range(len(ref[d]))] == ref[d], f"dest {d}: rows out of place"
        assert len(placed[d]) == len(ref[d])


def test_block_roles_partition():
    for W in range(1, 33):
        for nb in range(W, 140):
            for me in {0, W // 2, W - 1}:
                groups = {}
                for b in range(nb):
                    d, g, G = block_role(b, nb, W, me)
                    assert 0 <= d < W and 0 <= g < G
                    groups.setdefault(d, []).append((g, G))
                    if b == 0:
                        assert (d, g) == (me, 0), "block 0 must lead the local destination"
                assert sorted(groups) == list(range(W)), (W, nb, "a destination has no block")
                for lst in groups.values():
                    G = lst[0][1]
                    assert all(x[1] == G for x in lst) and sorted(x[0] for x in lst) == list(range(G))


def test_rows_with_block_roles():
    check(4, 64, 8, [256, 7, 0, 300], 24, 32, 16, "random", 4)
    check(4, 64, 8, [128] * 4, 64, 32, 4, "random", 6)
    check(8, 4, 8, [100] * 8, 30, 64, 8, "random", 5)
    check(2, 8, 8, [300, 300], 132, 32, 16, "random", 3)
    check(4, 2, 3, [130, 0, 64, 1], 12, 32, 16, "neg", 1)
    check(4, 2, 3, [130, 0, 64, 1], 4, 32, 16, "neg", 1)
