"""quant_type "fp8_direct_cast" combine (docs/ep.md, "FP8 combine"), no GPU: config validation,
the buffer it adds, the cross-rank agreement; the reference formula the GPU suites use
(tests/ops/ep_test_utils.py: fp8_direct_cast_reference / _combine_reference) against an exact
Python-float model built on the kernels' encoder (mori._C._testing.fp8_encode = core::Fp8Encode),
and the documented error bound against that model."""

import math
import random
import struct

import pytest

import ep_test_utils as U

from conftest import needs_torch
from test_ep_config import make  # world 4, hidden 7168, 4096 tokens per rank

import mori
from mori import _C
from mori import ops

FORMATS = ("e4m3fn", "e4m3fnuz")
F = "fp8_direct_cast"


# --- validation, layout, agreement ----------------------------------------------------------------
def test_fp8_direct_cast_validates_for_every_kernel_type_built():
    for kt in ("IntraNode", "InterNode", "InterNodeV1", "AsyncLL"):
        for m in (128, 4096):  # push (<= 256) and pull combines; V1 is V1's combine either way
            if kt == "AsyncLL" and m > 256:
                continue
            make(quant_type=F, kernel_type=kt, gpu_per_node=2, max_num_inp_token_per_rank=m).validate()
    make(quant_type=F, kernel_type="InterNodeV1LL", gpu_per_node=2, max_num_inp_token_per_rank=128).validate()


def test_fp8_direct_cast_needs_hidden_multiple_of_16():
    make(hidden_dim=7176).validate()  # bf16 rows of 7176 elements are whole 16-byte vectors
    with pytest.raises(mori.InvalidUsageError, match=r"fp8_direct_cast needs hidden_dim to be a multiple of 16.*7176"):
        make(hidden_dim=7176, quant_type=F).validate()
    make(hidden_dim=7184, quant_type=F).validate()


def _region(c, name):
    for blk, n, off, nbytes, role in ops.ep_layout(c)["regions"]:
        if blk == "symmetric" and n == name:
            return off, nbytes, role
    raise AssertionError(f"no region {name}")


@pytest.mark.parametrize("kt,cap", [("IntraNode", 0), ("InterNode", 0), ("IntraNode", 200), ("InterNodeV1", 0)])
def test_combine_in_fp8_region(kt, cap):
    plain = make(kernel_type=kt, gpu_per_node=2, max_total_recv_tokens=cap)
    fp8 = make(kernel_type=kt, gpu_per_node=2, max_total_recv_tokens=cap, quant_type=F)
    rmax = fp8.world_size * fp8.max_num_inp_token_per_rank if cap == 0 else cap
    assert _region(plain, "combine_in_fp8")[1] == 0
    off, nbytes, role = _region(fp8, "combine_in_fp8")
    assert nbytes == rmax * fp8.hidden_dim and role == "staging"
    assert ops.ep_symmetric_bytes(fp8) >= ops.ep_symmetric_bytes(plain) + nbytes
    # every other region keeps its size
    rp = {n: b for blk, n, _, b, _ in ops.ep_layout(plain)["regions"] if blk == "symmetric" and n != "combine_in_fp8"}
    rf = {n: b for blk, n, _, b, _ in ops.ep_layout(fp8)["regions"] if blk == "symmetric" and n != "combine_in_fp8"}
    assert rp == rf


def _rows(configs):
    return [(c.to_native(), 1 << 40) for c in configs]


def test_agreement_names_quant_type():
    g = [make(rank=r, quant_type=F if r == 2 else "none") for r in range(4)]
    msg = _C.ops._find_ep_disagreement("config", _rows(g))
    assert "PE 2 has quant_type = 1 but PE 0 has 0" in msg, msg
    g = [make(rank=r, quant_type=F) for r in range(4)]
    assert _C.ops._find_ep_disagreement("config", _rows(g)) == ""


def test_quant_type_of_rocm_names_and_enum():
    assert make(quant_type=ops.EpDispatchCombineQuantType.Fp8DirectCast).to_native().quant_type == 1
    with pytest.raises(mori.InvalidUsageError, match="'fp8_blockwise' is not a quant type of this build"):
        make(quant_type="fp8_blockwise").validate()


# --- the reference formula --------------------------------------------------------------------------
def _enc(x, fmt):
    return _C._testing.fp8_encode(x, fmt == "e4m3fnuz")


def model_cast(x, fmt):
    """What the kernel sums for input element x: its core::Fp8Encode code, decoded exactly."""
    return U.fp8_decode_float(_enc(x, fmt), fmt)


def model_combine(rows, fmt, out):
    """rows: lists of Python floats (input-dtype values), ascending rank order. The kernels'
    formula: decoded codes summed in fp32 from +0.0 in that order, rounded once to `out`."""
    acc = 0.0
    for row in rows:
        acc = U.round_to("fp32", acc + model_cast(row, fmt))
    return U.round_to(out, acc)


def model_v1_combine(rows, G, fmt, out):
    """InterNodeV1/V1LL's formula (docs/ep_internode_v1.md, "FP8 combine"): per node of G ranks the
    model_combine of its rows, then those partials summed in fp32 in node order, rounded once."""
    acc = 0.0
    for n in range(0, len(rows), G):
        acc = U.round_to("fp32", acc + model_combine(rows[n:n + G], fmt, out))
    return U.round_to(out, acc)


