"""The results site: one Markdown page per operator, with PNG plots beside it, rendered from results/.

    attnbench report --site [results] --out docs/report

``README.md`` is the index (what results/ and results/index.csv hold, per GPU and operator, and which roofline
each GPU is drawn against); ``<op>.md`` has, per GPU folder (results/<gpu>/):

- **achieved TF/s against arithmetic intensity** (FLOPs over minimum bytes, both from the operator's cost model,
  as the rows record them) with the roofline: the ceilings measured on that GPU (``gate/calibration.txt``, else
  the ceilings the newest run recorded), or the datasheet's where none is committed, labelled so. Every
  GPU-time row of every run of the operator, the newest measurement of each case, mode and variant; the variants
  drawn are ours (kind triton), the peers, the baseline and the declared ratio peers.
- **speedup bars**: the subject (``ratio_subject``, triton) against the run's baseline and against the fastest
  peer that ran beside it, on both clocks where measured (GPU time; eager latency), one pair of bars per case
  and mode of the headline set.
- **the headline table**: the anchor case set (else whatever sets were run), each case and mode from the newest
  complete run that timed the subject there (a partial run only where no complete one did: a run cut short may
  lack the peers of its last case; CUDA events before CUDA-graph replays), every ratio within that one run;
  only columns that were measured (a CPU tree shows times and errors, no TF/s, roofline or GPU ratios).
- **decision verdicts** (``attnbench.bench.decisions``' rule) computed from the headline rows, and the verdict
  files committed for the operator; **the capability matrix** where one is committed (jvp_attention);
- **the runs**: every result file of the operator on that GPU (case set, status, date, commit, rows), linked.

Numbers compare only within one run on one machine: every ratio here is one, and the roofline plot mixes runs
only as points, each against the same ceilings.
"""
import csv
import math
import os
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from . import decisions, floors, report, results, tables, traffic
from .cases import base_case_set

MARKER = "<!-- written by `attnbench report --site`: regenerate it, do not edit -->"
# datasheet peaks (bf16 dense tensor-core TF/s, HBM GB/s) of the GPUs results/ holds, for a GPU with no measured
# ceiling committed; the page says the roofline is the datasheet's
SPEC = {"H100": ("H100 SXM datasheet", 989.0, 3350.0), "H200": ("H200 SXM datasheet", 989.0, 4800.0)}
CALIBRATION = re.compile(r"bf16 matmul ([0-9.]+) TF/s, device copy ([0-9.]+) GB/s")
# (case, mode) pairs per speedup figure: more go to a second figure, so that labels stay legible
BARS_PER_FIGURE = 50


class SiteError(ValueError):
    """The site cannot be written (an --out folder holding other files); the message is one line."""


@dataclass
class Run:
    """One attnbench result file under the results folder."""

    path: str  # as the files are named from here (root joined with rel)
    rel: str  # relative to the results folder: <gpu>/<op>/<run>.json
    data: dict
    date: str  # the run's own (ISO), else the day of the commit that wrote it, else ""
    order: int  # that commit's place in git history (-1: unknown)

    @property
    def gpu(self):
        return report._gpu_folder(self.rel, self.data.get("machine"))

    @property
    def machine(self):
        return self.data.get("machine") or {}

    def ops(self):
        return list(dict.fromkeys(r["op"] for r in self.data.get("bench", []) + self.data.get("checks", [])))

    def timed(self, op):
        return [r for r in self.data.get("bench", []) if r.get("timing") and r["op"] == op]

    def case_set(self, op):
        return str(((self.data.get("operators") or {}).get(op) or {}).get("case_set") or "")

    def claim(self, op):
        return report._claim(self.data, op)

    def graphs(self, op):
        """Timed by CUDA-graph replays (``--graphs``): a clock of its own, after CUDA events in the headline."""
        return any((r["timing"].get("method") == "cuda-graph") for r in self.timed(op))

    @property
    def when(self):
        """Sort key, newest last: the day, the commit that wrote the file, the run's own time."""
        return (self.date[:10], self.order, self.date, self.rel)

    @property
    def complete(self):
        return self.data.get("status", "complete") == "complete"

    @property
    def tuned(self):
        """Launch configs autotuned, as users run them (ATTNBENCH_AUTOTUNE=0 fixes the default configs: a study's
        setting, not a headline's). Files from before the field was recorded ran autotuned."""
        return self.data.get("autotune") is not False

    def rank(self, op):
        """Sort key for ``op``'s headline, the run to show last: an autotuned run after one with fixed configs,
        CUDA events after graph replays, a complete run after a partial one (cut short, its last case may lack
        peers), then the newest."""
        return (self.tuned, not self.graphs(op), self.complete, *self.when)


