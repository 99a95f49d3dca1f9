"""Turn a ``--json`` report of ``attnbench bench``/``run`` into a markdown summary and a plot, and index
every committed result file.

    attnbench report results/nvidia-h200/flash/anchor.json --markdown out.md --plot out.png
    attnbench report --index                  # results/index.csv: one row per measurement

The markdown gives, per case and mode, each variant's latency and TF/s and the Triton variant's
speed as a multiple of every peer's; the plot shows TF/s per variant, one panel per mode. The index
is a tidy table (operator, case, mode, variant, clock, median, TF/s, GB/s, GPU, commit, date, file)
of every timed row under results/, for filtering and plotting across runs without opening each file.
"""
import math
import os
from collections import defaultdict

from . import results
from .cases import base_case_set
from .provenance import describe


def load(path):
    """A validated result file, complete or partial; ``results.BadResultFile`` says what is wrong."""
    return results.load(path)


def _rows(report):
    return [r for r in report.get("bench", []) if r.get("timing")]


def _claim(report, op_name):
    """(subject, peers) of an operator: as recorded in the file, else the registered operator's."""
    recorded = (report.get("operators") or {}).get(op_name) or {}
    if "ratio_subject" in recorded and "ratio_peers" in recorded:
        return recorded["ratio_subject"], tuple(recorded["ratio_peers"])
    from .registry import all_operators

    op = all_operators().get(op_name)
    return (op.ratio_subject, tuple(op.ratio_peers)) if op else ("triton", ())


def _num(value, spec):
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _comparable(a, b):
    ma, mb = a["timing"].get("method"), b["timing"].get("method")  # files from before "method": one clock
    return ma == mb and ma != "interpreter"


def _code_lines(code):
    """The code that produced the report (attnbench.bench.provenance): one line, or one a part where parts differ."""
    if isinstance(code, dict) and "parts" in code:
        return [f"Code: parts from {len({describe(c) for c in code['parts']})} versions:",
                *(f"- {os.path.basename(str(c.get('file')))}: {describe(c)}" for c in code["parts"])]
    return [f"Code: {describe(code)}."]


def variant_kinds(op_name) -> dict:
    """{variant: kind} of a registered operator's default set ("reference", "split", "triton", "peer"); {} for an
    operator this checkout does not register (a file from elsewhere, a test's toy)."""
    from .registry import all_operators

    op = all_operators().get(op_name)
    return {name: v.kind for name, v in op.variants.items()} if op else {}


def peer_candidates(op_name, rows, declared) -> list:
    """The variants a table may set beside the subject: the declared ratio peers first, then every other variant
    of kind "peer" with a row here, then our other Triton variants and forced routes (``triton@tma``,
    ``triton_fused``: a route timed beside the default is what such a run is for; they had no column and no
    mention), in the order they ran. A candidate gets a column only where it was measured on the subject's clock
    (``_subject_table``)."""
    kinds = variant_kinds(op_name)
    ran = [r["variant"] for r in rows]
    return list(dict.fromkeys([*declared, *(v for v in ran if kinds.get(v) == "peer"),
                               *(v for v in ran if kinds.get(v) == "triton" or "@" in v)]))


def _gpu_time(row, machine) -> bool:
    return clock(row, machine) == "gpu_time"


