"""``attnbench tune``: a kernel's candidate launch configs, each forced alone and timed through the timing core (the
GPU studies' --configs sweeps). The command needs CUDA; the function runs in the interpreter, where the CPU gate
checks the forcing, the oracle check, the launch detection and that the kernel's autotuner is left as it was."""
import json

import pytest
import torch

import attnbench
from attnbench.bench import tune
from attnbench.cli import main
from attnbench.kernels.tuning import cfg


def test_every_operator_names_its_tunable_kernels():
    for name, kernels in {"flash": {"fwd", "fwd_tma", "decode", "dkdv", "dq"},
                          "jvp_attention": {"jvp", "bwd_jvp_dkdv", "bwd_jvp_dq"},
                          "shared_context": {"fused", "context", "buffer"},
                          "sparse": {"product", "scale", "bilinear", "small_matmul", "split_matmul", "channelwise_rows",
                                     "channelwise_gram"}}.items():
        op = attnbench.get(name)
        tunables = op.tunables()
        assert kernels <= set(tunables), name
        for t in tunables.values():
            assert t.mode in op.variant(t.variant).modes, (name, t.name)
            assert all(hasattr(a, "configs") and hasattr(a, "cache") for a in t.autotuners()), (name, t.name)


def test_a_tunable_table_looks_its_kernels_up_when_the_tuner_asks(monkeypatch):
    """tune.tunable_table: a row's kernel is an autotuner or a dict of them (one per head-dim class) of the family's
    module, and ``forget`` a function of the family, each read when called; a row without a variant takes the
    Tunable's default."""
    from attnbench.kernels import shared_context as launchers
    from attnbench.kernels.attention import flash_fwd
    from attnbench.kernels.shared_context import kernels

    fused = attnbench.get("shared_context").tunables()["fused"]
    assert fused.autotuners() == list(kernels.FUSED.values()) and (fused.mode, fused.variant) == ("fwd", "triton")
    calls = []
    monkeypatch.setattr(launchers, "clear_split_picks", lambda: calls.append("forgot"))
    fused.forget()
    assert calls == ["forgot"]
    flash = attnbench.get("flash").tunables()
    assert flash["fwd"].autotuners() == [flash_fwd.flash_fwd_kernel] and flash["fwd"].variant == "triton@tiles"
    assert flash["dq"].variant == "triton" and flash["dq"].forget() is None


def test_tune_needs_cuda_and_says_so(capsys):
    assert main(["tune", "--op", "flash", "--kernel", "dkdv"]) == 2
    assert "tune times launch configurations on a GPU: it needs CUDA, and this run is on cpu" in capsys.readouterr().err
    assert main(["tune", "--op", "flash", "--kernel", "nope"]) == 2
    assert "--kernel nope: not a tunable kernel of flash; known: fwd, fwd_tma, decode, dkdv, dq" in \
        capsys.readouterr().err
    assert main(["tune", "--op", "nope", "--kernel", "fwd"]) == 2


def test_list_names_the_tunable_kernels(capsys):
    assert main(["list", "--op", "shared_context"]) == 0
    assert "tunable kernels (attnbench tune --kernel): fused, context, buffer" in capsys.readouterr().out


@pytest.mark.interpreter
def test_each_candidate_runs_alone_and_the_autotuner_is_restored(monkeypatch):
    """Two candidates on flash's forward tiles: the autotuned row names its pick, each candidate row is checked
    against float64 and timed, and the kernel keeps its list and forgets nothing of its own afterwards."""
    from attnbench.kernels.attention import flash_fwd

    kernel = flash_fwd.flash_fwd_kernel
    candidates = [cfg(1, 1, BLOCK_M=16, BLOCK_N=16), cfg(1, 1, BLOCK_M=32, BLOCK_N=16)]
    monkeypatch.setattr(kernel, "configs", candidates)
    monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(kernel, "_do_bench", lambda call, quantiles: (call(), [1.0, 1.0, 1.0])[1])  # no CUDA here
    op = attnbench.get("flash")
    case = next(c for c in op.cases("tiny") if c.label == "B1 H2 N37x29 D24 fp32")
    seen = []
    rows = tune.tune(op, op.tunables()["fwd"], [case], "cpu", rep_ms=0, on_row=seen.append)
    assert seen == rows and [r.index for r in rows] == [None, 0, 1]
    assert rows[0].config == "autotuned: BLOCK_M=16 BLOCK_N=16 warps 1 stages 1"
    assert rows[2].config == "BLOCK_M=32 BLOCK_N=16 warps 1 stages 1"
    assert all(r.timing and r.passed and r.max_error < 1e-6 for r in rows)
    assert all(r.speedup is not None for r in rows[1:])
    assert kernel.configs == candidates and kernel.cache == {}
    text = tune.table(rows)
    assert text.count("\n") == 4 and "fastest" in text
    assert json.dumps([r.as_dict() for r in rows])  # what --json writes


@pytest.mark.interpreter
def test_a_kernel_the_case_does_not_reach_is_a_skipped_row():
    """The split-KV kernel is not launched when the query tiles are forced: said, not timed."""
    op = attnbench.get("flash")
    case = op.cases("tiny")[0]
    rows = tune.tune(op, op.tunables()["decode"], [case], "cpu", rep_ms=0, variant="triton@tiles")
    assert len(rows) == 1 and not rows[0].timing
    assert rows[0].skipped == "decode does not run on this case (triton@tiles, fwd)"


def test_a_candidate_that_fails_to_compile_is_a_row_with_the_reason():
    """A candidate that raises (out of shared memory on a GPU) is reported, and the next one still runs."""
    calls = []

    class FakeTuner:
        configs = [cfg(4, 1, BLOCK=1), cfg(4, 1, BLOCK=2)]
        cache, best_config = {}, None

    tuner = FakeTuner()

    class Op:
        name = "toy"

        def variant(self, name):
            return Variant()

        def make_inputs(self, case, device, seed):
            return {}

        def oracle(self, case, x):
            return {"z": torch.ones(1, dtype=torch.float64)}

    class Variant:
        modes = ("fwd",)

        def prepare(self, case, x, mode):
            def fn():
                config = tuner.configs[0] if len(tuner.configs) == 1 else FakeTuner.configs[0]
                tuner.best_config = config
                calls.append(config.kwargs["BLOCK"])
                if len(tuner.configs) == 1 and config.kwargs["BLOCK"] == 1:
                    raise RuntimeError("out of resources: shared memory, Required: 300000, Hardware limit: 232448")
                return {"z": torch.ones(1, dtype=torch.float64)}
            return fn

    class Case:
        label = "toy case"

    rows = tune.tune(Op(), tune.Tunable("k", "a toy", lambda: [tuner], "fwd"), [Case()], "cpu", rep_ms=0)
    assert [r.index for r in rows] == [None, 0, 1]
    assert rows[1].skipped.startswith("RuntimeError: out of resources: shared memory") and not rows[1].timing
    assert rows[2].timing and rows[2].passed
    assert tuner.configs == FakeTuner.configs
