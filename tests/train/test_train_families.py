"""grpo_train on tiny saved Mixture-of-Experts models, as a user runs it (`--model <dir>`): the run
logs shared rows (grpo_train adds no auxiliary loss, and routing is per token) and its step
equals the padded run's (loss, gradient norm, entropy, KL), with prompts and completions of
different lengths. A config that asks for router logits (`output_router_logits: true`, as
checkpoints trained with the auxiliary loss are saved) generates from padded prompts and shares
prompts too, with the fused loss and with the materialized-logits reference (`--loss
reference`, a full forward on shared rows)."""

import json
import textwrap

import pytest
import torch
import transformers

from grpo_train import main
from grpo_train.length_forcing import forced_lengths
from grpo_train.logs import read_metrics
from grpo_train.tiny import build_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

_MOE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
MODELS = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_MOE, head_dim=8, num_experts=4, moe_intermediate_size=32)),
    "mixtral-router-logits": ("MixtralConfig", "MixtralForCausalLM",
                              dict(_MOE, num_local_experts=4, router_aux_loss_coef=0.02,
                                   output_router_logits=True)),
}
LENGTH_REWARD = """
def length_mod_3(prompts, completions, **columns):
    # varies inside a group even for a random model: non-zero advantages and gradients
    return [float(len(c) % 3) for c in completions]
"""


def save_model(path, name) -> None:
    config_cls, model_cls, kwargs = MODELS[name]
    tok = build_tokenizer()
    torch.manual_seed(0)
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, **kwargs)).save_pretrained(path)
    tok.save_pretrained(path)


def run(tmp_path, capsys, model_dir, name, *flags):
    """One step of `python -m grpo_train --model model_dir` (in this process), completions of
    1 to 7 tokens; (the step's metrics record, the micro-batch layout line)."""
    data = tmp_path / "sums.jsonl"
    # prompts of different lengths (left padding): a config's router logits in a decode step
    # cover the new token while its attention mask covers the cache
    data.write_text("".join(json.dumps({"question": "+".join("1" * n), "answer": str(n)}) + "\n"
                            for n in range(1, 17)))
    reward = tmp_path / "length_reward.py"
    reward.write_text(textwrap.dedent(LENGTH_REWARD))
    out = tmp_path / name
    # one iteration: a second would start from parameters AdamW moved by about lr wherever a
    # gradient is float32 rounding (experts that saw few tokens), so the runs would part there
    argv = ["--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out),
            "--steps", "1", "--num_prompts", "2", "--num_generations", "4",
            "--max_new_tokens", "6", "--micro_batch_size", "4", "--beta", "0.04",
            "--num_iterations", "1", "--learning_rate", "1e-3", "--max_grad_norm", "0",
            "--reward", f"{reward}:length_mod_3", "--eval_size", "0", "--save_every", "0",
            "--no_save_final_model", "--backend", "chunked", "--no-progress", "--no-plot",
            *flags]
    with forced_lengths(lambda n: [1 + (5 * i) % 7 for i in range(n)]):
        assert main(argv) == 0
    step = next(r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 1)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "micro-batches:" in ln]
    return step, lines


@pytest.mark.parametrize("name, loss", [("qwen3-moe", "fused"),
                                        ("mixtral-router-logits", "fused"),
                                        ("mixtral-router-logits", "reference")])
def test_moe_model_runs_shared_rows_equal_to_padded(tmp_path, capsys, name, loss):
    model_dir = tmp_path / "model"
    save_model(model_dir, name)
    padded, padded_lines = run(tmp_path, capsys, model_dir, "padded", "--loss", loss,
                               "--no_padding_free")
    shared, lines = run(tmp_path, capsys, model_dir, "shared", "--loss", loss)
    assert len(lines) == 1 and "micro-batches: shared rows, each group's prompt once" in lines[0]
    assert "padded rows" in padded_lines[0]
    assert padded["grad_norm"] > 0 and 1 < padded["completion_length"] < 6
    for key in ("reward", "completion_length", "loss", "grad_norm", "entropy", "kl"):
        assert shared[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("path", ["padded", "static", "continuous"])
def test_router_logits_config_generates_from_padded_prompts(tmp_path, path):
    """A config asking for router logits generates on every path from prompts of different
    lengths, greedy tokens equal to each prompt generated alone (no padding), and keeps its
    setting."""
    from grpo_train.config import TrainConfig, resolve_auto
    from grpo_train.generation import generate
    from tests.train.test_generation import VARIED, make_ctx

    save_model(tmp_path, "mixtral-router-logits")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    cfg = resolve_auto(TrainConfig(max_new_tokens=4, min_new_tokens=4, num_generations=2,
                                   static_compile=False))
    log = []
    batch = generate(model, VARIED, make_ctx(model, tok, cfg, path, log), greedy=True)
    assert not any("failed" in line for line in log), log  # the path asked for ran
    for row, example in zip(batch["input_ids"][:, -batch["T"]:], VARIED):
        ids = tok.apply_chat_template([{"role": "user", "content": example["prompt"]}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.no_grad():  # one unpadded prompt: the model's own generate runs
            alone = model.generate(ids, do_sample=False, max_new_tokens=4, min_new_tokens=4,
                                   pad_token_id=tok.pad_token_id)
        assert torch.equal(row, alone[0, ids.shape[1]:]), example
    assert model.config.output_router_logits
