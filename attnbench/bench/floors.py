"""The attainable floor of a case: the least time any kernel can take, resource by resource.

    attnbench report RUN.json --floors                                   the run's measured ceilings
    attnbench report RUN.json --floors matmul_tflops=989,exp_rate_factor=2   a generous reading

Per (operator, case, mode), from the operator's own cost model and the machine's rates (by default those
``attnbench calibrate`` measured, recorded in the run's file), each of these is a time no kernel can beat:

- **bytes**: the minimum bytes (``Operator.bytes``: every input read once, every output written once) at the
  measured device-copy bandwidth (bytes read plus written, so pure reads can pass 100%);
- **compute**: the cost model's FLOPs (``Operator.flops``) at the measured bf16 matmul rate, or the operator's own
  compute floor where its FLOPs are not tensor-core work (``Operator.compute_floor_s``: sparse's products, the
  faster of their terms on the FMA units and their dense form on the tensor cores);
- **exponentials**, where the operator counts them (``Operator.exponentials``: one per visible (query row, key)
  pair and query head, for each pass that forms P): 16 a clock on each SM's special-function units at the highest
  SM clock (``roofline.exp_floor_s``, Hopper's rate), times ``exp_rate_factor`` (2: as if half of them ran as
  polynomials on the FMA units at no cost, FlashAttention-4's trick, more than a Hopper SM's issue slots allow);
- **launch**: one empty Triton launch's GPU time (``calibrate``'s ``launch_floor_us``), when the run recorded it:
  it holds for CUDA-event timings, not for CUDA-graph replays.

Assumptions: each floor is a lower bound taken alone, at peak rate, with nothing else in flight (no launch gaps,
no instruction overhead, perfect overlap of the other resources), so the largest one binds and they never add;
the rates are those of one machine (a run's ceilings, or the values given). The **attainable % of copy
bandwidth** is the bytes' time over the largest floor (``roofline.attainable_copy_pct``): no kernel shows more,
and where it is under a bar the bar cannot be met on that machine. Where the operator's chosen design must move
more than the minimum (``Operator.design_bytes``: sparse's derivatives as one kernel per sibling product) the
**design cap** is the minimum over what the design moves: a kernel per product at full copy bandwidth shows no
more. Measured rows (the operator's subject variant, GPU clocks only) get their % of copy bandwidth and their %
of the floor (the floor's time over theirs).

``table(op, cases, modes, rates)`` gives the same rows for any cases without a run (a model: e.g. sparse's sweep
at the H100's datasheet rates); the speed bars (over the best baseline) are ``attnbench report``'s ratio lines
and ``attnbench.bench.decisions``.
"""
import math
from dataclasses import dataclass, fields

from .roofline import MAX_SM_CLOCK_GHZ, exp_floor_s

GPU_CLOCKS = ("cuda-events", "cuda-graph")
# The FMA units' fp32 rate when none is given: the H100 SXM's datasheet peak (no calibration measures it). Only
# an operator whose compute floor uses the FMA units reads it (sparse).
DATASHEET_FMA_TFLOPS = 67.0


@dataclass(frozen=True)
class Rates:
    """The machine the floors are computed for."""

    copy_gbps: float
    matmul_tflops: float  # bf16 tensor cores; fp32's one TF32 pass counts at half
    multiprocessors: int
    sm_clock_ghz: float = MAX_SM_CLOCK_GHZ
    exp_rate_factor: float = 1.0
    launch_floor_us: float = 0.0  # 0: not counted
    fma_tflops: float = DATASHEET_FMA_TFLOPS


def parse_overrides(text: str) -> dict:
    """``name=value,...`` (names of ``Rates``) as a dict; ValueError naming what is wrong."""
    known = {f.name: f.type for f in fields(Rates)}
    out = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in known:
            raise ValueError(f"{item!r}: expected name=value with a name of {', '.join(known)}")
        try:
            out[name] = int(value) if name == "multiprocessors" else float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number") from None
        if not out[name] > 0 and name != "launch_floor_us":
            raise ValueError(f"{item!r}: must be > 0")
    return out


