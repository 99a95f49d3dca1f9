"""attnbench traffic: ncu's CSV read back (units, thousands separators), kernels split into calls at the markers,
bytes summed per call beside the analytic minimum, the document rebuilt from a run's kept files, its report, and
the parts run under a stand-in for ncu (the real one needs a GPU: scripts/gpu_gate.sh traffic)."""
import json
import re
import sys

import pytest

from attnbench.bench import report, traffic
from attnbench.cli import main

CASE = "B4 H16 N4096 D64 bf16"
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_row(kid, name, block, grid, metric, unit, value):
    return (f'"{kid}","4182","python3.12","127.0.0.1","{name}","1","7","{block}","{grid}","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def kernel(kid, name, grid, block, read, write, time):
    """Three rows of one kernel: (value, unit) of bytes read, bytes written, duration."""
    return [ncu_row(kid, name, block, grid, traffic.READ, read[1], read[0]),
            ncu_row(kid, name, block, grid, traffic.WRITE, write[1], write[0]),
            ncu_row(kid, name, block, grid, traffic.TIME, time[1], time[0])]


# What ncu 2025.x prints for two calls of flash's Triton variant on one anchor (fwd, bwd): its notes first, the
# header, then one row per kernel and metric; byte counts both in base units with thousands separators and scaled.
SAMPLE = "\n".join([
    "==PROF== Connected to process 4182 (/usr/bin/python3.12)",
    "==PROF== Profiling \"attnbench_traffic_marker\": 0%....50%....100% - 1 pass",
    "==PROF== Profiling \"flash_fwd_kernel\": 0%....50%....100% - 1 pass",
    "==PROF== Disconnected from process 4182",
    HEADER,
    *kernel(0, traffic.MARKER, "(1, 1, 1)", "(128, 1, 1)", ("0", "byte"), ("0", "byte"), ("2,336", "nsecond")),
    *kernel(1, "flash_fwd_kernel", "(32, 64, 1)", "(256, 1, 1)", ("101,711,872", "byte"), ("33.82", "Mbyte"),
            ("412.35", "usecond")),
    *kernel(2, traffic.MARKER, "(2, 1, 1)", "(128, 1, 1)", ("0", "byte"), ("0", "byte"), ("2,208", "nsecond")),
    *kernel(3, "row_dot_kernel", "(1024, 1, 1)", "(128, 1, 1)", ("67.31", "Mbyte"), ("262.14", "Kbyte"),
            ("31.23", "usecond")),
    *kernel(4, "vectorized_elementwise_kernel", "(8192, 1, 1)", "(128, 1, 1)", ("0", "byte"), ("1.02", "Mbyte"),
            ("9.92", "usecond")),
    *kernel(5, "flash_bwd_dkdv_kernel", "(32, 64, 1)", "(256, 1, 1)", ("0.30", "Gbyte"), ("67,108,864", "byte"),
            ("1.21", "msecond")),
    *kernel(6, "flash_bwd_dq_kernel", "(32, 64, 1)", "(256, 1, 1)", ("201.33", "Mbyte"), ("33.55", "Mbyte"),
            ("805.6", "usecond")),
]) + "\n"

FWD_READ, FWD_WRITE = 101_711_872, 33.82e6
BWD_READ = 67.31e6 + 0 + 0.30e9 + 201.33e6
BWD_WRITE = 262.14e3 + 1.02e6 + 67_108_864 + 33.55e6


def test_the_csv_reads_back_in_bytes_and_nanoseconds():
    kernels = traffic.parse_ncu_csv(SAMPLE)
    assert [k.id for k in kernels] == list(range(7))
    assert [k.name for k in kernels][:2] == [traffic.MARKER, "flash_fwd_kernel"]
    fwd = kernels[1]
    assert fwd.read_bytes == FWD_READ and fwd.write_bytes == pytest.approx(FWD_WRITE)
    assert fwd.time_ns == pytest.approx(412_350) and fwd.grid == "(32, 64, 1)" and fwd.block == "(256, 1, 1)"
    assert kernels[3].write_bytes == pytest.approx(262_140)  # Kbyte: SI, 1000 bytes
    assert kernels[5].read_bytes == pytest.approx(3e8) and kernels[5].time_ns == pytest.approx(1.21e6)
    assert kernels[0].time_ns == 2336  # a thousands separator in a duration too


def test_markers_split_the_kernels_into_calls():
    groups = traffic.assign(traffic.parse_ncu_csv(SAMPLE), [0, 1])
    assert [k.name for k in groups[0]] == ["flash_fwd_kernel"]
    assert [k.name for k in groups[1]] == ["row_dot_kernel", "vectorized_elementwise_kernel", "flash_bwd_dkdv_kernel",
                                           "flash_bwd_dq_kernel"]


@pytest.mark.parametrize("profiled, message", [
    ([0], "markers for call(s) [1] the driver did not profile"),
    ([0, 1, 2], "no marker for call(s) [2]"),
    ([1, 0], "order [0, 1] against [1, 0]"),
])
def test_markers_that_do_not_match_the_driver_are_an_error(profiled, message):
    with pytest.raises(traffic.NcuOutputError, match=re.escape(message)):
        traffic.assign(traffic.parse_ncu_csv(SAMPLE), profiled)


def test_a_kernel_before_any_marker_is_an_error():
    text = "\n".join([HEADER, *kernel(0, "flash_fwd_kernel", "(1, 1, 1)", "(1, 1, 1)", ("1", "byte"), ("1", "byte"),
                                      ("1", "nsecond"))])
    with pytest.raises(traffic.NcuOutputError, match="kernel ID 0 .flash_fwd_kernel. was profiled before any"):
        traffic.assign(traffic.parse_ncu_csv(text), [])


def test_a_call_sums_its_kernels_beside_the_minimum(flash):
    calls = traffic.plan_calls([flash], "anchor", ["fwd", "bwd"], match=re.compile(f"^{CASE}$"))
    case = next(c for c in flash.cases("anchor") if c.label == CASE)
    assert [(c["index"], c["mode"], c["variant"], c["part"]) for c in calls] == [(0, "fwd", "triton", 0),
                                                                                (1, "bwd", "triton", 0)]
    assert calls[1]["minimum_bytes"] == flash.bytes(case, "bwd") == 269_484_032
    groups = traffic.assign(traffic.parse_ncu_csv(SAMPLE), [0, 1])
    names = traffic.triton_kernel_names()
    assert {"flash_fwd_kernel", "flash_bwd_dq_kernel", "row_dot_kernel", "flash_fwd_hopper_kernel"} <= names
    fwd, bwd = (traffic.call_row(c, groups[c["index"]], names) for c in calls)
    assert fwd["bytes"] == pytest.approx(FWD_READ + FWD_WRITE)
    assert fwd["ratio"] == pytest.approx((FWD_READ + FWD_WRITE) / flash.bytes(case, "fwd"))
    assert bwd["read_bytes"] == pytest.approx(BWD_READ) and bwd["write_bytes"] == pytest.approx(BWD_WRITE)
    assert bwd["ratio"] == pytest.approx((BWD_READ + BWD_WRITE) / 269_484_032)
    assert bwd["triton_bytes"] == pytest.approx(BWD_READ + BWD_WRITE - 1.02e6)  # less torch's fill
    assert bwd["gpu_time_ms"] == pytest.approx((31.23e3 + 9.92e3 + 1.21e6 + 805.6e3) / 1e6)
    assert [(k["name"], k["triton"]) for k in bwd["kernels"]] == [
        ("row_dot_kernel", True), ("vectorized_elementwise_kernel", False), ("flash_bwd_dkdv_kernel", True),
        ("flash_bwd_dq_kernel", True)]
    assert bwd["kernels"][2] == {"id": 5, "name": "flash_bwd_dkdv_kernel", "triton": True, "grid": "(32, 64, 1)",
                                 "block": "(256, 1, 1)", "read_bytes": pytest.approx(3e8), "write_bytes": 67_108_864,
                                 "gpu_time_ns": pytest.approx(1.21e6)}


def test_parts_split_between_cases_never_within_one(flash):
    calls = traffic.plan_calls([flash], "anchor", calls_per_process=4)  # 4 cases x 3 modes
    assert [c["part"] for c in calls] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    calls = traffic.plan_calls([flash], "anchor", calls_per_process=7)
    assert [c["part"] for c in calls] == [0] * 6 + [1] * 6
    calls = traffic.plan_calls([flash], "anchor", ["fwd"], ["triton", "triton@tma"], calls_per_process=1)
    assert [(c["part"], c["variant"]) for c in calls][:3] == [(0, "triton"), (0, "triton@tma"), (1, "triton")]


@pytest.mark.parametrize("text, message", [
    ("", "not ncu --csv output"),
    ("time,bytes\n1,2\n", "not ncu --csv output"),
    ("==PROF== Connected to process 1\n==PROF== Disconnected from process 1\n", "ncu profiled no kernel"),
    ("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters\n",
     "ncu said: ERR_NVGPUCTRPERM"),
    ('"ID","Kernel Name","Metric Name","Metric Value"\n', "the header lacks Block Size, Grid Size, Metric Unit"),
    (HEADER + "\n" + ncu_row(0, "k", "(1, 1, 1)", "(1, 1, 1)", traffic.READ, "furlong", "3"), "unit 'furlong'"),
    (HEADER + "\n" + ncu_row(0, "k", "(1, 1, 1)", "(1, 1, 1)", traffic.READ, "byte", "n/a"), "reads 'n/a', not a"),
    (HEADER + "\n" + ncu_row("x", "k", "(1, 1, 1)", "(1, 1, 1)", traffic.READ, "byte", "3"), "ID 'x' is not an"),
    (HEADER + '\n"0","4182","k"', "line 2: 3 cells, the header has 15"),
    (HEADER + "\n" + ncu_row(0, "k", "(1, 1, 1)", "(1, 1, 1)", traffic.READ, "byte", "3"),
     "kernel ID 0 (k) has no dram__bytes_write.sum"),
    (HEADER + "\n" + "\n".join([ncu_row(0, "k", "(1, 1, 1)", "(1, 1, 1)", traffic.READ, "byte", "3")] * 2),
     "dram__bytes_read.sum of kernel ID 0 given twice"),
])
def test_an_unreadable_file_says_what_is_wrong(text, message):
    with pytest.raises(traffic.NcuOutputError, match=re.escape(message)) as info:
        traffic.parse_ncu_csv(text, "part-000.csv")
    assert str(info.value).startswith("part-000.csv") and "\n" not in str(info.value)


def _raw(tmp_path, flash, csv_text=SAMPLE, skipped_third=True):
    """A raw folder as `attnbench traffic --keep-raw` leaves it: the plan, the part's ncu CSV and manifest."""
    raw = tmp_path / "raw"
    raw.mkdir()
    calls = traffic.plan_calls([flash], "anchor", match=re.compile(f"^{CASE}$"))
    header = {"argv": ["traffic", "--op", "flash"], "machine": None, "code": {"version": "0"},
              "ncu": {"version": "Version 2025.3.1.0 (build 36398880)", "command": [],
                      "metrics": list(traffic.METRICS)},
              "case_set": "anchor", "operators": {"flash": {"case_set": "anchor", "variants": ["triton"]}}}
    (raw / "plan.json").write_text(json.dumps({"format": 1, "device": "cuda", "seed": 0, "case_set": "anchor",
                                               "kernel_regex": None, "header": header, "calls": calls}))
    entries = [{"index": 0, "status": "profiled", "reason": "", "warmup_s": 2.5},
               {"index": 1, "status": "profiled", "reason": "", "warmup_s": 4.0}]
    if skipped_third:
        entries.append({"index": 2, "status": "skipped", "reason": "out of memory"})
    machine = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6",
               "cuda": "13.0"}
    (raw / "part-000.json").write_text(json.dumps({"format": 1, "part": 0, "machine": machine, "autotune": True,
                                                   "calls": entries}))
    (raw / "part-000.csv").write_text(csv_text)
    return raw


