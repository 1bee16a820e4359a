"""benchmarks/trainer_step.py runs end to end at its tiny size (CPU smoke test, no CSV)."""

import pytest

trainer_step = pytest.importorskip("benchmarks.trainer_step")


@pytest.mark.parametrize("provider", ["fused", "reference"])
def test_trainer_step_benchmark_smoke(provider):
    row = trainer_step.main(["--provider", provider, "--tiny", "--steps", "1", "--no_record",
                             "--backend", "chunked", "--device", "cpu"])
    assert row["timed_steps"] == 1 and row["completion_tokens"] == 16
    assert row["step_time_s_median"] > 0 and row["tokens_per_s_median"] > 0
    assert row["peak_memory_gib"] > 0 and row["device"].startswith("CPU")
    assert row["kernel_fallbacks"] == 0
    # the route of each of our loss calls (none for the reference's loss), and no contradiction
    assert row["status"] == "ok", row
    if provider == "fused":
        assert row["loss_routes"].startswith("three-pass x"), row["loss_routes"]
    else:
        assert row["loss_routes"] == ""


def test_a_row_whose_loss_took_no_route_of_ours_says_so():
    from benchmarks.step_row import route_columns

    assert route_columns("fused", ["three-pass", "three-pass"]) == {
        "loss_routes": "three-pass x2"}
    assert route_columns("trl", []) == {"loss_routes": ""}
    assert route_columns("fused", [])["status"] == (
        "wrong route: fused took no route of grpo-kernels")
    assert route_columns("trl", ["four-pass"])["status"] == "wrong route: trl took four-pass x1"


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
                             "--backend", "chunked", "--device", "cpu"])
    assert row["commit"] == "start"


def test_forced_lengths_end_every_completion_where_drawn():
    """Random weights never stop on their own: the benchmark's lengths are drawn (the same for
    every provider) and enforced with EOS; a cap-length draw ends without EOS (truncated)."""
    import torch
    from transformers import GenerationMixin, Qwen2Config, Qwen2ForCausalLM

    from benchmarks import lengths

    drawn = lengths.draw_lengths("lognormal", 4000, 96, seed=0, call=0)
    assert drawn == lengths.draw_lengths("lognormal", 4000, 96, seed=0, call=0)
    assert drawn != lengths.draw_lengths("lognormal", 4000, 96, seed=0, call=1)
    assert min(drawn) >= 1 and max(drawn) == 96
    assert abs(sorted(drawn)[2000] - 32) <= 3  # median: a third of the cap
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, eos_token_id=7))
    forcing = lengths.ForcedLengths("lognormal", cap=12, eos_id=7, seed=3)
    original = GenerationMixin.generate
    with forcing.installed():
        out = model.generate(input_ids=torch.ones(6, 3, dtype=torch.long), do_sample=True,
                             max_new_tokens=12, pad_token_id=0, eos_token_id=7)
    assert GenerationMixin.generate is original  # restored
    want = forcing.history[0]
    assert len(set(want)) > 1
    for row, n in zip(out[:, 3:].tolist(), want):
        ended = row.index(7) + 1 if 7 in row else len(row)
        assert ended == n and (7 in row) == (n < 12)


@pytest.mark.parametrize("provider", ["fused", "trl"])
def test_trainer_step_long_tailed_lengths(provider):
    """Both providers get the same drawn lengths: the row's mean is the draws' mean."""
    if provider == "trl":
        pytest.importorskip("trl")
    from benchmarks import lengths

    args = ["--provider", provider, "--tiny", "--steps", "1", "--no_record", "--backend",
            "chunked", "--device", "cpu", "--length_profile", "lognormal",
            "--completion_tokens", "24"]
    row = trainer_step.main(args)
    drawn = lengths.draw_lengths("lognormal", 4, 24, seed=0, call=0)  # the timed step's draw
    assert row["completion_tokens_mean"] == pytest.approx(sum(drawn) / 4, abs=0.05)
    assert row["length_profile"] == "lognormal" and row["warmup"] == 1


@pytest.mark.parametrize("padding_free", ["on", "off"])
def test_trl_subclass_provider_with_synthetic_completions_and_reference(padding_free):
    """grpo-kernels' TRL subclass under TRL's defaults, beta 0.04 (reference scoring), completions
    made without the model: the drawn lengths, the row says what ran."""
    pytest.importorskip("trl")
    from benchmarks import lengths

    row = trainer_step.main(["--provider", "trl-kernels", "--tiny", "--steps", "1", "--no_record",
                             "--backend", "chunked", "--device", "cpu", "--synthetic",
                             "--beta", "0.04", "--length_profile", "lognormal",
                             "--completion_tokens", "24", "--padding_free", padding_free])
    drawn = lengths.draw_lengths("lognormal", 4, 24, seed=0, call=0)
    assert row["completion_tokens_mean"] == pytest.approx(sum(drawn) / 4, abs=0.05)
    assert row["provider"] == "grpo_kernels.trl GRPOTrainer" and row["beta"] == 0.04
    assert row["generation"] == "synthetic" and row["padding_free"] == padding_free
    assert row["scoring_s"] > 0 and row["loss_s"] > 0
    assert row["status"] == "ok" and row["loss_routes"].startswith("three-pass x"), row


def test_warmup_steps_replay_the_timed_steps_lengths():
    """Warm-up call k draws what timed call k mod the timed calls draws, so the warm-up runs the
    timed shapes (compiled kernels, sized allocator pools) and not other lengths."""
    from benchmarks import lengths

    forcing = lengths.ForcedLengths("lognormal", cap=64, eos_id=7, seed=1, warmup=2, timed=3)
    for _ in range(5):
        forcing.draw(8)
    warm, timed = forcing.history[:2], forcing.history[2:]
    assert warm == timed[:2] and timed[0] != timed[1] != timed[2]
    assert timed == [lengths.draw_lengths("lognormal", 8, 64, seed=1, call=k) for k in range(3)]
    one = lengths.ForcedLengths("lognormal", cap=64, eos_id=7, seed=1, warmup=3, timed=1)
    for _ in range(4):
        one.draw(8)
    assert all(call == one.history[-1] for call in one.history)
    with pytest.raises(ValueError, match="timed"):
        lengths.ForcedLengths("lognormal", cap=64, eos_id=7, timed=0)


def test_synthetic_completions_end_as_drawn_without_special_tokens_inside():
    import torch

    from benchmarks import lengths

    forcing = lengths.ForcedLengths("lognormal", cap=12, eos_id=7, seed=3)
    prompt = torch.full((6, 3), 5)
    out = forcing.synthetic(prompt, pad_id=0, vocab=50)
    forcing.check(out, 3)  # EOS exactly at each drawn length, none when truncated at the cap
    assert torch.equal(out[:, :3], prompt)
    for row, n in zip(out[:, 3:].tolist(), forcing.history[-1]):
        body = row[:n - 1] if n < 12 else row
        assert 7 not in body and 0 not in body and len(set(body)) > 1
    # grpo_train takes synthetic completions on its padded path only
    assert trainer_step.parse_args(["--provider", "fused", "--synthetic"]).generation == "padded"
    with pytest.raises(SystemExit):
        trainer_step.parse_args(["--provider", "fused", "--synthetic", "--generation",
                                 "continuous"])