@dataclass
class Site:
    root: str
    runs: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)  # (rel, data) of decisions files
    capabilities: list = field(default_factory=list)  # (rel, data) of capability matrices
    traffic: list = field(default_factory=list)  # (rel, doc) of `attnbench traffic --json` files
    skipped: list = field(default_factory=list)  # (rel, why) of JSON files that are neither

    def gpus(self):
        return sorted({r.gpu for r in self.runs})

    def ops(self):
        return sorted({op for r in self.runs for op in r.ops() if r.timed(op)})

    def runs_of(self, gpu, op):
        return sorted((r for r in self.runs if r.gpu == gpu and r.timed(op)), key=lambda r: r.rank(op))


def load(root) -> Site:
    """Every JSON under ``root`` except asv's folders: result files, verdict files, capability matrices."""
    history, top = report.git_history(root)
    site = Site(str(root))
    for path in report.json_files(root):
        rel = os.path.relpath(path, root)
        try:  # each file read once, then taken for what it is
            data = results.read_json(path)
            if isinstance(data, dict) and "verdicts" in data and "rule" in data:
                site.verdicts.append((rel, data))
            elif isinstance(data, dict) and {"cells", "columns", "shapes"} <= set(data):
                site.capabilities.append((rel, data))
            elif traffic.is_traffic(data):
                site.traffic.append((rel, traffic.validate(data, path)))
            else:
                results.validate(data, path)
                date, order = history.get(os.path.relpath(os.path.realpath(path), top), ("", -1)) if top else ("", -1)
                site.runs.append(Run(path, rel, data, str(data.get("date") or date), order))
        except results.BadResultFile as exc:
            site.skipped.append((rel, str(exc).split(": ", 1)[-1]))
    return site


# ---------------------------------------------------------------- what a page shows

@dataclass
class Line:
    """One case and mode of the headline: the subject's row and the rows timed beside it in the same run."""

    case: str
    mode: str
    run: Run
    subject: str
    variants: dict  # variant -> row, all from ``run``
    baseline: str | None
    kinds: dict

    @property
    def ours(self):
        return self.variants[self.subject]

    def versus(self, name, clock):
        """Its time over the subject's on ``clock``, where both ran on it comparably; else None."""
        if name == self.subject:
            return None
        return report._ratio(self.variants.get(name), self.ours, "timing" if clock == "gpu_time" else clock)

    def best_peer(self, clock):
        """(name, ratio) of the fastest peer timed beside the subject on ``clock``, or (None, None)."""
        peers = [v for v in self.variants if self.kinds.get(v, "peer" if v in self.declared else None) == "peer"]
        timed = [(v, self.versus(v, clock)) for v in peers]
        timed = [(v, x) for v, x in timed if x is not None]
        return min(timed, key=lambda t: t[1]) if timed else (None, None)

    @property
    def declared(self):
        return self.run.claim(self.ours["op"])[1]


def _baseline(run, op, variants):
    """The variant the run's speedup column divided by (recorded), else the operator's first baseline that ran."""
    recorded = ((run.data.get("operators") or {}).get(op) or {}).get("baseline")
    if recorded in variants:
        return recorded
    from .registry import all_operators

    registered = all_operators().get(op)
    return next((b for b in (registered.baselines if registered else ()) if b in variants), None)


def headline(site, gpu, op):
    """(lines, the case sets they come from): the anchor set's cases and modes (every set where no anchor run
    exists), each from the last run by ``Run.rank`` that timed the subject there."""
    runs = site.runs_of(gpu, op)
    anchor = [r for r in runs if r.case_set(op).startswith("anchor")]
    pool = anchor or runs
    sets = sorted({base_case_set(r.case_set(op)) or "unnamed" for r in pool})
    chosen, order = {}, {}
    for run in sorted(pool, key=lambda r: r.rel):  # the order the cases are listed in: by file, then as run
        for row in run.timed(op):
            order.setdefault((row["case"], row["mode"]), len(order))
    kinds = report.variant_kinds(op)
    for run in pool:  # oldest first: a newer run of the same case and mode replaces it
        subject = run.claim(op)[0]
        for row in run.timed(op):
            if row["variant"] == subject:
                chosen[row["case"], row["mode"]] = run
    lines = []
    for (case, mode), run in sorted(chosen.items(), key=lambda kv: order[kv[0]]):
        variants = {r["variant"]: r for r in run.timed(op) if r["case"] == case and r["mode"] == mode}
        lines.append(Line(case, mode, run, run.claim(op)[0], variants, _baseline(run, op, variants), kinds))
    return lines, sets