def rates_of(report: dict, overrides: str = "") -> Rates:
    """The rates a run measured (its ceilings and the GPU's multiprocessors), with ``overrides`` applied. A run
    timed by CUDA-graph replays alone counts no launch floor (it is measured with CUDA events), unless given."""
    ceilings, machine = report.get("ceilings") or {}, report.get("machine") or {}
    clocks = {(r.get("timing") or {}).get("method") for r in report.get("bench", []) if r.get("timing")}
    values = {"copy_gbps": ceilings.get("copy_gbps"), "matmul_tflops": ceilings.get("matmul_tflops"),
              "multiprocessors": machine.get("multiprocessors"),
              "launch_floor_us": 0.0 if clocks == {"cuda-graph"} else ceilings.get("launch_floor_us") or 0.0}
    values.update(parse_overrides(overrides))
    missing = [k for k in ("copy_gbps", "matmul_tflops", "multiprocessors") if not values.get(k)]
    if missing:
        raise ValueError(f"the run records no {', '.join(missing)} (a CPU run, or a file from before they were "
                         "recorded): give them, e.g. --floors copy_gbps=3020,matmul_tflops=785,multiprocessors=132")
    return Rates(**values)


@dataclass
class Floor:
    op: str
    case: str
    mode: str
    nbytes: float
    floors_s: dict  # resource -> seconds
    design_cap_pct: float | None = None
    measured_s: float | None = None  # the subject variant's median, GPU clocks only

    @property
    def floor_s(self) -> float:
        return max(self.floors_s.values())

    @property
    def binding(self) -> str:
        return max(self.floors_s, key=self.floors_s.get)

    @property
    def attainable_pct(self) -> float:
        """As ``roofline.attainable_copy_pct``: the bytes' time over the largest floor."""
        return 100.0 * (self.floors_s["bytes"] / self.floor_s)

    @property
    def copy_pct(self):
        return None if self.measured_s is None else 100.0 * self.floors_s["bytes"] / self.measured_s

    @property
    def of_floor_pct(self):
        return None if self.measured_s is None else 100.0 * self.floor_s / self.measured_s


def floor(op, case, mode, rates: Rates) -> Floor:
    """The floors of one case and mode (see the module)."""
    nbytes = op.bytes(case, mode)
    floors_s = {"bytes": nbytes / (rates.copy_gbps * 1e9)}
    compute = getattr(op, "compute_floor_s", None)
    floors_s["compute"] = compute(case, mode, rates) if compute else op.flops(case, mode) / (rates.matmul_tflops * 1e12)
    if (count := getattr(op, "exponentials", None)) is not None:
        floors_s["exps"] = exp_floor_s(count(case, mode), rates.multiprocessors, rates.sm_clock_ghz) / \
            rates.exp_rate_factor
    if rates.launch_floor_us:
        floors_s["launch"] = rates.launch_floor_us * 1e-6
    design = getattr(op, "design_bytes", None)
    moved = design(case, mode) if design else None
    return Floor(op.name, case.label, mode, nbytes, floors_s, None if not moved else 100.0 * nbytes / moved)


def table(op, cases, modes, rates: Rates) -> list:
    """Floors of ``cases`` x ``modes``, no measurement (a model)."""
    return [floor(op, case, mode, rates) for case in cases for mode in modes]


def _cases_by_label(op):
    return {c.label: c for name in op.case_sets for c in op.cases(name)}


