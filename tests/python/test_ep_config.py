"""EP dispatch/combine config validation, size hints and layout: no GPU or torch needed."""

import pytest

import mori
from mori import _C
import mori.ops as ops


def make(**kw):
    base = dict(rank=0, world_size=4, hidden_dim=7168, scale_dim=56, scale_type_size=4, max_token_type_size=2,
                max_num_inp_token_per_rank=4096, num_experts_per_rank=64, num_experts_per_token=8)
    base.update(kw)
    return ops.EpDispatchCombineConfig(**base)


def test_native_module_has_ops():
    assert hasattr(_C, "ops"), "mori._C.ops missing: RegisterOpsBindings is not called by the module"


def test_valid_config_and_derived_values():
    c = make()
    c.validate()
    assert c.num_experts == 256
    assert c.max_num_recv_tokens == 4 * 4096
    n = c.to_native()
    assert (n.rank, n.world_size, n.hidden_dim, n.num_experts_per_token) == (0, 4, 7168, 8)
    assert n.kernel_type == 0


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("world_size", 0, "world_size"),
        ("world_size", 33, "world_size"),
        ("rank", 4, "rank"),
        ("rank", -1, "rank"),
        ("hidden_dim", 0, "hidden_dim"),
        ("max_token_type_size", 0, "max_token_type_size"),
        ("max_token_type_size", 16, "max_token_type_size"),
        ("num_experts_per_token", 0, "num_experts_per_token"),
        ("num_experts_per_token", 65, "num_experts_per_token"),
        ("num_experts_per_rank", 0, "num_experts_per_rank"),
        ("max_num_inp_token_per_rank", 0, "max_num_inp_token_per_rank"),
        ("max_num_inp_token_per_rank", 1 << 20, "max_num_inp_token_per_rank"),
        ("scale_type_size", 3, "scale_type_size"),
        ("warp_num_per_block", 0, "warp_num_per_block"),
        ("warp_num_per_block", 17, "warp_num_per_block"),
        ("block_num", 0, "block_num"),
        ("num_qp_per_pe", -1, "num_qp_per_pe"),  # 0 is the default (ROCm/mori's one-node examples)
        ("rdma_block_num", -1, "rdma_block_num"),
        ("gpu_per_node", 0, "gpu_per_node"),
    ],
)
def test_bad_field_names_the_field(field, value, needle):
    with pytest.raises(mori.InvalidUsageError) as e:
        make(**{field: value}).validate()
    assert needle in str(e.value)
    assert isinstance(e.value, ValueError)


def test_row_smaller_than_a_vector():
    with pytest.raises(mori.InvalidUsageError, match="16-byte"):
        make(hidden_dim=4, max_token_type_size=2).validate()


def test_non_int_field():
    with pytest.raises(mori.InvalidUsageError, match="hidden_dim"):
        make(hidden_dim="7168").validate()


def test_kernel_types_are_mori_s():
    """Names and values as ROCm/mori's, taken from the C++ enum (one source)."""
    expected = {"IntraNode": 0, "InterNode": 1, "InterNodeV1": 2, "InterNodeV1LL": 3, "AsyncLL": 4, "IntraNodeLL": 5}
    assert {m.name: m.value for m in ops.EpDispatchCombineKernelType} == expected
    assert {n: int(v) for n, v in _C.ops.EpDispatchCombineKernelType.__members__.items()} == expected
    assert ops.KERNEL_TYPE_BUILT == {n: n != "IntraNodeLL" for n in expected}


def test_intranode_ll_not_built_names_what_works():
    kt = "IntraNodeLL"
    what_works = (r"not built yet \(this build has IntraNode, InterNode, InterNodeV1, InterNodeV1LL and AsyncLL; "
                  r"for small batches on one node use IntraNode, or AsyncLL for the split phase\)")
    with pytest.raises(mori.InvalidUsageError, match=f"kernel_type = {kt}: {what_works}"):
        make(kernel_type=ops.EpDispatchCombineKernelType[kt]).validate()
    with pytest.raises(mori.InvalidUsageError, match=what_works):
        make(kernel_type=kt).validate()  # names work too
    with pytest.raises(mori.InvalidUsageError, match=what_works):
        make(kernel_type=int(ops.EpDispatchCombineKernelType[kt])).validate()  # and values