def ceilings(site, gpu):
    """(matmul TF/s, copy GB/s, where they come from, measured?) for a GPU folder; (None, None, why, False)."""
    calibration = os.path.join(site.root, gpu, "gate", "calibration.txt")
    if os.path.exists(calibration):
        with open(calibration) as f:
            m = CALIBRATION.search(f.read())
        if m:
            return float(m.group(1)), float(m.group(2)), f"`{_shown(calibration)}`", True
    recorded = [r for r in sorted(site.runs, key=lambda r: r.when)
                if r.gpu == gpu and (r.data.get("ceilings") or {}).get("matmul_tflops")]
    if recorded:
        ceil = recorded[-1].data["ceilings"]
        return (ceil["matmul_tflops"], ceil["copy_gbps"],
                f"the ceilings recorded by `{_shown(recorded[-1].path)}` (its `attnbench calibrate`)", True)
    names = " ".join(r.machine.get("device_name") or "" for r in site.runs if r.gpu == gpu) + " " + gpu.upper()
    for key, (source, tflops, gbps) in SPEC.items():
        if key in names:
            return tflops, gbps, f"the {source} (not measured: no calibration is committed for this GPU)", False
    return None, None, "none (no calibration committed and no datasheet figure known for this GPU)", False


def _shown(path):
    """A path as the page names it: as the results folder was given (results/... from the checkout's top)."""
    return os.path.normpath(path).replace(os.sep, "/")


# ---------------------------------------------------------------- plots

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roofline_points(site, gpu, op):
    """{variant: [(intensity FLOP/B, TF/s, mode)]}: every GPU-time row of the operator's runs on ``gpu`` with a
    cost model, newest per case, mode and variant; ours, the peers, the baselines and declared peers only."""
    kinds = report.variant_kinds(op)
    newest = {}
    for run in site.runs_of(gpu, op):
        subject, declared = run.claim(op)
        wanted = {subject, *declared, ((run.data.get("operators") or {}).get(op) or {}).get("baseline")}
        for row in run.timed(op):
            v = row["variant"]
            if kinds and kinds.get(v) not in ("triton", "peer") and v not in wanted:
                continue
            tflops, gbps = row.get("tflops"), row.get("gbps")
            if report.clock(row, run.machine) != "gpu_time" or not (report._measured(tflops) and tflops > 0
                                                                     and report._measured(gbps) and gbps > 0):
                continue
            newest[row["case"], row["mode"], v] = (1e3 * tflops / gbps, tflops, row["mode"])
    points = defaultdict(list)
    for (_, _, v), point in newest.items():
        points[v].append(point)
    return dict(points)


