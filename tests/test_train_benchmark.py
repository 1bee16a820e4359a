"""benchmarks/trainer_step.py runs end to end at its tiny size (CPU smoke test, no CSV)."""

import pytest

trainer_step = pytest.importorskip("benchmarks.trainer_step")


@pytest.mark.parametrize("provider", ["fused", "reference"])
def test_trainer_step_benchmark_smoke(provider):
    row = trainer_step.main(["--provider", provider, "--tiny", "--steps", "1", "--no_record",
                             "--backend", "torch", "--device", "cpu"])
    assert row["timed_steps"] == 1 and row["completion_tokens"] == 16
    assert row["step_time_s_median"] > 0 and row["tokens_per_s_median"] > 0
    assert row["peak_memory_gib"] > 0 and row["device"].startswith("CPU")
