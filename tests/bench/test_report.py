"""attnbench report: the markdown ratios are peer latency over ours, and the plot is written."""
import json

from attnbench.cli import main


def _report(tmp_path):
    def row(case, variant, ms, tflops):
        return {"op": "flash", "case": case, "mode": "fwd", "variant": variant, "tflops": tflops,
                "roofline_pct": 50.0, "max_error": 2e-3, "timing": {"median_ms": ms}}

    data = {"machine": {"device_name": "Test GPU", "torch": "t", "triton": "tr", "cuda": "c"},
            "ceilings": {"matmul_tflops": 700.0, "copy_gbps": 4000.0},
            "bench": [row("B1 H1 N64 D64 bf16", "triton", 1.0, 400.0), row("B1 H1 N64 D64 bf16", "sdpa_flash", 1.5, 266.0),
                      row("B1 H1 N64 D64 bf16", "sdpa_cudnn", 0.8, 500.0),
                      {"op": "flash", "case": "B1 H1 N64 D64 bf16", "mode": "fwd", "variant": "flex", "timing": None,
                       "skipped": "needs CUDA"}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    return path


def _markdown(tmp_path, capsys, data):
    """report's markdown of the result document ``data`` (written to a file first, as a run writes it)."""
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 0
    return capsys.readouterr().out


def test_markdown_ratios_and_plot(tmp_path, capsys):
    path = _report(tmp_path)
    png = tmp_path / "r.png"
    assert main(["report", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    # flex was skipped on every case: no column of n/a for it, and a line says why
    assert ("| case | mode | triton ms | triton TF/s | vs sdpa_flash | vs sdpa_cudnn | % roofline | max rel. error |"
            in out)
    assert "| B1 H1 N64 D64 bf16 | fwd | 1.000 | 400 | 1.50x | 0.80x | 50 | 2.0e-03 |" in out
    # flex (skipped) and the declared peers that never ran here (the FA-4 pair, flashinfer) get no column, and a line
    # names them
    assert "vs flex" not in out
    assert "No column for flex, fa4, fa4_deterministic, flashinfer: not timed on triton's clock" in out
    assert "Test GPU" in out and "700 TF/s" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_goes_logarithmic_where_bars_span_decades(tmp_path):
    """Peers 100x slower would be flat on a linear axis: that panel is logarithmic, a 2x panel stays linear."""
    from attnbench.bench import report

    def row(mode, variant, tflops):
        return {"op": "toy", "case": "c1", "mode": mode, "variant": variant, "tflops": tflops,
                "timing": {"median_ms": 1.0, "method": "cuda-events"}}

    data = {"machine": {"device_name": "Test GPU"},
            "bench": [row("fwd", "fast", 100.0), row("fwd", "slow", 1.0), row("bwd", "fast", 2.0),
                      row("bwd", "slow", 1.0), row("bwd", "none", None)]}
    assert report.plot(data, tmp_path / "p.png") == ["log", "linear"]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_partial_cpu_run_states_what_it_is(tmp_path, capsys):
    """An interrupted CPU run: the report says it is partial, and interpreter timings are never
    divided by another clock's; the peers are the ones the file recorded for the operator."""
    def row(variant, ms, method):
        return {"op": "toy", "case": "c1", "mode": "fwd", "variant": variant, "tflops": None, "max_error": 1e-7,
                "timing": {"median_ms": ms, "method": method}}

    data = {"status": "interrupted", "machine": {"device": "cpu", "device_name": "cpu"},
            "operators": {"toy": {"ratio_subject": "fast", "ratio_peers": ["eager", "slow"]}},
            "bench": [row("fast", 100.0, "interpreter"), row("eager", 0.5, "cpu-wall"), row("slow", 300.0, "interpreter")]}
    out = _markdown(tmp_path, capsys, data)
    assert "**Partial run** (status: interrupted): 3 bench and 0 check rows" in out
    assert "CPU run" in out
    # only what a CPU run measured: no TF/s, no % roofline, and no ratio of the interpreter's clock to another
    assert "| case | mode | fast ms | max rel. error |" in out
    assert "| c1 | fwd | 100.000 | 1.0e-07 |" in out
    assert "No column for eager, slow" in out and "never divided" in out and "GPU time" not in out


def test_every_peer_that_ran_gets_a_column_and_none_that_did_not(tmp_path, capsys):
    """The declared ratio peers of flash are sdpa_flash, sdpa_cudnn and flex; sdpa_math and sdpa_efficient are
    peers too. A run where flex and sdpa_cudnn never ran but sdpa_math did: sdpa_math gets a column on each clock it
    ran on, flex and sdpa_cudnn none; a peer that ran only some cases reads n/a on the others."""
    def row(case, variant, ms, eager=None, **extra):
        return {"op": "flash", "case": case, "mode": "fwd", "variant": variant, "tflops": 100.0 / ms,
                "roofline_pct": 10.0 / ms, "max_error": 1e-3,
                "timing": {"median_ms": ms, "method": "cuda-events"},
                "eager": {"median_ms": eager, "method": "eager-wall"} if eager else None, **extra}

    a, b = "B1 H1 N64 D64 bf16", "B1 H1 N128 D64 bf16"
    data = {"machine": {"device": "cuda", "device_name": "Test GPU"},
            "operators": {"flash": {"ratio_subject": "triton", "ratio_peers": ["sdpa_flash", "sdpa_cudnn", "flex"]}},
            "bench": [row(a, "triton", 1.0, eager=2.0), row(a, "sdpa_math", 4.0, eager=5.0), row(a, "sdpa_flash", 2.0),
                      row(b, "triton", 2.0), row(b, "sdpa_flash", 3.0), row(b, "sdpa_efficient", 3.0),
                      {"op": "flash", "case": a, "mode": "fwd", "variant": "flex", "timing": None, "skipped": "x"},
                      row(a, "sdpa_cudnn", 0.5) | {"timing": {"median_ms": 0.5, "method": "interpreter"}}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| case |"))
    assert header == ("| case | mode | triton ms | triton TF/s | vs sdpa_flash | vs sdpa_math | vs sdpa_efficient | "
                      "triton eager ms | vs sdpa_math eager | % roofline | max rel. error |")
    assert f"| {a} | fwd | 1.000 | 100 | 2.00x | 4.00x | n/a | 2.000 | 2.50x | 10 | 1.0e-03 |" in out
    assert f"| {b} | fwd | 2.000 | 50 | 1.50x | n/a | 1.50x | - | n/a | 5 | 1.0e-03 |" in out
    assert "No column for sdpa_cudnn, flex: not timed on triton's clock in this file." in out


def test_parts_of_one_run_read_as_one_and_other_devices_refused(tmp_path, capsys):
    """A run split with --match into files: report reads them as one table (a part still running
    makes the whole partial); parts from two GPUs are one usage error."""
    first = _report(tmp_path)
    data = json.loads(first.read_text())
    data["status"] = "interrupted"
    data["bench"] = [dict(r, case="B1 H1 N128 D64 bf16") for r in data["bench"]]
    second = tmp_path / "r2.json"
    second.write_text(json.dumps(data))
    png = tmp_path / "both.png"
    assert main(["report", str(first), str(second), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| B1 H1 N64 D64 bf16 | fwd |" in out and "| B1 H1 N128 D64 bf16 | fwd |" in out
    assert "**Partial run** (status: interrupted): 8 bench" in out
    for key, value in (("device_name", "Other GPU"), ("triton", "other")):
        other = dict(data, machine=dict(data["machine"], **{key: value}))
        second.write_text(json.dumps(other))
        assert main(["report", str(first), str(second)]) == 2
        assert "parts from different devices or versions" in capsys.readouterr().err
    # the same file twice is a mistake, not two parts
    assert main(["report", str(first), str(first)]) == 2
    assert "a file is given twice" in capsys.readouterr().err


def test_rows_in_two_parts_are_taken_from_the_later_and_said(tmp_path, capsys):
    """Parts that repeat rows (jvp_attention's second-order checks run in every --match part; a resumed run times
    its cut case again) were refused as 'in two parts', so such parts could never be reported together (found
    by review): the later part's row is shown, and a line says how many were replaced."""
    first = _report(tmp_path)
    data = json.loads(first.read_text())
    data["bench"] = [dict(r, timing={"median_ms": 2.0}) if r["variant"] == "triton" else r for r in data["bench"]]
    second = tmp_path / "resumed.json"
    second.write_text(json.dumps(data))
    assert main(["report", str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert "4 bench rows were in more than one part: the later part's are shown." in out
    assert "| B1 H1 N64 D64 bf16 | fwd | 2.000 |" in out and "| B1 H1 N64 D64 bf16 | fwd | 1.000 |" not in out


def test_parts_measured_on_different_code_say_so(tmp_path, capsys):
    """Parts of one grid may come from different commits (a part whose code did not change is not measured again):
    the report names each part's code; one code for all is one line; a file without the record says so."""
    first = _report(tmp_path)
    data = json.loads(first.read_text())
    code = {"version": "0.1.0", "commit": "a" * 40, "dirty": False, "source_sha256": "0123456789abcdef"}
    first.write_text(json.dumps(dict(data, code=code)))
    second = tmp_path / "r2.json"
    moved = [dict(r, case="B1 H1 N128 D64 bf16") for r in data["bench"]]
    second.write_text(json.dumps(dict(data, bench=moved, code=code)))
    assert main(["report", str(first), str(second)]) == 0
    assert "Code: attnbench 0.1.0, commit aaaaaaa (source 0123456789abcdef)." in capsys.readouterr().out
    other = dict(code, commit="b" * 40, dirty=True, source_sha256="fedcba9876543210")
    second.write_text(json.dumps(dict(data, bench=moved, code=other)))
    assert main(["report", str(first), str(second)]) == 0
    out = capsys.readouterr().out
    assert "Code: parts from 2 versions:" in out
    assert "- r.json: attnbench 0.1.0, commit aaaaaaa (source 0123456789abcdef)" in out
    assert "- r2.json: attnbench 0.1.0, commit bbbbbbb + local changes (source fedcba9876543210)" in out
    assert main(["report", str(_report(tmp_path))]) == 0
    assert "Code: unknown (the result file predates this record)." in capsys.readouterr().out


def test_a_random_set_plots_the_speedup_per_shape_on_both_clocks(tmp_path):
    """Many shapes get one point each per peer and clock: the legend counts the shapes where ours is slower and
    names the worst; a clock a peer never ran on stays empty rather than borrowing the other clock's numbers."""
    from attnbench.bench import report

    def row(case, variant, ms, eager_ms=None):
        return {"op": "flash", "case": case, "mode": "fwd", "variant": variant, "tflops": 1.0,
                "timing": {"median_ms": ms, "method": "cuda-events"},
                "eager": None if eager_ms is None else {"median_ms": eager_ms, "method": "eager-wall"}}

    cases = [f"B{i} H8 N{64 * i} D64 bf16" for i in range(1, 31)]
    rows = []
    for i, case in enumerate(cases):
        rows += [row(case, "triton", 1.0, 2.0), row(case, "sdpa_flash", 0.5 if i < 3 else 1.5, 1.0),
                 row(case, "sdpa_cudnn", 2.0)]  # cuDNN: GPU time only
    data = {"machine": {"device_name": "Test GPU"},
            "operators": {"flash": {"case_set": "random", "ratio_subject": "triton",
                                    "ratio_peers": ["sdpa_flash", "sdpa_cudnn"]}},
            "bench": rows}
    points = report.speedup_points(data)
    assert sorted(points[("flash", "fwd")]["timing"]) == ["sdpa_cudnn", "sdpa_flash"]
    assert sorted(points[("flash", "fwd")]["eager"]) == ["sdpa_flash"]
    flash_gpu = points[("flash", "fwd")]["timing"]["sdpa_flash"]
    assert sum(ratio < 1 for _, ratio, _ in flash_gpu) == 3 and len(flash_gpu) == 30
    assert all(ratio == 0.5 for _, ratio, _ in points[("flash", "fwd")]["eager"]["sdpa_flash"])
    png = tmp_path / "random.png"
    titles = report.plot(data, png)  # 30 shapes: the per-shape figure, not bars
    assert titles == ["flash fwd, GPU time (CUDA events, L2 flushed)", "flash fwd, eager latency (wall per call)"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_routes_get_columns_and_untimed_subject_rows_are_listed(tmp_path, capsys):
    """Found by review: a forced route timed beside the default (triton@dq-split, the point of such a run) had no
    column and no mention; a subject row skipped for memory vanished from the table without a word; CUDA-graph
    rows were labelled 'CUDA events, L2 flushed'; and a decode row's 0.52 TF/s read '0'."""
    def row(case, variant, ms, method="cuda-graph", **extra):
        return {"op": "flash", "case": case, "mode": "bwd", "variant": variant, "tflops": 0.52,
                "timing": {"median_ms": ms, "method": method}, **extra}

    data = {"machine": {"device_name": "Test GPU", "device": "cuda"},
            "bench": [row("c1", "triton", 1.0), row("c1", "triton@dq-split", 0.5), row("c1", "sdpa_flash", 2.0),
                      {"op": "flash", "case": "c2", "mode": "bwd", "variant": "triton", "timing": None,
                       "skipped": "out of memory"}]}
    out = _markdown(tmp_path, capsys, data)
    assert "| case | mode | triton ms | triton TF/s | vs sdpa_flash | vs triton@dq-split |" in out
    assert "| c1 | bwd | 1.000 | 0.52 | 2.00x | 0.50x |" in out
    assert "Not timed (triton, 1 rows):\n- c2 bwd: out of memory" in out
    assert "GPU time (CUDA-graph replays, back to back, L2 not flushed" in out and "CUDA events" not in out


def test_the_tf_s_plot_leaves_interpreter_rows_out(tmp_path):
    """A CPU run's plot set the interpreter's TF/s beside the reference's wall-clock TF/s on one axis, the
    comparison the tables refuse (found by review): interpreter rows are not drawn."""
    from attnbench.bench import report

    def row(variant, method, tflops):
        return {"op": "toy", "case": "c1", "mode": "fwd", "variant": variant, "tflops": tflops,
                "timing": {"median_ms": 1.0, "method": method}}

    data = {"machine": {"device": "cpu", "device_name": "cpu"},
            "bench": [row("triton", "interpreter", 0.001), row("reference", "cpu-wall", 1.0),
                      row("split", "cpu-wall", 2.0)]}
    assert report.plot(data, tmp_path / "p.png") == ["linear"]  # the wall-clock rows alone: a 2x span
    data["bench"] = data["bench"][:1]
    import pytest

    with pytest.raises(Exception, match="interpreter rows are not drawn"):
        report.plot(data, tmp_path / "q.png")


def test_a_ratio_to_a_peer_past_its_float64_bound_is_marked(tmp_path, capsys):
    """A bench run times a peer whatever its error: its ratio cell says the answer was wrong (bf16's bound is 1e-2),
    on both clocks, and a note says what the mark means; a peer within its bound is shown plain."""
    def row(variant, ms, error):
        return {"op": "flash", "case": "B1 H1 N64 D64 bf16", "mode": "fwd", "variant": variant, "max_error": error,
                "timing": {"median_ms": ms}, "eager": {"median_ms": 2 * ms}}

    machine = {"device_name": "Test GPU", "device": "cuda", "torch": "t", "triton": "tr", "cuda": "c"}
    out = _markdown(tmp_path, capsys, {"machine": machine, "bench": [
        row("triton", 1.0, 2e-3), row("sdpa_flash", 1.5, 2e-3), row("sdpa_cudnn", 3.0, 0.34)]})
    line = next(line for line in out.splitlines() if line.startswith("| B1 H1 N64 D64 bf16 |"))
    assert "| 1.50x |" in line and "| 3.00x ! |" in line and line.count(" ! |") == 2  # GPU time and eager
    assert "!: that variant's answer is past its float64 bound" in out
    out = _markdown(tmp_path, capsys, {"machine": machine,
                                       "bench": [row("triton", 1.0, 2e-3), row("sdpa_flash", 1.5, 2e-3)]})
    assert " ! |" not in out and "past its float64 bound" not in out
