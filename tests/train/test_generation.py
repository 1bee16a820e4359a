"""grpo_train.generation: the padded and continuous-batching paths give the same batch (greedy),
the same EOS / length semantics, seeded reproducibility, the fallback and its log line, and
forced completion lengths on both paths. Tiny models; each continuous call takes ~0.1 s."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_train import continuous, generation
from grpo_train.cli import parse_config
from grpo_train.config import TrainConfig, resolve_auto
from grpo_train.flags import UsageError
from grpo_train.models import build_embedded, eos_token_ids

EXAMPLES = [{"prompt": p, "answer": "3"} for p in ("1+2=", "2+0+1=", "0+1+1+1=", "12+20+1=")]


@pytest.fixture(scope="module")
def embedded():
    """The embedded model (random weights: greedy completions never reach EOS)."""
    torch.set_num_threads(1)
    cfg = resolve_auto(TrainConfig(tiny_hidden_size=32, tiny_layers=1, max_new_tokens=8,
                                   num_generations=3))
    return build_embedded(cfg) + (cfg,)


def biased(embedded, bias: dict[int, float]):
    """A copy of the embedded model whose logits are a constant bias (weights zero): the
    probabilities do not depend on the context, and greedy picks the largest bias."""
    model, tok, cfg = embedded
    hf = type(model)(model.config)
    hf.generation_config = model.generation_config
    hf.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size)
    with torch.no_grad():
        hf.lm_head.weight.zero_()
        hf.lm_head.bias.fill_(-10.0)
        for token, value in bias.items():
            hf.lm_head.bias[token] = value
    return hf.eval()


def make_ctx(model, tok, cfg, path, log=None, eos_ids=None, **fields):
    return generation.GenerationSetup(
        cfg=dataclasses.replace(cfg, generation=path, **fields), tokenizer=tok,
        eos_ids=eos_ids or eos_token_ids(model, tok),
        say=(log.append if log is not None else lambda _m: None))


def both(model, tok, cfg, greedy=True, seed=0, **fields):
    """The batch of each path, from the same global seed."""
    out = {}
    for path in ("padded", "continuous"):
        log = []
        torch.manual_seed(seed)
        out[path] = generation.generate(model, EXAMPLES, make_ctx(model, tok, cfg, path, log,
                                                                   **fields), greedy=greedy)
        # the path asked for is the one that ran (a failed continuous call runs padded)
        assert log == [{"padded": "generation: padded (--generation padded)",
                        "continuous": "generation: continuous batching (sdpa)"}[path]], log
    return out["padded"], out["continuous"]


def assert_same_batch(a, b):
    for key in ("input_ids", "attention_mask", "completion_mask", "lengths", "truncated"):
        assert torch.equal(a[key], b[key]), key
    assert a["T"] == b["T"] and a["texts"] == b["texts"] and a["columns"] == b["columns"]
    assert a["prompt_tokens"] == b["prompt_tokens"] and a["prompts"] == b["prompts"]


def test_greedy_is_the_same_on_both_paths(embedded):
    model, tok, cfg = embedded
    padded, cont = both(model, tok, cfg)
    assert padded["input_ids"].shape == (len(EXAMPLES), padded["input_ids"].shape[1])
    assert padded["T"] == cfg.max_new_tokens  # random weights: no EOS, all truncated
    assert_same_batch(padded, cont)


def test_eos_semantics_on_both_paths(embedded):
    """EOS on top: every completion is [EOS]; min_new_tokens bans it (and only it) before;
    a second EOS id ends completions too; without EOS the cap truncates."""
    model, tok, cfg = embedded
    eos, a, b = tok.eos_token_id, tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    m = biased(embedded, {eos: 5.0, a: 4.0, b: 3.0})
    padded, cont = both(m, tok, cfg)
    assert_same_batch(padded, cont)
    assert cont["T"] == 1 and cont["lengths"].tolist() == [1] * 4
    assert not cont["truncated"].any()

    padded, cont = both(m, tok, cfg, min_new_tokens=3)
    assert_same_batch(padded, cont)
    assert cont["completion_mask"].sum(1).tolist() == [4] * 4
    assert cont["input_ids"][:, -4:].tolist() == [[a, a, a, eos]] * 4

    padded, cont = both(m, tok, cfg, min_new_tokens=2, eos_ids=[eos, a])  # a ends too
    assert_same_batch(padded, cont)
    assert cont["input_ids"][:, -3:].tolist() == [[b, b, eos]] * 4

    m = biased(embedded, {a: 5.0})  # no EOS ever: cut at max_new_tokens
    padded, cont = both(m, tok, cfg)
    assert_same_batch(padded, cont)
    assert cont["T"] == cfg.max_new_tokens and cont["truncated"].all()
    assert cont["completion_mask"].sum().item() == 4 * cfg.max_new_tokens
    padded, cont = both(m, tok, cfg, mask_truncated_completions=True)
    assert_same_batch(padded, cont)
    assert cont["completion_mask"].sum().item() == 0


def test_sampling_settings_reach_continuous_batching(embedded):
    """top_k = 1 sampling is greedy, and min_new_tokens bans EOS before top-k filters (else
    every score of the row would be -inf); temperature -> 0 also tends to greedy."""
    model, tok, cfg = embedded
    eos, a = tok.eos_token_id, tok.convert_tokens_to_ids("a")
    m = biased(embedded, {eos: 3.0, a: 2.0})
    greedy = both(m, tok, cfg, min_new_tokens=2)[1]
    for fields in (dict(top_k=1), dict(temperature=1e-3), dict(top_p=1e-3)):
        sampled = both(m, tok, cfg, greedy=False, min_new_tokens=2, num_generations=1,
                       **fields)[1]
        assert torch.equal(sampled["input_ids"], greedy["input_ids"]), fields


def test_groups_stay_contiguous(embedded):
    """top_k = 1 on the embedded model (prompt-dependent greedy completions): the G rows of
    prompt j are rows j·G .. j·G + G - 1, each prompt's greedy completion."""
    model, tok, cfg = embedded
    G = cfg.num_generations
    greedy, _ = both(model, tok, cfg)
    assert len({tuple(r) for r in greedy["input_ids"][:, -greedy["T"]:].tolist()}) > 1
    for batch in both(model, tok, cfg, greedy=False, top_k=1):
        assert torch.equal(batch["input_ids"], greedy["input_ids"].repeat_interleave(G, 0))


