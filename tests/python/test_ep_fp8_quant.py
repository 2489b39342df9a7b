"""FP8 dispatch quantisation (docs/ep.md, "FP8 dispatch"), no GPU: the Python-float reference
(tests/ops/ep_test_utils.py) on known values; the host form of the kernel's steps
(mori._C._testing.ep_fp8_quantize: EpFp8QuantizeRow, the functions the dispatch kernel calls)
bit-exact against it on random and edge rows; the torch reference the GPU suites use bit-exact
against it where torch is installed; and the op's argument checks that need no GPU."""

import math
import random
import struct

import pytest

import ep_test_utils as U

from conftest import needs_torch

FORMATS = ("e4m3fn", "e4m3fnuz")
MODES = ((False, False), (True, False), (False, True))  # (round_scale, use_ue8m0)
MAX_CODE = {"e4m3fn": 0x7E, "e4m3fnuz": 0x7F}


def _testing():
    import mori._C

    return mori._C._testing


def ops_native():
    import mori._C

    return mori._C.ops


def quant_code(round_scale, use_ue8m0):
    codes = ops_native().DISPATCH_QUANT_CODES
    if use_ue8m0:
        return codes["fp8 (use_ue8m0)"]
    return codes["fp8 (round_scale)"] if round_scale else codes["fp8"]


def bf16_bits(x):
    """bf16 bit pattern of x (x already a bf16 value)."""
    return struct.unpack("<I", struct.pack("<f", x))[0] >> 16


def bf16_of_bits(b):
    return struct.unpack("<f", struct.pack("<I", b << 16))[0]


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


# --- the reference on known values ------------------------------------------------------------
def test_encode_known_values():
    E = U.fp8_encode_float
    assert E(1.0, "e4m3fn") == 0x38 and E(1.0, "e4m3fnuz") == 0x40
    assert E(448.0, "e4m3fn") == 0x7E and E(240.0, "e4m3fnuz") == 0x7F
    # saturation (also of values that would round up to the NaN code / past the max)
    assert E(464.0, "e4m3fn") == 0x7E and E(1e30, "e4m3fn") == 0x7E and E(-1e30, "e4m3fn") == 0xFE
    assert E(math.inf, "e4m3fnuz") == 0x7F and E(-math.inf, "e4m3fnuz") == 0xFF
    # round to nearest even: 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39)
    assert E(1.0625, "e4m3fn") == 0x38 and E(1.1875, "e4m3fn") == 0x3A
    # subnormals and zero signs
    assert E(2.0 ** -9, "e4m3fn") == 0x01 and E(2.0 ** -11, "e4m3fn") == 0x00
    assert E(2.0 ** -10, "e4m3fnuz") == 0x01
    assert E(-0.0, "e4m3fn") == 0x80 and E(-0.0, "e4m3fnuz") == 0x00 and E(-2.0 ** -12, "e4m3fnuz") == 0x00
    assert E(math.nan, "e4m3fn") == 0x7F and E(math.nan, "e4m3fnuz") == 0x80


def test_zero_group_scale_and_codes():
    for fmt in FORMATS:
        row = [0.0] * 64 + [-0.0] * 64
        codes, scales = U.fp8_quantize_row_floats(row, fmt)
        assert scales == [2.0 ** -126]  # amax 0: the floor, so 1/scale stays finite
        assert codes == [0x00] * 64 + [0x80 if fmt == "e4m3fn" else 0x00] * 64
        codes, words = U.fp8_quantize_row_floats(row, fmt, use_ue8m0=True)
        assert words == [1]  # 2^-126 = 2^(1 - 127); bytes 1..3 unused, 0


def test_amax_element_saturates_to_max_code():
    rnd = random.Random(5)
    for fmt in FORMATS:
        for _ in range(200):
            amax = U.round_to("bf16", rnd.uniform(1, 2) * 2.0 ** rnd.randint(-60, 60))
            row = [U.round_to("bf16", rnd.uniform(-amax, amax)) for _ in range(127)] + [-amax]
            codes, scales = U.fp8_quantize_row_floats(row, fmt)
            assert codes[-1] == MAX_CODE[fmt] | 0x80
            assert scales[0] == U.round_to("fp32", amax / U.FP8_FORMATS[fmt][1])


def test_power_of_two_scale():
    # amax 1: scale 1/448 = 2^-8.81, rounded up to 2^-8; 1.0 * 256 = 2^8 is the e4m3fn code with
    # exponent 8 + 7 = 15 and mantissa 0 (0x78), 0.5 * 256 = 2^7 is 0x70.
    codes, scales = U.fp8_quantize_row_floats([1.0] + [0.5] * 127, "e4m3fn", round_scale=True)
    assert scales == [2.0 ** -8] and codes[0] == 0x78 and codes[1] == 0x70
    # a scale that is already a power of two stays: amax 56 = 448 / 8 -> scale 2^-3
    codes, scales = U.fp8_quantize_row_floats([56.0] * 128, "e4m3fn", round_scale=True)
    assert scales == [0.125] and codes[0] == 0x7E
    for s in (2.0 ** -126, 0.75, 1.0, 1.5, 3.0):
        p = U.pow2_ceil_float(s)
        assert p >= s and p / 2 < s and math.frexp(p)[0] == 0.5