def test_a_run_rebuilds_from_its_kept_files_and_reports(tmp_path, capsys, flash):
    raw, out = _raw(tmp_path, flash), tmp_path / "flash-traffic.json"
    assert main(["traffic", "--rebuild", str(raw), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"B4 H16 N4096 D64 bf16\s+bwd\s+triton\s+4\s+568\.6\s+101\.9\s+670\.6\s+269\.5\s+2\.49x", printed)
    assert "out of memory" in printed
    doc = traffic.load(str(out))
    assert doc["status"] == "complete" and doc["autotune"] is True
    assert doc["machine"]["device_name"] == "NVIDIA H100 80GB HBM3"
    assert [(r["mode"], r["skipped"]) for r in doc["traffic"]] == [("fwd", ""), ("bwd", ""),
                                                                   ("fwd_bwd", "out of memory")]

    assert main(["report", str(out)]) == 0
    md = capsys.readouterr().out
    assert md.startswith("# Measured DRAM traffic: flash on NVIDIA H100 80GB HBM3")
    assert "| kernels | case | mode | read MB | written MB | measured MB | minimum MB | measured / minimum |" in md
    assert f"| flash_fwd_kernel | {CASE} | fwd | 101.7 | 33.8 | 135.5 | 135.3 | 1.00x |" in md
    assert (f"| row_dot_kernel, vectorized_elementwise_kernel (lib), flash_bwd_dkdv_kernel, flash_bwd_dq_kernel | "
            f"{CASE} | bwd | 568.6 | 101.9 | 670.6 | 269.5 | 2.49x |") in md
    assert f"- {CASE} fwd_bwd triton: out of memory" in md
    assert f"| {CASE} | bwd | flash_bwd_dkdv_kernel | (32, 64, 1) | (256, 1, 1) | 300.0 | 67.1 | 1210.0 |" in md
    assert "autotuning on" in md and "--clock-control none" in md

    png = tmp_path / "t.png"
    assert main(["report", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_traffic_file_follows_a_run_summary(tmp_path, capsys, flash):
    raw, out = _raw(tmp_path, flash), tmp_path / "t.json"
    assert main(["traffic", "--rebuild", str(raw), "--json", str(out)]) == 0
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"machine": {"device_name": "NVIDIA H100 80GB HBM3"}, "bench": [
        {"op": "flash", "case": CASE, "mode": "fwd", "variant": "triton", "timing": {"median_ms": 0.5}}]}))
    capsys.readouterr()
    assert main(["report", str(run), str(out)]) == 0
    md = capsys.readouterr().out
    assert md.index("| case | mode | triton ms |") < md.index("## Measured DRAM traffic: flash")


