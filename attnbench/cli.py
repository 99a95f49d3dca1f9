"""``attnbench``: list operators, verify them, benchmark them, or do both (``run``).

On a machine without CUDA everything runs on the CPU: Triton kernels through the interpreter,
on the tiny case set, and the timings say they are interpreter timings.

Exit status: 0 all good; 1 a check failed, or one of our variants' benchmarked outputs exceeds
its error bound; 2 a bad argument, a bad input file, an output path that cannot be written, or a
request that cannot run here (nothing is run then, or, for a write that fails mid-run, the run
stops); 130 interrupted (Ctrl-C), every finished row kept in the --json file.
"""
import argparse
import json
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass, field

import torch

from . import __version__
from .bench import results
from .bench.cases import shard
from .bench.provenance import code_version
from .bench.registry import all_operators, get
from .bench.roofline import ceilings, machine_info
from .bench.runner import bench, check, detach
from .bench.tables import bench_table, check_table, ratio_lines, summary_line, traffic_table, unavailable_lines, wrap
from .bench.verify import BOUNDS
from .kernels.tuning import autotune_enabled

# Default case set per command, as (on CPU, on CUDA). ``run`` checks and times the same cases.
DEFAULT_SETS = {"check": ("tiny", "gpu"), "bench": ("tiny", "anchor"), "run": ("tiny", "anchor")}
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A bad argument or file, or a request that cannot run here: one line, exit status 2."""


class Console:
    """Human-readable output: stdout, or stderr when stdout carries the JSON (``--json -``).
    A reader that leaves early (``| head``) silences it; the run goes on and writes its file."""

    def __init__(self, stream):
        self.stream = stream

    def print(self, text: str = ""):
        if self.stream is None:
            return
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except BrokenPipeError:
            detach(self.stream)
            self.stream = None


# ---------------------------------------------------------------- arguments

def parse_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    match = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", name)
    if not match or (match[1] == "cpu" and match[2] is not None):
        raise UsageError(f"--device {name}: expected auto, cpu, cuda or cuda:N")
    if match[1] == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: torch sees no CUDA device on this machine")
        count = torch.cuda.device_count()
        if match[2] is not None and int(match[2]) >= count:
            raise UsageError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device(name)


def seed_type(text: str) -> int:
    """Seeds are 0 <= seed < 2**63: torch's generators take a 64-bit seed, and a negative one
    would alias a large positive one, so the same inputs would carry two names."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"{seed} is out of range: seeds are 0 <= seed < 2**63")
    return seed


def label_pattern(text: str):
    """A --match regular expression, compiled (a bad one is a usage error, not a traceback)."""
    try:
        return re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {exc}") from None


