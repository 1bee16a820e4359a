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


def test_trainer_step_row_names_the_commit_the_run_started_from(monkeypatch):
    # a step can take many minutes: a commit made meanwhile is not the code that ran
    import benchmarks

    checkout = {"head": "start"}
    build = trainer_step.build_assets

    def build_then_commit(*args):  # the run has started; someone commits
        out = build(*args)
        checkout["head"] = "later"
        return out

    monkeypatch.setattr(benchmarks, "git_commit", lambda: checkout["head"])
    monkeypatch.setattr(trainer_step, "build_assets", build_then_commit)
    row = trainer_step.main(["--provider", "fused", "--tiny", "--steps", "1", "--no_record",
                             "--backend", "torch", "--device", "cpu"])
    assert row["commit"] == "start"