def _measured(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _ratio(peer, ours, name):
    """peer / ours on clock ``name`` ("timing": GPU time, only between comparable methods; "eager"), or None."""
    if not peer or not ours:
        return None
    if name == "timing":
        return peer["timing"]["median_ms"] / ours["timing"]["median_ms"] if _comparable(peer, ours) else None
    a, b = (peer.get("eager") or {}).get("median_ms"), (ours.get("eager") or {}).get("median_ms")
    return a / b if a and b else None


def past_bound(row):
    """The row's error against float64 where it is past its dtype's bound (verify.BOUNDS, for the dtype its label ends
    in), else None: a peer's ratio to a wrong answer is marked, not shown plain (a ``bench`` run times such a row)."""
    from .cases import DTYPES, label_dtype
    from .verify import BOUNDS

    dtype = label_dtype(row["case"])
    error = row.get("max_error")
    if dtype is None or not _measured(error) or error <= BOUNDS[DTYPES[dtype]]:
        return None
    return error


def _ratio_cell(peer, ours, name):
    x = _ratio(peer, ours, name)
    if x is None:
        return "n/a"
    return f"{x:.2f}x" + (" !" if past_bound(peer) is not None else "")


def _floor_cell(row):
    """``NN (binding)``: the row's share of its attainable floor (bench/floors.py) and the resource that binds."""
    if not _measured(row.get("floor_pct")):
        return "-"
    return f"{row['floor_pct']:.0f} ({row.get('floor_binding') or '?'})"


def _subject_table(by_key, subject, candidates, machine):
    """(lines of the table, the peers with a GPU-time column, those with an eager one, the candidates left without
    a column, whether the subject's eager latency has one). A column is there only when some row has its
    value: TF/s on GPU time, a peer's ratio where the peer ran on the subject's clock, eager latency where it was
    measured, % roofline where the run had ceilings; so a CPU run shows what a CPU measures, and a peer that never
    ran (or ran only on another clock) gets no column of n/a."""
    ours_rows = {key: v[subject] for key, v in by_key.items() if subject in v}
    if not ours_rows:
        return [], [], [], list(candidates), False
    ours = list(ours_rows.values())
    show_tflops = any(_gpu_time(r, machine) and _measured(r.get("tflops")) for r in ours)
    vs = [p for p in candidates if any(_ratio(by_key[k].get(p), r, "timing") for k, r in ours_rows.items())]
    show_eager = any(r.get("eager") for r in ours)
    vs_eager = [p for p in candidates if any(_ratio(by_key[k].get(p), r, "eager") for k, r in ours_rows.items())]
    show_roof = any(_measured(r.get("roofline_pct")) for r in ours)
    show_floor = any(_measured(r.get("floor_pct")) for r in ours)
    show_err = any(_measured(r.get("max_error")) or r.get("unverified") for r in ours)
    headers = (["case", "mode", f"{subject} ms"] + [f"{subject} TF/s"] * show_tflops + [f"vs {p}" for p in vs]
               + [f"{subject} eager ms"] * show_eager + [f"vs {p} eager" for p in vs_eager]
               + ["% roofline"] * show_roof + ["% of floor (binding)"] * show_floor + ["max rel. error"] * show_err)
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for (case, mode), r in ours_rows.items():
        variants = by_key[case, mode]
        cells = [case, mode, f"{r['timing']['median_ms']:.3f}"]
        if show_tflops:
            # three figures: a decode row's 0.52 TF/s read "0" at .0f
            cells.append(_num(r.get("tflops") if _gpu_time(r, machine) else None, ".3g"))
        for p in vs:
            cells.append(_ratio_cell(variants.get(p), r, "timing"))
        if show_eager:
            cells.append(_num((r.get("eager") or {}).get("median_ms"), ".3f"))
        for p in vs_eager:
            cells.append(_ratio_cell(variants.get(p), r, "eager"))
        if show_roof:
            cells.append(_num(r.get("roofline_pct"), ".0f"))
        if show_floor:
            cells.append(_floor_cell(r))
        if show_err:
            cells.append("unverified" if r.get("unverified") else _num(r.get("max_error"), ".1e"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines, vs, vs_eager, [p for p in candidates if p not in vs and p not in vs_eager], show_eager


def _untimed_lines(report, op, subject):
    """The subject's rows of ``op`` that have no timing (skipped: out of memory, a declined case; or failed), each
    with its reason: a table of timed rows alone had dropped them without a word."""
    untimed = [r for r in report.get("bench", []) if r["op"] == op and r["variant"] == subject and not r.get("timing")]
    if not untimed:
        return []
    return ["", f"Not timed ({subject}, {len(untimed)} rows):",
            *(f"- {r['case']} {r['mode']}: {r.get('skipped') or 'no timing'}" for r in untimed)]


def markdown(report, subject=None, peers=None) -> str:
    """Per operator, one row per case and mode: the subject's latency and TF/s (GPU clocks only),
    its speed as a multiple of each peer's (peer latency over ours, same clock only), % of
    roofline, error. The peers are ``peers``, else the operator's declared ratio peers and every
    other variant of kind "peer" in the file; only those measured on the subject's clock get a
    column, and only measured quantities get one (``_subject_table``)."""
    machine = report.get("machine") or {}
    ceil = report.get("ceilings") or {}
    rows = _rows(report)
    ops = list(dict.fromkeys(r["op"] for r in report.get("bench", []) + report.get("checks", [])))
    lines = [f"# {', '.join(ops) or 'attnbench'} on {machine.get('device_name', '?')}", "",
             f"torch {machine.get('torch')}, triton {machine.get('triton')}, CUDA {machine.get('cuda')}.",
             *_code_lines(report.get("code"))]
    status = report.get("status", "complete")
    if status != "complete":
        lines.append(f"**Partial run** (status: {status}): {len(report.get('bench', []))} bench and "
                     f"{len(report.get('checks', []))} check rows finished; the rest never ran.")
    for kind, count in (report.get("replaced_rows") or {}).items():
        lines.append(f"{count} {kind} rows were in more than one part: the later part's are shown.")
    if machine.get("device") == "cpu":
        lines.append("CPU run: Triton timings come from the interpreter; they show that code runs, not how fast.")
    if ceil:
        lines.append(f"Measured ceilings: bf16 matmul {ceil['matmul_tflops']:.0f} TF/s, "
                     f"device copy {ceil['copy_gbps']:.0f} GB/s.")
    checks = report.get("checks", [])
    if checks:
        passed = sum(1 for c in checks if c.get("passed"))
        skipped = sum(1 for c in checks if c.get("skipped"))
        lines.append(f"Checks: {passed} passed, {len(checks) - passed - skipped} failed, {skipped} skipped.")
    any_vs = any_eager = False
    subject_clocks = set()
    for op in ops:
        op_subject, op_peers = _claim(report, op)
        op_subject = subject or op_subject
        op_rows = [r for r in rows if r["op"] == op]
        by_key = defaultdict(dict)
        for r in op_rows:
            by_key[r["case"], r["mode"]][r["variant"]] = r
        candidates = [p for p in (peer_candidates(op, op_rows, op_peers) if peers is None else peers)
                      if p != op_subject]
        if len(ops) > 1:
            lines += ["", f"## {op}"]
        table, vs, vs_eager, left_out, eager = _subject_table(by_key, op_subject, candidates, machine)
        if not table:
            lines.append(f"\n(no timed {op_subject} row for {op})")
            lines += _untimed_lines(report, op, op_subject)
            continue
        any_vs, any_eager = any_vs or bool(vs or vs_eager), any_eager or eager
        subject_clocks |= {clock(r, machine) for r in op_rows if r["variant"] == op_subject}
        lines += ["", *table]
        if left_out:
            lines += ["", f"No column for {', '.join(left_out)}: not timed on {op_subject}'s clock in this file."]
        lines += _untimed_lines(report, op, op_subject)
    named = " / ".join(dict.fromkeys(subject or _claim(report, op)[0] for op in ops)) or "the subject"
    notes = []
    if any_vs:
        notes.append(f"'vs peer' is the peer's median latency over {named}'s, measured in the same run on the same "
                     f"clock: above 1 means {named} is faster; n/a: the peer did not run that case, or on another "
                     "clock.")
        if any(past_bound(r) is not None for r in rows if r["variant"] != (subject or _claim(report, r["op"])[0])):
            notes.append("!: that variant's answer is past its float64 bound (its max_error in the JSON; expected of "
                         "the eager reference in 16 bits, a red flag for a peer): the ratio is to a wrong answer.")
    if subject_clocks == {"gpu_time"} and (any_vs or any_eager):
        graphs = any((r.get("timing") or {}).get("method") == "cuda-graph" for r in rows)
        notes.append("ms and 'vs peer' are GPU time ("
                     + ("CUDA-graph replays, back to back, L2 not flushed" if graphs else "CUDA events, L2 flushed")
                     + ": the kernels' cost)"
                     + ("; 'eager' columns are eager latency (wall time per call back to back, host included: what "
                        "a Python caller pays)." if any_eager else "."))
    elif subject_clocks - {"gpu_time"}:
        notes.append(f"ms are on the run's own clock ({', '.join(sorted(subject_clocks))}): cpu_wall is wall time on "
                     "the CPU; the interpreter's times show that code runs, not how fast, and are never divided.")
    if notes:
        lines += ["", " ".join(notes)]
    return "\n".join(lines) + "\n"


# max / min of a panel's bars beyond which its axis is logarithmic
LOG_SPAN = 20


# Past this many cases a run's plot is the subject's speedup per shape (bars per case would be unreadable).
MANY_CASES = 24


def plot(report, path):
    """Grouped bars of TF/s: one panel per mode, cases along x, one bar per variant; a logarithmic axis where a
    panel's bars span more than LOG_SPAN (peers 10x-300x slower, as sparse's are, would be flat on a linear one).
    A run of more than MANY_CASES cases, or of the random set, gets ``plot_speedups`` instead."""
    # interpreter timings show that code runs, not how fast: their TF/s beside another clock's would read as a
    # comparison the tables refuse to make (found by review)
    rows = [r for r in _rows(report) if r["timing"].get("method") != "interpreter"]
    if not rows:
        raise results.BadResultFile("--plot: the file has no timed rows to plot (interpreter rows are not drawn)")
    shape_sets = {base_case_set(info.get("case_set")) for info in (report.get("operators") or {}).values()}
    if len({r["case"] for r in rows}) > MANY_CASES or shape_sets & {"random"}:
        return plot_speedups(report, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    value = {(r["case"], r["mode"], r["variant"]): math.nan if r.get("tflops") is None else r["tflops"] for r in rows}
    # a few cases get wide groups and flat labels; a sweep of tens of cases, narrow bars and slanted labels
    many = len(cases) > 8
    per_case = min(2.2, 0.12 * len(variants) + 0.1) if many else 2.2
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, per_case * len(cases)), (4.5 if many else 3.2) * len(modes)),
                             squeeze=False)
    width = 0.8 / len(variants)
    for ax, mode in zip(axes[:, 0], modes):
        for i, variant in enumerate(variants):
            ys = [value.get((c, mode, variant), math.nan) for c in cases]
            ax.bar([x + i * width for x in range(len(cases))], ys, width, label=variant)
        ax.set_title(f"{mode}")
        positive = [v for (_, m, _), v in value.items() if m == mode and v > 0]  # NaN compares False
        log = bool(positive) and max(positive) > LOG_SPAN * min(positive)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel("TF/s (log scale)" if log else "TF/s")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases, fontsize=6 if many else 8,
                      rotation=75 if many else 0, ha="right" if many else "center")
        ax.set_xlim(-0.5, len(cases))
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(ncol=min(4, len(variants)), fontsize=8)
    ops = ", ".join(dict.fromkeys(r["op"] for r in rows if r.get("op")))
    fig.suptitle(f"{report.get('machine', {}).get('device_name', '')}: {ops or 'throughput'} by variant "
                 f"(each operator's FLOP model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    scales = [ax.get_yscale() for ax in axes[:, 0]]
    plt.close(fig)
    return scales


def speedup_points(report):
    """{(op, mode): {clock: {peer: [(peer ms, ratio, case), ...]}}}: for each case the subject ran, the ratio peer
    time / subject time on each clock ("timing": GPU time between comparable methods; "eager"), keyed by the
    peer's own time on that clock (the shape's size as the peer sees it)."""
    by_key = {}
    for r in _rows(report):
        by_key.setdefault((r.get("op", ""), r["mode"], r["case"]), {})[r["variant"]] = r
    points = {}
    for (op, mode, case), variants in by_key.items():
        subject, declared = _claim(report, op)
        ours = variants.get(subject)
        if not ours:
            continue
        for peer in peer_candidates(op, list(variants.values()), declared):
            if peer == subject:
                continue
            for name in ("timing", "eager"):
                ratio = _ratio(variants.get(peer), ours, name)
                if ratio:
                    peer_ms = variants[peer][name]["median_ms"]
                    points.setdefault((op, mode), {}).setdefault(name, {}).setdefault(peer, []).append(
                        (peer_ms, ratio, case))
    return points


def plot_speedups(report, path):
    """The subject's speedup over each peer, one point per shape: a row of panels per (operator, mode), GPU time
    on the left and eager latency on the right; x the peer's time (log: small shapes left), y peer time / ours
    (log; above the line at 1 ours is faster). Each panel's legend counts the shapes below 1 and names the worst.
    Returns the panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = speedup_points(report)
    if not points:
        raise results.BadResultFile("--plot: no case has the subject and a peer timed on one clock")
    clocks = (("timing", "GPU time (CUDA events, L2 flushed)"), ("eager", "eager latency (wall per call)"))
    fig, axes = plt.subplots(len(points), 2, figsize=(13, 4.2 * len(points)), squeeze=False, sharey="row")
    titles = []
    for row, ((op, mode), by_clock) in zip(axes, sorted(points.items())):
        subject = _claim(report, op)[0]
        for ax, (name, label) in zip(row, clocks):
            for peer, pts in sorted(by_clock.get(name, {}).items()):
                xs, ys, cases = zip(*pts)
                below = sorted((y, c) for y, c in zip(ys, cases) if y < 1.0)
                worst = f"; worst {below[0][0]:.2f}x {below[0][1]}" if below else ""
                ax.scatter(xs, ys, s=14, alpha=0.75, label=f"vs {peer}: {len(below)} of {len(ys)} below 1{worst}")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("the peer's time per call, ms (log)")
            title = f"{op} {mode}, {label}"
            titles.append(title)
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3, which="both")
            if ax.has_data():
                ax.legend(fontsize=7, loc="lower right")
            else:
                ax.text(0.5, 0.5, "not measured on this clock", transform=ax.transAxes, ha="center")
        row[0].set_ylabel(f"{subject} speedup = peer time / {subject}'s (log)")
    fig.suptitle(f"{report.get('machine', {}).get('device_name', '')}: speedup per shape, "
                 f"{len({c for v in points.values() for pts in v.values() for p in pts.values() for *_, c in p})} shapes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return titles


# ---------------------------------------------------------------- the index of committed results

INDEX_COLUMNS = ("operator", "case", "mode", "variant", "clock", "method", "median_ms", "iqr_ms", "tflops", "gbps",
                 "roofline_pct", "max_error", "gpu", "device_name", "commit", "date", "file")
# folders under results/ that hold other tools' files, not attnbench result files
INDEX_SKIP_DIRS = ("asv", "html")


def clock(row, machine) -> str:
    """The clock a row's ``timing`` was taken on: "gpu_time" (CUDA events or graph replays, L2 flushed: what the
    kernels cost), "cpu_wall", "interpreter"; a row's own "clock" field wins. Its "eager" and "host" timings, where
    present, are indexed as rows of those clocks."""
    timing = row.get("timing") or {}
    if timing.get("clock"):
        return str(timing["clock"])
    method = timing.get("method") or ("cuda-events" if (machine or {}).get("device") != "cpu" else "cpu-wall")
    return {"cuda-events": "gpu_time", "cuda-graph": "gpu_time", "cpu-wall": "cpu_wall"}.get(method, method)


def _short_commit(code):
    if not isinstance(code, dict):
        return ""
    if "parts" in code:  # a merged document; files on disk are single runs, kept for completeness
        return " ".join(dict.fromkeys(_short_commit(c) for c in code["parts"]))
    commit = (code.get("commit") or "")[:7]
    return commit + ("+dirty" if commit and code.get("dirty") else "")


def _git_dates(root):
    """{path relative to the checkout: date (YYYY-MM-DD) of the last commit that wrote its content}: a pure rename
    (git mv) keeps the date, a rewrite (a later run over the same name) takes its own; {} outside a git checkout.
    One ``git log`` over the folder, oldest first."""
    history, top = git_history(root)
    return {path: date for path, (date, _) in history.items()}, top


def git_history(root):
    """({path relative to the checkout: (date, order)}, the checkout's top folder): the date of the last commit
    that wrote the file's content, as ``_git_dates`` gives it, and that commit's place in the history (0 the
    oldest), which orders files written on the same day. ({}, None) outside a git checkout."""
    import subprocess

    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        log = subprocess.run(["git", "-C", top, "log", "--reverse", "-M", "--diff-filter=AMR", "--name-status",
                              "--format=@%cs", "--", os.path.relpath(os.path.realpath(root), top)],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}, None
    history, date, order = {}, "", -1
    for line in log.splitlines():
        if line.startswith("@"):
            date, order = line[1:], order + 1
        elif line:
            fields = line.split("\t")
            if fields[0].startswith("R") and len(fields) == 3:
                moved = history.pop(fields[1], (date, order))
                history[fields[2]] = moved if fields[0] == "R100" else (date, order)
            elif fields[0] in ("A", "M"):
                history[fields[1]] = (date, order)
    return history, top


def _gpu_folder(rel, machine):
    """results/<gpu>/<op>/<run>.json names its GPU by the folder; elsewhere the machine's slug."""
    parts = rel.split(os.sep)
    if len(parts) > 1:
        return parts[0]
    name = (machine or {}).get("device_name") or ""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "unknown"


# A bench row's clocks beside its ``timing``, each indexed as a measurement of its own where the row was timed on it.
OTHER_CLOCKS = ("eager", "host")


def measurements(row) -> int:
    """How many rows of results/index.csv a timed bench row makes: its timing and each of its other clocks."""
    return 1 + sum(1 for name in OTHER_CLOCKS if row.get(name))


def json_files(root):
    """Every .json under ``root`` in a stable order (folders and files sorted), asv's folders at the top
    (``INDEX_SKIP_DIRS``) left out: what the index and the results pages read."""
    for folder, dirs, files in os.walk(root):
        if os.path.samefile(folder, root):
            dirs[:] = [d for d in dirs if d not in INDEX_SKIP_DIRS]
        dirs.sort()
        yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith(".json"))


