"""The GPU scripts' dry runs: `DRY_RUN=1 bash benchmarks/gpu_peers.sh` and `... gpu_session.sh`
run every step of the device run on the CPU at the synthetic heads and write the files a device
run writes, so a device call does not fail on something a CPU can catch. Each script runs once,
in a fresh process, as a user runs it; then its files are read. Also: the shared preamble
refuses two blocks of settings that drift apart, and PACK keeps every file in one archive."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 300  # each dry run must finish within 5 minutes on a 2-core machine



def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "PACK", "DRY_RUN", "OUT")}  # not this process's
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, Path]:
    """Both dry runs, at the same time (each runs its sweeps on one thread), into their own
    folders; both must exit 0 within LIMIT_S."""
    outs, procs = {}, {}
    deadline = time.monotonic() + LIMIT_S
    for script in ("gpu_peers.sh", "gpu_session.sh"):
        outs[script] = tmp_path_factory.mktemp(script.split(".")[0])
        procs[script] = subprocess.Popen(
            ["bash", f"benchmarks/{script}"], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=_env(DRY_RUN="1", OUT=str(outs[script])),
            start_new_session=True)  # its own process group: a timeout ends all of it
    failed = []
    for script, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            failed.append(f"{script}: over {LIMIT_S} s\n{output[-3000:]}")
            continue
        if proc.returncode != 0:
            failed.append(f"{script}: exit {proc.returncode}\n{output[-3000:]}")
    assert not failed, "\n".join(failed)
    return outs


@pytest.fixture(scope="module")
def peers(dry_runs) -> Path:
    return dry_runs["gpu_peers.sh"]


@pytest.fixture(scope="module")
def session(dry_runs) -> Path:
    return dry_runs["gpu_session.sh"]


def _steps(out: Path) -> list[str]:
    """steps.txt's lines without their "[Ns] " time stamp."""
    lines = (out / "steps.txt").read_text().splitlines()
    assert all(line.startswith("[") and "s] " in line for line in lines), lines
    return [line.split("s] ", 1)[1] for line in lines]


def _check_steps(out: Path, names: list[str], on_cpu: list[str]) -> None:
    steps = _steps(out)
    cut = [s for s in steps if "skipped" in s and "deadline" in s]
    assert not cut, f"the dry run ran out of its deadline (load {os.getloadavg()}): {steps}"
    starts = [next((i for i, s in enumerate(steps) if s.startswith(n)), None) for n in names]
    missing = [n for n, i in zip(names, starts) if i is None]
    assert not missing and starts == sorted(starts), (missing, steps)  # all, in order
    for name in on_cpu:  # the steps a CPU runs differently say how
        (line,) = [s for s in steps if s.startswith(name)]
        assert "[dry run: " in line, line
    assert "run: dry" in (out / "env.txt").read_text()


def _rows(out: Path, suffix: str = ".csv") -> list[dict]:
    (path,) = [p for p in (out / "results").glob("*.csv") if p.name.endswith(suffix)
               and (suffix != ".csv" or not p.name.endswith(
                   ("-profile.csv", "-row-tiles.csv", "-three-pass-knobs.csv")))]
    assert path.name.startswith("cpu-")
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _exit_zero(path: Path) -> None:
    assert path.read_text().rstrip().splitlines()[-1] == "exit 0", path.read_text()[-2000:]


def _check_rows(rows: list[dict]) -> None:
    """Every provider ran or said why it could not (CUDA only, not installed); none failed."""
    bad = [(r["provider"], r["mode"], r["status"]) for r in rows
           if r["status"] != "ok" and not r["status"].startswith("n/a: ")]
    assert not bad, bad


def _measured(rows, kernel, provider, mode) -> list[dict]:
    return [r for r in rows if (r["kernel"], r["provider"], r["mode"], r["status"])
            == (kernel, provider, mode, "ok")]


