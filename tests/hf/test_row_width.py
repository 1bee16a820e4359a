"""choose_row_width: the packed rows' width for the model's attention implementation (one row
for flash, narrow rows for eager and unknown ones, the cost rule for sdpa), and rows that are
exact whatever width is chosen."""

import pytest
import torch
from transformers import Qwen2Config

from benchmarks.lengths import draw_lengths
from benchmarks.trainer_step import QWEN25_05B
from grpo_kernels.hf import choose_row_width, pack_sequences
from grpo_kernels.hf.row_width import RowWidthRule, first_fit, pair_cost, row_width_rule


def qwen_config(attn: str | None) -> Qwen2Config:
    config = Qwen2Config(**QWEN25_05B)
    config._attn_implementation = attn
    return config


def long_tailed(n: int, cap: int = 1024, prompt: int = 64, call: int = 0) -> list[int]:
    """Real tokens of n sequences: a prompt plus a long-tailed completion (benchmarks'
    lognormal profile, median cap / 3)."""
    return [prompt + x for x in draw_lengths("lognormal", n, cap, seed=0, call=call)]


def test_pair_cost_is_the_flop_ratio_of_a_qwen_layer():
    # 4·14·64 pair FLOPs over 2·(896·64·(28 + 4) + 3·896·4864) position FLOPs
    assert pair_cost(qwen_config("sdpa")) == pytest.approx(3584 / 29_818_880, rel=1e-9)
    assert pair_cost(object()) is None  # a config without the sizes: no cost rule


@pytest.mark.parametrize("attn,rule", [("sdpa", RowWidthRule.COST),
                                       ("eager", RowWidthRule.NARROW),
                                       ("flash_attention_2", RowWidthRule.ONE_ROW),
                                       ("kernels-community/flash-attn3", RowWidthRule.ONE_ROW),
                                       ("flex_attention", RowWidthRule.NARROW),
                                       (None, RowWidthRule.NARROW)])
def test_width_rule_follows_the_attention_implementation(attn, rule):
    assert row_width_rule(qwen_config(attn)) is rule
    lengths = long_tailed(8)
    width = choose_row_width(lengths, qwen_config(attn))
    assert width >= max(lengths)
    if rule is RowWidthRule.ONE_ROW:
        assert width == sum(lengths)
    if rule is RowWidthRule.NARROW:
        assert width == -(-max(lengths) // 16) * 16
    assert choose_row_width(lengths) == -(-max(lengths) // 16) * 16  # no config: narrow


@pytest.mark.parametrize("G,call", [(8, 0), (8, 1), (8, 2), (16, 0), (16, 1)])
def test_cost_rule_rows_fill_and_cost_no_more_than_any_other_width(G, call):
    """At the long-tailed profile the chosen rows hold 1.02-1.11x the real tokens over these
    draws (rows as wide as the longest sequence: up to 1.29x) and at most 0.8x the padded
    positions; no width from the longest sequence to one row is cheaper under the rule's own
    cost, so neither are the narrow rows."""
    config = qwen_config("sdpa")
    ratio = pair_cost(config)
    lengths = long_tailed(G, call=call)
    width = choose_row_width(lengths, config)
    assert width % 16 == 0 or width == sum(lengths)

    def cost(w):
        return len(first_fit(lengths, w)[2]) * w * (1 + ratio * w)

    positions = len(first_fit(lengths, width)[2]) * width
    assert positions <= 1.12 * sum(lengths), (positions, sum(lengths))
    padded = G * max(lengths)
    assert positions <= 0.8 * padded, (positions, padded)
    widths = range(-(-max(lengths) // 16) * 16, sum(lengths) + 16, 16)
    assert cost(width) <= min(cost(w) for w in widths) * (1 + 1e-9)


def test_wide_rows_are_exact():
    """Rows chosen by the cost rule (several sequences each) give the padded model's hidden
    states: the packing itself does not depend on the width."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=60, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).eval()
    S, Lp, T = 6, 5, 11
    lengths = [3, 11, 7, 1, 9, 5]
    ids = torch.randint(1, 60, (S, Lp + T))
    attn = torch.ones(S, Lp + T, dtype=torch.long)
    attn[0, :2] = 0  # a left-padded prompt
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    attn[:, Lp:] = mask
    packed = pack_sequences(ids, attn, T, mask, model_config=config)
    assert packed.input_ids.shape[0] < S  # several sequences share a row
    with torch.no_grad():
        pos = (attn.cumsum(1) - 1).clamp(min=0)
        padded = model(input_ids=ids, attention_mask=attn, position_ids=pos,
                       use_cache=False).logits
        rows = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                     use_cache=False).logits  # a cache turns packed-row detection off
    want = padded[:, Lp - 1:-1].reshape(S * T, -1)[packed.token_index]
    got = rows.reshape(-1, rows.shape[-1])[packed.logits_to_keep]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_row_cost_fit_recovers_the_two_constants():
    """benchmarks.row_cost fits t = a·P + b·P·W at fixed P: exact on points made from it."""
    from benchmarks.row_cost import fit

    a, b, P = 1.4e-3, 1.7e-7, 4096
    points = [(w, a * P + b * P * w) for w in (256, 512, 1024, 2048, 4096)]
    got_a, got_b = fit(points, P)
    assert got_a == pytest.approx(a, rel=1e-9) and got_b == pytest.approx(b, rel=1e-9)