# AsyncLL: the split-phase type, run as IntraNode on one node, else InterNode.
@pytest.mark.parametrize("world,gpn,runs_as", [(4, 8, "IntraNode"), (4, 4, "IntraNode"), (8, 8, "IntraNode"),
                                               (4, 2, "InterNode"), (16, 8, "InterNode"), (4, 1, "InterNode")])
def test_async_ll_runs_as_intranode_on_one_node_else_internode(world, gpn, runs_as):
    kt = ops.EpDispatchCombineKernelType
    c = make(kernel_type=kt.AsyncLL, world_size=world, gpu_per_node=gpn, max_num_inp_token_per_rank=256)
    c.validate()
    assert c.kernel_type is kt.AsyncLL and c.to_native().kernel_type == 4  # reads back as given
    assert c.runs_as is kt[runs_as] and c.to_native().runs_as == int(kt[runs_as])
    # every other type runs as itself, whatever the topology
    for other in ("IntraNode", "InterNode", "InterNodeV1", "InterNodeV1LL"):
        assert make(kernel_type=other, world_size=world, gpu_per_node=gpn).runs_as is kt[other]


@pytest.mark.parametrize("m", [1, 128, 256, 257, 4096, 65536])
def test_async_ll_validates_any_token_count(m):
    # No kernel type caps max_num_inp_token_per_rank below the implementation's limit (65536).
    for kt in ("AsyncLL", ops.EpDispatchCombineKernelType.AsyncLL, 4):  # member, name, value
        make(kernel_type=kt, max_num_inp_token_per_rank=m).validate()
        make(kernel_type=kt, max_num_inp_token_per_rank=m, world_size=16, gpu_per_node=8).validate()
    with pytest.raises(mori.InvalidUsageError, match=r"max_num_inp_token_per_rank = 65537 is out of range"):
        make(kernel_type="AsyncLL", max_num_inp_token_per_rank=65537).validate()


