"""grpo_train.generation: the padded and continuous-batching paths give the same batch (greedy),
the same EOS / length semantics, seeded reproducibility, the fallback and its log line, and
forced completion lengths on both paths; the padded path's prefill computed once per prompt
gives what a prefill per row gives. Tiny models; each continuous call takes ~0.1 s."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_train import continuous, generation, length_forcing
from grpo_train.cli import parse_config
from grpo_train.config import TrainConfig, resolve_auto
from grpo_train.flags import UsageError
from grpo_train.models import build_embedded, eos_token_ids

EXAMPLES = [{"prompt": p, "answer": "3"} for p in ("1+2=", "2+0+1=", "0+1+1+1=", "12+20+1=")]
ONCE = "each prompt prefilled once"  # the padded path's prefill, as its log line says


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
        assert log == [{"padded": f"generation: padded (--generation padded); {ONCE}",
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
        with length_forcing.forced_lengths(lambda n: lengths):
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
    assert log == [f"generation: padded (auto, rule cpu: padded (measured)); {ONCE}"]

    log = []
    generation.generate(model, EXAMPLES, make_ctx(model, tok, cfg, "continuous", log, fsdp=True))
    assert log == ["generation: padded (--fsdp: continuous batching needs the full parameters in "
                   f"one process); {ONCE}"]

    def broken(*args, **kwargs):
        raise RuntimeError("no cache for you")

    want = both(model, tok, cfg)[0]
    monkeypatch.setattr(continuous, "generate", broken)
    log = []
    ctx = make_ctx(model, tok, cfg, "continuous", log)
    for _ in range(2):
        assert_same_batch(generation.generate(model, EXAMPLES, ctx, greedy=True), want)
    assert log == ["generation: padded (continuous batching failed: RuntimeError: no cache "
                   f"for you); {ONCE}"]


def test_generation_flag():
    assert TrainConfig().generation == "auto"
    assert parse_config(["--generation", "padded"]).generation == "padded"
    with pytest.raises(SystemExit):
        parse_config(["--generation", "paged"])
    from grpo_train.checks import validate

    with pytest.raises(UsageError, match="--generation"):
        validate(resolve_auto(TrainConfig(generation="fast")))


# ---- the padded path's prefill, once per prompt ------------------------------------------------

# prompts of 4 to 40 characters: left padding of up to 36 positions in the batch
VARIED = EXAMPLES + [{"prompt": p, "answer": "3"} for p in ("7=", "1+1+1+1+1+1+1+1+1+1+1+1+1+9=")]


def random_model(tok, arch="qwen2", sliding_window=None):
    """A random Qwen2 or Llama with large weights (std 0.2): its greedy completions depend on the
    prompt; sliding_window: a Qwen2 whose every layer attends to that many tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_train.tiny import build_tiny_model

    model = build_tiny_model(tok, arch=arch, hidden_size=64, num_layers=2, initializer_range=0.2)
    if sliding_window is not None:
        config = Qwen2Config(**{**model.config.to_dict(), "layer_types": None,
                                "use_sliding_window": True, "sliding_window": sliding_window,
                                "max_window_layers": 0})  # layer_types: from these three
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        assert set(config.layer_types) == {"sliding_attention"}
    return model.eval()


def per_row_and_once(model, tok, cfg, examples, **fields):
    """The padded path's batch with a prefill per row, then with one per prompt (same seed)."""
    out, logs = [], []
    for prefill in (False, None):
        log = []
        ctx = make_ctx(model, tok, cfg, "padded", log, **fields)
        ctx.prefill_once = prefill  # False: turned off; None: decided on the first call
        torch.manual_seed(0)
        out.append(generation.generate(model, examples, ctx, greedy=False))
        logs += log
    return out, logs


def test_prefill_once_gives_the_completions_of_a_prefill_per_row(embedded):
    """top_k = 1 (greedy, G > 1) and seeded sampling, left-padded prompts of varied length, on
    the embedded model and a random Qwen2: the same batch either way. Prefilling draws no random
    numbers, so a seed samples the same tokens from logits that agree up to rounding."""
    _, tok, cfg = embedded
    for model in (embedded[0], random_model(tok)):
        for fields in (dict(top_k=1), {}):
            (per_row, once), logs = per_row_and_once(model, tok, cfg, VARIED, **fields)
            assert_same_batch(per_row, once)
            assert logs == ["generation: padded (--generation padded); prefill per row: turned off",
                            f"generation: padded (--generation padded); {ONCE}"]
        completions = once["input_ids"][:, -once["T"]:].tolist()
        assert len({tuple(r) for r in completions}) > len(VARIED)  # prompt-dependent, sampled
    m = biased(embedded, {tok.eos_token_id: 2.0, tok.convert_tokens_to_ids("a"): 0.0})
    B = len(VARIED) * cfg.num_generations
    lengths = [1 + (i * 5) % (cfg.max_new_tokens + 1) for i in range(B)]
    with length_forcing.forced_lengths(lambda n: lengths):  # exactly the forced lengths
        (per_row, once), _ = per_row_and_once(m, tok, cfg, VARIED)
    assert_same_batch(per_row, once)
    assert once["lengths"].tolist() == [min(n, cfg.max_new_tokens) for n in lengths]


