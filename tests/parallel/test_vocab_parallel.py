"""Vocabulary-parallel heads on several CPU processes (torchrun, gloo; `vp_worker.py`): loss,
metrics and gradients of tp = 2 and 4 shards equal the whole head's on one process (every loss
type at every level, both routes, both backends with Triton in its interpreter, packed rows,
the entropy bonus, temperatures, biases, mixed heads, both forms of the shard); a 2 x 2 mesh
(data x tensor) equals one process on the same global batch; bad inputs raise on every rank,
and no rank waits forever (each run has a timeout)."""

import json
from pathlib import Path

import pytest
import torch
import vp_cases as vc
from mp_launch import torchrun

from grpo_kernels.parallel.combine import STATS_ROWS

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow  # several processes, a few tens of seconds each


def run_suite(suite: str, nproc: int, out: Path) -> list[dict]:
    """Every rank's results of one worker suite."""
    torchrun(HERE / "vp_worker.py", nproc, suite, str(out))
    return [json.loads((out / f"{suite}-rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def exact2(tmp_path_factory):
    return run_suite("exact", 2, tmp_path_factory.mktemp("exact2"))


@pytest.fixture(scope="module")
def exact4(tmp_path_factory):
    return run_suite("exact", 4, tmp_path_factory.mktemp("exact4"))


# The bound on a loss case's quantities (loss, metrics, gradients): this route's error against
# a float64 truth (PyTorch's reference in float64) within K times PyTorch's own float32 error
# (`vp_cases.torch_error`: the largest over a few equally valid float32 evaluation orders, so
# that one lucky rounding does not set the bar) plus a floor of FLOOR_ULPS float32 roundings at
# the quantity's magnitude: a float32 result is rounded at its magnitude at least once (half an
# ulp), and a sum's last additions round there too, so no float32 computation can be held to
# less. K: the whole head on one process is within 3.6x of PyTorch on these cases (vespo's
# sequence-level gradients, where a sum over the sequence's tokens cancels), so 4.
K, FLOOR_ULPS = 4.0, 4.0
EPS32 = torch.finfo(torch.float32).eps


def _check(results: list[dict], key: str, mixed: bool, backend: str) -> None:
    """Each quantity's largest error over every rank (over every rank's rows of d W and d b)
    within K·PyTorch's float32 error + FLOOR_ULPS·eps·max|truth|. A mixed head's (bfloat16
    hidden states): their gradient is rounded to bfloat16 (2^-9 relative) once, and on Triton
    once more per rank (its partial sums travel in bfloat16): (tp + 1)·2^-9 of its magnitude
    more; and on Triton, whose split dot reads the float32 weight in two bfloat16 pieces,
    1e-4 of each quantity's magnitude more, the bound the whole head is held to
    (tests/api/test_fused_linear_grpo.py, test_mixed_head_precision)."""
    tp = len(results)
    for what in results[0][key]:
        if what.startswith("_"):
            continue
        ours, torch32, scale = (max(r[key][what][i] for r in results) for i in range(3))
        floor = FLOOR_ULPS * EPS32 * scale
        if mixed and what == "d_hidden":
            floor += (tp + 1) * 2.0**-9 * scale
        if mixed and backend == "triton":
            floor += 1e-4 * scale
        assert ours <= K * torch32 + floor, (
            f"{key}, {what}: error {ours:.3g} against float64 (magnitude {scale:.3g}); "
            f"PyTorch float32's {torch32:.3g}, bound {K * torch32 + floor:.3g}")


def _check_case(results, tp: int, name: str) -> None:
    opts = vc.loss_cases(tp)[name]
    key = "loss/" + name
    _check(results, key, opts.get("mixed", False), opts["backend"])
    values = [r[key]["_values"] for r in results]
    assert all(v == values[0] for v in values), f"ranks disagree on {name}: {values}"
    routes = [line for r in results for line in r[key]["_routes"]]
    assert all("vocabulary-parallel head" in line for line in routes), routes


@pytest.mark.parametrize("name", list(vc.loss_cases(2)))
def test_loss_tp2_equals_whole_head(exact2, name):
    _check_case(exact2, 2, name)


@pytest.mark.parametrize("name", list(vc.loss_cases(4)))
def test_loss_tp4_equals_whole_head(exact4, name):
    _check_case(exact4, 4, name)


@pytest.mark.parametrize("name", list(vc.logprob_cases()))
@pytest.mark.parametrize("tp", [2, 4])
def test_selective_logprobs_equal_whole_head(exact2, exact4, tp, name):
    opts = vc.logprob_cases()[name]
    _check(exact2 if tp == 2 else exact4, "logprobs/" + name, opts["mixed"], opts["backend"])


def test_routes_are_logged_with_the_shards(exact2):
    """A token-level loss on GRPO_KERNELS_THREE_PASS=1 takes the three-pass route, and its log
    line names the vocabulary-parallel head and its form."""
    lines = {line for r in exact2 for case in r.values() if isinstance(case, dict)
             for line in case.get("_routes", ())}
    assert any("three-pass route: vocabulary-parallel head (a local shard with vocab_group=, "
               "2 shards)" in line for line in lines), lines
    assert any("three-pass route: vocabulary-parallel head (DTensor Shard(0) on a 1-D mesh"
               in line for line in lines), lines
    assert any("four-pass route: vocabulary-parallel head" in line and "sequence-level" in line
               for line in lines), lines
    assert any("selective log-probs on the four-pass route: vocabulary-parallel head" in line
               for line in lines), lines


@pytest.mark.parametrize("tp", [2, 4])
def test_no_rank_holds_tokens_by_vocabulary(exact2, exact4, tp):
    """The largest tensor any operator returns in a call (forward and backward, both routes)
    holds at most N x V_r elements, the shard's own logits: never N x V."""
    N, largest_shard = vc.B * vc.T, max(vc.shard_sizes(tp))
    stats = tp * STATS_ROWS * N  # every rank's gathered per-token statistics
    for r in exact2 if tp == 2 else exact4:
        for route in ("four", "three"):
            # (the hidden states [N, D] and their gradient are larger at tp = 4)
            assert r[f"largest/{route}"] <= max(N * largest_shard, N * vc.D, stats) < N * vc.V


@pytest.mark.parametrize("case", ["chunked-four", "chunked-three", "triton-three"])
def test_data_by_tensor_mesh_equals_one_process(tmp_path_factory, case, request):
    """The loss summed over the data dimension, d hidden and d W (summed over it) against
    PyTorch's float64 reference on the whole batch, within the loss cases' bound."""
    results = request.getfixturevalue("mesh")
    for rank, r in enumerate(results):
        for what, (ours, torch32, scale) in r[case].items():
            bound = K * torch32 + FLOOR_ULPS * EPS32 * scale
            assert ours <= bound, (rank, case, what, ours, torch32, bound)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    return run_suite("mesh", 4, tmp_path_factory.mktemp("mesh"))


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    return run_suite("errors", 2, tmp_path_factory.mktemp("errors"))


OTHER_RANK = "of the vocabulary group rejected its inputs"
ERRORS = {  # case: (rank 0's message part, rank 1's)
    "hidden_size": ("the hidden size D (weight.shape[1]) differs", None),
    "dtensor_wrong_dim": ("placements (Shard(dim=1),)", None),
    "target_out_of_range": ("token id 37 outside [0, 37) (vocabulary size = the sum of the 2 "
                            "shards' rows [19, 18])", None),
    "hidden_differs": ("hidden states differ between ranks 0 and 1", None),
    "targets_differ": ("completion_ids differ between ranks 0 and 1", None),
    "tokens_differ": ("the number of tokens N differs", None),
    "local_error_on_rank0": ("advantages must have shape", "rank 0 " + OTHER_RANK),
    "empty_shard": ("rank 1 " + OTHER_RANK, "weight must have at least one vocabulary row"),
    "mask_padded_other_side": ("mask differ between ranks 0 and 1", None),
    "targets_permuted": ("completion_ids differ between ranks 0 and 1", None),
    "hidden_rows_swapped": ("hidden states differ between ranks 0 and 1", None),
    "temperature_differs": ("the call's options (GRPO hyperparameters, temperature", None),
    "loss_type_differs": ("the call's options (GRPO hyperparameters, temperature", None),
    "bad_hyperparameter_on_rank1": ("rank 1 " + OTHER_RANK, "loss_type must be one of"),
    "weight_dtype_differs": ("the weight's dtype differs across the ranks of the vocabulary group: "
                             "['torch.bfloat16', 'torch.float32']", None),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_raises_on_every_rank(errors, case):
    for rank, expected in enumerate(ERRORS[case]):
        expected = expected or ERRORS[case][0]
        got = errors[rank][case]
        assert got is not None, f"rank {rank} raised nothing for {case}"
        assert expected in got[1], (rank, got)
    # the group still works after every bad call
    assert errors[0]["good_after"] == errors[1]["good_after"]
    assert torch.isfinite(torch.tensor(errors[0]["good_after"]))
