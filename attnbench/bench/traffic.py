"""Measured DRAM traffic: each Triton variant's timed call as Nsight Compute counts it, beside the analytic minimum.

    attnbench traffic --op flash --json flash-traffic.json          # on a GPU machine with ncu

For every (case, mode) of a case set, one process run under ``ncu --clock-control none`` does what
``attnbench bench`` does before it times: it makes the inputs, prepares the variant (a backward's saved
forward, say) and calls it twice, so that compilation and autotuning are settled and the tuned configs are
the ones in use (``ATTNBENCH_AUTOTUNE=0`` in the environment profiles the default configs instead). Then it
turns the profiler on (``cudaProfilerStart``; ncu runs with ``--profile-from-start off``), launches a marker
kernel whose grid names the call, makes the one profiled call, synchronizes and turns the profiler off. ncu
therefore profiles the timed call's kernels and nothing else: no warm-up, no autotuning sweep, no preparation.
Every kernel the call launches is counted, Triton's and torch's alike (a zero-fill of an accumulator is
traffic the call pays for); each kernel row says which it is, and ``--kernel-regex`` narrows ncu to some.

ncu prints ``--csv`` rows, one per kernel and metric; ``parse_ncu_csv`` reads them (units scaled to bytes
and nanoseconds), ``assign`` splits the kernels at the markers into calls, and ``call_row`` sums each call's
DRAM bytes read and written over its kernels and divides by the operator's minimum bytes (``op.bytes``).
A long case set runs in parts, one ncu process each (``calls_per_process``), and the JSON is rewritten after
every part, so a run cut short keeps what finished. docs/traffic.md says what the numbers mean.

The document (``"command": "traffic"``)::

    {"format": 1, "command": "traffic", "status": ..., "date": ..., "argv": [...], "machine": {...},
     "code": {...}, "ncu": {"version": ..., "command": [...], "metrics": [...]}, "autotune": true,
     "operators": {"flash": {"case_set": "anchor", "variants": ["triton"]}},
     "traffic": [{"op", "case", "mode", "variant", "minimum_bytes", "read_bytes", "write_bytes", "bytes",
                  "ratio", "triton_bytes", "gpu_time_ms", "kernels": [{"id", "name", "triton", "grid",
                  "block", "read_bytes", "write_bytes", "gpu_time_ns"}], "skipped"}]}
"""
import csv
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from . import results

FORMAT = 1
READ, WRITE, TIME = "dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum"
METRICS = (READ, WRITE, TIME)
# The marker kernel launched first in each profiled call; its grid's x is the call's index + 1.
MARKER = "attnbench_traffic_marker"
# Columns of ncu's --csv details page that the parser needs; ncu prints others too (Process ID, Context, ...).
NEEDED_COLUMNS = ("ID", "Kernel Name", "Block Size", "Grid Size", "Metric Name", "Metric Unit", "Metric Value")
# ncu's units (SI prefixes: "Kbyte" is 1000 bytes) in bytes and in nanoseconds; --print-units base prints
# "byte" and "nsecond", and the scaled forms are read all the same.
BYTE_UNITS = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12,
              "Kibyte": 2.0**10, "Mibyte": 2.0**20, "Gibyte": 2.0**30, "Tibyte": 2.0**40}
TIME_UNITS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "ns": 1.0, "us": 1e3, "ms": 1e6,
              "s": 1e9}
UNITS = {READ: BYTE_UNITS, WRITE: BYTE_UNITS, TIME: TIME_UNITS}


class NcuOutputError(ValueError):
    """ncu's output cannot be read, or does not match the calls the driver profiled; one line says where."""


# ---------------------------------------------------------------- ncu's CSV

@dataclass
class Kernel:
    """One profiled kernel launch as ncu printed it, its metrics in bytes and nanoseconds."""

    id: int
    name: str
    grid: str = ""
    block: str = ""
    metrics: dict = field(default_factory=dict)

    @property
    def read_bytes(self):
        return self.metrics.get(READ)

    @property
    def write_bytes(self):
        return self.metrics.get(WRITE)

    @property
    def time_ns(self):
        return self.metrics.get(TIME)