def test_a_bad_kept_csv_is_one_line_and_exit_2(tmp_path, capsys, flash):
    raw = _raw(tmp_path, flash, csv_text="==PROF== Connected to process 7\nSegmentation fault\n")
    assert main(["traffic", "--rebuild", str(raw), "--json", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "part-000.csv: ncu profiled no kernel" in err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["traffic", "--op", "flash"], "--json OUT is required"),
    (["traffic", "--op", "flash", "--json", "T"], "traffic profiles kernels with Nsight Compute: it needs a CUDA"),
    (["traffic", "--rebuild", "R", "--op", "flash", "--json", "T"], "--rebuild reads what a run kept: give no --op"),
    (["traffic", "--rebuild", "nosuch", "--json", "T"], "--rebuild nosuch: not a directory"),
    (["traffic", "--op", "flash", "--mode", "double_bwd", "--json", "T"], "--mode double_bwd: not a mode of flash"),
    (["traffic", "--op", "flash", "--budget", "0", "--json", "T"], "--budget 0: a positive number of seconds"),
])
def test_traffic_usage_errors(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "R").mkdir()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_parts_of_a_traffic_run_merge_and_refuse_a_row_twice(tmp_path, capsys, flash):
    one, two = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["traffic", "--rebuild", str(_raw(tmp_path, flash)), "--json", str(one)]) == 0
    doc = json.loads(one.read_text())
    doc["traffic"] = [dict(r, case="B1 other") for r in doc["traffic"]]
    two.write_text(json.dumps(doc))
    merged = traffic.merge([traffic.load(str(one)), traffic.load(str(two))], [str(one), str(two)])
    assert len(merged["traffic"]) == 6
    with pytest.raises(Exception, match="a file is given twice"):
        traffic.merge([traffic.load(str(one))] * 2, [str(one)] * 2)