@pytest.mark.slow  # the script's dry run: a minute or two
def test_peers_dry_run_writes_every_step(peers):
    _check_steps(peers, ["environment", "install peers", "pytest", "sweep peers-main",
                         "profile", "three-pass-knobs", "sweep peers-heads",
                         "sweep peers-logits", "row-tiles", "sweep peers-long",
                         "sweep peers-short", "done"],
                 on_cpu=["environment", "pytest", "sweep peers-main", "profile",
                         "three-pass-knobs", "row-tiles", "sweep peers-short"])
    tests = (peers / "pytest.txt").read_text()
    assert " passed" in tests and " failed" not in tests, tests[-2000:]
    _exit_zero(peers / "pytest.txt")
    for name in ("peers-main", "peers-heads", "peers-logits", "peers-long", "peers-short"):
        assert (peers / f"{name}.md").read_text().startswith("| kernel | provider |"), name
        _exit_zero(peers / f"{name}.log")
    _exit_zero(peers / "profile.log")
    assert (peers / "row-tiles.md").read_text().startswith("| kernel | configuration |")
    _exit_zero(peers / "row-tiles.log")
    tiles = _rows(peers, "-row-tiles.csv")
    for kernel in ("forward", "backward"):  # the default and at least one candidate, all exact
        raced = [r for r in tiles if r["kernel"] == kernel]
        assert [r["default"] for r in raced][:1] == ["True"] and len(raced) >= 2, raced
        assert all(float(r["ms"]) > 0 and float(r["max_diff"]) < 1e-3 for r in raced), raced
    assert (peers / "three-pass-knobs.md").read_text().startswith("| head | budget MiB |")
    _exit_zero(peers / "three-pass-knobs.log")
    knobs = _rows(peers, "-three-pass-knobs.csv")  # the default first, then 2 budgets x 2 kinds
    assert [r["default"] for r in knobs] == ["True"] + ["False"] * 4, knobs
    assert {r["row_kernels"] for r in knobs} == {"two", "fused"}, knobs
    assert len({r["chunk_rows"] for r in knobs}) == 3, knobs  # three chunkings of the rows


@pytest.mark.slow  # the script's dry run: a minute or two
def test_peers_dry_run_rows_cover_both_routes_and_the_peers(peers):
    rows = _rows(peers)
    _check_rows(rows)
    assert {r["provider"] for r in rows if r["kernel"] == "ceiling"} == {"torch.matmul",
                                                                        "tensor.copy_"}
    for provider in ("ours", "ours-4pass", "reference"):
        for mode in ("score", "forward", "fwd+bwd"):
            (row,) = _measured(rows, "fused_linear", provider, mode)[:1]
            assert float(row["peak_above_mib"]) > 0, row  # the memory row of each route
    # the main shape had every provider: each has rows, or one "n/a" row saying why
    named = {r["provider"] for r in rows if r["kernel"] == "fused_linear"}
    assert named >= {"ours", "ours-4pass", "trl", "cce", "cce-filter", "liger", "reference",
                     "reference-compile"}
    for n in ("64", "192", "512"):  # the other steps' shapes: both routes there too
        assert {"ours", "ours-4pass"} <= {r["provider"] for r in rows if r["n_tokens"] == n}
    assert {"ours", "reference"} <= {r["provider"] for r in rows if r["kernel"] == "logits"
                                     and r["status"] == "ok"}
    # ours-4pass took the four-pass route because of its variable (the sweep logs each route)
    log = (peers / "peers-main.log").read_text().splitlines()
    assert any("four-pass" in ln and "GRPO_KERNELS_THREE_PASS=0" in ln for ln in log)
    # and each row says the route its own calls took (a wrong one is not "ok": _check_rows)
    for provider, route in (("ours", "three-pass"), ("ours-4pass", "four-pass")):
        for row in _measured(rows, "fused_linear", provider, "fwd+bwd"):
            assert f"route: {route}" in row["note"], row
    profiled = {r["provider"] for r in _rows(peers, "-profile.csv")}
    assert profiled == {"ours", "ours-4pass", "reference"}


@pytest.mark.slow  # the script's dry run: a minute or two
def test_session_dry_run_writes_every_step(session):
    _check_steps(session, ["environment", "install peers", "pytest gpu", "benchmark suite",
                           "sweep targets", "sweep scaling", "plots", "static report", "done"],
                 on_cpu=["pytest gpu", "benchmark suite", "sweep targets", "static report"])
    pytest_out = (session / "pytest_gpu.txt").read_text()
    assert " passed" in pytest_out and " failed" not in pytest_out, pytest_out[-2000:]
    _exit_zero(session / "pytest_gpu.txt")
    _exit_zero(session / "bench_suite.txt")
    assert (session / "bench_suite.json").stat().st_size > 0
    for name in ("targets", "scaling"):
        assert (session / f"{name}.md").read_text().startswith("| kernel | provider |")
        _exit_zero(session / f"{name}.log")
    static = (session / "static-sm90.md").read_text()
    assert "| kernel | default |" in static
    assert static.rstrip().endswith("compile_check sm_90: 0 failed, 0 spill registers")
    if "plots: skipped" not in "\n".join(_steps(session)):
        for png in ("bench_fwd_bwd.png", "bench_forward.png"):
            assert (session / png).stat().st_size > 10_000


@pytest.mark.slow  # the script's dry run: a minute or two
def test_session_dry_run_rows(session):
    rows = _rows(session)
    _check_rows(rows)
    for provider in ("ours", "ours-4pass", "reference"):
        for mode in ("forward", "backward", "fwd+bwd"):
            if (provider, mode) == ("ours", "backward"):  # the three-pass route: no backward
                assert any(r["status"].startswith("n/a: three-pass route") for r in rows
                           if (r["provider"], r["mode"]) == (provider, mode))
                continue
            assert _measured(rows, "fused_linear", provider, mode), (provider, mode)
    tokens = {r["n_tokens"] for r in _measured(rows, "fused_linear", "ours-4pass", "fwd+bwd")}
    assert len(tokens) >= 2  # the scaling sweep's several N


