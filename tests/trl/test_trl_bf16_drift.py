"""grpo_kernels.trl.GRPOTrainer against TRL 1.16's trainer under bf16, where the two differ.

With TRL's `bf16=True` (bf16 autocast over float32 weights on the CPU) or a bf16 model, and
without `cast_lm_head_to_fp32`, both heads multiply bf16 operands (the autocast dtype: what the
model's own lm_head multiplies), but TRL's head stores each logit in bf16 while ours keeps it in
float32. So the two trainers' log-probs (and losses) differ by bf16 rounding of the logits. The
test scores one batch three ways, on the hidden states both heads saw (a forward hook on the
body): TRL's trainer, ours, and the exact product of the same bf16 operands in float64. Ours must
be within float32 rounding of that truth and no further from it than TRL's; TRL's must differ
from ours by no more than bf16 rounding of the logits explains; the same for the loss, through
the float64 gradient of TRL's loss with respect to the log-probs. Scoring runs without autograd
and the loss with it (two routes), on the chunked path and on the Triton kernels (interpreter).
`-s` prints the errors.
"""

import pytest
import torch
from helpers import triton_unavailable

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from trl_harness import P, T, make_batch, make_trainer  # noqa: E402

from grpo_kernels import force_backend  # noqa: E402
from grpo_kernels.trl import GRPOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

U32, U16 = 2.0**-24, 2.0**-8  # unit roundoff (half the relative step) of float32 and bf16


def float32_bound(h, w, z, lse, logp):
    """Per-token bound [B, T] on a float32 log-prob's error from the exact value, for logits
    z = h @ w.T summed in float32 from bf16 operands (each product is exact in float32).

    h [B, T, D], w [V, D], z [B, T, V], lse, logp [B, T] (float64). Summing D products errs by
    at most D·u·Σ_i |h_i w_ji| per logit, and scaling into log2 units by u·|z_j|; a shift of
    every logit moves logp = z_t - lse(z) by at most twice the largest. The log-sum-exp sums V
    exponentials (relative error (V - 1)·u in any order, plus an ulp for each exp: V + 1 in
    all), its log and its conversion back from log2 units round (2·u·|lse|), and logp rounds
    once (u·|logp|)."""
    D, V = w.shape
    a = (h.abs() @ w.abs().T).amax(-1)  # max_j Σ_i |h_i w_ji|
    return U32 * (2 * D * a + 2 * z.abs().amax(-1) + V + 1 + 2 * lse.abs() + logp.abs())


def bf16_bound(z, targets):
    """Per-token bound [B, T] on what rounding every logit to bf16 does to a log-prob:
    |δz_j| <= 2^-8·|z_j| (round to nearest, 8 significant bits), and logp = z_t - lse(z), where
    lse(z + δ) - lse(z) is a convex combination of the δz_j (mean value theorem: softmax weights),
    so |δ logp| <= 2^-8·(|z_t| + max_j |z_j|). z [B, T, V] float64, targets [B, T]."""
    z_t = z.gather(-1, targets[..., None]).squeeze(-1)
    return U16 * (z_t.abs() + z.abs().amax(-1))


def truth(hidden, weight, targets):
    """float64 (z [B, T, V], lse, logp, entropy [B, T]) of the head on `hidden` [B, T, D] with
    both operands in bf16, as the two heads multiply them."""
    h = hidden.to(torch.bfloat16).double()
    w = weight.to(torch.bfloat16).double()
    z = h @ w.T
    lse = z.logsumexp(-1)
    logp = z.gather(-1, targets[..., None]).squeeze(-1) - lse
    p = torch.softmax(z, -1)
    return h, w, z, lse, logp, lse - (p * z).sum(-1)


# TRL's bf16=True on the CPU: bf16 autocast over the float32 weights; and a bf16 model. Ours
# runs padded (padding_free=False), as TRL's, so that both bodies give the same hidden states
BF16 = {
    "autocast-fp32-weights": dict(bf16=True),
    "bf16-weights": dict(bf16=True, model_init_kwargs={"dtype": "bfloat16"}),
}