def test_ue8m0_packing():
    # three groups with scales 2^-8, 2^-126 (zero group), 2^0 -> bytes 119, 1, 127; byte 3 unused
    row = [1.0] + [0.0] * 127 + [0.0] * 128 + [448.0] + [-56.0] * 127
    codes, words = U.fp8_quantize_row_floats(row, "e4m3fn", use_ue8m0=True)
    assert words == [119 | 1 << 8 | 127 << 16]
    assert codes[0] == 0x78 and codes[128] == 0 and codes[256] == 0x7E and codes[257] == 0xE6
    # five groups: two words, the second with one used byte
    codes, words = U.fp8_quantize_row_floats([448.0] * 640, "e4m3fn", use_ue8m0=True)
    assert words == [0x7F7F7F7F, 0x7F]
    # use_ue8m0 uses the same (rounded) scales as round_scale
    row = [U.round_to("bf16", 0.37 * i - 11) for i in range(256)]
    c1, s1 = U.fp8_quantize_row_floats(row, "e4m3fnuz", round_scale=True)
    c2, w2 = U.fp8_quantize_row_floats(row, "e4m3fnuz", use_ue8m0=True)
    assert c1 == c2 and w2 == [(math.frexp(s1[0])[1] + 126) | (math.frexp(s1[1])[1] + 126) << 8]