def metric_value(text: str, unit: str, metric: str, where: str) -> float:
    """A Metric Value cell in the metric's base unit (bytes, nanoseconds): thousands separators dropped, the unit's
    prefix applied. An unknown unit or a value that is not a number raises NcuOutputError naming ``where``."""
    units = UNITS.get(metric)
    if units is not None and unit not in units:
        raise NcuOutputError(f"{where}: unit {unit!r} of {metric} is not one of {', '.join(units)}")
    cleaned = text.strip().replace(",", "").replace("\u202f", "").replace(" ", "")
    try:
        value = float(cleaned)
    except ValueError:
        raise NcuOutputError(f"{where}: {metric} reads {text!r}, not a number") from None
    if not math.isfinite(value) or value < 0:
        raise NcuOutputError(f"{where}: {metric} reads {text!r}")
    return value * (units[unit] if units is not None else 1.0)


def parse_ncu_csv(text: str, source: str = "ncu output") -> list:
    """The kernels of ncu's ``--csv`` details page (one row per kernel and metric), in profiling order.

    Lines before the header (``==PROF==`` notes, the application's own output) and lines after it that are not
    quoted CSV rows (``==WARNING==``) are skipped. No header, a header without the needed columns, a row of the
    wrong width, an ID that is not an integer, a metric given twice, a unit or value that cannot be read, or a
    kernel without both DRAM metrics raise NcuOutputError naming ``source`` and the line."""
    lines = text.splitlines()
    header, start = None, None
    for number, line in enumerate(lines, 1):
        if line.startswith('"ID"'):
            header, start = next(csv.reader([line])), number
            break
    if header is None:
        error = next((line for line in lines if line.startswith("==ERROR==")), None)
        if error:
            raise NcuOutputError(f"{source}: no CSV, and ncu said: {error[9:].strip()}")
        if any(line.startswith("==PROF==") for line in lines):
            raise NcuOutputError(f"{source}: ncu profiled no kernel (no CSV header after its ==PROF== lines)")
        raise NcuOutputError(f"{source}: not ncu --csv output (no line starts with the \"ID\" column)")
    missing = [c for c in NEEDED_COLUMNS if c not in header]
    if missing:
        raise NcuOutputError(f"{source}: line {start}: the header lacks {', '.join(missing)} (ncu --csv --page "
                             "details prints them)")
    col = {name: header.index(name) for name in NEEDED_COLUMNS}
    kernels = {}
    for number, line in enumerate(lines[start:], start + 1):
        if not line.startswith('"'):
            continue
        cells = next(csv.reader([line]))
        where = f"{source}: line {number}"
        if len(cells) != len(header):
            raise NcuOutputError(f"{where}: {len(cells)} cells, the header has {len(header)}")
        try:
            kid = int(cells[col["ID"]])
        except ValueError:
            raise NcuOutputError(f"{where}: ID {cells[col['ID']]!r} is not an integer") from None
        kernel = kernels.setdefault(kid, Kernel(kid, cells[col["Kernel Name"]], cells[col["Grid Size"]],
                                                cells[col["Block Size"]]))
        if kernel.name != cells[col["Kernel Name"]]:
            raise NcuOutputError(f"{where}: kernel ID {kid} is named {cells[col['Kernel Name']]!r} here and "
                                 f"{kernel.name!r} above")
        metric = cells[col["Metric Name"]]
        if metric in kernel.metrics:
            raise NcuOutputError(f"{where}: {metric} of kernel ID {kid} given twice")
        kernel.metrics[metric] = metric_value(cells[col["Metric Value"]], cells[col["Metric Unit"]], metric,
                                              f"{where} (kernel ID {kid}, {kernel.name})")
    for kernel in kernels.values():
        lacking = [m for m in (READ, WRITE) if m not in kernel.metrics]
        if lacking:
            raise NcuOutputError(f"{source}: kernel ID {kernel.id} ({kernel.name}) has no {', '.join(lacking)}: "
                                 f"profile with --metrics {','.join(METRICS)}")
    return [kernels[k] for k in sorted(kernels)]


def marker_index(kernel: Kernel, source: str) -> int:
    """The call index a marker launch carries: its grid's x less one."""
    match = re.match(r"\s*\(?\s*(\d+)", kernel.grid)
    if not match or int(match[1]) < 1:
        raise NcuOutputError(f"{source}: marker kernel ID {kernel.id} has grid {kernel.grid!r}, not (index + 1, 1, 1)")
    return int(match[1]) - 1


