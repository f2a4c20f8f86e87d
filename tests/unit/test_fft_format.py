"""The range-based float format of the fft sparsifier: round trip within the documented bound."""
import numpy as np
import pytest

from exdyna_mpi.sparsifiers.baselines import rangefloat


@pytest.mark.parametrize("bits", [8, 16])
def test_round_trip_error_bound(bits):
    rng = np.random.default_rng(3)
    for trial in range(50):
        v = rng.standard_t(2, 2000) * 10.0 ** rng.uniform(-8, 3)
        v[::13] = 0.0
        codes, e_max, e_bits = rangefloat.encode(v, bits)
        assert codes.dtype == rangefloat.CODE_DTYPES[bits]
        w = rangefloat.decode(codes, e_max, e_bits, bits)
        m = bits - 1 - e_bits
        e_min = e_max - (2 ** e_bits - 2)
        a = np.abs(v)
        big = a >= 2.0 ** e_min
        # relative bound inside the representable range, absolute below it
        assert np.all(np.abs(w - v)[big] <= a[big] * 2.0 ** -(m + 1))
        assert np.all(np.abs(w - v)[~big] < 2.0 ** e_min)
        assert np.all(w[v == 0] == 0) and np.all(np.sign(w) * np.sign(v) >= 0)
        assert np.array_equal(rangefloat.error_bound(v, e_max, e_bits, bits) >= np.abs(w - v), np.ones_like(big))


def test_hand_worked_codes():
    # max 1.99 rounds (5 mantissa bits) up to 2 -> e_max is raised to 1; span 2 binades -> e_bits 2
    codes, e_max, e_bits = rangefloat.encode(np.array([1.99, 0.5, -0.75]), 8)
    assert (e_max, e_bits) == (1, 2)
    # 1.99: d=1, q=round(0.99*32)=32 -> carry: d=0, q=0 -> 2.0
    # 0.5 : d=2, q=0; -0.75: sign, d=2, q=round(0.5*32)=16
    assert codes.tolist() == [0b0_00_00000, 0b0_10_00000, 0b1_10_10000]
    assert rangefloat.decode(codes, e_max, e_bits, 8).tolist() == [2.0, 0.5, -0.75]


def test_exponent_width_from_floor_and_flush():
    v = np.array([1.0, 2.0 ** -3, 2.0 ** -10])
    codes, e_max, e_bits = rangefloat.encode(v, 8, floor=2.0 ** -3)
    assert e_max == 0 and e_bits == 3  # 2^3 - 2 = 6 >= 3 binades of span
    w = rangefloat.decode(codes, e_max, e_bits, 8)
    assert w[0] == 1.0 and w[1] == 2.0 ** -3 and w[2] == 0.0  # below 2^e_min = 2^-6: flushed


def test_all_zero_message():
    codes, e_max, e_bits = rangefloat.encode(np.zeros(5), 16)
    assert np.all(rangefloat.decode(codes, e_max, e_bits, 16) == 0)
