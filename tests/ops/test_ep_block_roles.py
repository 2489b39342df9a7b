"""The dispatch block roles of the kernel itself (EpDispatchBlockRole in
src/ops/dispatch_combine/intranode_device.hpp, through mori._C._testing; no GPU): every destination
has exactly one leader and a complete group, block 0 leads the local destination, and with at
least 3 blocks per destination every peer's group is about twice the local one (a local block
copies about twice as fast as a peer block streams). Where rows land with these roles is checked
by tests/python/test_ep_kernel_model.py.

    PYTHONPATH=<build>/python python3 -m pytest -q tests/ops/test_ep_block_roles.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_test_utils as U  # noqa: E402

T = U.import_mori()._C._testing


def groups_of(nb, W, me):
    """{dest: [(g, G) of its blocks]} and block 0's role."""
    roles = T.ep_dispatch_block_roles(nb, W, me)
    assert len(roles) == nb
    groups = {}
    for d, g, G in roles:
        assert 0 <= d < W and 0 <= g < G, (nb, W, me, d, g, G)
        groups.setdefault(d, []).append((g, G))
    return groups, roles[0]


def test_block_roles_partition():
    for W in range(1, 33):
        for nb in range(W, 140):
            for me in {0, W // 2, W - 1}:
                groups, first = groups_of(nb, W, me)
                assert first[:2] == (me, 0), (W, nb, me, "block 0 must lead the local destination")
                assert sorted(groups) == list(range(W)), (W, nb, me, "a destination has no block")
                for lst in groups.values():
                    G = lst[0][1]
                    assert all(x[1] == G for x in lst) and sorted(x[0] for x in lst) == list(range(G))


def test_peer_groups_are_about_twice_the_local_group():
    for W in range(2, 17):
        for nb in range(3 * W, 200):
            for me in {0, W - 1}:
                groups, _ = groups_of(nb, W, me)
                local = len(groups[me])
                for d, lst in groups.items():
                    if d != me:
                        assert 2 * local <= len(lst) <= 2 * local + 2, (W, nb, me, d, local, len(lst))


def test_round_robin_below_three_blocks_per_destination():
    for W in range(1, 17):
        for nb in range(W, 3 * W):
            groups, _ = groups_of(nb, W, 0)
            sizes = sorted(len(v) for v in groups.values())
            assert sizes[-1] - sizes[0] <= 1, (W, nb, sizes)


def test_arguments_out_of_range_raise():
    import pytest

    for args in ((0, 0, 1, 0), (4, 4, 2, 0), (0, 4, 2, 2), (0, 4, 0, 0)):
        with pytest.raises(ValueError):
            T.ep_dispatch_block_role(*args)