def test_the_ncu_command_profiles_only_between_profiler_start_and_stop():
    command = traffic.ncu_command("ncu", "p.csv", ["python", "-m", "attnbench.bench.traffic", "plan", "0", "m"])
    text = " ".join(command)
    for flag in ("--clock-control none", "--profile-from-start off", "--csv", "--print-units base",
                 "--log-file p.csv", f"--metrics {','.join(traffic.METRICS)}", "--replay-mode kernel",
                 "--cache-control all"):
        assert flag in text
    assert "--kernel-name" not in text and command[-6:] == ["python", "-m", "attnbench.bench.traffic", "plan", "0", "m"]
    narrowed = traffic.ncu_command("ncu", "p.csv", ["python"], kernel_regex="flash_.*")
    assert narrowed[narrowed.index("--kernel-name") + 1] == f"regex:{traffic.MARKER}|flash_.*"


FAKE_NCU = """#!{python}
# Stands in for ncu: runs the driver, then prints what ncu would for its profiled calls (a marker and one kernel each).
import json, os, subprocess, sys, time
argv = sys.argv[1:]
assert "--clock-control" in argv and argv[argv.index("--profile-from-start") + 1] == "off", argv
log = argv[argv.index("--log-file") + 1]
at = argv.index("attnbench.bench.traffic") - 2
time.sleep(float(os.environ.get("FAKE_NCU_SLEEP", "0")))
rc = subprocess.call(argv[at:])
manifest = json.load(open(argv[-1]))
rows = []
header = '{header}'
def row(kid, name, grid, metric, unit, value):
    return ",".join('"%s"' % c for c in (kid, 1, "python3", "host", name, 1, 7, "(128, 1, 1)", grid, 0, "9.0",
                                         "Command line profiler metrics", metric, unit, value))
kid = 0
for entry in manifest["calls"]:
    if entry["status"] != "profiled":
        continue
    grid = "(%d, 1, 1)" % (entry["index"] + 1)
    for name, read, write in (("attnbench_traffic_marker", "0", "0"), ("flash_decode_kernel", "1,024", "0.5")):
        rows += [row(kid, name, grid, "dram__bytes_read.sum", "byte", read),
                 row(kid, name, grid, "dram__bytes_write.sum", "Kbyte", write),
                 row(kid, name, grid, "gpu__time_duration.sum", "usecond", "1.5")]
        kid += 1
with open(log, "w") as f:
    f.write("==PROF== Disconnected from process 1\\n" + header + "\\n" + "\\n".join(rows) + "\\n")
sys.exit(rc)
"""


