"""The combine's pack of fp32 sums into the output dtype (EpBf16Elem/EpFp16Elem/EpFp32Elem::Pack,
run on the GPU through mori._C._testing.ep_combine_pack) against torch's conversions and, for
bf16, bitwise against core::Bf16RoundBits, the software rounding kernels use where the GPU has no
conversion instruction: both paths give the same bits, NaN included (0x7FFF)."""

import math
import random
import struct

import pytest

from mori import _C
from conftest import needs_gpu, needs_torch

T = _C._testing


def _inputs(torch):
    """fp32 values around every rounding case of bf16 and fp16: both neighbours of every bf16
    value, the midpoints between bf16 neighbours and one ulp either side of them, fp16's
    normal/subnormal boundaries, overflow thresholds, +-0, +-inf, NaNs with assorted payloads,
    and random bit patterns."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int64) << 16  # every bf16 value (as fp32 bits)
    mids = bits + 0x8000
    cand = [bits, bits + 1, bits - 1, mids, mids - 1, mids + 1]
    rnd = random.Random(7)
    cand.append(torch.tensor([rnd.getrandbits(32) for _ in range(1 << 16)], dtype=torch.int64))
    fp16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    fp16_bits = fp16.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    cand += [fp16_bits, fp16_bits + 0x1000, fp16_bits + 0xFFF, fp16_bits + 0x1001]
    special = [0x7F7FFFFF, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
               0x7FBFFFFF, 0x00000001, 0x80000001, 0x00800000, 0x80000000, 0x7F800000, 0xFF800000]
    cand.append(torch.tensor(special, dtype=torch.int64))
    u = torch.cat(cand) & 0xFFFFFFFF
    n = (u.numel() + 7) // 8 * 8
    u = torch.cat([u, torch.zeros(n - u.numel(), dtype=torch.int64)])
    return u.to(torch.int32).view(torch.float32)  # two's-complement wrap keeps the bit patterns


def _device_pack(torch, x, dtype):
    code = _C.ops.DTYPE_CODES[str(dtype).replace("torch.", "")]
    xd = x.cuda()
    out = torch.empty(x.numel(), dtype=dtype, device="cuda")
    T.ep_combine_pack(code, xd.data_ptr(), out.data_ptr(), x.numel(), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return out.cpu()


def _u16(torch, t):
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


@needs_torch
@needs_gpu
@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_pack_rounds_as_torch(name):
    """Non-NaN values: bit-exact against torch's round-to-nearest-even conversion on the GPU;
    NaN stays NaN."""
    import torch

    dtype = getattr(torch, name)
    x = _inputs(torch)
    got = _device_pack(torch, x, dtype)
    want = x.cuda().to(dtype).cpu()
    nan = torch.isnan(x)
    assert torch.isnan(got.float()[nan]).all()
    if name == "float32":
        g, w = got.view(torch.int32), want.view(torch.int32)
    else:
        g, w = _u16(torch, got), _u16(torch, want)
    bad = (g != w) & ~nan
    assert not bad.any(), [(hex(struct.unpack("<I", struct.pack("<f", v))[0]), hex(a), hex(b))
                           for v, a, b in zip(x[bad][:5].tolist(), g[bad][:5].tolist(), w[bad][:5].tolist())]


@needs_torch
@needs_gpu
def test_bf16_pack_is_the_software_rounding_bitwise():
    """The kernels' bf16 pack (the conversion instruction where there is one) equals
    core::Bf16RoundBits for every input, NaNs included: the same bits on every platform."""
    import torch

    x = _inputs(torch)
    got = _u16(torch, _device_pack(torch, x, torch.bfloat16))
    sw = torch.empty(x.numel(), dtype=torch.int16)
    T.bf16_round_bits(x.data_ptr(), sw.data_ptr(), x.numel())
    want = sw.to(torch.int32) & 0xFFFF
    bad = got != want
    assert not bad.any(), list(zip([hex(v) for v in x.view(torch.int32)[bad][:5].tolist()],
                                   map(hex, got[bad][:5].tolist()), map(hex, want[bad][:5].tolist())))
    assert (want[torch.isnan(x)] == 0x7FFF).all()


def test_pack_refuses_fp8():
    with pytest.raises(Exception, match="fp8 combine is not built"):
        T.ep_combine_pack(_C.ops.DTYPE_CODES["float8_e4m3fn"], 0, 0, 16, 0)