def assign(kernels: list, profiled: list, source: str = "ncu output") -> dict:
    """{call index: [its kernels]}: the kernels after each marker up to the next, in profiling order.

    ``profiled``: the indices of the calls the driver profiled, in the order it made them; the markers must name
    exactly those, in that order, or NcuOutputError says how they differ (a kernel before any marker, too)."""
    groups, order = {}, []
    for kernel in kernels:
        if kernel.name == MARKER:
            index = marker_index(kernel, source)
            if index in groups:
                raise NcuOutputError(f"{source}: two markers for call {index}")
            groups[index] = []
            order.append(index)
        elif not order:
            raise NcuOutputError(f"{source}: kernel ID {kernel.id} ({kernel.name}) was profiled before any call's "
                                 "marker")
        else:
            groups[order[-1]].append(kernel)
    if order != list(profiled):
        missing = [i for i in profiled if i not in groups]
        extra = [i for i in order if i not in set(profiled)]
        why = (f"no marker for call(s) {missing}" if missing else "") + ("; " if missing and extra else "") + \
              (f"markers for call(s) {extra} the driver did not profile" if extra else "")
        raise NcuOutputError(f"{source}: the markers do not match the profiled calls: "
                             f"{why or f'order {order} against {list(profiled)}'}")
    return groups


# ---------------------------------------------------------------- rows and the document

# A function under @triton.jit or @gluon.jit (other decorators may sit between): a kernel, or a helper it calls.
_JIT_DEF = re.compile(r"@(?:triton|gluon)\.jit\b[^\n]*\n(?:[ \t]*@[^\n]*\n)*[ \t]*def (\w+)")


def triton_kernel_names() -> frozenset:
    """The names of every Triton and Gluon function in attnbench/kernels, read from the source (the name ncu
    prints for a Triton launch is the Python function's), and the marker's: the ``triton`` flag of a kernel row.
    Read from the files, not from imported modules, so that a machine without a GPU (where the Gluon kernels are
    not defined) classifies the same kernels the same way."""
    from pathlib import Path

    from .. import kernels as package

    names = {MARKER}
    for path in Path(package.__file__).parent.rglob("*.py"):
        names.update(_JIT_DEF.findall(path.read_text()))
    return frozenset(names)


def _total(values):
    values = list(values)
    return None if any(v is None for v in values) else float(sum(values))


def call_row(call: dict, kernels, triton_names=frozenset(), skipped: str = "") -> dict:
    """One call's row: its kernels (the marker left out), their DRAM bytes summed, the minimum and the ratio."""
    row = {"op": call["op"], "case": call["case"], "mode": call["mode"], "variant": call["variant"],
           "minimum_bytes": call.get("minimum_bytes"), "read_bytes": None, "write_bytes": None, "bytes": None,
           "ratio": None, "triton_bytes": None, "gpu_time_ms": None, "kernels": [], "skipped": skipped}
    if skipped:
        return row
    row["kernels"] = [{"id": k.id, "name": k.name, "triton": k.name in triton_names, "grid": k.grid,
                       "block": k.block, "read_bytes": k.read_bytes, "write_bytes": k.write_bytes,
                       "gpu_time_ns": k.time_ns} for k in kernels]
    row["read_bytes"] = _total(k.read_bytes for k in kernels)
    row["write_bytes"] = _total(k.write_bytes for k in kernels)
    row["bytes"] = row["read_bytes"] + row["write_bytes"]
    row["triton_bytes"] = _total(k.read_bytes + k.write_bytes for k in kernels if k.name in triton_names)
    time_ns = _total(k.time_ns for k in kernels)
    row["gpu_time_ms"] = None if time_ns is None else time_ns / 1e6
    minimum = row["minimum_bytes"]
    row["ratio"] = row["bytes"] / minimum if minimum else None
    if not kernels:
        row["skipped"] = "no kernel was profiled in the call (a --kernel-regex that matches none of its kernels?)"
    return row