def _fake_ncu(tmp_path):
    path = tmp_path / "ncu"
    path.write_text(FAKE_NCU.format(python=sys.executable, header=HEADER))
    path.chmod(0o755)
    return str(path)


def _cpu_plan(flash, raw, ncu):
    calls = traffic.plan_calls([flash], "tiny", ["fwd"], match=re.compile("^B1 H2 N37x29 D24 "), calls_per_process=1)
    plan = traffic.new_plan(calls, ["traffic"], ncu, "tiny", {"flash": {"case_set": "tiny", "variants": ["triton"]}},
                            device="cpu")
    raw.mkdir()
    (raw / "plan.json").write_text(json.dumps(plan))
    return plan


def test_each_part_runs_under_ncu_and_the_file_keeps_every_part(tmp_path, flash):
    """Two parts (one case and call each) through the stand-in ncu: the driver makes the calls on the CPU (the
    interpreter), the document sums the stand-in's bytes and names the minimum."""
    ncu, raw, out = _fake_ncu(tmp_path), tmp_path / "raw", tmp_path / "t.json"
    plan = _cpu_plan(flash, raw, ncu)
    assert len({c["part"] for c in plan["calls"]}) == 2
    lines = []
    doc = traffic.profile(plan, str(raw), ncu, str(out), progress=lines.append, log=None)
    assert doc["status"] == "complete" and doc["autotune"] is not None
    assert [(r["case"], r["bytes"], r["skipped"]) for r in doc["traffic"]] == [
        ("B1 H2 N37x29 D24 fp32", 1524.0, ""), ("B1 H2 N37x29 D24 fp16", 1524.0, "")]
    case = next(c for c in flash.cases("tiny") if c.label == "B1 H2 N37x29 D24 fp16")
    assert doc["traffic"][1]["ratio"] == pytest.approx(1524.0 / flash.bytes(case, "fwd"))
    assert doc["traffic"][0]["kernels"][0]["triton"] is True
    assert traffic.load(str(out)) == doc
    manifest = json.loads((raw / "part-001.json").read_text())
    assert manifest["calls"][0]["status"] == "profiled" and manifest["calls"][0]["warmup_s"] >= 0
    assert len(lines) == 2 and "part 2/2" in lines[1]


