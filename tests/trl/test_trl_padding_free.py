"""Padding-free grpo_kernels.trl.GRPOTrainer: packed rows give TRL's padded results.

- one `_compute_loss` of the same batch, packed against padded (padding_free=False): loss, the
  gradient of every parameter and every logged metric agree to float32 rounding across the loss
  matrix, with a tool mask, with a LoRA adapter on the head; the packed forward really ran packed
  rows (no attention mask, fewer positions);
- scoring (old / reference log-probs and entropies) equals TRL's, on fewer positions;
- short training runs (num_iterations 2, steps_per_generation 4 != gradient_accumulation_steps 2,
  beta 0.04, the entropy bonus, torch.compile) end with the parameters of the padded run and of
  TRL's trainer; under two-process FSDP2 (gloo) packed scoring and loss equal the padded ones;
- where packing cannot be exact (a model that attends across packed sequences, absolute position
  embeddings under TRL's padded forward without position_ids, a completion mask that is not a
  prefix) the trainer runs padded and says why.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from trl_harness import (  # noqa: E402
    CASES,
    REPO,
    B,
    P,
    T,
    assert_same,
    make_batch,
    make_trainer,
    run_both,
)

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402
from grpo_kernels.trl.padding_free import packable  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BodyCalls:
    """Records every forward of a trainer's model body: (positions computed, attention_mask
    given); `rows` the batch sizes."""

    def __init__(self, trainer):
        self.calls: list[tuple[int, bool]] = []
        self.rows: list[int] = []
        body = trainer.model.get_base_model().model if hasattr(trainer.model, "get_base_model") \
            else trainer.model.model
        self.handle = body.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append((ids.numel(), kwargs.get("attention_mask") is not None))
        self.rows.append(ids.shape[0])

    @property
    def positions(self) -> int:
        return sum(n for n, _ in self.calls)


def loss_pair(model_dir, extra=None, noise=0.3, share_prompt=False, prompt_rows=None, **cfg):
    """(padded trainer, packed (or shared) trainer, padded loss, packed loss, their body calls)
    on one batch, after backward."""
    padded = make_trainer(GRPOTrainer, model_dir, padding_free=False, **cfg)
    packed = make_trainer(GRPOTrainer, model_dir, share_prompt=share_prompt, **cfg)
    inputs = {**make_batch(padded, noise=noise, prompt_rows=prompt_rows), **(extra or {})}
    out, calls = [], []
    for tr in (padded, packed):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 2
        calls.append(BodyCalls(tr))
        with force_backend("chunked"):
            loss = tr._compute_loss(tr.model, inputs)
            loss.backward()
        calls[-1].handle.remove()
        out.append(loss)
    return padded, packed, *out, calls


FLOAT32_CASES = {k: v for k, v in CASES.items() if "model_init_kwargs" not in v}


@pytest.mark.parametrize("cfg", FLOAT32_CASES.values(), ids=FLOAT32_CASES.keys())
def test_packed_loss_equals_padded(model_dir, cfg):
    padded, packed, loss_padded, loss_packed, (c_pad, c_pack) = loss_pair(model_dir, **cfg)
    assert_same(padded, packed, loss_padded, loss_packed)
    # the packed forward: rows without an attention mask, fewer rows than sequences (here the
    # rows are 16 wide, the longest sequence rounded up: as many positions as [B, P + T])
    assert c_pad.calls == [(B * (P + T), True)]
    assert len(c_pack.calls) == 1 and not c_pack.calls[0][1] and c_pack.rows[0] < B


@pytest.mark.parametrize("cfg", FLOAT32_CASES.values(), ids=FLOAT32_CASES.keys())
def test_shared_prompt_loss_equals_padded(model_dir, cfg):
    """Two prompts whose completions are apart in the micro-batch (as TRL's shuffle leaves
    them): each prompt is computed once, and loss, gradients and metrics are the padded ones."""
    padded, shared, loss_padded, loss_shared, (c_pad, c_sh) = loss_pair(
        model_dir, share_prompt=True, prompt_rows=torch.tensor([0, 2, 0, 2]), **cfg)
    assert shared._layout == "shared"
    assert_same(padded, shared, loss_padded, loss_shared)
    assert len(c_sh.calls) == 1 and c_sh.calls[0][1]  # one forward, with its 4-D mask
    assert c_sh.positions < c_pad.positions


def test_packed_loss_with_tool_mask_and_lora_head(model_dir):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                           init_lora_weights=False)
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[0, 2:4] = 0  # tool output inside the first completion: no loss there, but context
    result = loss_pair(model_dir, extra=dict(tool_mask=tool_mask), peft_config=lora,
                       loss_type="dapo", beta=0.04)
    assert_same(*result[:4])
    assert not result[4][1].calls[0][1]  # packed


def test_bf16_model_with_fp32_head_packed_within_bf16_rounding(model_dir):
    """A bf16 body rounds differently on packed rows (other shapes, other accumulation order):
    the packed loss is as close to TRL's as bf16 rounding allows, not bit-equal."""
    cfg = CASES["dapo-bf16-fp32head"] | dict(padding_free=True)
    ref = make_trainer(trl.GRPOTrainer, model_dir, **{k: v for k, v in cfg.items()
                                                      if k != "padding_free"})
    ours = make_trainer(GRPOTrainer, model_dir, **cfg)
    inputs = make_batch(ref)
    want = ref._compute_loss(ref.model, inputs)
    with force_backend("chunked"):
        got = ours._compute_loss(ours.model, inputs)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-4)