def plan_calls(ops, case_set: str, modes=None, variants=None, match=None, calls_per_process: int = 32) -> list:
    """The calls to profile: for each operator, each case of ``case_set`` (those ``match`` finds), each mode and
    variant asked for (default: every mode the variant runs, the operator's ratio subject), numbered in order and
    cut into parts of at most ``calls_per_process`` calls without splitting a case (a case with more calls than
    that is a part of its own). Each call carries the operator's minimum bytes (None without a model)."""
    calls, part, in_part, last_case = [], 0, 0, None
    for op in ops:
        names = list(variants) if variants else [op.ratio_subject]
        cases = [c for c in op.cases(case_set) if match is None or match.search(c.label)]
        for case in cases:
            case_calls = []
            for name in names:
                if not op.knows(name):
                    continue
                for mode in (modes or op.variant(name).modes):
                    if mode not in op.modes:
                        continue
                    try:
                        minimum = float(op.bytes(case, mode))
                    except NotImplementedError:
                        minimum = None
                    case_calls.append({"op": op.name, "case": case.label, "mode": mode, "variant": name,
                                       "minimum_bytes": minimum})
            if not case_calls:
                continue
            if last_case is not None and in_part + len(case_calls) > calls_per_process:
                part, in_part = part + 1, 0
            for call in case_calls:
                calls.append({"index": len(calls), "part": part, **call})
            in_part += len(case_calls)
            last_case = (op.name, case.label)
    return calls


def document(header: dict, rows: list, status: str) -> dict:
    return {"format": FORMAT, "command": "traffic", "status": status, **header, "traffic": rows}


def part_paths(raw: str, part: int) -> tuple:
    """(ncu's CSV, the driver's manifest) of a part in the raw folder."""
    return os.path.join(raw, f"part-{part:03d}.csv"), os.path.join(raw, f"part-{part:03d}.json")


# A call no ncu part reached (cut, stopped, or its output unreadable): its row's "skipped" starts so, which makes the
# run partial (report.traffic_markdown counts them too).
NOT_PROFILED = "not profiled"


def not_profiled(why: str) -> str:
    return f"{NOT_PROFILED}: {why}" if why else NOT_PROFILED


def was_not_profiled(row) -> bool:
    return (row.get("skipped") or "").startswith(NOT_PROFILED)


def _fill_header(header, machine, autotune):
    """The run's machine and autotuning, from the first part whose driver recorded them."""
    if machine and not header.get("machine"):
        header["machine"] = machine
    if autotune is not None and header.get("autotune") is None:
        header["autotune"] = autotune