def _bf16(bits):
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _fp16(bits):
    return struct.unpack("<e", struct.pack("<H", bits))[0]


def _values(rnd):
    """bf16 and fp16 edge values and random fp32 values (no NaN)."""
    vals = [0.0, -0.0, math.inf, -math.inf, 448.0, 464.0, 465.0, 240.0, 248.0, 2.0 ** -10, 2.0 ** -11, 2.0 ** -12]
    vals += [_bf16(b) for b in range(0, 0x10000, 7)]
    vals += [_fp16(b) for b in range(0, 0x10000, 11)]
    vals += [U.round_to("fp32", rnd.uniform(-1, 1) * 2.0 ** rnd.randint(-30, 12)) for _ in range(3000)]
    return [v for v in vals if not math.isnan(v)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_cast_saturates_and_rounds_to_nearest_even(fmt):
    _, fmax = U.FP8_FORMATS[fmt]
    assert model_cast(1e6, fmt) == fmax and model_cast(-math.inf, fmt) == -fmax
    assert model_cast(fmax * 1.03, fmt) == fmax
    for v in _values(random.Random(1)):
        q = model_cast(v, fmt)
        assert q == U.fp8_decode_float(U.fp8_encode_float(v, fmt), fmt), f"{fmt} {v!r}"
        assert abs(q) <= fmax


@needs_torch
@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_reference_is_the_kernel_cast(fmt):
    """The GPU suites' torch reference (clamp, cast, decode) equals core::Fp8Encode then an exact
    decode, for every bf16 and fp16 value and random fp32 values."""
    import torch

    dt = getattr(torch, "float8_" + fmt, None)
    if dt is None:
        pytest.skip(f"NEEDS TORCH WITH FLOAT8: this torch has no float8_{fmt}")
    vals = _values(random.Random(2))
    x = torch.tensor(vals, dtype=torch.float32)
    got = U.fp8_direct_cast_reference(torch, x, dt).tolist()
    for v, g in zip(vals, got):
        assert struct.pack("<f", g) == struct.pack("<f", model_cast(v, fmt)), f"{fmt} {v!r}: {g!r}"
    for src in (torch.bfloat16, torch.float16):  # every bit pattern of the 16-bit input dtypes
        bits = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16).view(src)
        y = bits[~torch.isnan(bits.float())]
        want = [model_cast(v, fmt) for v in y.float().tolist()]
        got = U.fp8_direct_cast_reference(torch, y, dt).tolist()
        bad = [(v, g, w) for v, g, w in zip(y.float().tolist(), got, want)
               if struct.pack("<f", g) != struct.pack("<f", w)]
        assert not bad, f"{fmt} {src}: {bad[:5]}"


def _random_rows(rnd, n, H, gain):
    return [[U.round_to("bf16", rnd.gauss(0, 1) * gain * (1 + 0.125 * d)) for _ in range(H)] for d in range(n)]


@needs_torch
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out", ["bf16", "fp16", "fp32"])
def test_torch_combine_reference_bit_exact(fmt, out):
    import torch

    dt = getattr(torch, "float8_" + fmt, None)
    if dt is None:
        pytest.skip(f"NEEDS TORCH WITH FLOAT8: this torch has no float8_{fmt}")
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[out]
    rnd = random.Random(3)
    for gain in (1.0, 200.0, 2.0 ** -8):
        rows = _random_rows(rnd, 5, 64, gain)
        ref = U.fp8_direct_cast_combine_reference(
            torch, [torch.tensor([r], dtype=torch.float32).to(tdt) for r in rows] + [None], dt, tdt)
        rows_in = [[U.round_to(out, v) for v in r] for r in rows]  # the rows in the input dtype
        want = [model_combine([r[i] for r in rows_in], fmt, out) for i in range(64)]
        assert [struct.pack("<f", v) for v in ref.float()[0].tolist()] == [struct.pack("<f", v) for v in want]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("G", [None, 1, 2, 4], ids=["flat", "nodes_of_1", "nodes_of_2", "nodes_of_4"])
def test_documented_error_bound_holds(fmt, G):
    """docs/ep.md: |result - exact sum of the rows| <= 2^-4 sum|y| + n 2^(-3-bias) + the fp32 sum's
    and the output rounding's error, for rows within +-fp8max: U.fp8_direct_cast_bound (what the GPU
    suites check) against the exact model, flat (model_combine) and in nodes of G ranks with one
    rounded partial per node (model_v1_combine, InterNodeV1/V1LL)."""
    _, fmax = U.FP8_FORMATS[fmt]
    rnd = random.Random(4)
    for n in (1, 2, 4, 8):
        if G is not None and n % G:
            continue
        for gain in (1.0, 30.0, 2.0 ** -7, 2.0 ** -12):
            rows = _random_rows(rnd, n, 256, gain)
            for i in range(256):
                col = [r[i] for r in rows]
                if any(abs(v) > fmax for v in col):
                    continue
                if G is None:
                    got, bound_of = model_combine(col, fmt, "bf16"), {}
                else:
                    got, bound_of = model_v1_combine(col, G, fmt, "bf16"), {"partials": n // G}
                exact = math.fsum(col)
                bound = U.fp8_direct_cast_bound(math.fsum(abs(v) for v in col), fmt, "bf16", n, **bound_of)
                assert abs(got - exact) <= bound, (fmt, n, G, gain, col, got, exact, bound)