def index(root):
    """Every timed row of every attnbench result file under ``root`` (results/), one tidy row per measurement,
    and the files that were not read, each with a one-line reason. asv's own folders are not walked.

    ``clock`` says what the median measures ("gpu_time", "eager", "host", "cpu_wall"), ``gpu`` is the
    results/<gpu>/ folder, ``commit`` the code's commit as the run recorded it (``+dirty``: the checkout had
    changes; the GPU machine's copy of the tree may record a stale one), ``date`` the run's date where the
    file records one, else the date of the last commit that wrote the file's content (empty outside a git checkout)."""
    from . import traffic

    dates, top = _git_dates(root)
    rows, problems = [], []
    for path in json_files(root):
        rel = os.path.relpath(path, root)
        try:
            data = results.read_json(path)
            if traffic.is_traffic(data):
                problems.append(f"{rel}: a traffic file (attnbench traffic): measured DRAM bytes, no timed rows")
                continue
            results.validate(data, path)
        except results.BadResultFile as exc:
            problems.append(f"{rel}: skipped: {str(exc).split(': ', 1)[-1]}")
            continue
        machine = data.get("machine") or {}
        date = str(data.get("date") or "")[:10]
        if not date and top:
            date = dates.get(os.path.relpath(os.path.realpath(path), top), "")
        timed = [r for r in data.get("bench", []) if r.get("timing")]
        if not timed:
            problems.append(f"{rel}: no timed rows (checks only, or every row skipped)")
        for r in timed:
            common = {"operator": r["op"], "case": r["case"], "mode": r["mode"], "variant": r["variant"],
                      "max_error": r.get("max_error"), "gpu": _gpu_folder(rel, machine),
                      "device_name": machine.get("device_name") or "", "commit": _short_commit(data.get("code")),
                      "date": date, "file": os.path.normpath(path).replace(os.sep, "/")}
            t = r["timing"]
            rows.append({**common, "clock": clock(r, machine), "method": t.get("method") or "",
                         "median_ms": t["median_ms"], "iqr_ms": t.get("iqr_ms"), "tflops": r.get("tflops"),
                         "gbps": r.get("gbps"), "roofline_pct": r.get("roofline_pct")})
            for name in OTHER_CLOCKS:  # the other clocks of a row, where it was timed on them
                if r.get(name):
                    rows.append({**common, "clock": name, "method": r[name].get("method") or "",
                                 "median_ms": r[name]["median_ms"], "iqr_ms": r[name].get("iqr_ms"),
                                 "tflops": None, "gbps": None, "roofline_pct": None})
    return rows, problems