def part_rows(plan: dict, part: int, raw: str, triton_names=frozenset()) -> tuple:
    """(rows, machine info or None, autotune flag or None) of one part from its files in ``raw``: a call the
    driver skipped keeps its reason, one it never reached (the part was cut) says so."""
    calls = [c for c in plan["calls"] if c["part"] == part]
    csv_path, manifest_path = part_paths(raw, part)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return [call_row(c, [], skipped=not_profiled("the part's driver never started")) for c in calls], None, None
    except (OSError, ValueError) as exc:
        raise NcuOutputError(f"{manifest_path}: cannot read the driver's manifest: {exc}") from None
    done = {e["index"]: e for e in manifest.get("calls", [])}
    profiled = [e["index"] for e in manifest.get("calls", []) if e.get("status") == "profiled"]
    marked = [e["index"] for e in manifest.get("calls", []) if e.get("status") == "profiled" or e.get("marked")]
    groups = {}
    if profiled:
        try:
            with open(csv_path, errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            raise NcuOutputError(f"{csv_path}: no ncu output, yet the driver profiled {len(profiled)} call(s)") \
                from None
        groups = assign(parse_ncu_csv(text, csv_path), marked, csv_path)
    rows = []
    for call in calls:
        entry = done.get(call["index"])
        if entry is None:
            rows.append(call_row(call, [], skipped=not_profiled("the part stopped before this call")))
        elif entry.get("status") != "profiled":
            rows.append(call_row(call, [], skipped=entry.get("reason") or "skipped"))
        else:
            rows.append(call_row(call, groups[call["index"]], triton_names))
    return rows, manifest.get("machine"), manifest.get("autotune")


def rebuild(raw: str, triton_names=None) -> dict:
    """The document of a run from its raw folder (plan.json, part-NNN.csv and part-NNN.json): what
    ``attnbench traffic --rebuild`` writes, on any machine."""
    try:
        with open(os.path.join(raw, "plan.json")) as f:
            plan = json.load(f)
    except (OSError, ValueError) as exc:
        raise NcuOutputError(f"{raw}: no readable plan.json ({exc})") from None
    names = triton_kernel_names() if triton_names is None else triton_names
    header, rows, complete = dict(plan.get("header") or {}), [], True
    for part in sorted({c["part"] for c in plan["calls"]}):
        part_rows_, machine, autotune = part_rows(plan, part, raw, names)
        rows += part_rows_
        complete = complete and not any(map(was_not_profiled, part_rows_))
        _fill_header(header, machine, autotune)
    return document(header, rows, "complete" if complete else "interrupted")


# ---------------------------------------------------------------- reading a document back

def is_traffic(data) -> bool:
    return isinstance(data, dict) and data.get("command") == "traffic" and isinstance(data.get("traffic"), list)


def sniff(path: str) -> bool:
    """True when ``path`` holds a traffic document (anything else, unreadable files included: False)."""
    try:
        with open(path) as f:
            return is_traffic(json.load(f))
    except (OSError, ValueError):
        return False


def load(path: str) -> dict:
    """A validated traffic document; ``results.BadResultFile`` says in one line what is wrong."""
    return validate(results.read_json(path), path)


def validate(data, path: str = "traffic file") -> dict:
    """``data`` itself where it is a well-formed traffic document; else ``results.BadResultFile``, one line."""
    if not is_traffic(data):
        raise results.BadResultFile(f"{path}: not a traffic file (attnbench traffic --json writes them)")
    for i, row in enumerate(data["traffic"]):
        where = f"{path}: traffic[{i}]"
        if not isinstance(row, dict):
            raise results.BadResultFile(f"{where} is not an object")
        for key in ("op", "case", "mode", "variant"):
            if not isinstance(row.get(key), str):
                raise results.BadResultFile(f"{where}: '{key}' is missing or not a string")
        for key in ("minimum_bytes", "read_bytes", "write_bytes", "bytes", "ratio", "triton_bytes", "gpu_time_ms"):
            value = row.get(key)
            if value is not None and not results._number(value):
                raise results.BadResultFile(f"{where}: '{key}' must be a number or null, got {value!r}")
        if not isinstance(row.get("kernels", []), list):
            raise results.BadResultFile(f"{where}: 'kernels' must be a list")
    return data


def merge(docs: list, paths: list) -> dict:
    """One document of a run filed in parts (``--match`` splits): ``results.merge``'s rules on the traffic rows."""
    return results.merge(docs, paths, kinds=("traffic",))


# ---------------------------------------------------------------- running ncu (the GPU machine)

def ncu_command(ncu: str, csv_path: str, driver: list, kernel_regex: str | None = None) -> list:
    """The ncu command line of one part: ``driver`` (the Python command of ``drive``) under ncu, profiling only
    between cudaProfilerStart and cudaProfilerStop, the three metrics printed as CSV in base units to
    ``csv_path``. ``kernel_regex`` narrows ncu to the kernels whose function name it matches (the marker stays
    in)."""
    command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--replay-mode", "kernel",
               "--cache-control", "all", "--metrics", ",".join(METRICS), "--csv", "--page", "details",
               "--print-units", "base", "--print-kernel-base", "function", "--log-file", csv_path]
    if kernel_regex:
        command += ["--kernel-name-base", "function", "--kernel-name", f"regex:{MARKER}|{kernel_regex}"]
    return command + list(driver)


def ncu_version(ncu: str) -> str | None:
    try:
        done = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