def plot_roofline(points, ceiling, title, subject, path):
    """Log-log scatter, one colour a variant and one marker a mode, under the roofline min(P, I * B)."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    matmul, copy, label = ceiling
    modes = sorted({m for pts in points.values() for _, _, m in pts})
    markers = dict(zip(modes, "osD^vP*Xh<>"))
    variants = sorted(points, key=lambda v: (v != subject, v))
    colours = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [x for pts in points.values() for x, _, _ in pts]
    ys = [y for pts in points.values() for _, y, _ in pts]
    lo, hi = min(xs) / 2, max(xs) * 2
    if matmul:
        ridge = 1e3 * matmul / copy
        lo, hi = min(lo, ridge / 4), max(hi, ridge * 4)
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(grid, [min(matmul, x * copy / 1e3) for x in grid], color="black", lw=1.5,
                ls="-" if label.startswith("measured") else "--", label=label, zorder=1)
        ax.axvline(ridge, color="grey", lw=0.6, ls=":", zorder=0)
    for v in variants:
        for mode in modes:
            pts = [(x, y) for x, y, m in points[v] if m == mode]
            if pts:
                ax.scatter([x for x, _ in pts], [y for _, y in pts], s=40 if v == subject else 22,
                           marker=markers[mode], color=colours[v], alpha=0.75,
                           edgecolors="black" if v == subject else "none", linewidths=0.6, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    top = max([*ys, matmul or 0]) * 2
    ax.set_ylim(min(ys) / 2, top)
    ax.set_xlabel("arithmetic intensity (FLOP per minimum byte, the operator's cost model)")
    ax.set_ylabel("achieved TF/s (GPU time)")
    ax.set_title(title, fontsize=10)
    ax.grid(which="both", alpha=0.25)
    handles = [Line2D([], [], color="black", ls="-" if label.startswith("measured") else "--", label=label)] \
        if matmul else []
    handles += [Line2D([], [], ls="", marker="o", color=colours[v], label=v + (" (subject)" if v == subject else ""))
                for v in variants]
    handles += [Line2D([], [], ls="", marker=markers[m], color="grey", label=f"mode {m}") for m in modes]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def speedup_series(lines):
    """{clock: [(label, vs baseline, vs best peer, best peer's name)]} for the clocks with any ratio."""
    out = {}
    for clock in ("gpu_time", "eager"):
        series = []
        for line in lines:
            base = line.versus(line.baseline, clock) if line.baseline else None
            peer, best = line.best_peer(clock)
            series.append((f"{line.case} · {line.mode}", base, best, peer))
        if any(b is not None or p is not None for _, b, p, _ in series):
            out[clock] = series
    return out


CLOCK_TITLE = {"gpu_time": "GPU time (CUDA events, L2 flushed)",
               "eager": "eager latency (wall per call, host included)"}


def plot_speedups(series, subject, baseline, title, path):
    """Horizontal bars on a log axis, one panel a clock: the subject's speed over the baseline and over the best
    peer of each case and mode (above 1: the subject is faster); the line at 1 is parity."""
    plt = _pyplot()
    clocks = list(series)
    labels = [label for label, *_ in series[clocks[0]]]
    n = len(labels)
    fig, axes = plt.subplots(1, len(clocks), figsize=(6.5 + 4.5 * len(clocks), max(2.8, 1.6 + 0.28 * n)), sharey=True,
                             squeeze=False, layout="constrained")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    height = 0.38
    for ax, clock in zip(axes[0], clocks):
        rows = series[clock]
        ys = list(range(n))
        base = [b if b is not None else math.nan for _, b, _, _ in rows]
        peer = [p if p is not None else math.nan for _, _, p, _ in rows]
        ax.barh([y - height / 2 for y in ys], base, height, color="tab:blue", label=f"vs baseline ({baseline})")
        ax.barh([y + height / 2 for y in ys], peer, height, color="tab:orange", label="vs best peer")
        for y, (_, _, p, name) in zip(ys, rows):
            if p is not None:
                ax.annotate(name, (p, y + height / 2), xytext=(2, 0), textcoords="offset points", fontsize=6,
                            va="center")
        values = [v for v in base + peer if not math.isnan(v)]
        ax.set_xscale("log")
        lo, hi = (min(0.5, min(values) / 1.5), max(2.0, max(values) * 2.5)) if values else (0.5, 2.0)
        ax.set_xlim(lo, hi)
        # ticks at powers of two labelled as multiples ("0.5x", "4x"), not in scientific notation
        powers = range(math.floor(math.log2(lo)), math.ceil(math.log2(hi)) + 1)
        step = math.ceil(len(powers) / 9)  # at most about nine labels: every 2nd or 3rd power on a wide axis
        ax.xaxis.set_major_locator(FixedLocator([2.0 ** k for k in powers if k % step == 0]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(CLOCK_TITLE.get(clock, clock), fontsize=9)
        ax.set_xlabel(f"{subject} speed = other's time / {subject}'s (log; > 1: {subject} faster)", fontsize=8)
        ax.grid(axis="x", which="both", alpha=0.25)
    axes[0, 0].set_yticks(range(n), labels, fontsize=7)
    axes[0, 0].set_ylim(n - 0.5, -0.5)  # the first case on top
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def floor_shares(lines):
    """[(label, % of the attainable floor, binding resource)] of the headline's subject rows on GPU time: the floor
    from the row (runs since the floors became columns) or computed from its run's recorded rates
    (``floors.from_report``, as ``report --floors`` does, once per run); rows whose run records no rates are left
    out."""
    gpu = [line for line in lines if line.ours["timing"].get("method") in floors.GPU_CLOCKS]
    older = {}  # id(run) -> (run, its rows without a floor)
    for line in gpu:
        if line.ours.get("floor_pct") is None:
            older.setdefault(id(line.run), (line.run, []))[1].append(line.ours)
    computed = {}  # (id(run), case, mode) -> Floor
    for key, (run, rows) in older.items():
        try:
            placed, _ = floors.from_report({**run.data, "bench": rows}, floors.rates_of(run.data))
        except (ValueError, NotImplementedError):
            continue
        computed.update({(key, f.case, f.mode): f for f in placed})
    out = []
    for line in gpu:
        pct, binding = line.ours.get("floor_pct"), line.ours.get("floor_binding")
        if pct is None:
            f = computed.get((id(line.run), line.case, line.mode))
            if f is None or f.of_floor_pct is None:
                continue
            pct, binding = f.of_floor_pct, f.binding
        out.append((f"{line.case} · {line.mode}", pct, binding))
    return out


def plot_floor_shares(shares, subject, title, path):
    """Horizontal bars: the subject's share of each case's attainable floor, coloured by the resource that binds
    (100%: nothing on this GPU can be faster)."""
    plt = _pyplot()
    n = len(shares)
    colors = {"bytes": "tab:blue", "compute": "tab:green", "exps": "tab:red", "launch": "tab:gray"}
    fig, ax = plt.subplots(figsize=(9, max(2.6, 1.4 + 0.26 * n)), layout="constrained")
    for y, (_, pct, binding) in enumerate(shares):
        ax.barh(y, pct, color=colors.get(binding, "tab:purple"), label=binding)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), [f"{k} binds" for k in unique], fontsize=7, loc="lower right")
    ax.axvline(100.0, color="black", lw=0.8)
    ax.set_yticks(range(n), [label for label, *_ in shares], fontsize=7)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, max(105.0, max(p for _, p, _ in shares) * 1.05))
    ax.set_xlabel(f"{subject}'s share of the attainable floor, % (floor time / measured GPU time)", fontsize=8)
    ax.grid(axis="x", alpha=0.25)
    ax.set_title(title, fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- pages

def _cell(text):
    """A markdown table cell: a "|" inside (a case set's regular expression) would end it."""
    return str(text).replace("|", "\\|")


def _link(out, path, text=None):
    target = os.path.relpath(os.path.abspath(path), os.path.abspath(out)).replace(os.sep, "/")
    return f"[{text or os.path.basename(path)}]({target})"


def headline_table(out, lines):
    """The headline rows as markdown, with only the measured columns."""
    if not lines:
        return []
    subject = lines[0].subject
    baselines = {line.baseline for line in lines if line.baseline}
    base_name = next(iter(baselines)) if len(baselines) == 1 else None
    gpu = [line for line in lines if report._gpu_time(line.ours, line.run.machine)]
    show = {
        "tflops": any(report._measured(line.ours.get("tflops")) for line in gpu),
        "roof": any(report._measured(line.ours.get("roofline_pct")) for line in lines),
        "base": any(line.baseline and line.versus(line.baseline, "gpu_time") for line in lines),
        "peer": any(line.best_peer("gpu_time")[0] for line in lines),
        "eager": any(line.ours.get("eager") for line in lines),
        "ebase": any(line.baseline and line.versus(line.baseline, "eager") for line in lines),
        "epeer": any(line.best_peer("eager")[0] for line in lines),
        "err": any(report._measured(line.ours.get("max_error")) or line.ours.get("unverified") for line in lines),
    }
    vs_base = f"vs {base_name} (baseline)" if base_name else "vs baseline"
    headers = ["case", "mode", f"{subject} ms"] + [f"{subject} TF/s"] * show["tflops"] + ["% roofline"] * show["roof"] \
        + [vs_base] * show["base"] + ["vs best peer"] * show["peer"] + ["eager ms"] * show["eager"] \
        + [f"eager {vs_base}"] * show["ebase"] + ["eager vs best peer"] * show["epeer"] \
        + ["max rel. error"] * show["err"] + ["run"]
    out_lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for line in lines:
        r = line.ours
        cells = [line.case, line.mode, f"{r['timing']['median_ms']:.3f}"]
        if show["tflops"]:
            gpu_row = report._gpu_time(r, line.run.machine)
            cells.append(report._num(r.get("tflops") if gpu_row else None, ".0f"))
        if show["roof"]:
            cells.append(report._num(r.get("roofline_pct"), ".0f"))
        for clock, keys in (("gpu_time", ("base", "peer")), ("eager", ("ebase", "epeer"))):
            if clock == "eager" and show["eager"]:
                cells.append(report._num((r.get("eager") or {}).get("median_ms"), ".3f"))
            if show[keys[0]]:
                x = line.versus(line.baseline, clock) if line.baseline else None
                cells.append(tables.ratio_cell(x) + ("" if base_name or x is None else f" {line.baseline}"))
            if show[keys[1]]:
                name, x = line.best_peer(clock)
                cells.append(f"{tables.ratio_cell(x)} {name}" if name else "-")
        if show["err"]:
            cells.append("unverified" if r.get("unverified") else report._num(r.get("max_error"), ".1e"))
        cells.append(_link(out, line.run.path, os.path.splitext(os.path.basename(line.run.rel))[0])
                     + ("" if line.run.complete else f" ({line.run.data.get('status')})"))
        out_lines.append("| " + " | ".join(_cell(c) for c in cells[:-1]) + f" | {cells[-1]} |")
    return out_lines


def verdict_summary(verdicts):
    """Markdown rows: per comparison, how many cases got each verdict, and the speedups' range and geometric mean."""
    by = defaultdict(list)
    for v in verdicts:
        by[v["comparison"] if isinstance(v, dict) else v.comparison].append(v)
    rows = ["| comparison | cases | defer | implement | prioritize | speedup min / geomean / max |",
            "| --- | --- | --- | --- | --- | --- |"]
    for comparison, vs in by.items():
        get = (lambda v, k: v[k]) if isinstance(vs[0], dict) else getattr
        speedups = [get(v, "speedup") for v in vs]
        counts = {name: sum(1 for v in vs if get(v, "verdict") == name)
                  for name in ("defer", "implement", "prioritize")}
        geo = math.exp(statistics.fmean(math.log(s) for s in speedups)) if all(s > 0 for s in speedups) else math.nan
        rows.append(f"| {comparison} | {len(vs)} | {counts['defer']} | {counts['implement']} | {counts['prioritize']} "
                    f"| {min(speedups):.2f}x / {geo:.2f}x / {max(speedups):.2f}x |")
    return rows


# a capability cell's verdicts, worst first: a silent wrong answer is worse than an error, which at least says so
# (the order of attnbench.operators.jvp_attention.capabilities.Matrix.summary)
VERDICT_RANK = {"wrong": 0, "error": 1, "unavailable": 2, "verified": 3}


def capability_table(data):
    """A committed capability matrix as its own page summarizes it: per implementation and column (the file's), the
    worst verdict over the shapes, shortened."""
    columns = data["columns"]
    rows = ["| implementation | " + " | ".join(columns) + " |", "|" + " --- |" * (len(columns) + 1)]
    for impl, by_shape in data["cells"].items():
        worst = [min((cells[c] for cells in by_shape.values() if c in cells),
                     key=lambda v: VERDICT_RANK.get(v.split(":")[0], -1), default="-") for c in columns]
        shown = [v if len(v) <= 48 else v[:47] + "…" for v in worst]
        rows.append(f"| {_cell(impl)} | " + " | ".join(_cell(v) for v in shown) + " |")
    return rows


def _index_counts(site):
    """(rows of results/index.csv, or None where there is none; whether its header is the documented one; the
    measurements the result files hold now, counted as the index counts them: one a clock of each timed row)."""
    path = os.path.join(site.root, "index.csv")
    listed, documented = None, True
    if os.path.exists(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            listed = list(reader)
        documented = tuple(reader.fieldnames or ()) == report.INDEX_COLUMNS
    now = sum(report.measurements(row) for r in site.runs for op in r.ops() for row in r.timed(op))
    return listed, documented, now


def op_page(site, out, op, written):
    """The markdown of one operator's page; its plots are written into ``out`` and named in ``written``."""
    lines = [MARKER, f"# {op}", "",
             f"Rendered from `{_shown(site.root)}` by `attnbench report --site` ([how it chooses what to "
             "show](README.md#how-the-pages-are-made)). Every ratio divides two rows of one run on one clock.", ""]
    for gpu in site.gpus():
        runs = site.runs_of(gpu, op)
        if not runs:
            continue
        device = runs[-1].machine.get("device_name") or gpu
        heads, sets = headline(site, gpu, op)
        subject = heads[0].subject if heads else runs[-1].claim(op)[0]
        matmul, copy, source, measured = ceilings(site, gpu)
        lines += [f"## {gpu}: {device}", ""]
        points = roofline_points(site, gpu, op)
        if points:
            label = (f"measured roofline: {matmul:.0f} TF/s, {copy:.0f} GB/s" if measured else
                     f"spec roofline (not measured): {matmul:.0f} TF/s, {copy:.0f} GB/s") if matmul else ""
            name = f"{op}-{gpu}-roofline.png"
            plot_roofline(points, (matmul, copy, label), f"{device}: {op}, achieved TF/s against arithmetic "
                          "intensity", subject, os.path.join(out, name))
            written.append(name)
            count = sum(len(p) for p in points.values())
            lines += ["### Throughput against arithmetic intensity", "",
                      f"![{op} on {gpu}: achieved TF/s against arithmetic intensity]({name})", "",
                      f"{count} points: the newest GPU-time measurement of each case, mode and variant in "
                      f"{len(runs)} run{'s' * (len(runs) > 1)}. Roofline: "
                      + (f"{'measured' if measured else 'spec'}, bf16 matmul {matmul:.0f} TF/s and device copy "
                         f"{copy:.0f} GB/s, from {source}." if matmul else source + ".")]
            above = {v for v, pts in points.items() for x, y, _ in pts
                     if matmul and y > 1.02 * min(matmul, x * copy / 1e3)}
            if above:
                lines[-1] += (f" Points above the line ({', '.join(sorted(above))}) are faster than the ceilings allow "
                              "for the FLOPs and bytes the operator's cost model counts (one model for every variant): "
                              "that variant does less arithmetic than the model counts, or found its inputs in cache.")
            lines.append("")
        else:
            lines += ["No row timed on GPU time with a cost model: no roofline plot.", ""]
        if heads:
            kind = ", ".join(sets)
            title = f"the {kind} case set{'s' * (len(sets) > 1)}"
            lines += [f"### Speedups and the headline table ({kind})", ""]
            series = speedup_series(heads)
            if series:
                baselines = sorted({h.baseline for h in heads if h.baseline})
                for part, start in enumerate(range(0, len(heads), BARS_PER_FIGURE)):
                    chunk = {c: s[start:start + BARS_PER_FIGURE] for c, s in series.items()}
                    name = f"{op}-{gpu}-speedup{'' if len(heads) <= BARS_PER_FIGURE else f'-{part + 1}'}.png"
                    plot_speedups(chunk, subject, ", ".join(baselines) or "none",
                                  f"{device}: {op}, {subject} over the baseline and the best peer, {title}",
                                  os.path.join(out, name))
                    written.append(name)
                    lines += [f"![{op} on {gpu}: speedups, part {part + 1}]({name})", ""]
                lines += [f"Bars: {subject}'s speed over the baseline the run divided by ("
                          f"{', '.join(baselines) or 'none ran'}) and over the fastest peer timed beside it (named at "
                          "the bar), on each clock measured: GPU time and, where the run measured it, eager latency. "
                          "A missing bar: that variant did not run the case on that clock.", ""]
            else:
                lines += ["No case has a ratio on a comparable clock (a CPU run's interpreter timings are never "
                          "divided): no speedup plot.", ""]
            shares = floor_shares(heads)
            if shares:
                name = f"{op}-{gpu}-floor.png"
                plot_floor_shares(shares[:BARS_PER_FIGURE], subject, f"{device}: {op}, {subject}'s share of the "
                                  f"attainable floor, {title}", os.path.join(out, name))
                written.append(name)
                low = sorted(shares, key=lambda t: t[1])[:3]
                lines += [f"![{op} on {gpu}: share of the attainable floor]({name})", "",
                          f"The attainable floor of a case is the largest of its minimum bytes at the measured copy "
                          f"bandwidth, its matmul work at the measured matmul rate, its exponentials at the "
                          f"special-function rate and one empty launch (attnbench/bench/floors.py states the "
                          f"assumptions). {len(shares)} rows; median {statistics.median(p for _, p, _ in shares):.0f}%"
                          f"; furthest from it: " + ", ".join(f"{lab} {p:.0f}% ({b})" for lab, p, b in low) + ".", ""]
            lines += headline_table(out, heads) + [""]
            lines += [f"Each row comes from the newest complete run that timed {subject} on that case and mode (a "
                      "partial run, marked, only where no complete one did; CUDA events before CUDA-graph replays); "
                      "its ratios come from that run alone. Only measured columns are shown.", ""]
            computed = decisions.decide([r for h in heads for r in h.variants.values()])
            if computed:
                lines += ["### Decision verdicts", "", f"The decision rule ({decisions.SOURCE}) applied to the "
                          "headline rows (GPU time), per comparison:", "", *verdict_summary(computed), ""]
        committed = [(rel, data) for rel, data in site.verdicts
                     if rel.split(os.sep)[0] == gpu and any(v.get("op") == op for v in data.get("verdicts", []))]
        if committed:
            lines += ["Committed verdict files (`python -m attnbench.bench.decisions`, each from one run):", ""]
            for rel, data in committed:
                ours = [v for v in data["verdicts"] if v.get("op") == op]
                md = os.path.join(site.root, os.path.splitext(rel)[0] + ".md")
                link = _link(out, os.path.join(site.root, rel))
                if os.path.exists(md):
                    link += " (" + _link(out, md, "table") + ")"
                lines += [f"- {link}: {len(ours)} verdicts on {(data.get('machine') or {}).get('device_name', '?')}",
                          ""]
                lines += [*verdict_summary(ours), ""]
        for rel, data in site.capabilities:
            if rel.split(os.sep)[0] == gpu and rel.split(os.sep)[1:2] == [op]:
                md = os.path.join(site.root, os.path.splitext(rel)[0] + ".md")
                lines += ["### Capability matrix", "",
                          f"From {_link(out, os.path.join(site.root, rel))}"
                          + (f" ({_link(out, md, 'every shape and the silent wrong answers')})"
                             if os.path.exists(md) else "")
                          + f", on {(data.get('device') or {}).get('device_name', '?')}: the worst verdict of each "
                          "cell over the shapes.", "", *capability_table(data), ""]
        for rel, doc in site.traffic:
            if rel.split(os.sep)[0] == gpu and any(r["op"] == op for r in doc.get("traffic", [])):
                mine = {**doc, "traffic": [r for r in doc["traffic"] if r["op"] == op]}
                lines += [report.traffic_markdown(mine, level=3, kernels=False).rstrip("\n"), "",
                          f"From {_link(out, os.path.join(site.root, rel))} (per kernel: `attnbench report "
                          f"{rel.replace(os.sep, '/')}`).", ""]
        lines += ["### Runs", "", "| run | case set | status | date | commit | timed rows |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for run in reversed(runs):
            lines.append(f"| {_link(out, run.path, run.rel.replace(os.sep, '/'))} | "
                         f"{_cell(run.case_set(op) or '-')}{'' if run.tuned else ' (fixed configs)'} | "
                         f"{run.data.get('status', 'complete')} | "
                         f"{run.date[:10] or '-'} | "
                         f"{report._short_commit(run.data.get('code')) or '-'} | {len(run.timed(op))} |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def index_page(site, out, pages):
    listed, documented, now = _index_counts(site)
    lines = [MARKER, "# attnbench results", "",
             f"What the GPUs measured, rendered from `{_shown(site.root)}` by `attnbench report --site` "
             "(docs/cli.md). One page per operator:", ""]
    lines += [f"- [{op}]({op}.md)" for op in pages] + [""]
    lines += ["## Per GPU and operator", "", "| GPU | device | ceilings (roofline) | "
              + " | ".join(pages) + " |", "| --- | --- | --- |" + " --- |" * len(pages)]
    for gpu in site.gpus():
        runs = [r for r in site.runs if r.gpu == gpu]
        device = next((r.machine.get("device_name") for r in reversed(runs) if r.machine.get("device_name")), gpu)
        matmul, copy, source, measured = ceilings(site, gpu)
        roof = (f"{'measured' if measured else 'spec'}: {matmul:.0f} TF/s, {copy:.0f} GB/s" if matmul else "none")
        cells = []
        for op in pages:
            mine = site.runs_of(gpu, op)
            rows = sum(len(r.timed(op)) for r in mine)
            cells.append(f"{rows} rows, {len(mine)} run{'s' * (len(mine) != 1)}" if mine else "-")
        lines.append(f"| {gpu} | {device} | {roof} | " + " | ".join(cells) + " |")
    lines.append("")
    index = os.path.join(site.root, "index.csv")
    if listed is not None:
        stale = "" if len(listed) == now else (f" It lists {len(listed)} measurements where the result files now hold "
                                               f"{now}: regenerate it with `attnbench report --index`.")
        if not documented:
            stale += " Its columns are not the documented ones (docs/cli.md): regenerate it."
        lines += [f"{_link(out, index, _shown(index))}: {len(listed)} measurements (one row per "
                  f"clock of each timed row) from {len({r.get('file') for r in listed})} result files, for filtering "
                  f"across runs.{stale}", ""]
    else:
        lines += ["No `index.csv` in the results folder (`attnbench report --index` writes it).", ""]
    lines += [f"{len(site.runs)} result files, {len(site.verdicts)} verdict files and {len(site.capabilities)} "
              f"capability matri{'ces' if len(site.capabilities) != 1 else 'x'} read; {len(site.skipped)} other "
              "JSON files (studies' outputs) are not attnbench results and are not shown.", ""]
    lines += ["## How the pages are made", "",
              "- **Throughput against arithmetic intensity**: every row timed on GPU time (CUDA events or graph "
              "replays) with a cost model, the newest of each case, mode and variant, for our variants, the peers "
              "and the baselines; intensity is the row's FLOPs over its minimum bytes (TF/s over GB/s). The roofline "
              "is min(matmul ceiling, intensity x copy ceiling): measured on that GPU where a calibration is "
              "committed (`gate/calibration.txt`, else the ceilings the newest run recorded), else the datasheet's, "
              "drawn dashed and labelled spec.",
              "- **Speedups and the headline table**: the anchor case set (where a GPU has no anchor run, the sets it "
              "has), each case and mode from the newest complete run that timed the subject there (a partial run "
              "only where no complete one did: cut short, its last case may lack peers); the subject's speed over "
              "the baseline that run divided by and over the fastest peer timed beside it, on GPU time and on eager "
              "latency where measured. Columns appear only where something was measured: a peer that never ran gets "
              "none, and a CPU run shows no TF/s, roofline or ratios between clocks that differ.",
              "- **Decision verdicts**: `attnbench.bench.decisions`' rule on the headline rows, and the verdict "
              "files committed beside the runs. **Capability matrix**: the committed `capabilities.json`.",
              "- Numbers compare only within one run on one machine; the runs table on each page names them all.", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write(root, out) -> list:
    """Render the site of ``root`` into ``out``; returns the files written (names inside ``out``). A folder that
    holds anything but an earlier site is refused (``SiteError``), so a wrong --out cannot lose files."""
    if not os.path.isdir(root):
        raise SiteError(f"--site {root}: not a directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:  # a file of that name, a folder that cannot be made: one line, exit status 2
        raise SiteError(f"--out {out}: cannot be the site's folder ({exc.strerror or exc})") from None
    existing = sorted(os.listdir(out))
    if existing:
        index = os.path.join(out, "README.md")
        ours = os.path.exists(index) and open(index).read().startswith(MARKER)
        foreign = [f for f in existing if not f.endswith((".md", ".png")) or os.path.isdir(os.path.join(out, f))]
        if not ours or foreign:
            raise SiteError(f"--out {out}: holds files this command did not write; name an empty or new folder")
        for name in existing:  # an earlier site: its plots and pages are replaced, none left stale
            os.remove(os.path.join(out, name))
    site = load(root)
    written, pages = [], site.ops()
    for op in pages:
        results.write_atomic(os.path.join(out, f"{op}.md"), op_page(site, out, op, written))
        written.append(f"{op}.md")
    results.write_atomic(os.path.join(out, "README.md"), index_page(site, out, pages))
    return ["README.md", *written]