def shard_part(text: str):
    """--shard K/N: the K-th of N interleaved parts of the selected cases (a run that one call cannot hold, spread
    over calls or GPUs), as (K, N)."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected K/N, e.g. 2/4") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= K <= N")
    return k, n


@dataclass
class Plan:
    """What one operator will run, validated before any work starts."""

    op: object
    case_set: str
    cases: list
    variants: list
    modes: list
    baseline: str | None = None
    unavailable: dict = field(default_factory=dict)  # variant -> why it cannot run here (not asked for)

    def info(self):
        return {"case_set": self.case_set, "variants": self.variants, "modes": self.modes, "baseline": self.baseline,
                "ratio_subject": self.op.ratio_subject, "ratio_peers": list(self.op.ratio_peers),
                "unavailable": self.unavailable}


def _ops(names):
    try:
        return list(all_operators().values()) if not names else [get(n) for n in dict.fromkeys(names)]
    except KeyError as exc:
        raise UsageError(f"--op: {exc.args[0]}") from None


def _known(requested, ops, names_of, option):
    """Every requested name must belong to at least one selected operator (``names_of(op)``: its names)."""
    for name in requested or ():
        if not any(name in names_of(op) for op in ops):
            known = sorted({n for op in ops for n in names_of(op)})
            owners = " or ".join(op.name for op in ops)
            raise UsageError(f"{option} {name}: not a {option[2:]} of {owners}; known: {', '.join(known)}")


def make_plans(args, device, kind, timing, notes=None) -> list:
    """Check every argument against the selected operators and this device, before any work.
    ``timing``: plans for bench (a --baseline is timed with the rest), not for check. An operator
    that has none of the requested modes or variants (another operator's), or no case that --match
    selects, is left out, and ``notes`` gets a line saying so."""
    ops = _ops(args.op)
    _known(args.variant, ops, lambda op: op.variant_names(), "--variant")
    _known(args.mode, ops, lambda op: op.modes, "--mode")
    if timing and args.graphs and device.type != "cuda":
        raise UsageError(f"--graphs times CUDA-graph replays: it needs a CUDA device, and this run is on {device.type}")
    if timing and args.host_time and device.type != "cuda":
        raise UsageError(f"--host-time times the host's part of CUDA calls: it needs a CUDA device, and this run is on "
                         f"{device.type} (whose one clock, wall time, is the eager latency)")
    plans, unmatched, unsharded = [], [], []
    for op in ops:
        modes = [m for m in dict.fromkeys(args.mode)] if args.mode else list(op.modes)
        modes = [m for m in modes if m in op.modes]
        requested = [v for v in dict.fromkeys(args.variant)] if args.variant else None
        if requested is not None:
            requested = [v for v in requested if op.knows(v)]
        if not modes or (requested is not None and not requested):
            if notes is not None:
                what = "modes" if not modes else "variants"
                asked = args.mode if not modes else args.variant
                notes.append(f"{op.name}: left out, it has none of the requested {what} ({', '.join(asked)})")
            continue
        # the default set's variants that cannot run here are listed; a named one (a forced route too) must run
        unavailable = {n: v.unavailable_reason(device) for n, v in op.variants.items()}
        unavailable = {n: r for n, r in unavailable.items() if r is not None}
        for name in requested or ():
            if reason := op.variant(name).unavailable_reason(device):
                raise UsageError(f"{op.name}: variant {name} cannot run on {device.type}: {reason}")
        variants = requested if requested is not None else [n for n in op.variants if n not in unavailable]
        baseline = args.baseline if timing else None
        if baseline is not None:
            if not op.knows(baseline):
                raise UsageError(f"--baseline {baseline}: not a variant of {op.name}; known: "
                                 f"{', '.join(op.variant_names())}")
            if reason := op.variant(baseline).unavailable_reason(device):
                raise UsageError(f"--baseline {baseline}: cannot run on {device.type}: {reason}")
            if baseline not in variants:  # the baseline is timed too, or nothing could be divided by it
                variants = [n for n in op.variant_names() if n in variants or n == baseline]
        if not variants:
            reasons = "; ".join(f"{n}: {r}" for n, r in unavailable.items())
            raise UsageError(f"{op.name}: no variant can run on {device.type} ({reasons})")
        set_name = args.cases or DEFAULT_SETS[kind][device.type == "cuda"]
        try:
            cases = op.cases(set_name)
        except (KeyError, ValueError) as exc:
            raise UsageError(f"--cases {set_name}: {exc.args[0] if exc.args else exc}") from None
        if args.match is not None:
            cases = [c for c in cases if args.match.search(c.label)]
            if not cases:  # like --mode and --variant: another operator's cases
                unmatched.append(op.name)
                if notes is not None:
                    notes.append(f"{op.name}: left out, no case of its {set_name} set matches --match "
                                 f"{args.match.pattern!r}")
                continue
            set_name = f"{set_name} matching {args.match.pattern!r}"  # a report says it is not the whole set
        if getattr(args, "shard", None):
            k, n = args.shard
            cases = shard(cases, k - 1, n)
            if not cases:
                unsharded.append(op.name)
                if notes is not None:
                    notes.append(f"{op.name}: left out, part {k}/{n} of its {set_name} set is empty")
                continue
            set_name = f"{set_name} shard {k}/{n}"
        unasked = {} if requested is not None else unavailable
        plans.append(Plan(op, set_name, cases, variants, modes, baseline or op.baseline(device, variants), unasked))
    if not plans and unsharded:
        raise UsageError(f"--shard {args.shard[0]}/{args.shard[1]}: no case of {', '.join(unsharded)} is in that part"
                         + (f" of the cases --match {args.match.pattern!r} selects" if args.match is not None else ""))
    if not plans and unmatched:
        raise UsageError(f"--match {args.match.pattern!r}: no case of {', '.join(unmatched)} matches")
    if not plans:
        raise UsageError("no selected operator has the requested variants and modes together")
    return plans


# ---------------------------------------------------------------- commands

def _header(device):
    info = machine_info(device)
    line = f"# {info['device_name']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']}"
    if device.type == "cpu":
        line += ("\n# CPU run: Triton kernels run in the interpreter; timings check that code runs, "
                 "they are not performance")
    return line


def _bound_lookup(cases):
    by_label = {c.label: getattr(c, "torch_dtype", None) for c in cases}
    return lambda label: BOUNDS.get(by_label.get(label))


class Session:
    """One check/bench/run: its console, its result file, and what has finished so far."""

    def __init__(self, args, command):
        self.args, self.command = args, command
        self.device = parse_device(args.device)
        if args.json not in (None, "-"):
            args.json = results.check_output_path(args.json)
        self.notes = []
        self.plans_check = make_plans(args, self.device, command, False, self.notes) if command != "bench" else []
        self.plans_bench = make_plans(args, self.device, command, True, self.notes if command == "bench" else None) \
            if command != "check" else []
        self.console = Console(sys.stderr if args.json == "-" else sys.stdout)
        info = machine_info(self.device)
        self.file = results.ResultFile(args.json, {
            "command": command, "argv": args.argv, "machine": info, "code": code_version(),
            "autotune": autotune_enabled(), "ceilings": None})
        self.checks, self.rows, self.failures, self.bench_failures = [], [], 0, 0
        self.interrupt_seen = False

    def _on_sigint(self, signum, frame):
        """Ctrl-C (or SIGTERM): raise KeyboardInterrupt as Python's own handler does, and remember it. A library
        can swallow the exception (C code that clears any error of an attribute lookup, as
        ``PyObject_HasAttr`` does); CI saw a run go on to its last row and exit 0 that way."""
        self.interrupt_seen = True
        raise KeyboardInterrupt

    def _keep(self, kind, row):
        """Write a finished row, then stop if a Ctrl-C came while it ran and was swallowed."""
        self.file.add(kind, row)
        if self.interrupt_seen:
            raise KeyboardInterrupt

    def run(self) -> int:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live there only
            return self._run()
        # SIGTERM (what `timeout` and job schedulers send) stops a run as Ctrl-C does: rows kept, status "interrupted"
        previous = {sig: signal.signal(sig, self._on_sigint) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        self.console.print(_header(self.device))
        for note in dict.fromkeys(self.notes):
            self.console.print(wrap(f"# {note}"))
        if self.plans_bench or self.args.json:  # a GPU's first bench calibrates its ceilings (cached)
            c = ceilings(self.device)
            self.file.doc["ceilings"] = c.__dict__ if c else None
        for plan in self.plans_check + self.plans_bench:  # run: the bench plan (with its baseline) wins
            self.file.operator(plan.op.name, plan.info())
        checked = timed = True
        if self.plans_check:
            checked = self._checks()
        if self.plans_bench:
            timed = self._bench()
        unavailable = {(p.op.name, n) for p in self.plans_check + self.plans_bench for n in p.unavailable}
        self.console.print("\n" + summary_line(self.checks if self.plans_check else None,
                                               self.rows if self.plans_bench else None, len(unavailable)))
        if self.interrupt_seen:  # swallowed after the last row: still an interrupted run
            raise KeyboardInterrupt
        self.file.finish("complete")
        if not (checked and timed) and not self.failures:
            what = "checked" if not checked else "timed"
            raise UsageError(f"nothing was {what}: every row was skipped (the reasons are above)")
        if self.failures:
            checks = self.failures - self.bench_failures
            said = [f"{checks} check(s)"] * bool(checks) + [
                f"{self.bench_failures} bench row(s) (raised, or past the float64 bound)"] * bool(self.bench_failures)
            print(f"attnbench: failed: {', '.join(said)}", file=sys.stderr)
        return EXIT_FAILED if self.failures else EXIT_OK

    def _checks(self):
        args, ran = self.args, False
        for plan in self.plans_check:
            op_results = check(plan.op, plan.cases, self.device, plan.variants, plan.modes, args.seed,
                               not args.quiet, on_result=lambda r: self._keep("checks", r),
                               extra_checks=not args.variant and not args.mode)
            self.checks += op_results
            self.console.print(f"\n## check {plan.op.name} ({len(plan.cases)} {plan.case_set} cases)\n"
                               + check_table(op_results))
            for line in unavailable_lines(plan.op.name, plan.unavailable, self.device.type):
                self.console.print(line)
            wrong = [r for r in op_results if not r.passed and not r.skipped]
            # a peer's wrong answer is reported (the table, the file, the line below), not a failure of this gate,
            # which holds our implementations: a library's bf16 error must not turn a run of ours red
            peers = [r for r in wrong if _kind(plan.op, r.variant) == "peer"]
            if peers:
                self.console.print(f"peers past their float64 bounds (reported, not this gate's failures): "
                                   + ", ".join(sorted({r.variant for r in peers})) + f" ({len(peers)} checks)")
            self.failures += len(wrong) - len(peers)
            ran = ran or any(not r.skipped for r in op_results)
        return ran

    def _bench(self):
        args, ran = self.args, False
        for plan in self.plans_bench:
            op = plan.op
            rows = bench(op, plan.cases, self.device, plan.variants, plan.modes, args.seed, plan.baseline,
                         args.graphs, progress=not args.quiet, on_row=lambda r: self._keep("bench", r),
                         eager=not args.no_eager, host_time=args.host_time)
            self.rows += rows
            bound_of = _bound_lookup(plan.cases)
            self.console.print(f"\n## bench {op.name} ({len(plan.cases)} {plan.case_set} cases)\n"
                               + bench_table(rows, bound_of))
            for line in unavailable_lines(op.name, plan.unavailable, self.device.type):
                self.console.print(line)
            lines = ratio_lines(rows, op.ratio_subject, op.ratio_peers)
            if lines:
                self.console.print("\n" + "\n".join(lines))
            # our implementations must stay within bounds; the eager reference and peers are reported
            failed = sum(1 for r in rows if op.variant(r.variant).kind in ("split", "triton") and (
                r.failed or (r.timing and bound_of(r.case) is not None and r.max_error > bound_of(r.case))))
            self.failures += failed
            self.bench_failures += failed
            ran = ran or any(r.timing for r in rows)
        return ran

    def interrupted(self) -> int:
        done = self.file.count("checks") + self.file.count("bench")
        if not done:  # nothing to keep: an earlier file at the --json path stays as it was
            print(interrupted_before_any_row(self.args), file=sys.stderr)
            return EXIT_INTERRUPTED
        self.file.finish("interrupted")
        if self.args.json is None:  # no file holds them: the tables of the finished rows are what is kept
            checks, rows = self.file.rows["checks"], self.file.rows["bench"]
            if checks:
                self.console.print("\n## check (finished before the interrupt)\n" + check_table(checks))
            if rows:
                self.console.print("\n## bench (finished before the interrupt)\n"
                                   + bench_table(rows, _bound_lookup([c for p in self.plans_bench for c in p.cases])))
        where = {None: " in the tables above (no --json file was asked for)", "-": " in the JSON on stdout"}.get(
            self.args.json, f" in {self.args.json}")
        print(f"attnbench: interrupted; {done} finished row(s) kept{where}", file=sys.stderr)
        return EXIT_INTERRUPTED


def _kind(op, name):
    """A variant's kind, or None for a name the operator does not register (its extra checks' rows)."""
    try:
        return op.variant(name).kind
    except KeyError:
        return None


def interrupted_before_any_row(args) -> str:
    """What a Ctrl-C before the first finished row leaves: nothing, said plainly."""
    path = getattr(args, "json", None)
    if path in (None, "-"):
        kept = "no result was written"
    else:
        kept = f"no file was written ({path} is unchanged)" if os.path.exists(path) else \
            f"no file was written ({path} does not exist)"
    return f"attnbench: interrupted before any row finished; {kept}"


def cmd_list(args):
    device = parse_device(args.device)
    console = Console(sys.stdout)
    for op in _ops(args.op):
        console.print(f"{op.name}: {op.description}")
        console.print(f"  modes: {', '.join(op.modes)}; case sets: {', '.join(op.case_sets)}")
        for name, v in op.variants.items():
            reason = v.unavailable_reason(device)
            state = "available" if reason is None else f"unavailable on {device.type}: {reason}"
            console.print(f"  {name:15s} {v.kind:9s} {state}\n  {'':15s} {v.description}")
        tunables = op.tunables()
        if tunables:
            console.print(f"  tunable kernels (attnbench tune --kernel): {', '.join(tunables)}")
        if op.routes:
            console.print("  forced routes (run when named with --variant):")
        for name, v in op.routes.items():
            reason = v.unavailable_reason(device)
            state = "available" if reason is None else f"unavailable on {device.type}: {reason}"
            console.print(f"  {name:24s} {state}\n  {'':24s} {v.description}")
    return EXIT_OK


def cmd_report(args):
    from .bench import report

    if args.site is not None:
        return _report_site(args)
    if args.out is not None:
        raise UsageError("--out is the folder of --site's pages: give --site too")
    if args.index is not None:
        return _report_index(args, report)
    if not args.report:
        raise UsageError("report: name a result file (or several parts of one run), --index or --site")
    for option in ("markdown", "plot"):
        if getattr(args, option):
            results.check_output_path(getattr(args, option), f"--{option}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'attnbench[plot]'") from None
    from .bench import traffic

    # a traffic file (attnbench traffic --json) gets its own table, after the run's summary when both are given
    traffic_paths = [path for path in args.report if traffic.sniff(path)]
    run_paths = [path for path in args.report if path not in traffic_paths]
    if args.floors is not None and not run_paths:
        raise UsageError("--floors reads a run's timed rows: name a result file of check/bench/run too")
    data = results.merge([results.load(path) for path in run_paths], run_paths) if run_paths else None
    measured_traffic = traffic.merge([traffic.load(path) for path in traffic_paths], traffic_paths) \
        if traffic_paths else None
    if args.plot and data is not None and not report._rows(data):
        raise UsageError(f"--plot: {' '.join(run_paths)} has no timed rows to plot")
    text = report.markdown(data) if data is not None else ""
    if args.floors is not None:  # the floors of every timed case (bench/floors.py)
        from .bench import floors

        try:
            text = text.rstrip("\n") + "\n\n" + floors.report_section(data, args.floors)
        except ValueError as exc:
            raise UsageError(f"--floors: {exc}") from None
    if measured_traffic is not None:
        section = report.traffic_markdown(measured_traffic, level=2 if text else 1)
        text = text.rstrip("\n") + "\n\n" + section if text else section
    if args.markdown:
        results.write_atomic(args.markdown, text)
    else:
        Console(sys.stdout).print(text.rstrip("\n"))
    if args.plot:
        if data is not None:
            report.plot(data, args.plot)
        else:
            report.plot_traffic(measured_traffic, args.plot)
    return EXIT_OK


def _report_index(args, report):
    """results/index.csv from every result file under the folder; each file not read is named, with why."""
    if args.report or args.markdown or args.plot:
        raise UsageError("--index reads every result file under its folder: give no files, --markdown or --plot")
    if not os.path.isdir(args.index):
        raise UsageError(f"--index {args.index}: not a directory")
    out = results.check_output_path(args.csv or os.path.join(args.index, "index.csv"), "--csv")
    rows, problems = report.write_index(args.index, out)
    for line in problems:
        print(f"attnbench: {line}", file=sys.stderr)
    files = len({r["file"] for r in rows})
    print(f"{args.csv or os.path.join(args.index, 'index.csv')}: {len(rows)} measurements from {files} result "
          f"files; {len(problems)} files not indexed (listed above)")
    return EXIT_OK


def _report_site(args):
    """One page per operator, with plots, from every committed result under the folder (attnbench/bench/site.py)."""
    from .bench import site

    mixed = [name for name, given in (("result files", args.report), ("--index", args.index is not None),
                                      ("--csv", args.csv), ("--markdown", args.markdown), ("--plot", args.plot),
                                      ("--floors", args.floors is not None)) if given]
    if mixed:
        raise UsageError(f"--site renders every result under its folder: give no {', '.join(mixed)}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--site draws plots and needs matplotlib: pip install 'attnbench[plot]'") from None
    out = args.out or os.path.join("docs", "report")
    try:
        written = site.write(args.site, out)
    except site.SiteError as exc:
        raise UsageError(str(exc)) from None
    pages = [name for name in written if name.endswith(".md")]
    print(f"{out}: {len(pages)} pages ({', '.join(pages)}) and {len(written) - len(pages)} plots from {args.site}")
    return EXIT_OK


def cmd_capabilities(args):
    """The live capability matrix of jvp_attention (which implementation differentiates which way)."""
    from .operators.jvp_attention import capabilities

    device = parse_device(args.device)
    for option in ("json", "markdown"):
        if getattr(args, option):
            setattr(args, option, results.check_output_path(getattr(args, option), f"--{option}"))
    known = capabilities.implementations()
    for name in args.impl or ():
        if name not in known:
            raise UsageError(f"--impl {name}: not an implementation; known: {', '.join(known)}")
    console = Console(sys.stdout)
    console.print(_header(device))

    def progress(line):
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    matrix = capabilities.compute(device, args.impl, progress)
    capabilities.write(matrix, args.json, args.markdown)
    console.print(matrix.markdown().rstrip("\n"))
    # our implementation's silent wrong answer fails the command, as a failed check does (it had exited 0 whatever
    # the matrix said: found by review); the peers' cells are reported only
    ours = capabilities.OURS
    wrong = [(s, c) for s, cols in matrix.cells.get(ours, {}).items() for c, v in cols.items() if v.startswith("wrong")]
    if wrong:
        print(f"attnbench: {ours} answered wrong without an error in {len(wrong)} cell(s)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_calibrate(args):
    device = parse_device(args.device)
    c = ceilings(device, refresh=True)
    if c is None:
        print("no CUDA device: nothing to calibrate (CPU timings are interpreter timings)")
        return EXIT_OK
    print(calibration_line(c))
    return EXIT_OK


def calibration_line(c) -> str:
    line = f"{c.device_name}: bf16 matmul {c.matmul_tflops:.0f} TF/s, device copy {c.copy_gbps:.0f} GB/s"
    if c.launch_floor_us is not None:
        line += (f", empty Triton launch {c.launch_floor_us:.1f} us of GPU time (the least any timed call reads), "
                 f"{c.launch_host_us:.1f} us of host time to submit")
    return line


def cmd_tune(args):
    """Every candidate launch config of one kernel on the chosen cases (bench/tune.py), on a GPU."""
    import json

    from .bench import tune

    op = _ops([args.op])[0]
    tunables = op.tunables()
    if args.kernel not in tunables:
        known = ", ".join(tunables) or "none"
        raise UsageError(f"--kernel {args.kernel}: not a tunable kernel of {op.name}; known: {known}")
    tunable = tunables[args.kernel]
    device = parse_device(args.device)
    if device.type != "cuda":
        raise UsageError(f"tune times launch configurations on a GPU: it needs CUDA, and this run is on "
                         f"{device.type} (the interpreter runs one config per kernel, at no meaningful speed)")
    if args.json:
        args.json = results.check_output_path(args.json)
    name = args.variant or tunable.variant
    if not op.knows(name):
        raise UsageError(f"--variant {name}: not a variant of {op.name}; known: {', '.join(op.variant_names())}")
    if reason := op.variant(name).unavailable_reason(device):
        raise UsageError(f"{op.name}: variant {name} cannot run on {device.type}: {reason}")
    mode = args.mode or tunable.mode
    if mode not in op.variant(name).modes:
        raise UsageError(f"--mode {mode}: {name} runs {', '.join(op.variant(name).modes)}")
    try:
        cases = op.cases(args.cases or "anchor")
    except (KeyError, ValueError) as exc:
        raise UsageError(f"--cases {args.cases}: {exc.args[0] if exc.args else exc}") from None
    if args.match is not None:
        cases = [c for c in cases if args.match.search(c.label)]
        if not cases:
            raise UsageError(f"--match {args.match.pattern!r}: no case of {op.name}'s {args.cases or 'anchor'} set")
    console = Console(sys.stdout)
    console.print(_header(device))
    console.print(f"# {op.name} {tunable.name}: {tunable.description}; {name}, mode {mode}")

    def progress(line):
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    rows = tune.tune(op, tunable, cases, device, mode=mode, variant=name, seed=args.seed, progress=progress)
    console.print(tune.table(rows))
    if args.json:
        doc = {"format": 1, "command": "tune", "argv": args.argv, "machine": machine_info(device),
               "code": code_version(), "op": op.name, "kernel": tunable.name, "variant": name, "mode": mode,
               "rows": [r.as_dict() for r in rows]}
        results.write_atomic(args.json, json.dumps(doc, indent=1, default=str) + "\n")
    return EXIT_OK


def cmd_warm(args):
    """Compile ahead, in parallel worker processes, what the cases' Triton variants will autotune over
    (bench/warm.py)."""
    from .bench import warm

    device = parse_device(args.device)
    if device.type != "cuda":
        raise UsageError(f"warm compiles Triton kernels for a GPU ahead of a timing run: it needs CUDA, and this run "
                         f"is on {device.type} (the interpreter compiles nothing)")
    if args.procs < 1:
        raise UsageError(f"--procs {args.procs}: at least one worker process")
    notes = []
    plans = make_plans(args, device, "bench", timing=False, notes=notes)
    for line in notes:
        print(line, file=sys.stderr)
    set_name = args.cases or DEFAULT_SETS["bench"][True]
    status = EXIT_OK
    for plan in plans:
        op = plan.op
        variants = plan.variants if args.variant else [n for n in plan.variants if op.variant(n).kind == "triton"]
        if not variants:
            print(f"{op.name}: none of {', '.join(plan.variants)} is a Triton variant: nothing to compile",
                  file=sys.stderr)
            continue
        print(f"# warm {op.name}: {len(plan.cases)} {plan.case_set} cases, {', '.join(variants)}, "
              f"{', '.join(plan.modes)}, {args.procs} processes", flush=True)
        _, clean = warm.warm(op, set_name, plan.cases, args.match.pattern if args.match else None, variants,
                             plan.modes, device, args.procs, args.seed, progress=lambda line: print(line, flush=True),
                             part=args.shard)
        if not clean:
            print(f"attnbench: a warm worker of {op.name} exited with an error (its line above)", file=sys.stderr)
            status = EXIT_FAILED
    return status


def cmd_traffic(args):
    """DRAM traffic of each call under ncu beside the analytic minimum (bench/traffic.py, docs/traffic.md)."""
    import shutil
    import tempfile

    from .bench import traffic

    if not args.json:
        raise UsageError("traffic: --json OUT is required (the rows are rewritten there after every part)")
    args.json = results.check_output_path(args.json)
    console = Console(sys.stdout)
    if args.rebuild is not None:
        given = [name for name, value in (("--op", args.op), ("--match", args.match), ("--mode", args.mode),
                                          ("--variant", args.variant), ("--ncu", args.ncu),
                                          ("--kernel-regex", args.kernel_regex), ("--budget", args.budget),
                                          ("--keep-raw", args.keep_raw)) if value]
        if given:
            raise UsageError(f"--rebuild reads what a run kept: give no {', '.join(given)}")
        if not os.path.isdir(args.rebuild):
            raise UsageError(f"--rebuild {args.rebuild}: not a directory")
        try:
            doc = traffic.rebuild(args.rebuild)
        except traffic.NcuOutputError as exc:
            raise UsageError(str(exc)) from None
        results.write_atomic(args.json, json.dumps(doc, indent=1) + "\n")
        console.print(traffic_table(doc["traffic"]))
        return EXIT_OK
    if args.calls_per_process < 1:
        raise UsageError(f"--calls-per-process {args.calls_per_process}: at least 1")
    if args.budget is not None and not args.budget > 0:  # 0 profiled nothing and exited 0
        raise UsageError(f"--budget {args.budget:g}: a positive number of seconds")
    ops = _ops(args.op)
    _known(args.variant, ops, lambda op: op.variant_names(), "--variant")
    _known(args.mode, ops, lambda op: op.modes, "--mode")
    device = parse_device(args.device)
    if device.type != "cuda":
        raise UsageError(f"traffic profiles kernels with Nsight Compute: it needs a CUDA device, and this run is on "
                         f"{device.type} (--rebuild DIR writes the file from a run's kept ncu output anywhere)")
    ncu = traffic.find_ncu(args.ncu)
    if ncu is None:
        raise UsageError(f"traffic: ncu not found ({args.ncu or os.environ.get('NCU') or 'ncu'}): give --ncu PATH")
    for op in ops:
        names = args.variant or [op.ratio_subject]
        for name in names:
            if op.knows(name) and (reason := op.variant(name).unavailable_reason(device)):
                raise UsageError(f"{op.name}: variant {name} cannot run on {device.type}: {reason}")
        try:
            op.cases(args.cases)
        except (KeyError, ValueError) as exc:
            raise UsageError(f"--cases {args.cases}: {exc.args[0] if exc.args else exc}") from None
    calls = traffic.plan_calls(ops, args.cases, args.mode, args.variant, args.match, args.calls_per_process)
    if not calls:
        raise UsageError("traffic: no selected operator has a case, mode and variant together"
                         + (f" matching --match {args.match.pattern!r}" if args.match else ""))
    operators = {}
    for call in calls:
        entry = operators.setdefault(call["op"], {"case_set": args.cases, "variants": []})
        if call["variant"] not in entry["variants"]:
            entry["variants"].append(call["variant"])
    if args.match is not None:
        for entry in operators.values():
            entry["case_set"] = f"{args.cases} matching {args.match.pattern!r}"
    plan = traffic.new_plan(calls, args.argv, ncu, args.cases, operators, device, args.seed, args.kernel_regex)
    raw = args.keep_raw or tempfile.mkdtemp(prefix="attnbench-traffic-")
    os.makedirs(raw, exist_ok=True)
    results.write_atomic(os.path.join(raw, "plan.json"), json.dumps(plan, indent=1))
    parts = len({c["part"] for c in calls})
    console.print(f"# traffic: {len(calls)} calls of {', '.join(operators)} in {parts} ncu process(es), {ncu}")
    try:
        doc = traffic.profile(plan, raw, ncu, args.json, args.budget,
                              progress=lambda line: print(line, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print(f"attnbench: interrupted; the parts that finished are in {args.json}, ncu's files in {raw}",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    console.print(traffic_table(doc["traffic"]))
    measured = sum(1 for r in doc["traffic"] if not r["skipped"])
    console.print(f"\nsummary: traffic {measured} measured, {len(doc['traffic']) - measured} not; "
                  f"status {doc['status']}")
    if doc["status"] == "error" and not args.keep_raw:  # what ncu wrote stays for a look
        console.print(f"ncu's output and the driver's files are kept in {raw}")
    elif not args.keep_raw:
        shutil.rmtree(raw, ignore_errors=True)
    return EXIT_FAILED if doc["status"] == "error" else EXIT_OK


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit status 2), not the usage block."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser():
    parser = Parser(prog="attnbench", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"attnbench {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    def common(p, cases=False, timing=False):
        p.add_argument("--op", action="append", help="operator (repeatable; default: all)")
        p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
        if cases:
            p.add_argument("--cases", help="case set: tiny, gpu, anchor, sweep, odd (odd shapes, every operator), "
                                           "decode, random, host (flash; random and host for jvp_attention too), "
                                           "tabpfn (shared_context), layer (sparse) (default: tiny on CPU; on CUDA "
                                           "check: gpu, bench and run: anchor)")
            p.add_argument("--match", type=label_pattern, metavar="REGEX",
                           help="only the cases whose label matches (re.search), e.g. ' D(64|96) '")
            p.add_argument("--shard", type=shard_part, metavar="K/N",
                           help="only every N-th of the selected cases, from the K-th: part K of N (a long run "
                                "spread over calls or GPUs; the parts' JSON files read as one)")
            p.add_argument("--variant", action="append",
                           help="variant (repeatable; default: every variant that can run here)")
            p.add_argument("--mode", action="append", help="mode (repeatable; default: all)")
            p.add_argument("--seed", type=seed_type, default=0, help="input seed, 0 <= seed < 2**63 (default 0)")
            p.add_argument("--json", help="keep every result in this JSON file, rewritten as rows finish "
                                          "('-': print it to stdout at the end, tables go to stderr)")
            p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
        if timing:
            p.add_argument("--baseline", help="variant the speedup column divides by (it is timed too)")
            p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays (CUDA only)")
            p.add_argument("--no-eager", action="store_true",
                           help="GPU time alone: skip the eager-latency clock (wall time per call back to back, host "
                                "included), which CUDA rows carry by default")
            p.add_argument("--host-time", action="store_true",
                           help="also time the host's part of each call alone (CUDA only)")

    common(sub.add_parser("list", help="operators, variants and where they can run"))
    common(sub.add_parser("check", help="verify variants against the float64 oracle"), cases=True)
    common(sub.add_parser("bench", help="time variants: latency, TF/s, GB/s, %% of roofline, speedup, error"),
           cases=True, timing=True)
    common(sub.add_parser("run", help="check, then bench: the main job"), cases=True, timing=True)
    cal = sub.add_parser("calibrate", help="measure this GPU's matmul and copy ceilings and an empty launch's cost")
    cal.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    cap = sub.add_parser("capabilities", help="which attention implementation differentiates which way, and "
                                              "correctly (verified / wrong / error per mode)")
    cap.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    cap.add_argument("--impl", action="append", help="implementation (repeatable; default: all)")
    cap.add_argument("--json", help="write every cell here")
    cap.add_argument("--markdown", help="write the summary table here")
    cap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    tun = sub.add_parser("tune", help="time every candidate launch config of one kernel on an operator's cases "
                                      "(CUDA)")
    tun.add_argument("--op", required=True, help="operator")
    tun.add_argument("--kernel", required=True, help="a tunable kernel of the operator (an unknown name lists them)")
    tun.add_argument("--cases", help="case set (default: anchor)")
    tun.add_argument("--match", type=label_pattern, metavar="REGEX", help="only the cases whose label matches")
    tun.add_argument("--variant", help="the variant or forced route to run the kernel through (default: the "
                                       "kernel's own, e.g. triton@tiles for flash's fwd)")
    tun.add_argument("--mode", help="the mode to run (default: the kernel's)")
    tun.add_argument("--seed", type=seed_type, default=0, help="input seed (default 0)")
    tun.add_argument("--device", default="auto", help="auto (default), cuda or cuda:N")
    tun.add_argument("--json", help="write every row here")
    tun.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    wrm = sub.add_parser("warm", help="compile ahead, in parallel processes, every Triton kernel and config a bench "
                                      "of the same cases will autotune over (CUDA; then time as usual)")
    wrm.add_argument("--op", action="append", help="operator (repeatable; default: all)")
    wrm.add_argument("--cases", help="case set (default: anchor)")
    wrm.add_argument("--match", type=label_pattern, metavar="REGEX", help="only the cases whose label matches")
    wrm.add_argument("--shard", type=shard_part, metavar="K/N", help="part K of N of the selected cases, as bench's")
    wrm.add_argument("--variant", action="append",
                     help="variant or forced route (repeatable; default: each operator's Triton variants)")
    wrm.add_argument("--mode", action="append", help="mode (repeatable; default: all)")
    wrm.add_argument("--seed", type=seed_type, default=0, help="input seed (default 0)")
    wrm.add_argument("--device", default="auto", help="auto (default), cuda or cuda:N")
    wrm.add_argument("--procs", type=int, default=min(8, os.cpu_count() or 1),
                     help="worker processes side by side (default: the CPU count, at most 8)")
    tra = sub.add_parser("traffic", help="DRAM bytes read and written per call as Nsight Compute counts them, "
                                         "beside each operator's analytic minimum (CUDA and ncu)")
    tra.add_argument("--op", action="append", help="operator (repeatable; default: all)")
    tra.add_argument("--cases", default="anchor", help="case set (default: anchor)")
    tra.add_argument("--match", type=label_pattern, metavar="REGEX", help="only the cases whose label matches")
    tra.add_argument("--mode", action="append", help="mode (repeatable; default: every mode the variant runs)")
    tra.add_argument("--variant", action="append",
                     help="variant or forced route (repeatable; default: each operator's subject, triton)")
    tra.add_argument("--seed", type=seed_type, default=0, help="input seed (default 0)")
    tra.add_argument("--device", default="auto", help="auto (default), cuda or cuda:N")
    tra.add_argument("--json", help="write the rows here, rewritten after every part (required)")
    tra.add_argument("--ncu", help="the ncu executable (default: $NCU, else ncu on PATH)")
    tra.add_argument("--kernel-regex", metavar="REGEX",
                     help="profile only the kernels whose function name matches (ncu --kernel-name regex:; "
                          "default: every kernel the call launches, torch's too)")
    tra.add_argument("--calls-per-process", type=int, default=32, metavar="N",
                     help="calls per ncu process (default 32; a case's calls stay in one): a cut run keeps the "
                          "parts that finished")
    tra.add_argument("--budget", type=float, metavar="SECONDS",
                     help="start no part that the slowest so far would take past SECONDS, and stop one there "
                          "(the file then says 'interrupted')")
    tra.add_argument("--keep-raw", metavar="DIR",
                     help="keep ncu's CSV and the driver's files here (default: a temporary folder, removed)")
    tra.add_argument("--rebuild", metavar="DIR",
                     help="instead: write --json from a --keep-raw folder (any machine, no GPU)")
    rep = sub.add_parser("report", help="markdown summary (and a plot) of a --json file, complete or partial; "
                                        "--index: results/index.csv; --site: the results pages")
    rep.add_argument("report", nargs="*", help="a JSON file written by check/bench/run --json (several: the parts "
                                               "of one run, e.g. split with --match, read as one), or by traffic "
                                               "--json (its table of measured DRAM bytes)")
    rep.add_argument("--index", nargs="?", const="results", metavar="DIR",
                     help="instead: index every result file under DIR (default results/) into DIR/index.csv, one "
                          "row per measurement; files that are not result files are named on stderr")
    rep.add_argument("--csv", help="with --index: write the index here instead of DIR/index.csv")
    rep.add_argument("--site", nargs="?", const="results", metavar="DIR",
                     help="instead: render every result under DIR (default results/) as one markdown page per "
                          "operator with PNG plots (roofline, speedups), an index page, verdicts and the capability "
                          "matrix, into --out")
    rep.add_argument("--out", metavar="FOLDER", help="with --site: the folder to write (default docs/report); an "
                                                     "earlier site there is replaced, any other content refused")
    rep.add_argument("--markdown", help="write the summary here instead of printing it")
    rep.add_argument("--plot", help="write a PNG of TF/s per variant (needs matplotlib)")
    rep.add_argument("--floors", nargs="?", const="", metavar="RATES",
                     help="also each case's attainable floor (bytes, matmuls, exponentials, launch) at the run's "
                          "measured rates; RATES overrides them, e.g. matmul_tflops=989,exp_rate_factor=2")
    return parser


SIMPLE_COMMANDS = {"list": cmd_list, "calibrate": cmd_calibrate, "report": cmd_report, "capabilities": cmd_capabilities,
                   "tune": cmd_tune, "traffic": cmd_traffic, "warm": cmd_warm}


def main(argv=None):
    """The command line: ``argv`` a list of strings (None: sys.argv[1:]); returns the exit status."""
    if argv is not None and not (isinstance(argv, (list, tuple)) and all(isinstance(a, str) for a in argv)):
        raise TypeError(f"argv must be a list of str or None, got {argv!r}")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) and usage errors (2), already printed
        return exc.code
    args.argv = list(sys.argv[1:] if argv is None else argv)
    session = None
    try:
        if args.command in SIMPLE_COMMANDS:
            return SIMPLE_COMMANDS[args.command](args)
        session = Session(args, args.command)
        return session.run()
    except (UsageError, results.BadResultFile, results.OutputPathError) as exc:
        print(f"attnbench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the last write short
            signal.signal(sig, signal.SIG_IGN)
        if session is None:
            print(interrupted_before_any_row(args), file=sys.stderr)
            return EXIT_INTERRUPTED
        try:
            return session.interrupted()
        except results.WriteError as exc:
            print(f"attnbench: interrupted, and {exc}", file=sys.stderr)
            return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout's reader left while the JSON went to it (`--json - | head`)
        detach(sys.stdout)
        return EXIT_OK
    except results.WriteError as exc:  # mid-run (a full disk): the file's previous version is intact
        print(f"attnbench: {exc}; the run stopped, the file keeps the rows written before", file=sys.stderr)
        return EXIT_USAGE
    except BaseException:
        if session is not None:  # a bug: keep the finished rows, then show the traceback
            try:
                session.file.finish("error")
            except Exception:
                pass
        raise


if __name__ == "__main__":
    sys.exit(main())