def from_report(report: dict, rates: Rates) -> tuple:
    """(floors of every (op, case, mode) the run timed, labels it could not place): each with the subject
    variant's GPU-clock median when it has one."""
    from .registry import all_operators

    operators = all_operators()
    rows, unknown, known = [], [], {}
    seen = {}
    for row in report.get("bench", []):
        op = operators.get(row.get("op"))
        if op is None or not row.get("timing"):
            continue
        if op.name not in known:
            known[op.name] = _cases_by_label(op)
        case = known[op.name].get(row["case"])
        if case is None:
            unknown.append(f"{op.name} {row['case']}")
            continue
        key = (op.name, row["case"], row["mode"])
        if key not in seen:
            seen[key] = floor(op, case, row["mode"], rates)
            rows.append(seen[key])
        subject = ((report.get("operators") or {}).get(op.name) or {}).get("ratio_subject", op.ratio_subject)
        timing = row["timing"]
        if row["variant"] == subject and timing.get("method") in GPU_CLOCKS:
            seen[key].measured_s = timing["median_ms"] / 1e3
    return rows, list(dict.fromkeys(unknown))


def _us(seconds):
    return "-" if seconds is None else f"{seconds * 1e6:.2f}"


def _pct(value):
    return "-" if value is None or not math.isfinite(value) else f"{value:.1f}"


def markdown(rows, rates: Rates, title="Floors", unknown=()) -> str:
    """The floors as markdown, one table per operator."""
    launch = f"{rates.launch_floor_us:g} us" if rates.launch_floor_us else "not counted"
    lines = [f"## {title}", "",
             f"Copy bandwidth {rates.copy_gbps:.0f} GB/s; matmuls {rates.matmul_tflops:.0f} TF/s (bf16; fp32 at "
             f"half); exponentials {rates.multiprocessors} SMs x 16 a clock x {rates.sm_clock_ghz:g} GHz x "
             f"{rates.exp_rate_factor:g}; one launch {launch}. Each floor alone at peak rate: the largest binds "
             "(attnbench/bench/floors.py states the assumptions).", ""]
    for op in dict.fromkeys(r.op for r in rows):
        mine = [r for r in rows if r.op == op]
        resources = list(dict.fromkeys(n for r in mine for n in r.floors_s))
        design = any(r.design_cap_pct is not None for r in mine)
        measured = any(r.measured_s is not None for r in mine)
        head = ["case", "mode", "MB", *(f"{n} us" for n in resources), "binding", "attainable % copy"]
        head += ["design cap %"] if design else []
        head += ["measured us", "% copy", "% of floor"] if measured else []
        lines += [f"### {op}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in mine:
            cells = [r.case, r.mode, f"{r.nbytes / 1e6:.2f}", *(_us(r.floors_s.get(n)) for n in resources), r.binding,
                     _pct(r.attainable_pct)]
            cells += [_pct(r.design_cap_pct)] if design else []
            cells += [_us(r.measured_s), _pct(r.copy_pct), _pct(r.of_floor_pct)] if measured else []
            lines.append("| " + " | ".join(cells) + " |")
        bound = {n: sum(r.binding == n for r in mine) for n in resources}
        lines += ["", f"Binding: {', '.join(f'{n} {k}' for n, k in bound.items() if k)} of {len(mine)}."]
        if measured:
            shares = sorted(r.of_floor_pct for r in mine if r.measured_s is not None)
            lines.append(f"Measured (GPU clocks): {len(shares)} rows at {shares[0]:.1f}-{shares[-1]:.1f}% of their "
                         f"floor (median {shares[len(shares) // 2]:.1f}%).")
        lines.append("")
    if unknown:
        lines.append(f"Not placed (no case of that label in the operator's case sets): {', '.join(unknown)}.")
    return "\n".join(lines).rstrip("\n") + "\n"


def report_section(report: dict, overrides: str = "") -> str:
    """What ``attnbench report --floors`` appends: the run's floors at its measured rates (``overrides`` applied;
    ``rates_of``)."""
    rates = rates_of(report, overrides)
    rows, unknown = from_report(report, rates)
    if not rows:
        raise ValueError("the run has no timed rows of a known operator")
    return markdown(rows, rates, unknown=unknown)