@pytest.mark.parametrize("backend", ["chunked", "triton"])  # triton: its interpreter on CPU
@pytest.mark.parametrize("cfg", BF16.values(), ids=BF16.keys())
def test_bf16_logits_drift_from_trl_is_bf16_rounding_and_ours_is_float32(model_dir, cfg,
                                                                          backend):
    if backend == "triton" and (why := triton_unavailable()) is not None:
        pytest.skip(why)
    kw = dict(loss_type="dapo", beta=0.04, padding_free=False, **cfg)
    ref, ours = make_trainer(trl.GRPOTrainer, model_dir, **kw), make_trainer(GRPOTrainer,
                                                                             model_dir, **kw)
    seen = []  # the body's output [B, P + T, D] on every forward: what each head was given
    for tr in (ref, ours):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 2
        tr.model.base_model.register_forward_hook(
            lambda mod, args, out: seen.append(out.last_hidden_state.detach().clone()))
    inputs = make_batch(ref)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    am = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    mask = inputs["completion_mask"].bool()
    with force_backend(backend):
        with torch.no_grad():  # scoring, as TRL scores old and reference log-probs
            lp_trl = ref._get_per_token_logps_and_entropies(ref.model, ids, am, T)[0].double()
            lp_ours = ours._get_per_token_logps_and_entropies(ours.model, ids, am, T)[0].double()
        # the loss with autograd on: the training route (another route than scoring's)
        loss_trl = ref._compute_loss(ref.model, inputs).detach().double()
        loss_ours = ours._compute_loss(ours.model, inputs).detach().double()
    assert len(seen) == 5 and all(torch.equal(s, seen[0]) for s in seen)  # make_batch's too
    # position P - 1 + t predicts completion token t
    targets = inputs["completion_ids"]
    h, w, z, lse, lp, ent = truth(seen[0][:, P - 1:-1], ref.model.lm_head.weight.detach(),
                                  targets)
    lp = lp * mask

    b32 = float32_bound(h, w, z, lse, lp)[mask]
    b16 = bf16_bound(z, targets)[mask]
    err_trl, err_ours = (lp_trl - lp)[mask].abs(), (lp_ours - lp)[mask].abs()
    drift = (lp_trl - lp_ours)[mask].abs()
    # (a) ours: float32 rounding of the exact head, and no further from it than TRL's
    assert (err_ours <= b32).all(), f"ours vs float64: {err_ours.max():.3g} > {b32.min():.3g}"
    assert err_ours.max() <= err_trl.max() + b32.max() and err_ours.mean() <= err_trl.mean()
    # TRL's head does round its logits to bf16 here: its error is past float32 rounding
    assert err_trl.max() > b32.max(), "TRL's log-probs are float32-accurate: update the docs"
    # (b) TRL against ours: bf16 rounding of the logits plus each side's float32 rounding
    assert (err_trl <= b16 + b32).all() and (drift <= b16 + 2 * b32).all(), (
        f"TRL vs ours: {drift.max():.3g}, bound {(b16 + 2 * b32).min():.3g}")

    # The loss: TRL's `_compute_loss` on the float64 log-probs, and its gradient g = dL/dlogp
    # [B, T]; a log-prob error e moves the loss by g·e to first order. 1e-6·|L| + 1e-7 is the
    # float32 loss math's own rounding (the harness's tolerance for the same log-probs)
    lp64 = lp.clone().requires_grad_(True)
    ref._get_per_token_logps_and_entropies = lambda *a, **k: (lp64, ent * mask, None)
    loss = ref._compute_loss(ref.model, inputs)
    loss.backward()
    g = lp64.grad.abs()[mask]
    slack = 1e-6 * loss.abs().item() + 1e-7
    assert abs(loss_ours - loss) <= (g * b32).sum() + slack, (loss_ours, loss)
    assert abs(loss_trl - loss_ours) <= (g * (b16 + 2 * b32)).sum() + 2 * slack, (loss_trl,
                                                                                    loss_ours)
    rel = lambda x: abs(x / loss.item() - 1).item()  # noqa: E731 - relative loss error
    dtype = next(ours.model.parameters()).dtype
    print(f"{dtype} weights, {backend}: |logp| <= {lp[mask].abs().max():.2f}, "
          f"|z| <= {z.abs().max():.2f}; "
          f"log-prob error vs float64: TRL {err_trl.max():.3g}, ours {err_ours.max():.3g} "
          f"(float32 bound {b32.min():.3g}-{b32.max():.3g}); loss {loss.item():.6g}, relative "
          f"error: TRL {rel(loss_trl):.3g}, ours {rel(loss_ours):.3g}")