@pytest.mark.parametrize("kw", [dict(), dict(world_size=8), dict(max_total_recv_tokens=1001)])
def test_combine_rows_ready_has_a_tag_per_chunk_of_every_source(kw):
    # [src][chunk] epoch tags of the external-input copy beside the combine (layout.hpp)
    c = make(**kw)
    regs = {name: (nbytes, role) for _b, name, _o, nbytes, role in ops.ep_layout(c)["regions"]}
    R = _C._testing.EP_COMBINE_COPY_ROWS
    chunks = -(-c.max_num_recv_tokens // R)
    assert regs["combine_rows_ready"][0] == c.world_size * chunks * 8
    assert "control" in str(regs["combine_rows_ready"][1]).lower()


@pytest.mark.parametrize("world,gpn", [(4, 8), (16, 8)])
def test_async_ll_above_256_tokens_keeps_its_split_phase_buffers(world, gpn):
    # SGLang's low-latency mode: AsyncLL with 4096 tokens per rank. The split-phase staging and the
    # push combine's buffers are sized for M (what makes dispatch_send/combine_send work at any M);
    # IntraNode/InterNode ops of that size have neither (they split up to 256 tokens per rank).
    assert _C.ops.SPLIT_DISPATCH_MAX_TOKENS == _C.ops.PUSH_COMBINE_MAX_TOKENS == 256
    M, H = 4096, 7168
    a = make(kernel_type="AsyncLL", world_size=world, gpu_per_node=gpn, max_num_inp_token_per_rank=M)
    plain = make(kernel_type=a.runs_as.name, world_size=world, gpu_per_node=gpn, max_num_inp_token_per_rank=M)
    size = {name: nbytes for _b, name, _o, nbytes, _r in ops.ep_layout(a)["regions"]}
    other = {name: nbytes for _b, name, _o, nbytes, _r in ops.ep_layout(plain)["regions"]}
    G = min(gpn, world) if a.runs_as.name == "InterNode" else world
    assert size["split_tokens"] == 2 * world * M * H * 2  # [parity][src][M] rows of 7168 bf16
    assert size["push_recv_tokens"] == 2 * M * G * H * 2  # [parity][M][ranks of the node]
    assert other["split_tokens"] == 0 and other["push_recv_tokens"] == 0
    assert ops.ep_symmetric_bytes(a) > ops.ep_symmetric_bytes(plain)


def test_async_ll_other_rules_are_those_of_the_type_it_runs_as():
    # across nodes: InterNode's equal nodes; fp8_direct_cast as both IntraNode and InterNode
    with pytest.raises(mori.InvalidUsageError, match="kernel_type AsyncLL needs nodes of equal size"):
        make(kernel_type="AsyncLL", world_size=6, gpu_per_node=4, max_num_inp_token_per_rank=128).validate()
    for gpn in (2, 8):
        make(kernel_type="AsyncLL", gpu_per_node=gpn, max_num_inp_token_per_rank=128,
             quant_type="fp8_direct_cast").validate()


@pytest.mark.parametrize("world,gpn,as_", [(4, 8, "IntraNode"), (4, 2, "InterNode"), (16, 8, "InterNode")])
@pytest.mark.parametrize("m", [64, 256])
def test_async_ll_layout_is_the_type_it_runs_as(world, gpn, as_, m):
    # the same buffers, offsets and sizes as the type it runs as: split staging, and on one node
    # the push combine's buffers (the split combine)
    kw = dict(world_size=world, gpu_per_node=gpn, max_num_inp_token_per_rank=m)
    a, b = make(kernel_type="AsyncLL", **kw), make(kernel_type=as_, **kw)
    assert ops.ep_layout(a) == ops.ep_layout(b)
    assert ops.ep_symmetric_bytes(a) == ops.ep_symmetric_bytes(b) and ops.ep_local_bytes(a) == ops.ep_local_bytes(b)
    sym = ops.ep_layout(a)["symmetric"]
    assert "split_tokens" in sym and "push_recv_tokens" in sym
    assert ("split_tail" in sym) == (as_ == "InterNode")
    assert ("push_land_tokens" in sym) == (as_ == "InterNode")


def test_agreement_compares_the_kernel_type_given():
    # AsyncLL on one PE and IntraNode on the others have one layout but are different ops
    g = group(dict.fromkeys(range(4), dict(max_num_inp_token_per_rank=128)))
    g[1] = make(rank=1, kernel_type="AsyncLL", max_num_inp_token_per_rank=128)
    msg = _C.ops._find_ep_disagreement("config", rows(g))
    assert "PE 1 has kernel_type = 4 but PE 0 has 0" in msg, msg
    same = [make(rank=r, kernel_type="AsyncLL", max_num_inp_token_per_rank=128) for r in range(4)]
    assert _C.ops._find_ep_disagreement("config", rows(same)) == ""


def test_v1ll_validation():
    """InterNodeV1LL: nodes of equal size, any tokens per rank the shared-memory bound allows (two
    inbox and landing sets sized for them), at most 16 channels (QPs per rail peer); its regions are
    in the layout table (InterNode's are not)."""
    kw = dict(world_size=16, gpu_per_node=8, max_num_inp_token_per_rank=128, kernel_type="InterNodeV1LL")
    make(**kw).validate()
    with pytest.raises(mori.InvalidUsageError, match=r"num_qp_per_pe = 17 .*channels"):
        make(**dict(kw, num_qp_per_pe=17)).validate()
    with pytest.raises(mori.InvalidUsageError, match=r"InterNodeV1LL needs nodes of equal size"):
        make(**dict(kw, gpu_per_node=6)).validate()
    size = {name: nbytes for _block, name, _off, nbytes, _role in ops.ep_layout(make(**kw))["regions"]}
    rec = -(-(7168 * 2 + 4 * 8 + 56 * 4 + 8 * 8 + 4 + 4 * 8) // 16) * 16  # largest record (int64 ids)
    assert size["v1_inbox"] == 2 * 1 * 128 * rec  # [parity][remote node][M]
    assert size["v1_landing"] == 2 * 1 * 128 * (7168 * 2 + 4 * 8)
    assert size["v1_credit"] == 0 and size["v1_land_free"] == 0 and size["stage_tokens"] == 0
    assert size["v1_route"] == 1 * 128 * 8 * 4
    # InterNodeV1: any M the shared-memory bound allows; one inbox / landing set, credits, landFree.
    ht = dict(kw, kernel_type="InterNodeV1", max_num_inp_token_per_rank=4096)
    make(**ht).validate()
    size = {name: nbytes for _block, name, _off, nbytes, _role in ops.ep_layout(make(**ht))["regions"]}
    assert size["v1_inbox"] == 1 * 1 * 4096 * rec and size["v1_send_stage"] == 4096 * rec
    assert size["v1_credit"] == 8 and size["v1_land_free"] == 8 and size["v1_tail"] == 8
    with pytest.raises(mori.InvalidUsageError, match=r"InterNodeV1 dispatch kernel would need"):
        make(**dict(ht, max_num_inp_token_per_rank=65536)).validate()
    # InterNodeV1LL above 256 tokens per rank (vLLM's and SGLang's 4096): the LL protocol (two
    # parity sets, no credits), its buffers sized for M; lists above 256 records move in V1's chunks.
    for m in (257, 4096):
        ll = dict(kw, max_num_inp_token_per_rank=m)
        make(**ll).validate()
        size = {name: nbytes for _block, name, _off, nbytes, _role in ops.ep_layout(make(**ll))["regions"]}
        assert size["v1_inbox"] == 2 * 1 * m * rec and size["v1_landing"] == 2 * 1 * m * (7168 * 2 + 4 * 8)
        assert size["v1_credit"] == 0 and size["v1_land_free"] == 0
    with pytest.raises(mori.InvalidUsageError, match=r"InterNodeV1LL dispatch kernel would need"):
        make(**dict(kw, max_num_inp_token_per_rank=65536)).validate()


def test_unknown_kernel_type_value():
    with pytest.raises(mori.InvalidUsageError, match="kernel_type = 6 is not a kernel type"):
        make(kernel_type=6).validate()
    with pytest.raises(mori.InvalidUsageError, match="is not a kernel type"):
        make(kernel_type="InterNodeV2").validate()


def test_quant_type():
    assert {m.name: m.value for m in ops.EpDispatchCombineQuantType} == {"None_": 0, "Fp8DirectCast": 1}
    for q in ("none", "None", " NONE ", ops.EpDispatchCombineQuantType.None_, 0):
        make(quant_type=q).validate()
        assert make(quant_type=q).to_native().quant_type == 0
    assert make().quant_type == "none"
    for q in ("fp8_direct_cast", " FP8_Direct_Cast", ops.EpDispatchCombineQuantType.Fp8DirectCast, 1):
        make(quant_type=q).validate()
        assert make(quant_type=q).to_native().quant_type == 1
    for q in ("fp8_blockwise", "fp4_blockwise", "int8", 2, None, True):
        with pytest.raises(mori.InvalidUsageError, match=r"is not a quant type of this build; known: 'none', 'fp8_direct_cast'"):
            make(quant_type=q).validate()
    # The native config refuses a code outside the enum too.
    n = _C.ops.EpDispatchCombineConfig(**{k: getattr(make(), k) for k in (
        "rank", "world_size", "hidden_dim", "scale_dim", "scale_type_size", "max_token_type_size",
        "max_num_inp_token_per_rank", "num_experts_per_rank", "num_experts_per_token")}, quant_type=9)
    with pytest.raises(mori.InvalidUsageError, match="quant_type = 9 is not a quant type"):
        n.validate()


ROCM_FIELD_ORDER = [
    "data_type", "rank", "world_size", "hidden_dim", "scale_dim", "scale_type_size", "max_token_type_size",
    "max_num_inp_token_per_rank", "num_experts_per_rank", "num_experts_per_token", "warp_num_per_block",
    "block_num", "max_total_recv_tokens", "use_external_inp_buf", "kernel_type", "gpu_per_node",
    "rdma_block_num", "num_qp_per_pe", "quant_type",
]


def test_field_order_is_rocm_mori_s():
    import dataclasses

    fields = dataclasses.fields(ops.EpDispatchCombineConfig)
    assert [f.name for f in fields] == ROCM_FIELD_ORDER
    defaults = {f.name: f.default for f in fields if f.name in ROCM_FIELD_ORDER[10:]}
    assert defaults == dict(warp_num_per_block=8, block_num=80, max_total_recv_tokens=0, use_external_inp_buf=True,
                            kernel_type=ops.EpDispatchCombineKernelType.IntraNode, gpu_per_node=8,
                            rdma_block_num=0, num_qp_per_pe=1, quant_type="none")


class _Dtype:
    """A stand-in for a torch dtype (what the config reads of one: itemsize)."""

    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return self.name


BF16 = _Dtype("bf16", 2)


def test_positional_construction():
    c = ops.EpDispatchCombineConfig(BF16, 1, 4, 7168, 56, 4, 2, 4096, 64, 8, 16, 64, 1000, False,
                                    ops.EpDispatchCombineKernelType.InterNode, 2, 32, 2, "none")
    assert c.data_type is BF16 and (c.rank, c.world_size, c.hidden_dim) == (1, 4, 7168)
    assert (c.warp_num_per_block, c.block_num, c.max_total_recv_tokens) == (16, 64, 1000)
    assert c.use_external_inp_buf is False and c.kernel_type is ops.EpDispatchCombineKernelType.InterNode
    assert (c.gpu_per_node, c.rdma_block_num, c.num_qp_per_pe, c.quant_type) == (2, 32, 2, "none")
    c.validate()
    assert c.max_num_recv_tokens == 1000
    n = c.to_native()
    assert (n.max_total_recv_tokens, n.kernel_type, n.rdma_block_num, n.num_qp_per_pe) == (1000, 1, 32, 2)


def test_required_fields():
    with pytest.raises(TypeError, match="missing required argument.*world_size"):
        ops.EpDispatchCombineConfig(rank=0)
    with pytest.raises(TypeError, match="missing required argument"):
        ops.EpDispatchCombineConfig(None, 0, 4)


def test_internode_config_needs_equal_nodes():
    make(kernel_type="InterNode", world_size=4, gpu_per_node=2).validate()
    make(kernel_type="InterNode", world_size=4, gpu_per_node=8).validate()  # one node of 4
    with pytest.raises(mori.InvalidUsageError, match="multiple of gpu_per_node"):
        make(kernel_type="InterNode", world_size=6, gpu_per_node=4).validate()


def _regions(c):
    return {(blk, name): (off, nbytes, role) for blk, name, off, nbytes, role in ops.ep_layout(c)["regions"]}


def test_region_table_is_the_layout():
    # ep_layout's offsets, the region list and the size hint come from one table: every region
    # used by the config appears in both views with the same offset, unused ones have 0 bytes.
    for kt in ("IntraNode", "InterNode", "InterNodeV1", "InterNodeV1LL"):
        c = make(kernel_type=kt, world_size=4, gpu_per_node=2, max_num_inp_token_per_rank=128)
        lay = ops.ep_layout(c)
        regs = _regions(c)
        for (blk, name), (off, nbytes, role) in regs.items():
            assert role in ("control", "output", "input", "staging")
            if nbytes > 0:
                assert lay[blk][name] == off
            else:
                assert name not in lay[blk] and off == 0
        ends = sorted((off, off + n) for (blk, _), (off, n, _) in regs.items() if blk == "symmetric" and n > 0)
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "regions overlap"
        assert ends[-1][1] <= lay["symmetric"]["total_bytes"] == ops.ep_symmetric_bytes(c)
        inter = {n for (b, n), (_, nb, _) in regs.items() if nb > 0 and n.startswith(("stage_", "landing_", "inter_"))}
        push = {n for (b, n), (_, nb, _) in regs.items() if nb > 0 and n.startswith("push_")}
        v1 = {n for (b, n), (_, nb, _) in regs.items() if nb > 0 and n.startswith("v1_")}
        if kt == "InterNode":  # the push combine across nodes: its landings and tails too
            assert inter and not v1 and {n for n in push if n.startswith("push_land_")} == {
                "push_land_tail", "push_land_tokens", "push_land_weights"}
        elif kt.startswith("InterNodeV1"):
            assert v1 and not push and not inter
        else:
            assert push and not inter and not v1 and not any(n.startswith("push_land_") for n in push)


def test_max_total_recv_tokens_sizes_receive_regions():
    full = make(world_size=8, max_num_inp_token_per_rank=512)
    capped = make(world_size=8, max_num_inp_token_per_rank=512, max_total_recv_tokens=1024)
    assert full.max_num_recv_tokens == 8 * 512 and capped.max_num_recv_tokens == 1024
    assert make(world_size=2, max_num_inp_token_per_rank=512, max_total_recv_tokens=1 << 20).max_num_recv_tokens == 1024
    rf, rc = _regions(full), _regions(capped)
    row = 7168 * 2
    assert rf[("symmetric", "dispatch_out_tokens")][1] == 8 * 512 * row
    assert rc[("symmetric", "dispatch_out_tokens")][1] == 1024 * row
    assert rc[("symmetric", "combine_in_tokens")][1] == 1024 * row
    with pytest.raises(mori.InvalidUsageError, match="max_total_recv_tokens"):
        make(max_total_recv_tokens=-1).validate()


def test_size_hints_ht_config_under_1gib():
    # high-throughput benchmark config: 4 ranks, 4096 tokens, hidden 7168, bf16/fp8 + fp32 scales
    c = make()
    symm = ops.ep_symmetric_bytes(c)
    assert symm < (1 << 30), f"{symm / 2**20:.1f} MiB"
    rmax = 4 * 4096
    row = 7168 * 2
    assert symm >= 2 * rmax * row  # dispatch output + registered combine input
    assert ops.ep_local_bytes(c) >= 4096 * row


def test_size_hint_validates():
    with pytest.raises(mori.InvalidUsageError):
        ops.ep_symmetric_bytes(make(world_size=0))


def test_layout_is_ordered_aligned_and_disjoint():
    c = make(scale_dim=7, scale_type_size=1, num_experts_per_token=9, world_size=3, rank=2)
    lay = ops.ep_layout(c)
    for part in ("symmetric", "local"):
        d = dict(lay[part])
        total = d.pop("total_bytes")
        offs = sorted(d.items(), key=lambda kv: kv[1])
        for name, off in offs:
            assert off % 256 == 0, (part, name, off)
            assert off < total
        assert len({o for _, o in offs}) == len(offs), f"{part}: overlapping regions {offs}"
    s = lay["symmetric"]
    rmax = 3 * 4096
    assert s["dispatch_out_weights"] - s["dispatch_out_tokens"] >= rmax * 7168 * 2
    assert s["dispatch_out_indices"] - s["dispatch_out_scales"] >= rmax * 7
    assert s["dispatch_out_src_pos"] - s["dispatch_out_indices"] >= rmax * 9 * 8
    assert s["total_bytes"] == ops.ep_symmetric_bytes(c)


@pytest.mark.parametrize("m", [1, 128, 256])
def test_push_combine_buffers_for_small_batch_configs(m):
    # Configs of <= 256 tokens per rank get the push combine's buffers, per call parity: an
    # arrival counter per PE, one row slot (and K weights) per (token, PE). Disjoint from the rest.
    c = make(max_num_inp_token_per_rank=m, world_size=3, num_experts_per_token=9, max_token_type_size=4)
    lay = ops.ep_layout(c)
    d = dict(lay["symmetric"])
    total = d.pop("total_bytes")
    offs = sorted(d.items(), key=lambda kv: kv[1])
    assert len({o for _, o in offs}) == len(offs), offs
    ends = {name: (offs[i + 1][1] if i + 1 < len(offs) else total) for i, (name, _) in enumerate(offs)}
    assert ends["push_arrived"] - d["push_arrived"] >= 2 * 3 * 8
    assert ends["push_recv_tokens"] - d["push_recv_tokens"] >= 2 * m * 3 * 7168 * 4
    assert ends["push_recv_weights"] - d["push_recv_weights"] >= 2 * m * 3 * 9 * 4
    assert total == ops.ep_symmetric_bytes(c)


@pytest.mark.parametrize("m", [1, 128, 256])
def test_internode_push_combine_buffers(m):
    # InterNode (16 PEs, 8 per node): a row slot per (token, PE of our node), not per PE, and two
    # landing sets (one per call parity) of M x min(K, W) rows with K weights, plus a tail word per
    # (parity, PE). V1 kernel types have none (they keep their own combine).
    K = 9
    c = make(max_num_inp_token_per_rank=m, world_size=16, gpu_per_node=8, kernel_type="InterNode",
             num_experts_per_token=K, num_experts_per_rank=16)
    d = dict(ops.ep_layout(c)["symmetric"])
    total = d.pop("total_bytes")
    offs = sorted(d.items(), key=lambda kv: kv[1])
    assert len({o for _, o in offs}) == len(offs), offs
    ends = {name: (offs[i + 1][1] if i + 1 < len(offs) else total) for i, (name, _) in enumerate(offs)}
    size = {n: ends[n] - d[n] for n in d}
    row = 7168 * 2
    assert 2 * m * 8 * row <= size["push_recv_tokens"] < 2 * m * 8 * row + 256
    assert 2 * m * 8 * K * 4 <= size["push_recv_weights"] < 2 * m * 8 * K * 4 + 256
    assert 2 * m * K * row <= size["push_land_tokens"] < 2 * m * K * row + 256
    assert 2 * m * K * K * 4 <= size["push_land_weights"] < 2 * m * K * K * 4 + 256
    assert 2 * 16 * 8 <= size["push_land_tail"] < 2 * 16 * 8 + 256
    assert size["push_land_tokens"] // 2 <= size["landing_tokens"] + 256  # the fused landing, twice
    for kt in ("InterNodeV1", "InterNodeV1LL"):
        v1 = ops.ep_layout(make(max_num_inp_token_per_rank=m, world_size=16, gpu_per_node=8, kernel_type=kt,
                                num_experts_per_rank=16))["symmetric"]
        assert not any(n.startswith("push_") for n in v1), kt
    big = ops.ep_layout(make(max_num_inp_token_per_rank=257, world_size=16, gpu_per_node=8, kernel_type="InterNode",
                             num_experts_per_rank=16))["symmetric"]
    assert not any(n.startswith("push_") for n in big)


def test_no_push_combine_buffers_above_256_tokens():
    small = ops.ep_layout(make(max_num_inp_token_per_rank=256))["symmetric"]
    big = ops.ep_layout(make(max_num_inp_token_per_rank=257))["symmetric"]
    assert "push_recv_tokens" in small and "push_recv_tokens" not in big
    # The HT config stays as it was: dispatch output + registered combine input dominate.
    assert ops.ep_symmetric_bytes(make()) < (1 << 30)


def test_dispatch_smem_within_limit_for_extremes():
    c = make(max_num_inp_token_per_rank=65536, num_experts_per_rank=4096)
    c.validate()
    for ws in (32, 64):
        assert _C.ops.ep_dispatch_smem_bytes(c.to_native(), ws) <= 40 * 1024


def test_handle_before_shmem_init_is_invalid_usage():
    if mori.shmem.shmem_is_initialized():
        pytest.skip("shmem is initialised in this process")
    with pytest.raises(mori.InvalidUsageError, match="shmem is not initialised"):
        _C.ops.EpDispatchCombineHandle(make().to_native())


def test_constants():
    o = _C.ops
    assert o.MAX_WORLD_SIZE == 32
    assert o.ROW_ALIGN_BYTES == 16
    assert o.SMALL_BATCH_TOKENS == 128
    assert o.PUSH_COMBINE_MAX_TOKENS == o.SPLIT_DISPATCH_MAX_TOKENS == 256
    assert o.MAX_THREADS_PER_BLOCK // o.WARP_SIZE >= 8


# --- cross-PE agreement at handle construction / destruction (the check every PE runs on the
# rows gathered through the shmem bootstrap; here fed directly, no GPU) ------------------------
def rows(configs, free=1 << 40):
    return [(c.to_native(), free) for c in configs]


def group(per_rank=None, W=4):
    """One config per rank; per_rank maps rank -> field overrides."""
    per_rank = per_rank or {}
    return [make(rank=r, world_size=W, **per_rank.get(r, {})) for r in range(W)]


def test_agreement_same_config_agrees():
    assert _C.ops._find_ep_disagreement("config", rows(group())) == ""


def test_agreement_allows_per_rank_launch_settings():
    g = group({1: dict(block_num=17, warp_num_per_block=4), 3: dict(use_external_inp_buf=False)})
    assert _C.ops._find_ep_disagreement("config", rows(g)) == ""


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_dim", 4096),
        ("max_token_type_size", 1),
        ("max_num_inp_token_per_rank", 128),
        ("num_experts_per_rank", 8),
        ("num_experts_per_token", 4),
        ("scale_dim", 0),
        ("scale_type_size", 1),
    ],
)
def test_agreement_names_the_rank_and_field(field, value):
    base = getattr(make(), field)
    msg = _C.ops._find_ep_disagreement("config", rows(group({2: {field: value}})))
    assert f"PE 2 has {field} = {value} but PE 0 has {base}" in msg, msg


