"""Numba CPU kernels of the encode side (numba_kernels.cpu: nearest codeword, bit packing, the
decode kernel's run-of-codes unpack) against the plain-torch reference codec, on awkward shapes."""
import numpy as np
import pytest
import torch

from numba_kernels import cpu
from numba_kernels.cpu import bitpack
from sglang_tasq import codec, packing


def _distances(x, codebook):
    """[T, H, G, K] squared distances, float64."""
    return ((x.double().unsqueeze(3) - codebook.double().unsqueeze(0)) ** 2).sum(-1)


# (1, .., 8): one-token path; (5, .., 8): 4-token block + tail; >= 64 with g == 8 or 4: the lane
# kernels (odd K, K not a multiple of 4, T not a multiple of the 64-token block); the rest: the
# generic kernels
@pytest.mark.parametrize("T,H,G,K,g", [(1, 1, 1, 2, 2), (1, 3, 8, 1024, 8), (5, 2, 2, 100, 8), (37, 3, 5, 33, 4),
                                       (200, 3, 8, 1024, 8), (130, 2, 3, 257, 8), (64, 1, 1, 1, 8),
                                       (90, 2, 3, 64, 4), (17, 2, 3, 256, 16), (200, 3, 16, 256, 4),
                                       (65, 2, 3, 7, 4), (130, 1, 2, 258, 4)])
def test_nearest_matches_reference(T, H, G, K, g):
    gen = torch.Generator().manual_seed(T + K)
    cb = torch.randn(H, G, K, g, generator=gen)
    x = torch.randn(T, H, G, g, generator=gen) * 1.3
    ref = codec.nearest_codeword(x, cb)
    got = cpu.nearest(x, cpu.prepare(cb))
    assert got.dtype == torch.int64 and got.shape == ref.shape
    same = (got == ref).float().mean().item()
    assert same >= 0.999
    # wherever the index differs it is a float32 near-tie: the distances agree to rounding
    dist = _distances(x, cb)
    d_got = torch.gather(dist, 3, got.unsqueeze(-1))
    d_min = dist.min(-1, keepdim=True).values
    assert float((d_got - d_min).max()) <= 1e-5 * float(d_min.abs().max() + 1)


@pytest.mark.parametrize("T,g,dup", [(4, 4, (2, 5)), (70, 8, (2, 5)), (70, 8, (6, 7)), (70, 8, (0, 8)), (1, 8, (6, 7)),
                                     (70, 4, (1, 2)), (70, 4, (0, 3)), (70, 4, (2, 5)), (70, 4, (3, 8)), (70, 4, (4, 7))])
def test_nearest_first_index_on_exact_ties(T, g, dup):
    """Duplicated codewords: the first one wins, as in torch.argmin (also when the two sit in
    one codeword pair of the g == 8 lane kernel or one step of four of the g == 4 one, in two
    steps, and when the duplicate is the odd last one)."""
    cb = torch.randn(2, 3, max(8, dup[1] + 1), g)  # K = 9: the duplicate is the odd last codeword
    cb[:, :, dup[1]] = cb[:, :, dup[0]]
    x = cb[:, :, dup[0]].unsqueeze(0).repeat(T, 1, 1, 1) + 1e-3
    assert (cpu.nearest(x, cpu.prepare(cb)) == dup[0]).all()


def test_nearest_nonfinite_input_and_empty():
    cb = torch.randn(2, 3, 8, 4)
    x = cb[:, :, 2].unsqueeze(0).repeat(4, 1, 1, 1) + 1e-3
    x[1, 0, 0, 0] = float("nan")
    x[2, 1, 2, 3] = float("inf")
    assert torch.equal(cpu.nearest(x, cpu.prepare(cb)), codec.nearest_codeword(x, cb))
    assert cpu.nearest(torch.zeros(0, 2, 3, 4), cpu.prepare(cb)).shape == (0, 2, 3)


@pytest.mark.parametrize("bits", [1, 3, 6, 7, 8, 10, 12, 16, 17, 24])
@pytest.mark.parametrize("n", [1, 5, 72])
@pytest.mark.parametrize("rows", [1, 19, cpu._SERIAL_BELOW + 3])  # on the calling thread / in a parallel region
def test_pack_unpack_bit_exact(bits, n, rows):
    gen = torch.Generator().manual_seed(bits * 100 + n)
    codes = torch.randint(0, 1 << bits, (rows, n), generator=gen)
    codes[0] = (1 << bits) - 1  # the largest code everywhere
    codes[-1] = 0
    ref = packing.pack_codes(codes, bits)
    got = cpu.pack(codes, bits)
    assert torch.equal(got, ref)
    assert torch.equal(cpu.unpack(got, n, bits), packing.unpack_codes(ref, n, bits))
    assert torch.equal(cpu.unpack(got, n, bits), codes)