def _run_part(command: list, timeout_s: float | None, log) -> tuple:
    """(exit status, seconds) of one ncu process; past ``timeout_s`` its whole process group is killed and the
    status is None. The driver's progress lines go to ``log`` (stderr)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    except BaseException:  # Ctrl-C: the ncu process and the driver under it go too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return rc, time.perf_counter() - start


def profile(plan: dict, raw: str, ncu: str, out_path: str, budget_s: float | None = None, progress=None,
            log=2) -> dict:
    """Run every part of ``plan`` under ncu (one process each), rewriting the document at ``out_path`` after each
    part. With ``budget_s``, a part is not started when the slowest part so far would not finish within it, and
    a running part is stopped at it: the document then says "interrupted" and which calls were not profiled.
    ``log``: where ncu's process writes (the driver's progress lines; a file descriptor, default stderr's)."""
    names = triton_kernel_names()
    header, rows_of = dict(plan.get("header") or {}), {}
    parts = sorted({c["part"] for c in plan["calls"]})
    start, slowest, status = time.perf_counter(), 0.0, "running"

    def say(text):
        if progress:
            progress(text)

    def write(state):
        rows = [r for p in parts for r in rows_of.get(p, [])]
        done = {(r["op"], r["case"], r["mode"], r["variant"]) for r in rows}
        rows += [call_row(c, [], skipped=not_profiled("the run stopped before its part"))
                 for c in plan["calls"] if (c["op"], c["case"], c["mode"], c["variant"]) not in done] \
            if state != "running" else []
        results.write_atomic(out_path, json.dumps(document(header, rows, state), indent=1) + "\n")

    for part in parts:
        elapsed = time.perf_counter() - start
        left = None if budget_s is None else budget_s - elapsed
        if left is not None and (left <= 0 or (slowest and slowest > left)):
            say(f"traffic: part {part + 1}/{len(parts)} not started: {elapsed:.0f} s of the {budget_s:.0f} s budget "
                f"gone, the slowest part took {slowest:.0f} s")
            status = "interrupted"
            break
        csv_path, manifest_path = part_paths(raw, part)
        driver = [sys.executable, "-m", "attnbench.bench.traffic", os.path.join(raw, "plan.json"), str(part),
                  manifest_path]
        count = sum(1 for c in plan["calls"] if c["part"] == part)
        say(f"traffic: part {part + 1}/{len(parts)}, {count} calls, under {ncu}")
        try:
            rc, seconds = _run_part(ncu_command(ncu, csv_path, driver, plan.get("kernel_regex")), left, log)
        except KeyboardInterrupt:  # the parts that finished stay in the file, marked as an interrupted run
            write("interrupted")
            raise
        slowest = max(slowest, seconds)
        problem = ""
        try:
            rows, machine, autotune = part_rows(plan, part, raw, names)
        except NcuOutputError as exc:
            # a killed or failed part may leave no CSV, or one that does not read: its calls say so, the other
            # parts are kept (the raw folder holds what ncu wrote)
            rows = [call_row(c, [], skipped=not_profiled("")) for c in plan["calls"] if c["part"] == part]
            machine, autotune, problem = None, None, f" ({exc})"
        if rc != 0 or problem:
            what = "was stopped at the budget" if rc is None else f"exited {rc}" if rc else "output does not read"
            for row in rows:
                if was_not_profiled(row):
                    row["skipped"] = not_profiled(f"ncu {what}{problem}")
            say(f"traffic: part {part + 1}: ncu {what}{problem}")
            status = "interrupted" if rc is None else "error"
        _fill_header(header, machine, autotune)
        rows_of[part] = rows
        write("running")
        if rc is None:
            break
    if status == "running":
        status = "complete"
    write(status)
    with open(out_path) as f:
        return json.load(f)  # what the file holds, NaN-free: the rows as a reader gets them


def new_plan(calls: list, argv, ncu: str, case_set: str, operators: dict, device="cuda", seed: int = 0,
             kernel_regex: str | None = None) -> dict:
    """What the driver of each part reads (plan.json): the calls, the case set, seed and device, and the header
    of the document (when, which code, which ncu and its command line for a part)."""
    from .provenance import code_version

    example = ncu_command(ncu, "part-NNN.csv", ["python", "-m", "attnbench.bench.traffic", "plan.json", "PART",
                                                 "part-NNN.json"], kernel_regex)
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "argv": list(argv),
              "machine": None, "code": code_version(), "autotune": None,
              "ncu": {"version": ncu_version(ncu), "command": example, "metrics": list(METRICS)},
              "case_set": case_set, "operators": operators}
    return {"format": FORMAT, "device": str(device), "seed": seed, "case_set": case_set,
            "kernel_regex": kernel_regex, "header": header, "calls": calls}


# ---------------------------------------------------------------- the driver (runs under ncu)

_MARKER_KERNEL = []


def _marker_kernel():
    """The marker: an empty Triton kernel named MARKER, launched with grid (index + 1,)."""
    if not _MARKER_KERNEL:
        import triton

        def attnbench_traffic_marker(X):
            pass

        _MARKER_KERNEL.append(triton.jit(attnbench_traffic_marker))
    return _MARKER_KERNEL[0]