def _cell(value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return format(value, ".6g")
    return str(value)


def write_index(root, out=None):
    """Write ``root``/index.csv (or ``out``); returns (rows written, files skipped with their reasons)."""
    import csv
    import io

    rows, problems = index(root)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(INDEX_COLUMNS)
    for row in rows:
        writer.writerow([_cell(row[c]) for c in INDEX_COLUMNS])
    results.write_atomic(out or os.path.join(root, "index.csv"), buf.getvalue())
    return rows, problems


# ---------------------------------------------------------------- measured traffic (attnbench traffic)

def kernel_names(kernels) -> str:
    """A call's kernels by name, in launch order, a repeated one counted once with its count; a kernel that is not
    one of attnbench's Triton kernels (torch's, cuBLAS's) carries "(lib)"."""
    counts = {}
    for k in kernels:
        key = (k["name"], bool(k.get("triton")))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{name}{'' if triton else ' (lib)'}{f' x{n}' if n > 1 else ''}"
                     for (name, triton), n in counts.items()) or "-"


TRAFFIC_NOTE = (
    "read and written are DRAM bytes as Nsight Compute counts them (`dram__bytes_read.sum`, "
    "`dram__bytes_write.sum`), summed over the kernels of one call, each kernel replayed with the caches flushed "
    "before it and the clocks left alone (`--clock-control none`); minimum is the operator's analytic minimum "
    "(each input read once, each output written once: `op.bytes`). measured / minimum above 1 is traffic beyond "
    "the minimum (re-reads that missed L2, scratch, padding, a second pass); below 1, the L2 kept what the minimum "
    "counts as DRAM traffic (an output still in L2 when its kernel ends may reach DRAM only after the kernel's "
    "count). "
    "(lib): a kernel of torch or a library, not one of attnbench's Triton kernels. docs/traffic.md says more.")


