"""One rank of the Hugging Face tensor-parallel tests (torchrun, gloo):
`tp_model_worker.py OUT_DIR MODEL_DIR...`.

Loads each MODEL_DIR twice: with transformers' tensor parallelism (tp_plan="auto": the head's weight
a DTensor with Shard(0)) and whole, in this process. Runs `causal_lm_grpo_loss` and
`causal_lm_logprobs` on both, padded and packed rows, and writes the differences of loss,
metrics, log-probs and every parameter's gradient, and how often the tensor-parallel model's
gathering head ran during those calls, to OUT_DIR/hf-rank<R>.json ({model dir name: results}).
"""

import faulthandler
import json
import os
import sys
import warnings

faulthandler.enable()
warnings.simplefilter("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mp_launch import leave_after_barrier  # noqa: E402

from grpo_kernels import FusedLinearGRPOLoss, force_backend  # noqa: E402
from grpo_kernels.hf import (  # noqa: E402
    causal_lm_grpo_loss,
    causal_lm_logprobs,
    check_output_head,
    pack_sequences,
)


def batch(vocab: int):
    g = torch.Generator().manual_seed(3)
    B, Lp, T = 3, 4, 5
    ids = torch.randint(1, vocab, (B, Lp + T), generator=g)
    attn = torch.ones(B, Lp + T, dtype=torch.long)
    attn[0, :2] = 0  # left padding
    mask = torch.ones(B, T)
    mask[1, 3:] = 0  # a short completion
    return ids, attn, T, mask, torch.randn(B, generator=g)


def run(model, ids, attn, T, mask, adv, packed: bool):
    """(loss, metrics, log-probs, ref log-probs) of one call of each helper."""
    loss_fn = FusedLinearGRPOLoss(beta=0.04, loss_type="dapo", entropy_coef=0.01)
    with force_backend("chunked"):
        if packed:
            pk = pack_sequences(ids, attn, T, mask)
            ref = causal_lm_logprobs(model, pk.input_ids, None, pk.logits_to_keep,
                                     position_ids=pk.position_ids) - 0.1
            loss, metrics = causal_lm_grpo_loss(
                model, pk.input_ids, None, pk.logits_to_keep, adv, ref_logps=ref,
                cu_seqlens=pk.cu_seqlens, position_ids=pk.position_ids, loss_fn=loss_fn)
            logp = pk.unpack(ref + 0.1)
        else:
            pos = (attn.cumsum(1) - 1).clamp(min=0)
            ref = causal_lm_logprobs(model, ids, attn, T, position_ids=pos) - 0.1
            loss, metrics = causal_lm_grpo_loss(model, ids, attn, T, adv, mask, ref_logps=ref,
                                                position_ids=pos, loss_fn=loss_fn)
            logp = ref + 0.1
        loss.backward()
    return loss.detach(), metrics, logp


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main():
    out_dir, model_dirs = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    results = {os.path.basename(d): compare(d) for d in model_dirs}
    with open(os.path.join(out_dir, f"hf-rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(results, fh)
    leave_after_barrier()  # mp_launch: gloo's teardown


def compare(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    tp_model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto")
    whole = AutoModelForCausalLM.from_pretrained(model_dir)
    result = {"head": type(tp_model.lm_head.weight).__name__,
              "placements": str(getattr(tp_model.lm_head.weight, "placements", None))}
    check_output_head(tp_model)  # the once-per-model check (one [1, 1, V] forward)
    calls = []
    tp_model.lm_head.register_forward_pre_hook(lambda *_: calls.append(1))
    inputs = batch(whole.config.vocab_size)
    for packed in (False, True):
        for m in (tp_model, whole):
            m.zero_grad(set_to_none=True)
        got = run(tp_model, *inputs, packed)
        want = run(whole, *inputs, packed)
        grads = {name: float((full(p.grad) - q.grad).abs().max() / q.grad.abs().max())
                 for (name, p), (_, q) in zip(tp_model.named_parameters(),
                                              whole.named_parameters())}
        result["packed" if packed else "padded"] = dict(
            loss=abs(float(got[0] - want[0])), loss_value=float(want[0]),
            metrics=max(abs(float(got[1][k] - want[1][k])) for k in want[1]),
            logp=float((got[2] - want[2]).abs().max()), grads=grads,
            rank_loss=float(got[0]))
    result["head_calls"] = len(calls)
    return result


if __name__ == "__main__":
    main()