def _source_common(script: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -uo pipefail; source benchmarks/gpu_common.sh; "
                           + script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=_env(**env))


def test_blocks_that_set_different_variables_are_refused(tmp_path):
    done = _source_common("dev() { A=1; B=2; }; dry() { A=1; C=3; }; use_block dev dry; "
                          "echo reached", OUT=str(tmp_path))
    assert done.returncode == 2 and "reached" not in done.stdout
    assert "must set the same variables" in done.stderr and "B" in done.stderr
    done = _source_common('dev() { A=dev; }; dry() { A=dry; }; use_block dev dry; echo "$A"',
                          OUT=str(tmp_path), DRY_RUN="1")
    assert done.returncode == 0 and done.stdout.strip() == "dry"
    assert _source_common("true", OUT=str(tmp_path), DRY_RUN="yes").returncode == 2


def test_pack_keeps_every_file_in_one_archive(tmp_path):
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    done = _source_common('stamp one; echo rows > "$OUT/results/x.csv"; stamp two',
                          OUT=str(out), PACK="peers", TMPDIR=str(scratch))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["peers-steps.txt", "peers.tgz"]
    assert not list(scratch.iterdir())  # the files' own folder is gone at exit
    with tarfile.open(out / "peers.tgz") as tar:
        names = set(tar.getnames())
        assert {"peers/steps.txt", "peers/results/x.csv"} <= names
        steps = tar.extractfile("peers/steps.txt").read().decode()
    assert [ln.split("] ")[1] for ln in steps.splitlines()] == ["one", "two"]
    assert _source_common("true", OUT=str(out), PACK="../x").returncode == 2


def _block(script: str, block: str, names: list[str]) -> dict[str, list[str]]:
    """The values that `block` (a function at the top of `script`) gives `names` (arrays or
    strings), read by bash from the script itself."""
    dump = " ".join(names)
    done = subprocess.run(
        ["bash", "-c", f"eval \"$(sed -n '/^{block}() {{/,/^}}/p' benchmarks/{script})\"; "
         f"{block}; for n in {dump}; do declare -n v=$n; printf '%s\\0' \"${{#v[@]}}\" "
         "\"${v[@]}\"; unset -n v; done"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    fields, out = done.stdout.split("\0")[:-1], {}
    for name in names:
        count = int(fields.pop(0))
        out[name], fields = fields[:count], fields[count:]
    return out


# (shape array, providers variable or None for the default, kernel) of each script's sweeps
SWEEPS = {"gpu_peers.sh": [("MAIN", "MAIN_PROVIDERS", "fused_linear"),
                           ("HEADS", "EAGER", "fused_linear"),
                           ("LOGITS", "LOGITS_PROVIDERS", "logits"),
                           ("LONG", "EAGER", "fused_linear"), ("SHORT", "EAGER", "fused_linear")],
          "gpu_session.sh": [("TARGETS", None, "fused_linear,logits"),
                             ("SCALING", "SCALING_PROVIDERS", "fused_linear,logits")]}


@pytest.mark.parametrize("block", ["device_block", "dry_block"])
@pytest.mark.parametrize("script", sorted(SWEEPS))
def test_every_sweep_of_both_blocks_takes_its_arguments(tmp_path, capsys, script, block):
    """The device run's arguments are checked here, without a GPU: each sweep's heads, token
    counts, modes, kernels and providers go through the harness' own checks (`--from-csv` of an
    empty file measures nothing), and the profile's head and providers are known."""
    from benchmarks import HEADS, make_shape
    from benchmarks.__main__ import main
    from benchmarks.providers import PROVIDERS
    from benchmarks.runner import COLUMNS

    empty = tmp_path / "empty.csv"
    empty.write_text(",".join(COLUMNS) + "\n")
    names = sorted({x for sweep in SWEEPS[script] for x in sweep[:2] if x})
    values = _block(script, block, names + ["SWEEP_ARGS"])
    for shape, providers, kernels in SWEEPS[script]:
        args = [*values[shape], *values["SWEEP_ARGS"], "--kernels", kernels, "--from-csv",
                str(empty), "--device", "cpu"]
        if providers:
            args += ["--providers", values[providers][0]]
        assert main(args) == 0, (shape, args, capsys.readouterr())
        if "--tokens" in args:  # each head splits each N into sequences
            for head in args[args.index("--heads") + 1].split(","):
                for n in args[args.index("--tokens") + 1].split(","):
                    make_shape(head, int(n))
    if script == "gpu_peers.sh":
        profile = _block(script, block, ["PROFILE"])["PROFILE"]
        assert profile[profile.index("--head") + 1] in HEADS
        assert all(f"fused_linear/{p}" in PROVIDERS for p in ("ours", "ours-4pass", "reference"))
