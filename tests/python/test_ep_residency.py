"""EpResidentSms (src/ops/dispatch_combine/kernel_args.hpp, through mori._C._testing): the SMs one
PE's grids may take so that every PE on its GPU can have its grid resident at once (docs/ep.md,
"Residency"). No GPU needed."""

import pytest

mori = pytest.importorskip("mori")


def resident(num_sms, pes_on_gpu, mps, pct):
    return mori._C._testing.ep_resident_sms(num_sms, pes_on_gpu, mps, pct)


def test_without_mps_or_alone_unchanged():
    for sms in (1, 32, 132):
        for pes in (1, 2, 4, 8):
            assert resident(sms, pes, False, 0) == sms  # time slices: the whole GPU in turn
            assert resident(sms, pes, False, 25) == sms
        assert resident(sms, 1, True, 0) == sms
        assert resident(sms, 1, True, 50) == sms


def test_mps_without_share_divides_the_gpu():
    assert resident(132, 4, True, 0) == 33
    assert resident(132, 2, True, 0) == 66
    assert resident(132, 8, True, 0) == 16
    assert resident(132, 200, True, 0) == 1  # never below one block


def test_mps_share_is_the_processes_part_of_the_gpu():
    assert resident(32, 4, True, 25) == 32  # 25 % of 132 shown as 32: 128 / 4
    assert resident(132, 4, True, 100) == 33  # a 100 % share each: the GPU split four ways
    assert resident(66, 4, True, 50) == 33  # 132 / 4
    assert resident(66, 2, True, 50) == 66
    assert resident(33, 8, True, 25) == 16  # oversubscribed shares: 132 / 8


def test_invalid_share_counts_as_none():
    for pct in (0, 101, -3):
        assert resident(132, 4, True, pct) == 33


def test_bad_arguments():
    with pytest.raises(ValueError):
        resident(0, 1, True, 0)
    with pytest.raises(ValueError):
        resident(132, 0, True, 0)