def test_a_part_past_the_budget_is_stopped_and_the_file_says_so(tmp_path, monkeypatch, flash):
    ncu, raw, out = _fake_ncu(tmp_path), tmp_path / "raw", tmp_path / "t.json"
    plan = _cpu_plan(flash, raw, ncu)
    monkeypatch.setenv("FAKE_NCU_SLEEP", "30")
    doc = traffic.profile(plan, str(raw), ncu, str(out), budget_s=2, log=None)
    assert doc["status"] == "interrupted"
    assert doc["traffic"][0]["skipped"].startswith("not profiled: ncu was stopped at the budget")
    assert doc["traffic"][1]["skipped"] == "not profiled: the run stopped before its part"
    assert json.loads(out.read_text())["status"] == "interrupted"


def test_the_index_names_a_traffic_file_for_what_it_is(tmp_path, flash):
    folder = tmp_path / "results" / "nvidia-h100" / "flash"
    folder.mkdir(parents=True)
    assert main(["traffic", "--rebuild", str(_raw(tmp_path, flash)), "--json", str(folder / "traffic.json")]) == 0
    rows, problems = report.index(str(tmp_path / "results"))
    assert rows == [] and problems == ["nvidia-h100/flash/traffic.json: a traffic file (attnbench traffic): measured "
                                       "DRAM bytes, no timed rows"]


def test_a_call_that_failed_after_its_marker_is_matched_and_left_out(tmp_path, flash):
    """The driver launched call 1's marker, then the call raised: ncu saw the marker and the kernels before the
    error; the row keeps the error, and call 0's bytes stand."""
    raw = _raw(tmp_path, flash, skipped_third=False)
    manifest = json.loads((raw / "part-000.json").read_text())
    manifest["calls"][1] = {"index": 1, "status": "skipped", "reason": "error: RuntimeError: boom", "marked": True}
    (raw / "part-000.json").write_text(json.dumps(manifest))
    doc = traffic.rebuild(str(raw))
    assert doc["traffic"][0]["bytes"] == pytest.approx(FWD_READ + FWD_WRITE)
    assert doc["traffic"][1]["skipped"] == "error: RuntimeError: boom" and doc["traffic"][1]["kernels"] == []
    assert doc["traffic"][2]["skipped"] == "not profiled: the part stopped before this call"
    assert doc["status"] == "interrupted"


def test_ctrl_c_keeps_the_parts_that_finished(tmp_path, monkeypatch, flash):
    ncu, raw, out = _fake_ncu(tmp_path), tmp_path / "raw", tmp_path / "t.json"
    plan = _cpu_plan(flash, raw, ncu)
    real = traffic._run_part
    calls = []

    def run_part(command, timeout_s, log):
        calls.append(command)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(command, timeout_s, log)

    monkeypatch.setattr(traffic, "_run_part", run_part)
    with pytest.raises(KeyboardInterrupt):
        traffic.profile(plan, str(raw), ncu, str(out), log=None)
    doc = traffic.load(str(out))
    assert doc["status"] == "interrupted"
    assert [r["skipped"] for r in doc["traffic"]] == ["", "not profiled: the run stopped before its part"]


def test_the_results_pages_show_a_traffic_file_on_its_operators_page(tmp_path, flash):
    """A traffic file under results/<gpu>/<op>/ is read by `report --site` as what it is (not skipped as a bad result
    file), and its calls appear on the operator's page beside the runs of that GPU."""
    from attnbench.bench import site

    folder = tmp_path / "results" / "nvidia-h100" / "flash"
    folder.mkdir(parents=True)
    assert main(["traffic", "--rebuild", str(_raw(tmp_path, flash)), "--json", str(folder / "traffic.json")]) == 0
    (folder / "anchor.json").write_text(json.dumps({"machine": {"device_name": "NVIDIA H100 80GB HBM3"}, "bench": [
        {"op": "flash", "case": CASE, "mode": "fwd", "variant": "triton", "timing": {"median_ms": 0.5}}]}))
    out = tmp_path / "pages"
    site.write(str(tmp_path / "results"), str(out))
    page = (out / "flash.md").read_text()
    assert "### Measured DRAM traffic: flash on NVIDIA H100 80GB HBM3" in page
    assert f"| flash_fwd_kernel | {CASE} | fwd | 101.7 | 33.8 | 135.5 | 135.3 | 1.00x |" in page
    loaded = site.load(str(tmp_path / "results"))
    assert [rel for rel, _ in loaded.traffic] == ["nvidia-h100/flash/traffic.json"] and not loaded.skipped
