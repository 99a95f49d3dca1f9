"""Timing statistics, CPU measurement, roofline arithmetic, machine info and progress lines."""
import gc
import io
import time

import numpy
import pytest
import torch
import triton
import triton.testing

from attnbench.kernels import interpreting
from attnbench.bench.roofline import (Ceilings, achieved, attainable_copy_pct, calibrate, ceilings, exp_floor_s, machine_info,
                                machine_slug)
from attnbench.bench.runner import Progress
from attnbench.bench.timing import (CPU_MIN_SAMPLES, NOISY_IQR_FRACTION, Timing, comparable, measure, peak_memory_bytes,
                              summarize)


# ---------------------------------------------------------------- summarize

def test_summarize_median_and_quartiles():
    t = summarize([5, 1, 4, 2, 3], "cpu-wall")  # order must not matter
    assert (t.median_ms, t.q1_ms, t.q3_ms) == (3.0, 2.0, 4.0)
    assert t.samples == 5
    assert t.method == "cpu-wall"
    assert t.iqr_ms == 2.0


def test_summarize_even_count_interpolates():
    t = summarize([1.0, 2.0, 3.0, 4.0], "cuda-events")
    assert t.median_ms == pytest.approx(2.5)
    assert t.q1_ms == pytest.approx(1.75)
    assert t.q3_ms == pytest.approx(3.25)
    assert t.is_gpu


def test_summarize_single_sample():
    t = summarize([7.5], "cpu-wall")
    assert (t.median_ms, t.q1_ms, t.q3_ms, t.samples) == (7.5, 7.5, 7.5, 1)
    assert t.iqr_ms == 0.0
    assert not t.is_gpu


def test_summarize_empty_raises():
    with pytest.raises(ValueError):
        summarize([], "cpu-wall")


def test_timing_as_dict_has_iqr():
    d = Timing(2.0, 1.0, 4.0, 9, "cuda-graph").as_dict()
    assert d == {"median_ms": 2.0, "q1_ms": 1.0, "q3_ms": 4.0, "samples": 9, "method": "cuda-graph", "iqr_ms": 3.0}


# ---------------------------------------------------------------- measure

def test_measure_on_cpu_is_a_cpu_wall_timing():
    assert interpreting()  # import attnbench switched the interpreter on: no CUDA here
    calls = []
    t = measure(lambda: calls.append(None), "cpu", cpu_reps=3, rep_ms=0, warmup_ms=0)
    assert t.method == "cpu-wall" and not t.is_gpu
    assert not t.is_gpu
    assert t.samples == 3
    assert len(calls) == t.samples + 1  # one untimed call first


def test_measure_keeps_the_first_call_out_of_the_samples():
    """The first call (compile, autotune) is slow; none of the samples may contain it."""
    calls = []

    def fn():
        calls.append(None)
        if len(calls) == 1:
            time.sleep(0.3)

    t = measure(fn, "cpu", cpu_reps=3, rep_ms=0)  # the slow first call is warm-up enough
    assert len(calls) == 4
    assert t.q3_ms < 150


def test_measure_budget_still_gives_one_sample():
    calls = []

    def slow():
        calls.append(None)
        time.sleep(0.02)

    t = measure(slow, torch.device("cpu"), cpu_reps=10, cpu_budget_s=0.001, warmup_ms=0)
    assert t.samples == 1
    assert len(calls) == 2
    assert t.median_ms >= 15


def test_cpu_rule_takes_the_minimum_and_the_time_budget():
    """At least CPU_MIN_SAMPLES samples, and rep_ms of sampling, as do_bench gets on a GPU."""
    start = time.perf_counter()
    t = measure(lambda: time.sleep(0.001), "cpu", rep_ms=60, warmup_ms=0)
    assert t.samples >= CPU_MIN_SAMPLES
    # the sampling lasts the 60 ms: read on the clock, not as samples x median, which a loaded machine's
    # long outliers push below it (CI read 36 x 1.10 ms with the 60 ms spent)
    assert time.perf_counter() - start >= 0.060
    few = measure(lambda: time.sleep(0.03), "cpu", rep_ms=0)
    assert few.samples == CPU_MIN_SAMPLES  # a slow call: the minimum, once rep_ms is spent