def traffic_markdown(doc, level: int = 1, kernels: bool = True) -> str:
    """The traffic document (``attnbench traffic --json``) as markdown: per operator one row per call (its
    kernels, case, mode, DRAM bytes read and written, the analytic minimum and measured / minimum), then, with
    ``kernels``, one row per kernel. ``level``: the heading level of its title (2 below a run's summary). A
    results page can call this with a loaded document (``traffic.load``)."""
    from . import traffic
    from .tables import megabytes, ratio_cell

    machine = doc.get("machine") or {}
    rows = doc.get("traffic", [])
    ops = list(dict.fromkeys(r["op"] for r in rows))
    h = "#" * level
    ncu = doc.get("ncu") or {}
    lines = [f"{h} Measured DRAM traffic: {', '.join(ops) or 'no operator'} on {machine.get('device_name', '?')}", "",
             f"torch {machine.get('torch')}, triton {machine.get('triton')}, CUDA {machine.get('cuda')}; "
             f"ncu {ncu.get('version') or '(version not recorded)'}; autotuning "
             + {True: "on (the tuned configs, settled before the profiled call)",
                False: "off (ATTNBENCH_AUTOTUNE=0: the default configs)"}.get(doc.get("autotune"), "unknown") + ".",
             *_code_lines(doc.get("code"))]
    status = doc.get("status", "complete")
    if status != "complete":
        left = sum(1 for r in rows if traffic.was_not_profiled(r))
        lines.append(f"**Partial run** (status: {status}): {left} of {len(rows)} calls were not profiled.")
    several = len({r["variant"] for r in rows}) > 1
    for op in ops:
        op_rows = [r for r in rows if r["op"] == op]
        if len(ops) > 1:
            lines += ["", f"{h}# {op}"]
        headers = ["kernels", "case", "mode"] + ["variant"] * several + \
            ["read MB", "written MB", "measured MB", "minimum MB", "measured / minimum"]
        lines += ["", "| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        skipped = []
        for r in op_rows:
            if r.get("skipped"):
                skipped.append(r)
                continue
            cells = [kernel_names(r.get("kernels") or []), r["case"], r["mode"]] + [r["variant"]] * several + \
                [megabytes(r["read_bytes"]), megabytes(r["write_bytes"]), megabytes(r["bytes"]),
                 megabytes(r.get("minimum_bytes")), ratio_cell(r.get("ratio"))]
            lines.append("| " + " | ".join(cells) + " |")
        if skipped:
            lines += ["", "Not measured:"]
            lines += [f"- {r['case']} {r['mode']} {r['variant']}: {r['skipped']}" for r in skipped]
        multi = [r for r in op_rows if not r.get("skipped") and r.get("kernels")]
        if kernels and multi:
            lines += ["", f"Per kernel ({op}; ncu us: the kernel's duration under ncu, caches flushed, clocks "
                          "unlocked; not the bench's timing):", "",
                      "| case | mode | kernel | grid | block | read MB | written MB | ncu us |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for r in multi:
                for k in r["kernels"]:
                    us = k.get("gpu_time_ns")
                    shown_us = "-" if us is None else format(us / 1e3, ".1f")
                    lines.append(f"| {r['case']} | {r['mode']} | {k['name']}{'' if k.get('triton') else ' (lib)'} "
                                 f"| {k.get('grid', '')} | {k.get('block', '')} | {megabytes(k.get('read_bytes'))} "
                                 f"| {megabytes(k.get('write_bytes'))} | {shown_us} |")
    lines += ["", TRAFFIC_NOTE]
    return "\n".join(lines) + "\n"


def plot_traffic(doc, path):
    """Bars of measured / minimum per case, one panel per mode, a line at 1 (the minimum)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc.get("traffic", []) if r.get("ratio") is not None]
    if not rows:
        raise results.BadResultFile("--plot: the traffic file has no measured call against a minimum")
    several_ops = len({r["op"] for r in rows}) > 1
    label = (lambda r: f"{r['op']} {r['case']}") if several_ops else (lambda r: r["case"])
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cases = list(dict.fromkeys(label(r) for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    value = {(label(r), r["mode"], r["variant"]): r["ratio"] for r in rows}
    many = len(cases) > 8
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, (0.3 if many else 2.0) * len(cases)),
                                                     (4.5 if many else 3.2) * len(modes)), squeeze=False)
    width = 0.8 / len(variants)
    for ax, mode in zip(axes[:, 0], modes):
        for i, variant in enumerate(variants):
            ys = [value.get((c, mode, variant), math.nan) for c in cases]
            ax.bar([x + i * width for x in range(len(cases))], ys, width, label=variant)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(mode)
        ax.set_ylabel("measured / minimum bytes")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases, fontsize=6 if many else 8,
                      rotation=75 if many else 0, ha="right" if many else "center")
        ax.set_xlim(-0.5, len(cases))
        ax.grid(axis="y", alpha=0.3)
    if len(variants) > 1:
        axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"{(doc.get('machine') or {}).get('device_name', '')}: DRAM bytes (ncu) over the analytic minimum")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
