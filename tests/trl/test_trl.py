"""grpo_kernels.trl.GRPOTrainer against TRL's own GRPOTrainer.

- the same batch through both `_compute_loss`: loss, gradients of every parameter and the logged
  metrics agree to float32 precision, for every loss type we cover (token and sequence level,
  beta 0 and 0.04, entropy bonus, delta, tool masks, vLLM-style ratios, eval mode);
- old/reference scoring agrees with TRL's;
- a short training run (gradient accumulation 2, 4 micro-batches per generation so that
  num_items_in_batch rescaling matters, SGD so that any loss scale shows) ends with the same
  parameters as TRL's trainer from the same seed;
- the unsupported features fall back to TRL's loss with one warning; the examples run.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import triton_unavailable

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from trl_harness import CASES, REPO, B, P, T, assert_same, make_batch, make_trainer, run_both  # noqa: E402

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402
from grpo_kernels.trl.trainer import _adapter_on_head_allowed  # noqa: E402
from grpo_train.tiny import build_tokenizer, save_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("cfg", CASES.values(), ids=CASES.keys())
def test_compute_loss_matches_trl(model_dir, cfg):
    assert_same(*run_both(model_dir, **cfg))


def test_lora_head_matches_trl_loss_on_the_models_own_logits(model_dir):
    """PEFT LoRA on lm_head: TRL 1.16's own fused head reads lm_head.weight and leaves the
    adapter out, so the truth here is TRL's `_compute_loss` on log-probs from the wrapped
    model's real logits. Ours must match it and train the head's adapter."""
    peft = pytest.importorskip("peft")
    from grpo_kernels.reference import logprobs_from_logits

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                           init_lora_weights=False)
    cfg = dict(loss_type="dapo", beta=0.04, entropy_coef=0.05, temperature=0.9)
    with _adapter_on_head_allowed():  # TRL refuses the adapter; its loss math is what we need
        ref = make_trainer(trl.GRPOTrainer, model_dir, peft_config=lora, **cfg)
    ours = make_trainer(GRPOTrainer, model_dir, peft_config=lora, **cfg)
    ref.model.load_state_dict(ours.model.state_dict())

    def scoring(model, input_ids, attention_mask, logits_to_keep, **_):
        logits = model(input_ids=input_ids, attention_mask=attention_mask,
                       logits_to_keep=logits_to_keep + 1).logits[:, :-1]
        logp, ent = logprobs_from_logits(logits, input_ids[:, -logits_to_keep:],
                                         temperature=0.9, return_entropy=True)
        return logp, ent, None

    ref._get_per_token_logps_and_entropies = scoring
    for tr in (ref, ours):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 2
    inputs = make_batch(ref)
    loss_ref = ref._compute_loss(ref.model, inputs)
    loss_ref.backward()
    with force_backend("chunked"):
        loss = ours._compute_loss(ours.model, inputs)
        loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-7)
    trained = {n: p for n, p in ref.model.named_parameters() if p.requires_grad}
    head = [n for n in trained if "lm_head.lora_" in n]
    assert len(head) == 2
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name: f"grad of {n}: {m}")
            assert name not in head or q.grad.abs().sum() > 0, name


def test_lora_head_with_fp32_cast_or_dora_is_refused(model_dir):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, target_modules=["lm_head"])
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32"):
        make_trainer(GRPOTrainer, model_dir, peft_config=lora, cast_lm_head_to_fp32=True)
    # an adapter the fused head cannot reproduce is an error naming the module, not TRL's
    # fallback (whose head code would leave it untrained)
    dora = peft.LoraConfig(r=2, target_modules=["lm_head"], use_dora=True)
    with pytest.raises(ValueError, match="lm_head carries a LoRA variant"):
        make_trainer(GRPOTrainer, model_dir, peft_config=dora)


def test_triton_kernels_match_trl(model_dir):
    """The log-probs through the Triton kernels (Triton's interpreter on CPU)."""
    if (why := triton_unavailable()) is not None:
        pytest.skip(why)
    assert_same(*run_both(model_dir, backend="triton", loss_type="dapo", beta=0.04,
                          entropy_coef=0.05))
    # grad_filter reaches the kernel: eps = 0 drops only all-zero tiles, so it stays exact
    assert_same(*run_both(model_dir, backend="triton", patch={"_grad_filter": 0.0},
                          loss_type="dapo", beta=0.04, entropy_coef=0.05))


def test_bad_grad_filter_fails_before_loading_the_model():
    with pytest.raises(ValueError, match="grad_filter must be"):
        GRPOTrainer(model="/nonexistent/model", grad_filter="fast")


def test_tool_mask_vllm_ratio_and_eval_mode(model_dir):
    g = torch.Generator().manual_seed(7)
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[0, 2:4] = 0  # tool output inside a completion: attended to, not trained on
    extra = dict(tool_mask=tool_mask,
                 importance_sampling_ratio=torch.rand(B, T, generator=g) + 0.5)
    # vLLM is not installed here: switch its correction on after construction, as TRL reads it
    patch = dict(use_vllm=True, vllm_importance_sampling_correction=True)
    assert_same(*run_both(model_dir, patch=patch, extra=extra, loss_type="dapo", beta=0.04))
    assert_same(*run_both(model_dir, mode="eval", loss_type="cispo"), mode="eval")


_VLLM = dict(use_vllm=True, vllm_importance_sampling_correction=True)
_g = torch.Generator().manual_seed(11)
BATCH_FORMS = {
    # TRL's default schedule (num_iterations 1, steps_per_generation <= accumulation steps)
    # scores no old policy: the batch has no old_per_token_logps, the ratio is 1 with the
    # gradient of the current policy, and the off-policy mask drifts from the current policy
    "no-old-logps": dict(drop=("old_per_token_logps",), loss_type="dapo", beta=0.04,
                         off_policy_mask_threshold=0.05, entropy_coef=0.1),
    "no-old-logps-vllm": dict(drop=("old_per_token_logps",), loss_type="grpo", patch=_VLLM,
                              extra=dict(importance_sampling_ratio=torch.rand(B, T, generator=_g)
                                         + 0.5)),
    # TRL's default vllm_importance_sampling_mode ("sequence_mask") gives one ratio a sequence
    "vllm-sequence-ratio": dict(loss_type="bnpo", beta=0.04, patch=_VLLM, extra=dict(
        importance_sampling_ratio=torch.rand(B, 1, generator=_g) + 0.5)),
    "vllm-sequence-ratio-gspo": dict(loss_type="grpo", importance_sampling_level="sequence",
                                     noise=1.0, patch=_VLLM, extra=dict(
                                         importance_sampling_ratio=torch.rand(B, 1, generator=_g)
                                         + 0.5)),
    # advantages per token ([B, T], as TRL's subclasses may give them)
    "token-advantages": dict(loss_type="grpo", beta=0.04, extra=dict(
        advantages=torch.randn(B, T, generator=_g))),
    "token-advantages-cispo": dict(loss_type="cispo", epsilon_high=1.2, extra=dict(
        advantages=torch.randn(B, T, generator=_g))),
}


@pytest.mark.parametrize("cfg", BATCH_FORMS.values(), ids=BATCH_FORMS.keys())
def test_batch_forms_of_trl_match_trl(model_dir, cfg):
    assert_same(*run_both(model_dir, **cfg))


def test_old_and_ref_scoring_match_trl(model_dir):
    ref, ours = make_trainer(trl.GRPOTrainer, model_dir), make_trainer(GRPOTrainer, model_dir)
    batch = make_batch(ref)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad(), force_backend("chunked"):
        want = ref._get_per_token_logps_and_entropies(ref.model, ids, am, T, compute_entropy=True)
        got = ours._get_per_token_logps_and_entropies(ours.model, ids, am, T, batch_size=3,
                                                      compute_entropy=True)
    assert got[2] is None and not got[0].requires_grad
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert (got[0][batch["completion_mask"] == 0] == 0).all()  # TRL's zero padding


def test_unsupported_features_fall_back_to_trl_with_one_warning(model_dir):
    # every TRL 1.16 loss option runs on our route (tests/trl/test_trl_loss_options.py); what still
    # falls back to TRL's loss math is a setting TRL takes and GRPOParams refuses (TRL floors
    # vespo's lambda at 1e-4, GRPOParams asks for > 0)
    for cfg in (dict(loss_type="vespo", vespo_lambda_pos=0.0),):
        ref, ours = make_trainer(trl.GRPOTrainer, model_dir, **cfg), make_trainer(
            GRPOTrainer, model_dir, **cfg)
        for tr in (ref, ours):
            tr.model.train()
            tr.current_gradient_accumulation_steps = 2
        inputs = make_batch(ref)
        with pytest.warns(UserWarning, match="rejects this configuration"):
            with force_backend("chunked"):
                loss = ours._compute_loss(ours.model, inputs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second call is silent
            with force_backend("chunked"):
                ours._compute_loss(ours.model, inputs)
        torch.testing.assert_close(loss, ref._compute_loss(ref.model, inputs), rtol=1e-5,
                                   atol=1e-7)


def save_softcap_model(path, softcap: float = 0.5) -> None:
    """A tiny Gemma-2 that soft-caps its logits (a cap that bends them: head weights scaled up
    to logits of a few units) and its tokenizer, written to `path`."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        final_logit_softcapping=softcap))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def save_unknown_transform_model(path) -> None:
    """A tiny Qwen2 whose config names a logit divisor (logits_scaling) that Qwen2's forward does
    not apply: the head check finds the logits are not the transform's, so TRL's own
    implementation must run."""
    import json
    from pathlib import Path

    save_tiny_model(str(path), hidden_size=32, num_layers=1)
    config = json.loads((Path(path) / "config.json").read_text())
    (Path(path) / "config.json").write_text(json.dumps({**config, "logits_scaling": 4.0}))


def test_unsupported_model_falls_back_to_trl_entirely(tmp_path):
    """A model whose logits are not its head's output under a known transform: TRL's own
    forward is used for the loss and for the log-probs, with one warning."""
    save_unknown_transform_model(tmp_path)
    with pytest.warns(UserWarning, match="logits are not those"):
        result = run_both(str(tmp_path), loss_type="dapo", beta=0.04)
    assert_same(*result)


@pytest.mark.parametrize("cfg", [dict(loss_type="dapo", beta=0.04),
                                 dict(loss_type="grpo", entropy_coef=0.1)], ids=["dapo", "grpo"])
def test_softcapped_model_runs_the_fused_path_and_matches_trl(tmp_path, cfg):
    """Gemma-2's final-logit soft-capping runs in the fused kernels (softcap=): TRL's own
    trainer (its fused head caps too) gives the same loss, gradients and metrics."""
    save_softcap_model(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning from ours
        ref, ours, loss_ref, loss = run_both(str(tmp_path), **cfg)
    assert ours._support.fallback is None and ours._layout != "padded"
    assert_same(ref, ours, loss_ref, loss)


@pytest.mark.parametrize("cfg", [dict(loss_type="dapo", beta=0.04),
                                 dict(loss_type="grpo", entropy_coef=0.05)], ids=["dapo", "grpo"])
def test_training_run_matches_trl(model_dir, cfg):
    runs = []
    for cls in (trl.GRPOTrainer, GRPOTrainer):
        trainer = make_trainer(cls, model_dir, max_steps=3, optim="sgd", learning_rate=0.1, **cfg)
        with force_backend("chunked"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs.append(trainer)
    ref, ours = runs
    logs = [h for h in ref.state.log_history if "loss" in h]
    assert len(logs) == 3
    # the batch had completions of different lengths, so every normalizer was exercised
    assert logs[0]["completions/min_length"] < logs[0]["completions/max_length"]
    for want, got in zip(logs, [h for h in ours.state.log_history if "loss" in h]):
        for k in ("loss", "grad_norm", "entropy", "clip_ratio/region_mean", "kl", "reward"):
            if k in want:
                assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (k, want["step"])
    moved = 0.0
    init = make_trainer(trl.GRPOTrainer, model_dir).model
    for p0, p, q in zip(init.parameters(), ref.model.parameters(), ours.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 1e-3  # training did change the parameters


def test_import_error_names_the_extra():
    code = ("import sys; sys.modules['trl'] = None\n"
            "import grpo_kernels, grpo_kernels.hf\n"
            "try:\n    import grpo_kernels.trl\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install grpo-kernels[trl]" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name,args", [("hf_plain_pytorch.py", []),
                                       ("trl_swap.py", ["--compare"])])
def test_example_runs(name, args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"  # see one_thread()
    out = subprocess.run([sys.executable, str(REPO / "examples" / name), *args],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done:" in out.stdout
    if "--compare" in args:  # the example's own parity report: float32-level differences
        line = next(x for x in out.stdout.splitlines() if x.startswith("vs trl.GRPOTrainer"))
        d_loss, d_param = (float(x.split()[-1].rstrip(",")) for x in line.split(", "))
        assert d_loss < 1e-5 and d_param < 1e-4, line


def test_fsdp2_sharded_head_runs_the_fused_path(tmp_path):
    """Unit level, one CPU process (gloo): a model sharded with FSDP2's fully_shard keeps its
    head as a DTensor shard outside a forward; `run_as_forward` runs the fused policy terms as a
    registered FSDP forward of the root, giving the unsharded model's loss and gradients. (The
    multi-process FSDP run is grpo_train's tests/train/test_train_fsdp.py; the TRL trainer under
    accelerate's FSDP2 is not run here.)"""
    import copy

    import torch.distributed as dist

    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "register_fsdp_forward_method") or dist.is_initialized():
        pytest.skip("needs torch >= 2.6 FSDP2 and no process group in this test process")
    from grpo_kernels.hf import completion_hidden_states, head_for
    from grpo_kernels.params import GRPOParams
    from grpo_kernels.trl import policy_terms, run_as_forward
    from grpo_train.tiny import build_tiny_model

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        base = build_tiny_model(build_tokenizer(), hidden_size=32, num_layers=2,
                                tie_word_embeddings=False, seed=1)
        sharded = copy.deepcopy(base)
        for layer in sharded.model.layers:
            fsdp.fully_shard(layer)
        fsdp.fully_shard(sharded)
        assert type(sharded.lm_head.weight).__name__ == "DTensor"
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(8, 100, (B, P + T), generator=g)
        am = torch.ones_like(ids)
        am[1, -3:] = 0
        adv, mask = torch.randn(B, 1, generator=g), am[:, -T:].float()
        params = GRPOParams(loss_type="dapo", beta=0.0)

        seen = []

        def terms(model):
            hidden = completion_hidden_states(model, ids, am, T)
            hidden, weight, bias = head_for(hidden, model)
            seen.append(type(weight).__name__)
            return policy_terms(hidden, weight, bias, ids[:, -T:], mask, adv, None, None, params)

        with force_backend("chunked"):
            want = run_as_forward(base, terms)[0]
            want.backward()
            got = run_as_forward(sharded, terms)[0]
            got.backward()
        # inside the registered forward FSDP had unsharded the head: a plain [V, D] parameter
        assert seen[-1] != "DTensor" and type(sharded.lm_head.weight).__name__ == "DTensor"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for (name, p), q in zip(base.named_parameters(), sharded.parameters()):
            torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=name: f"grad of {n}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("loss_type", ["gmpo", "dppo"])
def test_loss_types_trl_lacks_are_refused_by_name(model_dir, loss_type):
    """gmpo and dppo are grpo_kernels' own: TRL's trainer has no such loss type, so the
    subclass refuses them at construction, naming TRL's types, before loading anything."""
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}' is not one of TRL 1.16's"):
        make_trainer(GRPOTrainer, model_dir, loss_type=loss_type)
