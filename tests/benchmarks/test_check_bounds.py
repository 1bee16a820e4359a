"""benchmarks.check_bounds: the numbers behind the exactness checks' bounds
(`hf.packed_rows.agreement_atol`) keep them between rounding and a leak, per precision (one
layer here; the documented figures are the 24-layer run's)."""

from benchmarks.check_bounds import measure
from grpo_kernels.hf.packed_rows import FULL_PRECISION_ATOL, HALF_PRECISION_ATOL


def test_bounds_sit_between_rounding_and_a_leak():
    rows = {(dtype, what): value for dtype, what, value in measure(1, "cpu")}
    for dtype, bound in (("float32", FULL_PRECISION_ATOL), ("bfloat16", HALF_PRECISION_ATOL)):
        rounding = max(v for (d, w), v in rows.items() if d == dtype and "leak" not in w)
        leaks = [v for (d, w), v in rows.items() if d == dtype and "leak" in w]
        assert rounding < bound / 2, (dtype, rounding)
        assert min(leaks) > 5 * bound, (dtype, leaks)
