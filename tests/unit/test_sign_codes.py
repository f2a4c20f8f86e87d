"""The 2-bit sign codes (exdyna_mpi/transport/signs.py, exdyna_mpi/kernels/cpu_signs.py) against a NumPy
reference written here: the packed bytes, and the decoded signs through each table."""
import numpy as np
import pytest

from exdyna_mpi.transport import signs


def _reference_codes(x):
    n = x.shape[0]
    codes = np.zeros(-(-n // 4) * 4, np.uint8)
    codes[:n][x > 0] = 1
    codes[:n][x < 0] = 2
    codes[:n][np.isnan(x)] = 3
    q = codes.reshape(-1, 4).astype(np.uint16)
    return (q[:, 0] | q[:, 1] << 2 | q[:, 2] << 4 | q[:, 3] << 6).astype(np.uint8)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1001])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_codes_and_signs(n, dtype):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(dtype)
    x[::5] = 0
    x[1::7] = -0.0
    x[2::9] = np.nan
    x[3::11] = -np.inf
    packed = signs.encode(x)
    assert packed.dtype == np.uint8 and packed.shape == (signs.packed_size(n),)
    assert np.array_equal(packed, _reference_codes(x))
    out = np.full(n + 2, 7, dtype)
    signs.decode(packed, n, signs.sign_table(dtype), out)
    assert np.array_equal(out[:n], np.where(x == 0, 0, np.sign(x)).astype(dtype), equal_nan=True)
    assert (out[n:] == 7).all()


def test_decode_through_16_bit_patterns():
    x = np.array([1.5, -2.0, 0.0, np.nan, 3.0], np.float32)
    table = np.array([0x0000, 0x3F80, 0xBF80, 0x7FC0], np.uint16)   # bfloat16 0, 1, -1, NaN
    out = np.empty(5, np.uint16)
    signs.decode(signs.encode(x), 5, table, out)
    assert out.tolist() == [0x3F80, 0xBF80, 0x0000, 0x7FC0, 0x3F80]
