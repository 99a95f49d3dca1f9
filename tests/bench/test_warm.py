"""attnbench warm: compile ahead in worker processes (bench/warm.py). Off a GPU the command refuses; the
workers' logic runs on the CPU through the interpreter, where it compiles nothing but runs the same calls."""
import re
import types

import pytest
import torch

import attnbench
from attnbench.bench import warm
from attnbench.bench.cases import shard
from attnbench.bench.registry import Unsupported
from attnbench.cli import main


def test_the_workers_take_every_case_once():
    cases = list(range(23))
    parts = [shard(cases, i, 4) for i in range(4)]
    assert sorted(c for p in parts for c in p) == cases
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


class Op:
    """An operator whose variant runs, declines or fails by case."""
    name = "stub"

    def __init__(self):
        self.calls = []

    def make_inputs(self, case, device, seed):
        if case.label == "no memory":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"x": case.label}

    def variant(self, name):
        def prepare(case, x, mode):
            if case.label == "declines":
                raise Unsupported("not this case")
            if case.label == "breaks" and mode == "bwd":
                raise RuntimeError("a compile error\nwith more lines")
            return lambda: self.calls.append((case.label, name, mode))
        return types.SimpleNamespace(modes=("fwd", "bwd"), prepare=prepare)


def test_a_worker_runs_each_case_and_mode_and_reports_what_did_not_run():
    op = Op()
    cases = [types.SimpleNamespace(label=label) for label in ("runs", "declines", "breaks", "no memory")]
    counts = warm.warm_cases(op, cases, torch.device("cpu"), ["triton"], ["fwd", "bwd", "double_bwd"],
                             progress=lambda line: None)
    assert op.calls == [("runs", "triton", "fwd"), ("runs", "triton", "bwd"), ("breaks", "triton", "fwd")]
    assert counts["ran"] == 3 and counts["declined"] == 2
    assert counts["failed"] == ["breaks triton bwd: RuntimeError: a compile error", "no memory: out of memory"]


def test_workers_in_processes_cover_the_cases():
    """Two worker processes on two of flash's tiny forward cases (the interpreter: nothing to compile, the same
    calls): each case runs once, in one of them."""
    op = attnbench.get("flash")
    pattern = "(N33x17|N19) .*fp32$"
    cases = [c for c in op.cases("tiny") if re.search(pattern, c.label)]
    assert len(cases) == 2, "the tiny set changed: pick other labels"
    lines = []
    summaries, clean = warm.warm(op, "tiny", cases, pattern, ["triton"], ["fwd"], torch.device("cpu"), 2,
                                 progress=lines.append)
    assert clean and [s.split(": ", 1)[1] for s in summaries] == ["1 runs, 0 declined, failed: none"] * 2, summaries
    assert lines[-1].startswith("warm flash: 2 cases in 2 processes")


def test_the_command_refuses_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["warm", "--op", "flash", "--cases", "random"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_a_pattern_starting_with_a_dash_reaches_the_workers_whole():
    command = warm.worker_command("flash", "random", "-top_left", ["triton"], ["fwd"], 0, 1, 4, torch.device("cuda"))
    assert "--match=-top_left" in command and "--variant=triton" in command and "--mode=fwd" in command


def test_a_runs_shard_reaches_the_workers_before_their_own_share():
    command = warm.worker_command("flash", "random", None, ["triton"], ["bwd"], 0, 1, 4, torch.device("cuda"),
                                  part=(2, 3))
    assert "--shard=2/3" in command and not any(a.startswith("--match") for a in command)
    assert "--shard=" not in " ".join(warm.worker_command("flash", "random", None, ["triton"], ["bwd"], 0, 1, 4,
                                                            torch.device("cuda")))
