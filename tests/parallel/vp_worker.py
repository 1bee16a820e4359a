"""One rank of the vocabulary-parallel tests (torchrun, gloo): `vp_worker.py SUITE OUT_DIR`.

Suites:
    exact   every case of `vp_cases` on this rank's shard (local form with vocab_group=, or a
            DTensor with Shard(0)); writes its errors against the float64 truth and PyTorch's
            float32 error (`vp_cases.errors`)
    mesh    a 2-D mesh (data x tensor, 4 ranks): each data rank's half of a global batch on its
            tensor group, the loss and gradients summed over the data dimension, against the
            whole head on the whole batch
    errors  bad inputs on one rank or all: every rank's exception (type, message)
    dominated  rows dominated by one token: this rank's errors against a float64 truth, and
            PyTorch's float32 error

Writes OUT_DIR/<suite>-rank<R>.json. A rank that aborts prints every thread's stack
(faulthandler); the tests run this under a timeout, so a hang fails instead of blocking.
"""

import datetime
import faulthandler
import json
import logging
import os
import sys
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
sys.path[:0] = [HERE, TESTS, os.path.join(TESTS, "api"), os.path.dirname(TESTS)]
faulthandler.enable()
warnings.simplefilter("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's GPU numerics, as in the tests
    from conftest import patch_interpreter  # noqa: E402

    patch_interpreter()

import vp_cases as vc  # noqa: E402
from mp_launch import leave_after_barrier  # noqa: E402

import grpo_kernels  # noqa: E402
from grpo_kernels import force_backend, fused_linear_grpo_loss, reference  # noqa: E402


def shard_head(weight, bias, form, rank, tp, mesh):
    """(weight, bias, keywords) as this rank passes its shard."""
    if form == "dtensor":
        dt = [None if x is None else torch.nn.Parameter(distribute_tensor(x, mesh, [Shard(0)]))
              for x in (weight, bias)]
        return dt[0], dt[1], {}
    return vc.local_rows(weight, rank, tp), vc.local_rows(bias, rank, tp), dict(
        vocab_group=dist.group.WORLD)


class Routes(logging.Handler):
    """The route log lines (ops/route.py) of the calls in its block."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returns inside the block."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def exact(rank, tp):
    mesh = init_device_mesh("cpu", (tp,))
    out = {}
    log = logging.getLogger("grpo_kernels")
    log.setLevel(logging.INFO)
    for name, opts in vc.loss_cases(tp).items():
        batch = vc.make_inputs(opts)
        w, b, kw = shard_head(batch["weight"], batch["bias"], opts.get("form"), rank, tp, mesh)
        routes = Routes()
        log.addHandler(routes)
        mine = vc.run_loss(opts, (w, b), **kw)
        log.removeHandler(routes)
        truth = vc.reference_of(opts, float64=True)
        diffs = vc.errors(mine, vc.torch_error(opts, truth, rank, tp), truth, rank, tp)
        # the values themselves, to compare across ranks; the route the call logged (a line is
        # logged the first time a (route, reason) is taken in the process)
        diffs["_values"] = [float(mine["loss"])] + [float(v.double().sum())
                                                      for v in mine["metrics"].values()]
        diffs["_routes"] = routes.lines
        out["loss/" + name] = diffs
    # the largest tensor of a call, forward and backward, on each route (chunked backend)
    for three in (False, True):
        opts = dict(backend="chunked", loss_type="dapo", level="token", three_pass=three)
        batch = vc.make_inputs(opts)
        w, b, kw = shard_head(batch["weight"], None, "local", rank, tp, mesh)
        with LargestTensor() as seen:  # inputs made beforehand (they use the whole head)
            vc.run_loss(opts, (w, b), batch=batch, **kw)
        out[f"largest/{'three' if three else 'four'}"] = seen.largest
    for name, opts in vc.logprob_cases().items():
        batch = vc.make_inputs(dict(opts, bias=True))
        w, b, kw = shard_head(batch["weight"], batch["bias"], opts["form"], rank, tp, mesh)
        routes = Routes()
        log.addHandler(routes)
        mine = vc.run_logprobs(opts, (w, b), **kw)
        log.removeHandler(routes)
        truth = vc.reference_of(opts, float64=True)
        out["logprobs/" + name] = vc.errors(mine, vc.torch_error(opts, truth, rank, tp), truth,
                                            rank, tp)
        out["logprobs/" + name]["_routes"] = routes.lines
    return out


def mesh_2d(rank, world):
    """dp = 2 x tp = 2: data rank d takes sequences [d·B/2, (d+1)·B/2) of a global batch of 4."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {f"{backend}-{'three' if three else 'four'}": _mesh_case(mesh, backend, three)
            for backend, three in (("chunked", False), ("chunked", True), ("triton", True))}