# --- the kernel's steps (host form) against the reference ------------------------------------
def random_row(rnd, hidden, kind):
    """bf16 values of one row: random magnitudes per group, with zero groups, -0, subnormal bf16,
    huge values and exact ties mixed in."""
    row = []
    for g in range(hidden // U.QUANT_GROUP):
        k = kind if kind != "mixed" else rnd.choice(("normal", "zero", "tiny", "huge", "wide", "ties"))
        e = rnd.randint(-30, 30)
        for _ in range(U.QUANT_GROUP):
            if k == "zero":
                v = rnd.choice((0.0, -0.0))
            elif k == "tiny":  # bf16 subnormals and the smallest normals
                v = rnd.choice((-1, 1)) * rnd.randint(0, 300) * 2.0 ** -133
            elif k == "huge":
                v = rnd.choice((-1, 1)) * rnd.uniform(1, 1.99) * 2.0 ** rnd.randint(100, 127)
            elif k == "wide":
                v = rnd.choice((-1, 1)) * rnd.uniform(1, 2) * 2.0 ** rnd.randint(-126, 126)  # finite in bf16
            elif k == "ties":  # small integers: many products land on fp8 midpoints
                v = float(rnd.randint(-64, 64))
            else:
                v = rnd.gauss(0, 1) * 2.0 ** e
            row.append(U.round_to("bf16", v))
    return row


def check_rows_against_reference(rows, hidden, fmt, round_scale, use_ue8m0):
    data = b"".join(struct.pack(f"<{hidden}H", *[bf16_bits(v) for v in row]) for row in rows)
    codes, scales = _testing().ep_fp8_quantize(data, hidden, quant_code(round_scale, use_ue8m0), fmt == "e4m3fnuz")
    groups = hidden // U.QUANT_GROUP
    words = (groups + 3) // 4 if use_ue8m0 else groups
    assert len(codes) == len(rows) * hidden and len(scales) == len(rows) * words * 4
    for r, row in enumerate(rows):
        want_codes, want_scales = U.fp8_quantize_row_floats(row, fmt, round_scale, use_ue8m0)
        got_codes = list(codes[r * hidden:(r + 1) * hidden])
        if got_codes != want_codes:
            i = next(i for i in range(hidden) if got_codes[i] != want_codes[i])
            pytest.fail(f"{fmt} round_scale={round_scale} ue8m0={use_ue8m0} row {r} element {i}: x={row[i]!r} "
                        f"code 0x{got_codes[i]:02x}, reference 0x{want_codes[i]:02x}")
        got = struct.unpack(f"<{words}I", scales[r * words * 4:(r + 1) * words * 4])
        want = list(want_scales) if use_ue8m0 else [f32_bits(s) for s in want_scales]
        assert list(got) == want, f"{fmt} round_scale={round_scale} ue8m0={use_ue8m0} row {r}: scales"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("round_scale,use_ue8m0", MODES)
def test_kernel_steps_match_reference(fmt, round_scale, use_ue8m0):
    rnd = random.Random(10 * FORMATS.index(fmt) + MODES.index((round_scale, use_ue8m0)))
    rows = [random_row(rnd, 640, kind) for kind in ("normal", "zero", "tiny", "huge", "wide", "ties")]
    rows += [random_row(rnd, 640, "mixed") for _ in range(10)]
    check_rows_against_reference(rows, 640, fmt, round_scale, use_ue8m0)
    check_rows_against_reference([random_row(rnd, 384, "mixed") for _ in range(4)], 384, fmt, round_scale, use_ue8m0)


def test_kernel_cast_matches_reference():
    rnd = random.Random(11)
    enc = _testing().fp8_encode
    values = [0.0, -0.0, math.inf, -math.inf, 448.0, 464.0, 480.0, 240.0, 248.0, 2.0 ** -149, 2.0 ** -126]
    for fmt in FORMATS:  # every code, the midpoints and their neighbours
        vals, _ = U._fp8_table(fmt)
        for a, b in zip(vals, vals[1:]):
            m = (a + b) / 2
            values += [a, m, U.round_to("fp32", m * (1 + 2.0 ** -23)), U.round_to("fp32", m * (1 - 2.0 ** -23))]
    values += [U.round_to("fp32", rnd.uniform(-1, 1) * 2.0 ** rnd.randint(-140, 127)) for _ in range(20000)]
    for fmt in FORMATS:
        for v in values:
            for x in (v, -v):
                assert enc(x, fmt == "e4m3fnuz") == U.fp8_encode_float(x, fmt), f"{fmt} x={x!r}"
    assert enc(math.nan, False) == 0x7F and enc(math.nan, True) == 0x80


def test_quantize_binding_rejects_bad_arguments():
    t = _testing()
    with pytest.raises(ValueError):
        t.ep_fp8_quantize(b"\0" * 200, 100, quant_code(False, False))  # hidden not a multiple of 128
    with pytest.raises(ValueError):
        t.ep_fp8_quantize(b"\0" * 256, 128, 0)  # not an fp8 code
    with pytest.raises(ValueError):
        t.ep_fp8_quantize(b"\0" * 255, 128, quant_code(False, False))  # not whole rows


# --- the torch reference against the float reference -------------------------------------------
@needs_torch
@pytest.mark.parametrize("round_scale,use_ue8m0", MODES)
def test_torch_reference_matches_float_reference(round_scale, use_ue8m0):
    import torch

    rnd = random.Random(3)
    hidden = 640
    rows = [random_row(rnd, hidden, k) for k in ("normal", "zero", "tiny", "huge", "wide", "ties", "mixed", "mixed")]
    bits = torch.tensor([[bf16_bits(v) for v in row] for row in rows], dtype=torch.int32)
    x = (bits << 16).view(torch.float32).to(torch.bfloat16)  # exact: the low halves are zero
    dtypes = [(n, getattr(torch, "float8_" + n)) for n in FORMATS if hasattr(torch, "float8_" + n)]
    if not dtypes:
        pytest.skip("NEEDS TORCH WITH FLOAT8: this torch has no float8_e4m3fn/e4m3fnuz")
    for fmt, dt in dtypes:
        codes, scales = U.fp8_quantize_reference(torch, x, dt, round_scale, use_ue8m0)
        for r, row in enumerate(rows):
            want_codes, want_scales = U.fp8_quantize_row_floats(row, fmt, round_scale, use_ue8m0)
            assert codes[r].view(torch.uint8).tolist() == want_codes, f"{fmt} row {r}"
            if use_ue8m0:
                assert [w & 0xFFFFFFFF for w in scales[r].tolist()] == want_scales
            else:
                assert scales[r].view(torch.int32).tolist() == [struct.unpack("<i", struct.pack("<f", s))[0] for s in want_scales]


# --- the op's argument handling that needs no GPU ------------------------------------------------
def test_dispatch_quant_codes_and_scale_bytes():
    o = ops_native()
    assert o.QUANT_GROUP == 128
    assert set(o.DISPATCH_QUANT_CODES) == {"none", "fp8", "fp8 (round_scale)", "fp8 (use_ue8m0)"}
    from mori.ops.dispatch_combine import _dispatch_quant

    import mori

    assert _dispatch_quant(False, False, False) == o.DISPATCH_QUANT_CODES["none"]
    assert _dispatch_quant(True, False, False) == o.DISPATCH_QUANT_CODES["fp8"]
    assert _dispatch_quant(True, True, False) == o.DISPATCH_QUANT_CODES["fp8 (round_scale)"]
    assert _dispatch_quant(True, False, True) == o.DISPATCH_QUANT_CODES["fp8 (use_ue8m0)"]
    assert _dispatch_quant(True, True, True) == o.DISPATCH_QUANT_CODES["fp8 (use_ue8m0)"]
    for rs, ue in ((True, False), (False, True)):
        with pytest.raises(mori.InvalidUsageError, match="need use_fp8=True"):
            _dispatch_quant(False, rs, ue)