@pytest.mark.parametrize("bits", [1, 5, 7, 10, 13, 16, 17])
def test_codes_row_reads_any_run_of_codes(bits):
    """The decode kernel's one-pass unpack of codes first..first+n-1 (a head's codes) equals
    the reference unpack for every start and length, on rows of exactly the packed size."""
    from numba import njit

    @njit
    def run(buf, first, n, bits, out):
        for slot in range(buf.shape[0]):
            cpu._codes_row(buf, slot, first, n, bits, out, slot)

    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (4, 11), generator=gen)
    codes[0] = (1 << bits) - 1
    packed = packing.pack_codes(codes, bits).numpy()
    # the 8-byte-load path (rows with 8 bytes after their last code inside the buffer), the
    # byte loop (the buffer's last row), and a non-contiguous view (the byte loop everywhere)
    wide = np.zeros((4, packed.shape[1] + 3), np.uint8)
    wide[:, :packed.shape[1]] = packed
    for buf in (packed, wide[:, :packed.shape[1]]):
        for first in range(11):
            for n in range(1, 12 - first):
                out = np.zeros((4, 12), np.int64)
                run(buf, first, n, bits, out)
                assert (out[:, :n] == codes[:, first:first + n].numpy()).all(), (first, n)


def test_serial_and_parallel_variants_have_their_own_compiled_code():
    """Numba's disk cache names an entry after the Python function and keys it by signature,
    not by ``parallel``: two compilations of one function loaded each other's code (the
    decode step's "serial" encode ran parallel regions). Each variant is its own function."""
    from numba_kernels.cpu import encode, search

    pairs = [(search._nearest, search._nearest_serial), (bitpack._pack, bitpack._pack_serial),
             (bitpack._unpack, bitpack._unpack_serial), (encode._tailor_keys, encode._tailor_keys_serial),
             (encode._write_rows, encode._write_rows_serial)]
    for par, ser in pairs:
        assert par.targetoptions.get("parallel") and not ser.targetoptions.get("parallel")
        assert par.py_func.__qualname__ != ser.py_func.__qualname__
        assert par._cache._cache_file._index_name != ser._cache._cache_file._index_name  # the cache entry


def test_pack_refuses_out_of_range_and_bad_rows():
    with pytest.raises(ValueError, match="out of range"):
        cpu.pack(torch.tensor([[4]]), 2)
    with pytest.raises(ValueError, match="bytes"):
        cpu.unpack(torch.zeros(2, 3, dtype=torch.uint8), 3, 10)


@pytest.mark.parametrize("T,N,K", [(1, 1, 2), (130, 3, 257), (64, 2, 1024), (200, 5, 33)])
def test_nearest_sqdist_is_the_lane_search_with_its_distance(T, N, K):
    """k-means' assignment: the serving lane kernel's codes (first index on ties) and the
    squared distance to the chosen codeword."""
    from numba_kernels.cpu.search import nearest_sqdist

    gen = torch.Generator().manual_seed(T * K)
    cb = torch.randn(N, K, 8, generator=gen)
    if K > 3:
        cb[:, K - 1] = cb[:, 1]  # an exact tie: index 1 must win
    x = torch.randn(T, N, 8, generator=gen)
    x[0] = cb[:, 1] + 1e-3
    codes, dist = nearest_sqdist(x.numpy(), cb.numpy(), (cb * cb).sum(-1).numpy())
    d = ((x.double()[:, :, None] - cb.double()[None]) ** 2).sum(-1)  # [T, N, K]
    ref = d.argmin(-1)
    assert (torch.from_numpy(codes).long() == ref).float().mean() >= 0.999
    assert (torch.from_numpy(codes)[0] == 1).all()
    chosen = torch.gather(d, 2, torch.from_numpy(codes).long()[..., None])[..., 0]
    torch.testing.assert_close(torch.from_numpy(dist).double(), chosen, rtol=1e-4, atol=1e-4)


def test_fp8_encode_kernel_is_torch_bit_for_bit():
    """The encoder's fp8 exact entries (``_f32_to_fp8_bits``, ``_fp8_store_row``) equal
    :func:`sglang_tasq.salient.fp8_encode` bit for bit: every e4m3 value, every midpoint between
    neighbours (ties to even) and the floats just around it, subnormals, signed zeros, the clamp
    at 448, and rows of every magnitude (per-head fp16 scales, their 2^-24 floor)."""
    from numba import njit

    from numba_kernels.cpu._common import _f32_to_fp8_bits, _fp8_store_row
    from sglang_tasq.salient import FP8_VALUES, fp8_encode

    @njit
    def convert(a, out):
        for i in range(a.shape[0]):
            out[i] = _f32_to_fp8_bits(a[i])

    v = torch.unique(FP8_VALUES[~torch.isnan(FP8_VALUES)])
    mid = (v[1:] + v[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    y = torch.cat([v, mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1),
                   torch.randn(50000, generator=gen) * torch.logspace(-14, 2.7, 50000),
                   torch.tensor([0.0, -0.0, 1e-40, -1e-40, 448.0, -448.0, 2.0 ** -9, 2.0 ** -10])]).clamp(-448, 448)
    got = np.empty(y.numel(), np.uint8)
    convert(y.numpy(), got)
    assert np.array_equal(got, y.to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    x = torch.randn(40, 3, 64, generator=gen) * torch.logspace(-12, 4, 40)[:, None, None]
    x[3] = 0.0  # an all-zero row: the scale's floor
    codes, scales = np.zeros((41, 1, 3, 64), np.uint8), np.zeros((41, 3), np.uint16)
    for t in range(40):
        _fp8_store_row(x.numpy(), t, codes, t + 1, 0, scales)
    want_c, want_s = fp8_encode(x)
    assert np.array_equal(codes[1:, 0], want_c.numpy())
    assert np.array_equal(scales[1:], want_s.view(torch.int16).numpy().view(np.uint16))
