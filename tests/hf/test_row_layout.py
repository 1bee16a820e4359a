"""RowLayout: the one name of a batch's row layout (padded, packed or shared rows), parsed from
the strings that command lines and results rows use, and printed back as the same strings."""

import csv
import io
import json

import pytest
import torch

from grpo_kernels.hf import ROW_LAYOUTS, RowLayout, parse_row_layout, plan_rows


def test_the_names_round_trip():
    assert ROW_LAYOUTS == ("padded", "packed", "shared")
    for name in ROW_LAYOUTS:
        layout = parse_row_layout(name)
        assert layout is RowLayout(name) and layout == name and parse_row_layout(layout) is layout
        # log lines, JSON and CSV rows print the name, as they did when it was a string
        assert str(layout) == f"{layout}" == "%s" % layout == name  # noqa: UP031
        assert json.loads(json.dumps({"layout": layout})) == {"layout": name}
        out = io.StringIO()
        csv.writer(out).writerow([layout])
        assert out.getvalue().strip() == name


@pytest.mark.parametrize("value", ["Packed", "pad", "", None, "one_row"])
def test_unknown_names_are_refused_with_the_argument_and_the_names(value):
    with pytest.raises(ValueError) as err:
        parse_row_layout(value, "--layouts")
    assert str(err.value) == f"--layouts must be one of padded, packed, shared, got {value!r}"


def test_plan_rows_and_micro_batches_parse_their_layout():
    from grpo_train import batching

    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    batch = dict(input_ids=ids, attention_mask=attn, completion_mask=attn[:, 2:], T=2)
    assert plan_rows(ids, attn, 2, None, "packed").layout is RowLayout.PACKED
    with pytest.raises(ValueError, match="layout must be one of padded, packed, shared"):
        plan_rows(ids, attn, 2, None, "unpacked")
    with pytest.raises(ValueError, match="lays out 'packed' or 'shared' rows, got layout 'padded'"):
        plan_rows(ids, attn, 2, None, RowLayout.PADDED)
    with pytest.raises(ValueError, match="layout must be one of padded, packed, shared"):
        batching.micro_batches(batch, "unpacked", 0, 0)


def test_the_benchmarks_flags_and_rows_use_the_names():
    capacity = pytest.importorskip("benchmarks.capacity")
    for layout, flags in capacity.LAYOUT_FLAGS.items():  # the flags a probe runs with ...
        row = dict(zip(flags[::2], flags[1::2]))
        row = {"padding_free": row["--padding_free"], "share_prompt": row.get("--share_prompt")}
        assert capacity.layout_ran(row) is layout  # ... are the layout its row reports
    assert capacity.layout_ran({}) is None
    assert set(capacity.LAYOUT_FLAGS) == set(RowLayout)
    with pytest.raises(SystemExit) as refused:  # the flag accepts the names only
        capacity.main(["--providers", "fused", "--layouts", "Packed", "--no_record"])
    assert refused.value.code == 2


@pytest.mark.parametrize("adapter", ["prompt", "prefix", "lora"])
def test_choose_layout_keeps_prompt_learning_adapters_padded(adapter):
    """A PEFT prompt-learning adapter puts virtual tokens before every row in the PEFT model's
    forward: packed or shared rows would give them to the row's first sequence only, so the
    layout is padded, with the adapter named; LoRA keeps the richest layout."""
    peft = pytest.importorskip("peft")
    from grpo_kernels.hf import choose_layout
    from grpo_train.tiny import build_tiny_model, build_tokenizer

    config = {"prompt": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                        num_virtual_tokens=3),
              "prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                        num_virtual_tokens=3),
              "lora": lambda: peft.LoraConfig(r=4, target_modules=["q_proj"])}[adapter]()
    model = peft.get_peft_model(build_tiny_model(build_tokenizer(), hidden_size=32,
                                                 num_layers=1), config)
    choice = choose_layout(model)
    if adapter == "lora":
        assert choice.layout is RowLayout.SHARED, choice
    else:
        assert choice.layout is RowLayout.PADDED
        assert f"{adapter.capitalize()}TuningConfig" in choice.reason, choice.reason


BAD_ROWS = [  # (mutate(ids, attn) -> plan_rows arguments, exception, message fragment)
    (lambda i, a: (i.tolist(), a, None), TypeError, "input_ids must be a tensor"),
    (lambda i, a: (i, None, None), TypeError, "attention_mask must be a tensor"),
    (lambda i, a: (i.float(), a, None), TypeError, "input_ids must be an integer tensor"),
    # no sequence: failed choosing the row width ("max() arg is an empty sequence")
    (lambda i, a: (i[:0], a[:0], None), ValueError, "input_ids must hold at least one sequence"),
    # a weight other than 0 and 1 read as 1: packed rows keep or drop a token
    (lambda i, a: (i, a, torch.full((2, 3), 0.5)), ValueError,
     "completion_mask must hold 0s and 1s"),
]


@pytest.mark.parametrize("layout", ["packed", "shared"])
@pytest.mark.parametrize("case", BAD_ROWS, ids=["ids list", "no mask", "float ids", "S = 0",
                                                "weighted mask"])
def test_plan_rows_refuses_bad_input_by_name(layout, case):
    ids, attn = torch.randint(1, 9, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    mutate, error, fragment = case
    input_ids, attention_mask, completion_mask = mutate(ids, attn)
    with pytest.raises(error, match=fragment):
        plan_rows(input_ids, attention_mask, 3, completion_mask, layout)
    # a 0/1 mask of any dtype is taken: the rows keep its 1s
    rows = plan_rows(ids, attn, 3, torch.tensor([[1.0, 1.0, 0.0]] * 2), layout)
    assert rows.cu_seqlens.tolist() == [0, 2, 4]


def test_choose_row_width_refuses_no_lengths_or_negative_ones():
    from grpo_kernels.hf import choose_row_width

    for bad in ([], [3, -1]):
        with pytest.raises(ValueError, match="lengths must be one or more sequence lengths"):
            choose_row_width(bad)