@pytest.mark.parametrize("share_prompt", [False, True], ids=["packed", "shared"])
def test_packed_scoring_equals_trl_on_fewer_positions(model_dir, share_prompt):
    tr = make_trainer(GRPOTrainer, model_dir, share_prompt=share_prompt)
    batch = make_batch(tr)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1).repeat(4, 1)  # 16 rows
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).repeat(4, 1)
    with torch.no_grad():
        want, want_ent, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            tr, tr.model, ids, am, T, batch_size=B, compute_entropy=True)
        calls = BodyCalls(tr)
        with force_backend("chunked"):
            got, got_ent, _ = tr._get_per_token_logps_and_entropies(
                tr.model, ids, am, T, batch_size=B, compute_entropy=True)
        calls.handle.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_ent, want_ent * am[:, -T:], rtol=1e-5, atol=1e-6)
    # TRL: 4 forwards of B x (P + T); packed: each forward at most that many positions, no more
    # forwards, fewer positions in all; shared (the 4 copies of each prompt share it): fewer
    # still, with the 4-D mask
    assert all(n <= B * (P + T) and masked == share_prompt for n, masked in calls.calls)
    assert len(calls.calls) <= 4 and calls.positions < 16 * (P + T)
    if share_prompt:
        real = int(am.sum())
        assert calls.positions < real  # below even the packed rows' real tokens


RUNS = {
    "iterations2-kl": dict(loss_type="dapo", beta=0.04, num_iterations=2),
    "grpo-entropy-seq": dict(loss_type="grpo", entropy_coef=0.05,
                             importance_sampling_level="sequence"),
    "bnpo-compiled": dict(loss_type="bnpo", beta=0.04, torch_compile=True,
                          torch_compile_backend="aot_eager"),
}


