"""Plain-text tables of check and bench results, sized for a 120-column terminal.

A cell never holds prose: a skipped row says ``skip [n]`` and reason n is printed once, wrapped,
below the table. Columns that mean nothing for the rows at hand are left out: TF/s, GB/s and
% of roofline without a GPU timing, "vs <baseline>" when no row could be divided by the baseline
(it did not run, or the clocks differ, as the interpreter's do); the baseline is named below.
"""
import math
import textwrap

from .timing import NOISY_IQR_FRACTION, comparable

WIDTH = 120


def _fmt(value, spec, empty="-"):
    return empty if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def table(headers, rows) -> str:
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()
    out = [line, "-" * len(line)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(out)


def wrap(text: str, indent: str = "    ") -> str:
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


class Notes:
    """Numbered reasons printed once below a table; a row refers to its reason by number."""

    def __init__(self):
        self.reasons: dict[str, int] = {}

    def ref(self, reason: str, label: str = "skip") -> str:
        number = self.reasons.setdefault(reason, len(self.reasons) + 1)
        return f"{label} [{number}]"

    def lines(self) -> list:
        return [wrap(f"[{n}] {reason}") for reason, n in self.reasons.items()]


def _worst(outputs):
    """The output closest to (or furthest over) its bound."""
    def ratio(o):
        if math.isnan(o.error) or math.isinf(o.error):
            return math.inf
        return o.error / o.bound if o.bound > 0 else math.inf

    return max(outputs, key=ratio) if outputs else None


def check_table(results) -> str:
    """One row per (case, mode, variant): status and the output nearest its bound (every output's
    error and bound are in the --json file); failures' details and skip reasons below."""
    notes, rows, failures = Notes(), [], []
    for r in results:
        worst = _worst(r.outputs)
        status = notes.ref(r.skipped) if r.skipped else ("ok" if r.passed else "FAIL")
        rows.append((r.case, r.mode, r.variant, status, worst.name if worst else "",
                     _fmt(worst.error, ".1e") if worst else "", _fmt(worst.bound, ".0e") if worst else ""))
        if not r.skipped and not r.passed:
            for o in r.outputs:
                if not o.passed:
                    failures.append(wrap(f"FAIL {r.case} {r.mode} {r.variant} {o.name}: error {o.error:.2e} "
                                         f"> bound {o.bound:.1e}; {o.detail}"))
    text = table(("case", "mode", "variant", "status", "worst output", "rel. error", "bound"), rows)
    extra = failures + notes.lines()
    return text + ("\n\n" + "\n".join(extra) if extra else "")


def bench_table(rows, bound_of) -> str:
    """``bound_of(case_label)`` -> the error bound of the case's dtype (None: not judged)."""
    notes = Notes()
    gpu = any(r.timing and r.timing.is_gpu for r in rows)
    eager = any(getattr(r, "eager", None) for r in rows)  # rows read back from older files lack the clocks
    host = any(getattr(r, "host", None) for r in rows)
    base = next((r.baseline for r in rows if r.speedup is not None), None)
    show_vs = any(r.speedup is not None and r.variant != r.baseline for r in rows)
    extra_cols = eager * (1 + show_vs) + host
    noisy = over = False
    body = []
    for r in rows:
        t = r.timing
        if t is None:
            body.append([r.case, r.mode, r.variant, notes.ref(r.skipped or "no timing")]
                        + [""] * (4 + 4 * gpu + show_vs + extra_cols))
            continue
        iqr = _fmt(t.iqr_ms, ".3f")
        if t.noisy:
            iqr, noisy = iqr + " *", True
        err = notes.ref(r.unverified, "unverified") if r.unverified else _fmt(r.max_error, ".1e")
        bound = bound_of(r.case)
        if bound is not None and not math.isnan(r.max_error) and r.max_error > bound:
            err, over = err + " !", True
        cells = [r.case, r.mode, r.variant, t.method, _fmt(t.median_ms, ".3f"), iqr, str(t.samples)]
        if gpu:
            cells += [_fmt(r.tflops, ".1f"), _fmt(r.gbps, ".0f"), _fmt(r.roofline_pct, ".0f"),
                      "-" if r.floor_pct is None else f"{r.floor_pct:.0f} {r.floor_binding}"]
        if show_vs:
            cells.append("-" if r.speedup is None else f"{r.speedup:.2f}x")
        if eager:
            cells.append(_fmt(r.eager.median_ms if r.eager else None, ".3f"))
            if show_vs:
                cells.append("-" if r.speedup_eager is None else f"{r.speedup_eager:.2f}x")
        if host:
            cells.append(_fmt(r.host.median_ms * 1e3 if r.host else None, ".0f"))
        body.append(cells + [err])
    headers = ["case", "mode", "variant", "clock", "median ms", "IQR ms", "n"]
    if gpu:
        headers += ["TF/s", "GB/s", "% roof", "% floor"]
    if show_vs:
        headers.append("speedup")
    if eager:
        headers += ["eager ms"] + (["speedup eager"] if show_vs else [])
    if host:
        headers.append("host us")
    headers.append("max rel err")
    legend = []
    if gpu:
        legend.append("% floor: the attainable floor (the largest of bytes at copy bandwidth, matmul work, "
                      "exponentials, one launch: attnbench/bench/floors.py) over the row's GPU time, and what binds")
        legend.append("clock cuda-events: GPU time (the kernels' cost, host kept out)"
                      + ("; eager ms: wall time per call back to back, host included (what a Python caller pays)"
                         if eager else "") + ("; host us: the host's time to issue one call" if host else ""))
    if show_vs:
        legend.append(f"speedup: {base}'s median over the row's, on the same clock (-: clocks differ, "
                      "as the interpreter's do)")
    if noisy:
        legend.append(f"* noisy: IQR above {NOISY_IQR_FRACTION:.0%} of the median (another load on this machine?)")
    if over:
        legend.append("! error above the dtype's bound (expected of the eager reference in bf16, a red flag elsewhere)")
    extra = [wrap(line) for line in legend] + notes.lines()
    return table(headers, body) + ("\n\n" + "\n".join(extra) if extra else "")


def ratio_lines(rows, subject, peers) -> list:
    """'<subject> speed = N.NNx <peer>, ...' per case and mode, between comparable clocks only."""
    by_key = {}
    for r in rows:
        if r.timing:
            by_key.setdefault((r.case, r.mode), {})[r.variant] = r
    lines = []
    for (case, mode), by_variant in by_key.items():
        ours = by_variant.get(subject)
        if ours is None:
            continue
        parts = []
        for p in peers:
            peer = by_variant.get(p)
            if peer is None or not comparable(peer.timing, ours.timing):
                continue
            part = f"{peer.timing.median_ms / ours.timing.median_ms:.2f}x {p}"
            if getattr(ours, "eager", None) and getattr(peer, "eager", None):
                part += f" ({peer.eager.median_ms / ours.eager.median_ms:.2f}x eager)"
            parts.append(part)
        if parts:
            lines.append(f"{case}  {mode}  {subject} speed = " + ", ".join(parts))
    return lines


def unavailable_lines(op_name, unavailable: dict, device_type: str) -> list:
    """Variants that did not run because they cannot run here, grouped by reason."""
    by_reason = {}
    for name, reason in unavailable.items():
        by_reason.setdefault(reason, []).append(name)
    return [wrap(f"not run on {device_type}: {op_name} {', '.join(names)}: {reason}")
            for reason, names in by_reason.items()]


def summary_line(checks=None, bench_rows=None, unavailable: int = 0) -> str:
    """The closing line: what passed, failed, was skipped, timed (short enough for 120 columns)."""
    parts = []
    if checks is not None:
        passed = sum(1 for r in checks if r.passed)
        skipped = sum(1 for r in checks if r.skipped)
        parts.append(f"checks {passed} passed, {len(checks) - passed - skipped} failed, {skipped} skipped")
    if bench_rows is not None:
        timed = [r for r in bench_rows if r.timing]
        noisy = sum(1 for r in timed if r.timing.noisy)
        unverified = sum(1 for r in timed if getattr(r, "unverified", ""))  # rows of other sources may lack it
        failed = sum(1 for r in bench_rows if getattr(r, "failed", ""))  # the variant raised
        parts.append(f"bench {len(timed)} timed" + (f", {failed} failed" if failed else "")
                     + f", {len(bench_rows) - len(timed) - failed} skipped"
                     + (f", {noisy} noisy" if noisy else "") + (f", {unverified} unverified" if unverified else ""))
    if unavailable:
        parts.append(f"{unavailable} variant{'s' if unavailable > 1 else ''} unavailable")
    return "summary: " + "; ".join(parts)


def megabytes(n) -> str:
    """Bytes as MB (10^6 bytes), three significant figures or more: the unit of every traffic table."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    mb = n / 1e6
    return f"{mb:,.1f}" if mb >= 10 else f"{mb:.2f}" if mb >= 1 else f"{mb:.3f}"


def ratio_cell(value) -> str:
    """A ratio as "1.23x", or "-" where there is none."""
    return "-" if value is None else f"{value:.2f}x"


def traffic_table(rows) -> str:
    """One row per profiled call of ``attnbench traffic``: its kernel count, the DRAM bytes ncu counted (read,
    written, both), the operator's minimum and measured / minimum; skipped calls' reasons below."""
    notes, body = Notes(), []
    for r in rows:
        if r.get("skipped"):
            body.append([r["case"], r["mode"], r["variant"], notes.ref(r["skipped"]), "", "", "", "", ""])
            continue
        body.append([r["case"], r["mode"], r["variant"], str(len(r.get("kernels") or [])), megabytes(r["read_bytes"]),
                     megabytes(r["write_bytes"]), megabytes(r["bytes"]), megabytes(r.get("minimum_bytes")),
                     ratio_cell(r.get("ratio"))])
    headers = ["case", "mode", "variant", "kernels", "read MB", "written MB", "measured MB", "minimum MB", "ratio"]
    legend = ["measured MB: DRAM bytes read plus written as ncu counts them over the call's kernels (caches flushed "
              "before each); minimum MB: the operator's analytic minimum (op.bytes); ratio: measured over minimum"]
    extra = [wrap(line) for line in legend] + notes.lines()
    return table(headers, body) + "\n\n" + "\n".join(extra)