def test_cpu_rule_hard_budget_caps_slow_calls():
    t = measure(lambda: time.sleep(0.05), "cpu", cpu_budget_s=0.12)
    assert 1 <= t.samples < CPU_MIN_SAMPLES  # the cap wins over the minimum: 3 samples of 50 ms


def test_cpu_samples_run_on_one_thread_without_gc():
    """One intra-op thread (two on a 2-core machine with a busy core read 330x slow) and no garbage
    collection inside a sample; both restored afterwards."""
    seen, threads = [], torch.get_num_threads()
    measure(lambda: seen.append((torch.get_num_threads(), gc.isenabled())), "cpu", cpu_reps=3, rep_ms=0, warmup_ms=0)
    assert seen[0] == (threads, True)  # the untimed first call runs as the caller set things
    assert set(seen[1:]) == {(1, False)}
    assert torch.get_num_threads() == threads and gc.isenabled()


def test_noisy_flag_and_comparable_clocks():
    assert Timing(1.0, 0.8, 0.8 + NOISY_IQR_FRACTION + 0.01, 10, "cpu-wall").noisy
    assert not Timing(1.0, 0.9, 0.9 + NOISY_IQR_FRACTION - 0.01, 10, "cpu-wall").noisy
    assert not Timing(1.0, 1.0, 1.0, 1, "cpu-wall").noisy
    assert comparable(Timing(1, 1, 1, 1, "cuda-events"), Timing(2, 2, 2, 1, "cuda-events"))
    assert not comparable(Timing(1, 1, 1, 1, "cuda-events"), Timing(2, 2, 2, 1, "cuda-graph"))
    assert not comparable(Timing(1, 1, 1, 1, "interpreter"), Timing(2, 2, 2, 1, "interpreter"))


def test_bench_reports_rows_as_they_finish_and_divides_comparable_clocks_only(flash):
    """on_row sees each row when it is done; the baseline runs last here, so the earlier rows get
    their speedup afterwards, on the same objects. Interpreter rows get none."""
    from attnbench.bench.runner import bench

    seen = []
    rows = bench(flash, flash.cases("tiny")[:1], "cpu", ["triton", "split", "reference"], ["fwd"], baseline="reference",
                 progress=False, on_row=lambda r: seen.append((r, r.speedup)), rep_ms=5)
    assert [r for r, _ in seen] == rows and [r.variant for r in rows] == ["triton", "split", "reference"]
    assert seen[1][1] is None and rows[1].speedup is not None and rows[1].baseline == "reference"
    assert rows[2].speedup == 1.0
    assert rows[0].timing.method == "interpreter" and rows[0].speedup is None


# ---------------------------------------------------------------- GPU time, host time kept out

def test_gpu_time_quantiles_pick_sorted_samples(monkeypatch):
    from attnbench.kernels import gpu_time

    calls = []
    monkeypatch.setattr(gpu_time, "gpu_time_samples", lambda fn, **kw: [5.0, 1.0, 3.0, 2.0, 4.0])
    # the autotuner's hook: first call compiles (outside the samples), quantiles in the order asked
    assert gpu_time.gpu_time_quantiles(lambda: calls.append(1), (0.5, 0.2, 0.8)) == [3.0, 2.0, 4.0]
    assert calls == [1]
    assert gpu_time.gpu_time_median_ms(lambda: None) == 3.0


def test_peak_memory_is_none_on_cpu():
    assert peak_memory_bytes(lambda: torch.ones(10), "cpu") is None


# ---------------------------------------------------------------- roofline

CEIL = Ceilings("Test GPU", matmul_tflops=100.0, copy_gbps=1000.0, torch="x", triton="y")


def test_achieved_compute_bound():
    timing = Timing(4.0, 3.9, 4.1, 10, "cuda-events")
    flops, nbytes = 1e11, 5e8  # 1 ms at 100 TF/s, 0.5 ms at 1000 GB/s
    a = achieved(flops, nbytes, timing, CEIL)
    assert a.tflops == pytest.approx(25.0)
    assert a.gbps == pytest.approx(125.0)
    expected = 100 * max(flops / 100e12, nbytes / 1000e9) / 4e-3
    assert a.roofline_pct == pytest.approx(expected)
    assert a.roofline_pct == pytest.approx(25.0)


