"""bench.nearest measures both searches on the same inputs and they agree."""
from bench import nearest


def test_measure_small():
    r = nearest.measure(codebooks=2, points=200, K=33, reps=1)
    assert set(r["gfma_s"]) == {"torch matmul + argmin", "Numba lane kernel"}
    assert r["same_codes"] >= 0.99 and r["sgemm_gfma_s"] > 0
    assert "GFMA/s" in nearest.markdown(r)
