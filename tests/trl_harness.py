"""The TRL trainer harness of tests/trl: a tiny Qwen2 trainer (ours or TRL's) from a saved
model directory, one TRL micro-batch with completions of different lengths, and the comparison
of two trainers' loss, gradients and logged metrics after one `_compute_loss`."""

import os
import warnings
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from trl import GRPOConfig

from grpo_kernels import force_backend
from grpo_kernels.trl import GRPOTrainer
from grpo_train.tiny import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
B, P, T = 4, 5, 7  # micro-batch, prompt length, completion length
EOS = build_tokenizer().eos_token_id
DATASET = Dataset.from_dict(
    {"prompt": [[{"role": "user", "content": f"{i}+{2 * i}"}] for i in range(8)]})


def digits_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c[0]["content"]) + 0.1 * len(c[0]["content"])
            for c in completions]


def make_trainer(cls, model_dir, peft_config=None, padding_free=True, share_prompt=True,
                 processing_class=None, dataset=None, reward_funcs=digits_reward, **overrides):
    """A tiny trainer of class `cls` (TRL's or ours; padding_free and share_prompt go to ours
    only): micro-batch B, 4 generations, completions up to T tokens, gradient accumulation 2,
    4 micro-batches per generation; `overrides` are GRPOConfig fields."""
    cfg = dict(
        output_dir=os.path.join(model_dir, "out"), report_to=[], use_cpu=True, bf16=False,
        seed=0, per_device_train_batch_size=B, num_generations=4, max_completion_length=T,
        gradient_accumulation_steps=2, generation_batch_size=4 * B, logging_steps=1,
        max_steps=2, save_strategy="no", disable_tqdm=True,
        # a bias towards EOS so that completions have different lengths (masks matter)
        generation_kwargs={"sequence_bias": [[[EOS], 3.5]]},
    )
    cfg.update(overrides)
    ours = {} if cls is trl.GRPOTrainer else dict(padding_free=padding_free,
                                                   share_prompt=share_prompt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model=model_dir, reward_funcs=reward_funcs, args=GRPOConfig(**cfg),
                   train_dataset=DATASET if dataset is None else dataset,
                   peft_config=peft_config, processing_class=processing_class, **ours)


def make_batch(trainer, seed=0, noise=0.3, lengths=(7, 3, 5, 1), prompt_rows=None):
    """A TRL micro-batch: left-padded prompts, completions of `lengths` (B of them, <= T); old
    and reference log-probs near the policy's (TRL's own scoring + noise) so that ratios clip.
    prompt_rows: [B] indices, sequence i takes prompt prompt_rows[i] (e.g. [0, 2, 0, 2]: two
    groups whose siblings are apart, as after TRL's shuffle); default: B different prompts."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(10, 90, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    prompt_mask[2, :1] = 0
    if prompt_rows is not None:
        prompt_ids, prompt_mask = prompt_ids[prompt_rows], prompt_mask[prompt_rows]
    completion_mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    completion_ids = torch.randint(10, 90, (B, T), generator=g).masked_fill(completion_mask == 0,
                                                                            0)
    with torch.no_grad():
        logps, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([prompt_mask, completion_mask], 1), T)
    noisy = lambda: (logps + noise * torch.randn(B, T, generator=g)) * completion_mask
    return dict(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, advantages=torch.randn(B, generator=g),
        num_items_in_batch=completion_mask.sum().float() * 4,  # 4 micro-batches per generation
        old_per_token_logps=noisy(), ref_per_token_logps=noisy(),
    )


def run_both(model_dir, backend="chunked", mode="train", patch=None, extra=None, noise=0.3,
             drop=(), **cfg):
    """(TRL trainer, our trainer, TRL loss, our loss) on one batch, after backward. extra:
    batch entries added or replaced; drop: batch keys removed (e.g. old_per_token_logps)."""
    ref, ours = make_trainer(trl.GRPOTrainer, model_dir, **cfg), make_trainer(GRPOTrainer,
                                                                             model_dir, **cfg)
    for tr in (ref, ours):
        tr.model.train(mode == "train")
        tr.current_gradient_accumulation_steps = 2
        for k, v in (patch or {}).items():
            setattr(tr, k, v)
    inputs = {**make_batch(ref, noise=noise), **(extra or {})}
    inputs = {k: v for k, v in inputs.items() if k not in drop}
    loss_ref = ref._compute_loss(ref.model, inputs)
    loss_ref.backward()
    with force_backend(backend):
        loss = ours._compute_loss(ours.model, inputs)
        loss.backward()
    return ref, ours, loss_ref, loss


def assert_same(ref, ours, loss_ref, loss, mode="train"):
    # float32 sums in another order (our fused head's against TRL's logits, and the BLAS
    # kernels a CPU picks): 3e-7 at a loss of 0.19 measured on one AMD EPYC; the same bound
    # as the metrics' below
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    scale = max(p.grad.abs().max() for p in ref.model.parameters() if p.grad is not None)
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        assert (q.grad is None) == (p.grad is None), name  # frozen in both (e.g. under LoRA)
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda m, n=name: f"grad of {n}: {m}")
    got = {k: v[-1] for k, v in ours._metrics[mode].items()}
    want = {k: v[-1] for k, v in ref._metrics[mode].items()}
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6, nan_ok=True), k


# The loss matrix: every loss type, token- and sequence-level ratios, beta 0 and 0.04, the entropy
# bonus, delta and a bf16 model with a float32 head (TRL config overrides; noise: see make_batch)
CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo-kl": dict(loss_type="bnpo", beta=0.04),
    "dr_grpo-kl": dict(loss_type="dr_grpo", beta=0.04),
    "dapo": dict(loss_type="dapo"),
    "dapo-kl-entropy": dict(loss_type="dapo", beta=0.04, entropy_coef=0.1),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "sapo-kl": dict(loss_type="sapo", beta=0.04, use_bias_correction_kl=False),
    "luspo-seq": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "cispo-seq-entropy": dict(loss_type="cispo", epsilon_high=1.2, entropy_coef=0.1,
                              importance_sampling_level="sequence", noise=1.0),
    "luspo-token-kl": dict(loss_type="luspo", beta=0.04),
    # larger noise: sequence-level ratios (means over tokens) must clip too; TRL averages those
    # clip flags per sequence, not per token
    "grpo-seq-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                        noise=1.0),
    # delta below 1 + epsilon_high: TRL flags high clipping on the delta-capped ratio
    "grpo-delta-entropy": dict(loss_type="grpo", delta=1.15, entropy_coef=0.1),
    # an upper clip apart from the lower one, and a sampling temperature (scoring and loss)
    "grpo-asymmetric-temperature": dict(loss_type="grpo", epsilon=0.1, epsilon_high=0.3,
                                        temperature=0.7, beta=0.04),
    # a bf16 model with TRL's float32 head: our head runs in float32 too (head_dtype); padded,
    # as TRL's, because a bf16 body on packed rows rounds differently (its packed-against-padded
    # bound is in test_trl_padding_free.py)
    "dapo-bf16-fp32head": dict(loss_type="dapo", beta=0.04, cast_lm_head_to_fp32=True,
                               model_init_kwargs={"dtype": "bfloat16"}, padding_free=False),
}