def test_achieved_bandwidth_bound():
    timing = Timing(4.0, 3.9, 4.1, 10, "cuda-graph")
    flops, nbytes = 1e10, 2e9  # 0.1 ms of compute, 2 ms of traffic
    a = achieved(flops, nbytes, timing, CEIL)
    assert a.tflops == pytest.approx(2.5)
    assert a.gbps == pytest.approx(500.0)
    assert a.roofline_pct == pytest.approx(50.0)


def test_achieved_without_gpu_timing_has_no_roofline():
    cpu = Timing(4.0, 3.9, 4.1, 3, "cpu-wall")
    a = achieved(1e11, 5e8, cpu, CEIL)
    assert a.roofline_pct is None
    assert a.tflops == pytest.approx(25.0)  # throughput is still reported
    assert achieved(1e11, 5e8, Timing(4.0, 4.0, 4.0, 1, "cuda-events"), None).roofline_pct is None


def test_exp_floor_and_attainable_copy_share():
    # 132 SMs x 16 exp2 a clock x 2 GHz = 4.224e12 a second
    assert exp_floor_s(4.224e12, 132, 2.0) == pytest.approx(1.0)
    # 3 GB at 3000 GB/s take 1 ms: 100% while every other floor is shorter, their ratio once one is longer
    assert attainable_copy_pct(3e9, 3000.0) == pytest.approx(100.0)
    assert attainable_copy_pct(3e9, 3000.0, 0.5e-3, 0.9e-3) == pytest.approx(100.0)
    assert attainable_copy_pct(3e9, 3000.0, 4e-3, 2e-3) == pytest.approx(25.0)
    # an exp-bound attention: 1 MB (1/3 us) against 4.224e6 exponentials (1 us at 2 GHz): at most a third
    exps = 4.224e6
    assert attainable_copy_pct(1e6, 3000.0, exp_floor_s(exps, 132, 2.0)) == pytest.approx(100 / 3)


def test_ceilings_and_calibrate_on_cpu():
    assert ceilings("cpu") is None
    assert ceilings(torch.device("cpu"), refresh=True) is None
    with pytest.raises(ValueError):
        calibrate("cpu")


def test_machine_info_cpu():
    info = machine_info("cpu")
    for key in ("device", "device_name", "torch", "triton", "cuda", "python", "numpy", "triton_interpreter"):
        assert key in info
    assert info["device"] == "cpu"
    assert info["torch"] == torch.__version__
    assert info["triton"] == triton.__version__
    assert info["numpy"] == numpy.__version__
    assert info["triton_interpreter"] is True
    assert info["device_name"]


def test_machine_slug_is_file_system_safe():
    slug = machine_slug("cpu")
    assert slug
    assert all(c.isalnum() or c == "-" for c in slug)
    assert not slug.startswith("-") and not slug.endswith("-")


# ---------------------------------------------------------------- Progress

def test_progress_prints_numbered_lines():
    stream = io.StringIO()
    bar = Progress(2, stream=stream)
    bar.step("first")
    bar.step("second")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[1/2]") and lines[0].endswith("first")
    assert lines[1].startswith("[2/2]") and lines[1].endswith("second")


def test_progress_pads_to_the_total_width():
    stream = io.StringIO()
    bar = Progress(10, stream=stream)
    bar.step("x")
    assert stream.getvalue().startswith("[ 1/10]")


def test_progress_disabled_prints_nothing():
    stream = io.StringIO()
    bar = Progress(2, enabled=False, stream=stream)
    bar.step("first")
    bar.step("second")
    assert stream.getvalue() == ""
    assert bar.done == 2


def test_graph_mode_declines_autograd_backward(flash):
    """Capturing autograd's backward fails on a GPU (legacy stream); the variant must say so."""
    from attnbench import Unsupported
    from attnbench.bench.timing import measure

    case = flash.cases("tiny")[0]
    x = flash.make_inputs(case, "cpu", 0)
    fn = flash.variants["reference"].prepare(case, x, "bwd")
    assert fn.graph_capturable is False
    assert getattr(flash.variants["split"].prepare(case, x, "bwd"), "graph_capturable", True)
    with pytest.raises(Unsupported, match="cannot be captured"):
        measure(fn, "cuda", cuda_graph=True)  # refused before anything touches CUDA