def test_agreement_push_combine_must_match():
    # MORI_EP_COMBINE_PUSH picks the combine protocol at op creation: a PE that pulls while the
    # others push would wait for signals that never come, so creation refuses it.
    g = group(dict.fromkeys(range(4), dict(max_num_inp_token_per_rank=128)))
    entries = [(c.to_native(), 1 << 40, r != 2) for r, c in enumerate(g)]
    msg = _C.ops._find_ep_disagreement("config", entries)
    assert "PE 2 has push combine (MORI_EP_COMBINE_PUSH) = 0 but PE 0 has 1" in msg, msg
    assert _C.ops._find_ep_disagreement("config", [(c.to_native(), 1 << 40, True) for c in g]) == ""


def test_agreement_names_the_first_rank_then_the_first_field():
    g = group({1: dict(num_experts_per_token=4, hidden_dim=1024), 2: dict(hidden_dim=4096)})
    msg = _C.ops._find_ep_disagreement("config", rows(g))
    assert "PE 1 has hidden_dim = 1024" in msg, msg


def test_agreement_world_size_differs():
    g = group()
    g[3] = make(rank=3, world_size=5)
    assert "PE 3 has world_size = 5 but PE 0 has 4" in _C.ops._find_ep_disagreement("config", rows(g))


def test_agreement_unusable_rank_is_named_with_its_reason():
    entries = rows(group())
    entries[1] = "EpDispatchCombineConfig.hidden_dim = 0 is out of range"
    entries[2] = "something else"
    msg = _C.ops._find_ep_disagreement("config", entries)
    assert msg.startswith("PE 1 cannot create the EP op: EpDispatchCombineConfig.hidden_dim = 0"), msg