def test_seeded_sampling_is_reproducible_on_either_path(embedded):
    """A uniform-ish model with EOS at ~1/6 per token: varied lengths, some truncated."""
    model, tok, cfg = embedded
    eos = tok.eos_token_id
    m = biased(embedded, {eos: 0.0, **{tok.convert_tokens_to_ids(c): 0.0 for c in "abcde"}})
    for path in ("padded", "continuous"):
        runs = []
        for seed in (0, 0, 1):
            torch.manual_seed(seed)
            batch = generation.generate(m, EXAMPLES, make_ctx(m, tok, cfg, path))
            runs.append((batch["input_ids"], torch.rand(())))  # and the stream after it
        assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1], path
        assert not torch.equal(runs[0][0], runs[2][0]), path
        lengths = batch["lengths"]
        assert batch["input_ids"].shape[0] == len(EXAMPLES) * cfg.num_generations
        assert len(set(lengths.tolist())) > 2 and batch["truncated"].any(), path


def test_forced_lengths_on_both_paths(embedded):
    """EOS exactly at L_i, never before (sampling, where EOS is likely); L_i > max_new_tokens
    truncates. Groups stay contiguous: lengths come back in batch order."""
    model, tok, cfg = embedded
    eos = tok.eos_token_id
    m = biased(embedded, {eos: 2.0, tok.convert_tokens_to_ids("a"): 0.0})
    B = len(EXAMPLES) * cfg.num_generations
    lengths = [1 + (i * 5) % (cfg.max_new_tokens + 1) for i in range(B)]
    want = torch.tensor([min(n, cfg.max_new_tokens) for n in lengths])
    batches = []
    for path in ("padded", "continuous"):
        with generation.forced_lengths(lambda n: lengths):
            batch = generation.generate(m, EXAMPLES, make_ctx(m, tok, cfg, path))
        assert torch.equal(batch["lengths"], want), path
        assert batch["truncated"].tolist() == [n > cfg.max_new_tokens for n in lengths], path
        completions = batch["input_ids"][:, -batch["T"]:]
        for row, n in zip(completions.tolist(), lengths):
            assert eos not in row[:n - 1] and (n > cfg.max_new_tokens or row[n - 1] == eos)
        batches.append(batch)
    assert torch.equal(batches[0]["completion_mask"], batches[1]["completion_mask"])
    ctx = make_ctx(m, tok, cfg, "continuous")
    ctx.forced_lengths = lambda n: [2] * n  # a ctx's own hook
    assert generation.generate(m, EXAMPLES, ctx)["lengths"].tolist() == [2] * B
    ctx.forced_lengths = lambda n: [2] * (n - 1)
    with pytest.raises(ValueError, match="forced_lengths"):
        generation.generate(m, EXAMPLES, ctx)


def test_fallback_and_the_log_line(embedded, monkeypatch):
    model, tok, cfg = embedded
    log = []
    ctx = make_ctx(model, tok, cfg, "continuous", log)
    for _ in range(2):
        generation.generate(model, EXAMPLES, ctx, greedy=True)
    assert log == ["generation: continuous batching (sdpa)"]  # once, with the attention

    log = []
    ctx = make_ctx(model, tok, cfg, "auto", log)
    generation.generate(model, EXAMPLES, ctx)
    generation.generate(model, EXAMPLES, ctx)
    assert log == ["generation: padded (auto on CPU: continuous batching only pays off for long, "
                   "varied completions)"]

    log = []
    generation.generate(model, EXAMPLES, make_ctx(model, tok, cfg, "continuous", log, bf16=True))
    assert log == ["generation: padded (--bf16 autocast does not reach continuous batching's "
                   "generation thread)"]

    def broken(*args, **kwargs):
        raise RuntimeError("no cache for you")

    want = both(model, tok, cfg)[0]
    monkeypatch.setattr(continuous, "generate", broken)
    log = []
    ctx = make_ctx(model, tok, cfg, "continuous", log)
    for _ in range(2):
        assert_same_batch(generation.generate(model, EXAMPLES, ctx, greedy=True), want)
    assert log == ["generation: padded (continuous batching failed: RuntimeError: no cache "
                   "for you)"]


def test_generation_flag():
    assert TrainConfig().generation == "auto"
    assert parse_config(["--generation", "padded"]).generation == "padded"
    with pytest.raises(SystemExit):
        parse_config(["--generation", "paged"])
    from grpo_train.checks import validate

    with pytest.raises(UsageError, match="--generation"):
        validate(resolve_auto(TrainConfig(generation="fast")))
