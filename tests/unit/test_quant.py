"""The decoder's change in int8 codes (soma_edge.spsa.quant): within half a code step, exact where it can be,
the same bits on every decode, and refused in one line where a hostile record does not fit."""

from __future__ import annotations

import numpy as np
import pytest

from soma_edge.spsa import quant


def _change(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
    x[: quant.BLOCK] *= np.float32(100)  # blocks of very different ranges: each has its own scale
    return x


def test_codes_stand_for_the_change_within_half_a_code_step():
    x = _change(3 * quant.BLOCK + 17)  # a last block that is not full
    coded = quant.encode(x)
    assert coded.codes.dtype == np.int8 and coded.codes.shape == x.shape
    assert coded.scales.dtype == np.float32 and coded.scales.shape == (4,)
    back = quant.decode(coded, x.size)
    err = np.abs(back.astype(np.float64) - x)
    assert (err <= quant.error_bound(coded, x.size)).all()
    assert err.max() > 0  # lossy: the bound is what the audit allows, not zero
    # a block's largest value is coded at the end of the range, so each block uses its own scale
    assert np.abs(coded.codes[: quant.BLOCK]).max() == quant.LEVELS == np.abs(coded.codes[quant.BLOCK :]).max()
    # bytes: one a weight and four a block, about a quarter of float32
    assert coded.codes.nbytes + coded.scales.nbytes < 0.26 * x.nbytes


def test_a_zero_change_is_coded_exactly_and_decodes_to_the_same_bits_again():
    x = _change(2 * quant.BLOCK)
    x[quant.BLOCK :] = 0
    coded = quant.encode(x)
    assert coded.scales[1] == 0 and not coded.codes[quant.BLOCK :].any()
    a, b = quant.decode(coded, x.size), quant.decode(quant.encode(x), x.size)
    assert a.tobytes() == b.tobytes() and not a[quant.BLOCK :].any()


def test_adopt_gives_both_sides_base_plus_the_decoded_change():
    base = np.random.default_rng(1).standard_normal(600).astype(np.float32)
    end = base + _change(600, 2)
    coded, adopted = quant.adopt(base, end)
    assert adopted.tobytes() == (base + quant.decode(coded, 600)).tobytes()  # what the coordinator rebuilds
    assert not np.array_equal(adopted, end)
    assert (np.abs(adopted - end) <= quant.error_bound(coded, 600) + 1e-6).all()  # + float32 rounding of base + x


@pytest.mark.parametrize(
    "codes,scales,message",
    [
        (np.zeros(10, np.int16), np.ones(1, np.float32), "codes must be int8"),
        (np.zeros(9, np.int8), np.ones(1, np.float32), "codes must be int8"),
        (np.zeros(10, np.int8), np.ones(2, np.float32), "scales must be float32"),
        (np.zeros(10, np.int8), np.array([np.nan], np.float32), "finite"),
        (np.zeros(10, np.int8), np.array([-1.0], np.float32), "not negative"),
        (np.full(10, -128, np.int8), np.ones(1, np.float32), "lie in"),
    ],
)
def test_a_record_that_does_not_fit_is_refused(codes, scales, message):
    with pytest.raises(ValueError, match=message):
        quant.decode(quant.Coded(codes, scales), 10)


def test_a_change_that_is_not_finite_is_not_coded():
    x = _change(10)
    x[3] = np.inf
    with pytest.raises(ValueError, match="finite"):
        quant.encode(x)