def test_agreement_long_reason_is_truncated():
    entries = rows(group())
    entries[3] = "x" * 1000
    msg = _C.ops._find_ep_disagreement("config", entries)
    assert "PE 3 cannot create the EP op: xxx" in msg and msg.count("x") < 300


def test_agreement_heap_too_small_on_one_rank():
    g = group()
    need = ops.ep_symmetric_bytes(g[0])
    entries = rows(g, free=need)
    entries[2] = (g[2].to_native(), need - 1)
    msg = _C.ops._find_ep_disagreement("config", entries)
    assert f"needs {need} bytes" in msg and f"PE 2 has only {need - 1} free" in msg, msg
    assert "MORI_SHMEM_HEAP_SIZE" in msg


def test_agreement_allocation_offsets():
    assert _C.ops._find_ep_disagreement("allocation", [0x100, 0x100, 0x100]) == ""
    msg = _C.ops._find_ep_disagreement("allocation", [0x100, 0x100, 0x200, 0x300])
    assert "PE 2 got 0x200 but PE 0 got 0x100" in msg, msg
    assert "same order" in msg
    msg = _C.ops._find_ep_disagreement("allocation", [0x100, "cudaMalloc failed: out of memory"])
    assert msg == "PE 1 cannot create the EP op: cudaMalloc failed: out of memory"