@pytest.mark.parametrize("arch,window", [("qwen2", None), ("llama", None), ("qwen2", 8)])
def test_prefilled_cache_continues_like_generate(arch, window):
    """`generate` (greedy) from the repeated prefilled cache: the same tokens and, step by step,
    the same scores up to rounding as `generate` prefilling every row itself; positions count
    real tokens (left padding of up to 36), and a sliding window shorter than the prompts."""
    from grpo_train.tiny import build_tokenizer

    tok = build_tokenizer()
    model = random_model(tok, arch, window)
    enc = tok([ex["prompt"] for ex in VARIED], padding=True, return_tensors="pt")
    ids, mask, G = enc["input_ids"], enc["attention_mask"], 3  # [P, Lp]
    kw = dict(input_ids=ids.repeat_interleave(G, 0), attention_mask=mask.repeat_interleave(G, 0),
              max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True,
              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        want = model.generate(**kw)
        cache = generation._prefilled_cache(model, ids, mask, G)
        assert cache.get_seq_length() == ids.shape[1] - 1  # [P·G, heads, Lp - 1, head_dim]
        assert cache.layers[0].keys.shape[0] == len(VARIED) * G
        got = model.generate(**{generation._cache_kwarg(model): cache}, **kw)  # by version
    assert torch.equal(got.sequences, want.sequences)
    assert len({tuple(r) for r in want.sequences[:, ids.shape[1]:].tolist()}) > 2  # by prompt
    assert max((a - b).abs().max().item() for a, b in zip(got.scores, want.scores)) < 1e-4


def test_prefill_refusals(embedded, monkeypatch):
    """Where the cache cannot be repeated, the padded path prefills every row, as the log says."""
    from transformers.cache_utils import LinearAttentionLayer

    model, tok, cfg = embedded

    def refusal():
        return generation._prefill_refusal(model, make_ctx(model, tok, cfg, "padded"))

    assert refusal() is None
    with monkeypatch.context() as m:
        m.setattr(model.generation_config, "cache_implementation", "static")
        assert refusal() == "the generation config asks for a 'static' cache"
    with monkeypatch.context() as m:
        m.setattr(type(model), "_supports_default_dynamic_cache", classmethod(lambda cls: False))
        assert refusal() == "Qwen2ForCausalLM keeps its own cache, not transformers' Cache"
    # a linear-attention state would not be repeated with the keys and values
    monkeypatch.setattr(generation, "_new_cache", lambda hf, cls: type("C", (), dict(
        layers=[LinearAttentionLayer()]))())
    assert refusal() == "Qwen2ForCausalLM's cache has LinearAttentionLayer layers"
    (per_row, _), _ = per_row_and_once(model, tok, cfg, VARIED, top_k=1)
    log = []
    ctx = make_ctx(model, tok, cfg, "padded", log, top_k=1)
    torch.manual_seed(0)
    assert_same_batch(generation.generate(model, VARIED, ctx), per_row)
    assert log == ["generation: padded (--generation padded); prefill per row: Qwen2ForCausalLM's "
                   "cache has LinearAttentionLayer layers"]


def test_generation_benchmark_rows(tmp_path):
    """benchmarks.generation: the per-row and the once-per-prompt prefill, interleaved, give the
    same completion tokens; positions prefilled B·Lp against P·(Lp - 1) + B; one CSV row each,
    naming the path that ran."""
    import csv

    from benchmarks import generation as bench

    out = tmp_path / "rows.csv"
    assert bench.main(["--workloads", "default-run", "--paths", "per-row,padded,static-eager",
                       "--threads", "1", "--repeats", "1", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["path"] for r in rows] == ["per-row", "padded", "static-eager"]
    assert [r["ran_path"] for r in rows] == ["padded", "padded", "static"]
    assert len({r["completion_tokens"] for r in rows}) == 1
    assert rows[2]["prefilled_positions"] == rows[1]["prefilled_positions"]
    P, B = 64, 64 * bench.G
    Lp = int(rows[0]["prefilled_positions"]) // B
    assert int(rows[0]["prefilled_positions"]) == B * Lp
    assert int(rows[1]["prefilled_positions"]) == P * (Lp - 1) + B
    examples = bench.build(bench.QWEN_05B_2L | dict(layers=1), 4, 8, 512)[2]
    assert [len(ex["prompt"]) + 1 for ex in examples] == [512, 496, 480, 464]  # + "="


def test_eos_schedule_builds_its_masks_once():
    """The forced-length processor gives the schedule's scores (EOS banned before L_i - 1, only
    eos_ids[0] at L_i - 1, untouched after), and after its first call a decode step makes no
    tensor from Python data and copies nothing: on a GPU each was a host synchronization."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.name())
            return func(*args, **(kwargs or {}))

    B, V, Lp, eos = 3, 11, 4, [5, 7]
    lengths = torch.tensor([1, 3, 20])
    schedule = length_forcing.EosSchedule(lengths, eos, Lp)
    scores = torch.randn(B, V)
    for t in range(5):
        ids = torch.zeros(B, Lp + t, dtype=torch.long)
        with Ops() as ops:
            got = schedule(ids, scores)
        if t:  # the masks exist: only arithmetic on them
            copies = [n for n in ops.names if n in ("aten::lift_fresh", "aten::_to_copy",
                                                    "aten::copy_", "aten::index_put_",
                                                    "aten::_local_scalar_dense")]
            assert copies == [], (t, copies)
        for i, n in enumerate(lengths.tolist()):
            want = scores[i].clone()
            if t < n - 1:
                want[eos] = -torch.inf
            elif t == n - 1:
                want = torch.full((V,), -torch.inf)
                want[eos[0]] = 0.0
            assert torch.equal(got[i], want), (t, i)
    half = schedule(torch.zeros(B, Lp, dtype=torch.long), scores.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and half[0, eos[0]] == 0.0  # masks rebuilt per dtype