def _mesh_case(mesh, backend: str, three: bool) -> dict:
    """{quantity: (error, PyTorch's float32 error, magnitude)} of the loss summed over the data
    dimension, this rank's d hidden rows and d W summed over it, against PyTorch's float64
    reference on the whole batch (`vp_cases.errors`, `torch_error`'s yardstick)."""
    dp, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    g = torch.Generator().manual_seed(7)
    Bg, T, D, V = 4, 5, 16, 37
    hidden = torch.randn(Bg, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5
    ids = torch.randint(0, V, (Bg, T), generator=g)
    adv = torch.randn(Bg, generator=g)
    mask = (torch.rand(Bg, T, generator=g) > 0.2).float()
    os.environ["GRPO_KERNELS_THREE_PASS"] = "1" if three else "0"
    rows = slice(dp * Bg // 2, (dp + 1) * Bg // 2)

    def loss_of(fn, h, w, ids, rows):  # dapo: every data rank divides by the global token count
        return fn(h, w, ids[rows], adv[rows].to(h.dtype), mask[rows].to(h.dtype),
                  num_items_in_batch=mask.sum(), loss_type="dapo")[0]

    def whole(batch):  # PyTorch's reference on the whole batch
        h, w = (batch[k].clone().requires_grad_() for k in ("hidden", "weight"))
        loss = loss_of(reference.fused_linear_grpo_loss, h, w, batch["ids"], slice(0, Bg))
        loss.backward()
        return dict(loss=loss.detach(), d_hidden=h.grad[rows], d_weight=w.grad)

    batch = dict(hidden=hidden, weight=weight, bias=None, ids=ids)
    truth = whole({k: v.double() if k in ("hidden", "weight") else v for k, v in batch.items()})
    yardstick = {}
    for draw in range(4):
        out = vc.in_another_order(whole, batch, draw)
        for k in ("loss", "d_hidden", "d_weight"):
            cut = vc.local_rows if k == "d_weight" else lambda x, *_: x
            yardstick[k] = max(yardstick.get(k, 0.0),
                               vc._diff(cut(out[k], tp_rank, 2), cut(truth[k], tp_rank, 2))[0])
    h = hidden[rows].clone().requires_grad_()
    w = torch.nn.Parameter(distribute_tensor(weight, mesh, [Replicate(), Shard(0)]))
    with force_backend(backend):
        loss = loss_of(fused_linear_grpo_loss, h, w, ids, rows)
    loss.backward()
    dp_group = mesh.get_group("dp")
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp_group)
    d_w = w.grad.to_local().clone()
    dist.all_reduce(d_w, group=dp_group)  # the data-parallel gradient sum
    mine = dict(loss=total, d_hidden=h.grad, d_weight=d_w)
    return vc.errors(mine, yardstick, truth, tp_rank, 2)


def errors(rank, tp):
    """Each case's exception on this rank: (type name, message), or None if nothing raised."""
    mesh = init_device_mesh("cpu", (tp,))
    opts = dict(backend="chunked", loss_type="dapo", level="token")
    base = vc.make_inputs(opts)
    group = dict(vocab_group=dist.group.WORLD)

    def call(batch, weight, bias=None, **kw):
        return fused_linear_grpo_loss(batch["hidden"], weight, batch["ids"], batch["adv"],
                                      batch["mask"], bias=bias, **kw)

    def with_(**changes):
        return dict(base, **changes)

    local_w = vc.local_rows(base["weight"], rank, tp)
    cases = {
        # rank 1's shard has another hidden size (its hidden states too): the group disagrees
        "hidden_size": lambda: call(
            with_(hidden=base["hidden"][..., :12]) if rank == 1 else base,
            local_w[:, :12] if rank == 1 else local_w, **group),
        "dtensor_wrong_dim": lambda: call(base, torch.nn.Parameter(distribute_tensor(
            base["weight"], mesh, [Shard(1)]))),
        "target_out_of_range": lambda: call(
            with_(ids=base["ids"].masked_fill(torch.eye(vc.B, vc.T).bool(), vc.V)), local_w,
            **group),
        "hidden_differs": lambda: call(
            with_(hidden=base["hidden"] + (1e-3 if rank == 1 else 0.0)), local_w, **group),
        "targets_differ": lambda: call(
            with_(ids=(base["ids"] + rank) % vc.V), local_w, **group),
        "tokens_differ": lambda: call(
            with_(hidden=base["hidden"][:, :4], ids=base["ids"][:, :4],
                  mask=base["mask"][:, :4]) if rank == 0 else base, local_w, **group),
        "local_error_on_rank0": lambda: call(
            with_(adv=base["adv"][:2]) if rank == 0 else base, local_w, **group),
        "empty_shard": lambda: call(base, local_w[:0] if rank == 1 else local_w, **group),
        # the same values in other places: the checksums must see positions, not only values
        "mask_padded_other_side": lambda: call(
            with_(mask=base["mask"].flip(1)) if rank == 1 else base, local_w, **group),
        "targets_permuted": lambda: call(
            with_(ids=base["ids"].roll(1, 1)) if rank == 1 else base, local_w, **group),
        "hidden_rows_swapped": lambda: call(
            with_(hidden=base["hidden"].flip(0)) if rank == 1 else base, local_w, **group),
        # hyperparameters differ: another temperature, or another route on rank 1
        "temperature_differs": lambda: call(base, local_w, temperature=1.0 + 0.5 * rank,
                                            **group),
        "loss_type_differs": lambda: call(
            base, local_w, **group, **(dict(loss_type="grpo", importance_sampling_level=
                                            "sequence") if rank == 1 else {})),
        # a hyperparameter that rank 1 alone rejects: raised in the agreement, not before it
        "bad_hyperparameter_on_rank1": lambda: call(
            base, local_w, loss_type="dapoo" if rank == 1 else "dapo", **group),
        # a float32 shard (a mixed head) on rank 1 only: its backward's all-reduce would differ
        "weight_dtype_differs": lambda: call(
            with_(hidden=base["hidden"].bfloat16()),
            local_w if rank == 1 else local_w.bfloat16(), **group),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            out[name] = [type(exc).__name__, str(exc)]
        dist.barrier()  # the next case starts with every rank past this one
    # and the group still works: a good call after the bad ones
    out["good_after"] = float(call(base, local_w, **group)[0])
    return out


def dominated(rank, tp):
    """Each dominated case (`vp_cases.dominated_cases`) on this rank's shard: {case: {quantity:
    (error, PyTorch's float32 error)}}, against the float64 truth (this rank's rows of d W)."""
    out = {}
    for name, opts in vc.dominated_cases().items():
        hidden, weight, _, _ = vc.dominated_head(opts)
        mine = vc.run_dominated(opts, grpo_kernels, hidden, vc.local_rows(weight, rank, tp),
                                vocab_group=dist.group.WORLD)
        truth = vc.run_dominated(opts, reference, hidden.double(), weight.double())
        torch32 = vc.run_dominated(opts, reference, hidden, weight)
        out[name] = {}
        for k, true in truth.items():
            cut = (lambda x: vc.local_rows(x, rank, tp)) if k == "d_weight" else (lambda x: x)
            out[name][k] = (vc._diff(mine[k], cut(true))[0],
                            vc._diff(cut(torch32[k]), cut(true))[0])
    return out


def main():
    suite, out_dir = sys.argv[1], sys.argv[2]
    # the errors suite's calls are tiny: a rank left waiting in a collective (the bug those
    # cases look for) raises gloo's timeout there, which the test reports, instead of a hang
    timeout = dict(timeout=datetime.timedelta(seconds=120)) if suite == "errors" else {}
    dist.init_process_group("gloo", **timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    try:
        result = {"exact": exact, "mesh": mesh_2d, "errors": errors,
                  "dominated": dominated}[suite](rank, world)
    except Exception:
        traceback.print_exc()
        raise
    with open(os.path.join(out_dir, f"{suite}-rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    leave_after_barrier()  # mp_launch: gloo's teardown


if __name__ == "__main__":
    main()