def test_agreement_release_needs_every_rank_drained():
    assert _C.ops._find_ep_disagreement("release", [True, True, True]) == ""
    msg = _C.ops._find_ep_disagreement("release", [True, False, False])
    assert msg.startswith("PE 1:") and "did not finish" in msg, msg


def test_agreement_unknown_stage():
    with pytest.raises(mori.InvalidUsageError, match="unknown agreement stage"):
        _C.ops._find_ep_disagreement("nope", [])


def test_dtype_codes_come_from_the_binding():
    # The Python op maps torch dtypes by name through these tables: one source of the codes.
    codes = _C.ops.DTYPE_CODES
    assert set(codes) == {"bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e4m3fnuz"}
    assert sorted(codes.values()) == list(range(len(codes)))
    assert _C.ops.INDEX_TYPE_CODES == {"int32": 0, "int64": 1}


@pytest.mark.parametrize("dtype, needle", [
    (_Dtype("fp32", 4), "data_type fp32 has 4-byte elements but max_token_type_size is 2"),
    ("bf16", "data_type must be a torch dtype or None"),
])
def test_data_type_is_checked_against_the_row_size(dtype, needle):
    c = ops.EpDispatchCombineConfig(dtype, 0, 2, 1024, 0, 0, 2, 64, 4, 2)
    with pytest.raises(mori.InvalidUsageError, match=needle):
        c.validate()
    ops.EpDispatchCombineConfig(_Dtype("fp8", 1), 0, 2, 1024, 0, 0, 2, 64, 4, 2).validate()
    ops.EpDispatchCombineConfig(None, 0, 2, 1024, 0, 0, 2, 64, 4, 2).validate()
