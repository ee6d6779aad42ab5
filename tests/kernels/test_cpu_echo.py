"""numba_kernels.cpu.query_echo (the served prefill's salient window echo) against the reference
sglang_tasq.salient.query_echo, on awkward shapes: queries inside the sink, a sink longer than
the prompt, a recent window of 1, GQA groups of 1 to 4, head dims off the vector width, more key
columns than the windows need, and chunks that start mid-prompt."""
import pytest
import torch

from numba_kernels import cpu
from sglang_tasq import salient as sal
from sglang_tasq.windows import window_columns

CASES = [  # (P, S, sink, recent, Hq, H, d)
    (0, 40, 64, 256, 9, 3, 64),  # every query inside the sink
    (0, 300, 16, 64, 9, 3, 64),  # one chunk: sink, then windows that slide
    (5, 300, 16, 64, 8, 2, 24),  # a chunk from position 5, G = 4, d = 24
    (100, 101, 64, 256, 9, 3, 64),  # a decode-like chunk of one query
    (250, 517, 4, 1, 3, 3, 17),  # recent 1: a query reads the sink and itself; G = 1
    (3, 70, 0, 32, 6, 3, 8),  # no sink: an empty span, echo 0
    (768, 1024, 64, 256, 9, 3, 64),  # the served shape: a 256-chunk at 768
]


@pytest.mark.parametrize("P,S,sink,recent,Hq,H,d", CASES)
@pytest.mark.parametrize("all_columns", [False, True])
def test_query_echo_equals_the_reference(P, S, sink, recent, Hq, H, d, all_columns):
    gen = torch.Generator().manual_seed(P * 7 + S + d)
    cols = torch.arange(S) if all_columns else window_columns(P, S, sink, recent)
    q = 3 * torch.randn(S - P, Hq, d, generator=gen)
    k = 3 * torch.randn(cols.numel(), H, d, generator=gen)
    q_pos = torch.arange(P, S)
    ref = sal.query_echo(q, k, q_pos, cols, sink, recent, d ** -0.5)
    got = cpu.query_echo(q, k, q_pos, cols, sink, recent, d ** -0.5)
    assert got.shape == ref.shape == (S - P, H) and got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (got - ref).abs().max()
    if sink > 1:
        assert bool((ref[q_pos >= 1] > 0).all())  # a query past position 0 reads some of the span: not vacuous
    else:
        assert bool((got == 0).all())


def test_query_echo_refuses_what_it_cannot_serve():
    q, k = torch.zeros(2, 9, 8), torch.zeros(3, 3, 8)
    with pytest.raises(ValueError, match="recent >= 1"):
        cpu.query_echo(q, k, torch.arange(1, 3), torch.arange(3), 4, 0, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        cpu.query_echo(q, k[:2], torch.arange(1, 3), torch.arange(3), 4, 8, 1.0)
    assert cpu.query_echo(q[:0], k, torch.arange(0), torch.arange(3), 4, 8, 1.0).shape == (0, 3)
