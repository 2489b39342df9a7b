#!/usr/bin/env python3
"""GPU correctness suite of mori.ops InterNode dispatch/combine: the IntraNode suite's cases
(tests/ops/ep_intranode_test.py, same checks: dispatch bit-exact in IntraNode's order, combine
bitwise the ascending-rank fp32 sum) on nodes of --gpu-per-node ranks, same-node peers over P2P and
other nodes over GPU-posted RDMA (emulated by MORI_RDMA_EMULATE=1 when nodes are virtual).

    python3 tests/ops/ep_internode_test.py --nproc 4 --gpu-per-node 2     # 2 nodes x 2, one GPU
    python3 tests/ops/ep_internode_test.py --nproc 8 --gpu-per-node 4     # 2 x 4
    python3 tests/ops/ep_internode_test.py --nproc 4 --gpu-per-node 1     # 4 x 1
    MORI_RDMA_EMULATE_CHAOS=7 python3 tests/ops/ep_internode_test.py ...  # emulator chaos mode
    python3 tests/ops/ep_internode_test.py ... --num-qp-per-pe 4          # 4 QPs (channels) per peer
    python3 tests/ops/ep_internode_test.py --nproc 4 --gpu-per-node 2 --kernel-type InterNodeV1LL
                                          # node-deduplicated: combine checked by the two-level formula
    python3 tests/ops/ep_internode_test.py --nproc 4 --gpu-per-node 2 --kernel-type AsyncLL
                                          # runs as InterNode, ops of <= 256 tokens per rank
    python3 tests/ops/ep_internode_test.py --nproc 4 --gpu-per-node 2 --kernel-type InterNode
        --kernel-type InterNodeV1 --kernel-type InterNodeV1LL    # (one command) each type in turn
                                          # in the same ranks, case lines named case[type]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ep_intranode_test  # noqa: E402

if __name__ == "__main__":
    sys.exit(ep_intranode_test.main(default_kernel_type="InterNode"))