@pytest.mark.slow
@pytest.mark.parametrize("cfg", RUNS.values(), ids=RUNS.keys())
def test_training_run_packed_equals_padded_and_trl(model_dir, cfg):
    """3 optimizer steps (gradient accumulation 2, 4 micro-batches per generation): the packed
    and the shared-prompt runs end with the parameters and logs of the padded run and of TRL's
    trainer."""
    runs = {}
    for name, cls, extra in (("trl", trl.GRPOTrainer, {}),
                             ("padded", GRPOTrainer, dict(padding_free=False)),
                             ("packed", GRPOTrainer, dict(share_prompt=False)),
                             ("shared", GRPOTrainer, {})):
        trainer = make_trainer(cls, model_dir, max_steps=3, optim="sgd", learning_rate=0.1,
                               **cfg, **extra)
        with force_backend("chunked"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        runs[name] = trainer
    logs = {k: [h for h in t.state.log_history if "loss" in h] for k, t in runs.items()}
    assert runs["packed"]._layout == "packed" and runs["shared"]._layout == "shared"
    for mine in ("packed", "shared"):
        assert len(logs[mine]) == 3
        for name in ("padded", "trl"):
            for want, got in zip(logs[name], logs[mine]):
                for k in ("loss", "grad_norm", "entropy", "clip_ratio/region_mean", "kl"):
                    if k in want:
                        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (
                            mine, name, k)
            for p, q in zip(runs[name].model.parameters(), runs[mine].model.parameters()):
                torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


def test_packable_needs_prefix_completion_masks_and_a_prompt_token():
    am = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    assert packable(am, am[:, -3:])
    holed = am.clone()
    holed[0, 2:] = torch.tensor([1, 0, 1])  # a dropped token before a kept one
    assert not packable(holed, holed[:, -3:])
    no_prompt = torch.tensor([[0, 0, 1, 1, 0]])
    assert not packable(no_prompt, no_prompt[:, -3:])


def test_packing_off_is_said_once_and_batches_run_padded(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="grpo_kernels.trl.trainer"):
        off = make_trainer(GRPOTrainer, model_dir, padding_free=False)
        on = make_trainer(GRPOTrainer, model_dir)
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_kernels.trl.trainer"]
    assert lines == ["grpo_kernels.trl.GRPOTrainer: scoring and loss forwards run padded rows: "
                     "padding-free rows turned off (padding_free=False, share_prompt=True)",
                     "grpo_kernels.trl.GRPOTrainer: scoring and loss forwards run shared rows: "
                     "each group's prompt once (padding_free=True, share_prompt=True)"]
    assert off._layout == "padded" and on._layout == "shared"
    with pytest.raises(TypeError, match="padding_free must be a bool"):
        make_trainer(GRPOTrainer, model_dir, padding_free="yes")
    with pytest.raises(TypeError, match="share_prompt must be a bool"):
        make_trainer(GRPOTrainer, model_dir, share_prompt=1)


def test_model_attending_across_packed_rows_runs_padded(model_dir, monkeypatch, caplog):
    from grpo_kernels.hf import row_plan

    why = "ToyModel with attention 'eager' attends across the sequences of a packed row"
    monkeypatch.setattr(row_plan, "check_packed_attention", lambda model: why)
    # shared rows carry their own 4-D mask and would still be chosen where their check passes
    monkeypatch.setattr(row_plan, "check_shared_prompt", lambda model: "not exact here")
    with caplog.at_level(logging.WARNING, logger="grpo_kernels.trl.trainer"):
        tr = make_trainer(GRPOTrainer, model_dir)
    assert tr._layout == "padded"
    assert any(why in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    batch = make_batch(tr)
    calls = BodyCalls(tr)
    with force_backend("chunked"):
        tr._compute_loss(tr.model, batch)
    assert calls.calls == [(B * (P + T), True)]


@pytest.fixture(scope="module")
def position_model_dirs(tmp_path_factory):
    """Tiny random models saved with the tiny tokenizer: GPT-2 (learned absolute position
    embeddings) and Llama (rotary positions)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpo_train.tiny import build_tokenizer, save_tiny_model

    tok = build_tokenizer()
    gpt2 = tmp_path_factory.mktemp("tiny_gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # as Qwen2's: no dropout to match
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id)).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    llama = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_model(str(llama), arch="llama", hidden_size=32, num_layers=2)
    return {"gpt2": str(gpt2), "llama": str(llama)}


@pytest.mark.parametrize("arch, layout", [("gpt2", "padded"), ("llama", "shared")])
def test_absolute_positions_run_padded_and_equal_trl(position_model_dirs, arch, layout, caplog):
    """TRL's padded forward passes no position_ids: a left-padded prompt's positions start at
    its pad count, while packed and shared rows start every sequence at 0. GPT-2's learned
    position embeddings see the difference: the subclass runs padded rows and its one log line
    says why. Rotary (Llama) does not: shared rows. Both give TRL's loss, gradients, metrics
    and scoring on left-padded prompts."""
    with caplog.at_level(logging.INFO, logger="grpo_kernels.trl.trainer"):
        ref, ours, loss_ref, loss = run_both(position_model_dirs[arch])
    lines = [r.getMessage() for r in caplog.records if r.name == "grpo_kernels.trl.trainer"]
    assert ours._layout == layout and len(lines) == 1  # ours (TRL's trainer logs no layout)
    if layout == "padded":
        assert "padded rows: not packed: GPT2LMHeadModel reads other positions" in lines[0]
        assert caplog.records[-1].levelno == logging.WARNING
    assert_same(ref, ours, loss_ref, loss)
    batch = make_batch(ref)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    assert not bool(am[:, 0].all())  # left-padded prompts
    with torch.no_grad():
        want, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(ref, ref.model, ids,
                                                                        am, T)
        with force_backend("chunked"):
            got, _, _ = ours._get_per_token_logps_and_entropies(ours.model, ids, am, T)
    torch.testing.assert_close(got, want * am[:, -T:], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_two_processes_packed_equals_padded(model_dir, tmp_path):
    """Two processes (gloo): packed scoring and loss on an FSDP2-sharded policy equal the padded
    ones on the full model (gradients: the mean over processes, as FSDP reduces them). The ranks'
    batches pack into different numbers of scoring forwards; without pairing them up (the
    trainer's equal chunk count) the sharded forwards would wait on each other forever."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("needs torch's FSDP2 (fully_shard)")
    worker = Path(__file__).with_name("fsdp2_packed_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # PYTHONFAULTHANDLER: a rank that aborts prints every thread's Python stack
    env.update(GRPO_TEST_DIR=str(tmp_path), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), str(worker), model_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    written = sorted(p.name for p in tmp_path.glob("rank*.json"))
    assert proc.returncode == 0, f"results written: {written}\n{proc.stderr[-3000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["head_sharded"]
        assert r["scoring"] < 1e-5
        assert r["loss"] < 1e-6 * max(1.0, abs(r["loss_value"]))
        assert r["grad"] < 1e-5 * r["grad_scale"]