def drive(plan: dict, part: int, manifest_path: str, warmups: int = 2) -> dict:
    """Make the calls of one part: per case its inputs; per call the variant's preparation, ``warmups`` untimed
    calls (compilation, autotuning), then the profiler on, the marker, the call, a synchronization and the
    profiler off. The manifest (which calls were profiled, which skipped and why) is rewritten after each call; a
    call that raises is recorded with its error and the part goes on. On a CPU (the tests) the profiler and the
    marker are left out."""
    import torch

    from ..kernels.tuning import autotune_enabled
    from .registry import Unsupported, first_line, get
    from .runner import Progress, _case_inputs, is_out_of_memory
    from .roofline import machine_info

    device = torch.device(plan.get("device", "cuda"))
    cuda = device.type == "cuda"
    manifest = {"format": FORMAT, "part": part, "machine": machine_info(device), "autotune": autotune_enabled(),
                "calls": []}
    results.write_atomic(manifest_path, json.dumps(manifest, indent=1))
    marker = _marker_kernel() if cuda else None
    if cuda:
        flag = torch.empty(1, device=device)
        marker[(1,)](flag)  # compiled and loaded outside the profiled range
        torch.cuda.synchronize(device)
    calls = [c for c in plan["calls"] if c["part"] == part]
    case_maps, current, inputs = {}, None, None
    bar = Progress(len(calls))
    for call in calls:
        op = get(call["op"])
        if op.name not in case_maps:
            case_maps[op.name] = {c.label: c for c in op.cases(plan["case_set"])}
        case = case_maps[op.name][call["case"]]
        entry = {"index": call["index"], "status": "skipped", "reason": ""}
        if current != (op.name, case.label):
            inputs = None
            if cuda:
                torch.cuda.empty_cache()
            current = (op.name, case.label)
            inputs, _, _ = _case_inputs(op, case, device, plan.get("seed", 0), lambda x: None)  # None: out of memory
        try:
            if inputs is None:
                raise Unsupported("inputs out of memory")
            variant = op.variant(call["variant"])
            if call["mode"] not in variant.modes:
                raise Unsupported(f"{variant.name} does not implement mode {call['mode']}")
            fn = variant.prepare(case, inputs, call["mode"])
            t0 = time.perf_counter()
            for _ in range(warmups):
                fn()
            if cuda:
                torch.cuda.synchronize(device)
            entry["warmup_s"] = round(time.perf_counter() - t0, 3)
            if cuda:
                torch.cuda.profiler.start()
            try:
                if cuda:
                    marker[(call["index"] + 1,)](flag)
                    entry["marked"] = True  # ncu saw the marker: a call that fails after it is matched, then dropped
                fn()
                if cuda:
                    torch.cuda.synchronize(device)
            finally:
                if cuda:
                    torch.cuda.profiler.stop()
            entry["status"] = "profiled"
        except Unsupported as exc:
            entry["reason"] = str(exc)
        except Exception as exc:  # a failing call is reported and the part goes on (the check pass judges kernels)
            entry["reason"] = ("out of memory" if is_out_of_memory(exc)
                               else f"error: {type(exc).__name__}: {first_line(exc, 200)}")
        fn = None
        manifest["calls"].append(entry)
        results.write_atomic(manifest_path, json.dumps(manifest, indent=1))
        shown = entry["status"] if not entry["reason"] else f"skipped: {entry['reason']}"
        bar.step(f"traffic {call['op']} {call['variant']} {call['mode']} {call['case']}  {shown}")
    return manifest


def main(argv=None) -> int:
    """``python -m attnbench.bench.traffic PLAN PART MANIFEST``: the driver of one part (``attnbench traffic``
    runs it under ncu)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m attnbench.bench.traffic PLAN PART MANIFEST (attnbench traffic runs it under ncu)",
              file=sys.stderr)
        return 2
    with open(args[0]) as f:
        plan = json.load(f)
    drive(plan, int(args[1]), args[2])
    return 0


def find_ncu(name: str | None) -> str | None:
    """The ncu executable: ``name`` (a path or a command on PATH), else $NCU, else ``ncu`` on PATH."""
    candidate = name or os.environ.get("NCU") or "ncu"
    return candidate if os.path.isfile(candidate) and os.access(candidate, os.X_OK) else shutil.which(candidate)


if __name__ == "__main__":
    sys.exit(main())
