"""Turn a ``--json`` report of ``attnbench bench``/``run`` into a markdown summary and a plot.

    attnbench report results/gpu/nvidia-h200/flash-nvidia-h200.json --markdown out.md --plot out.png

The markdown gives, per case and mode, each variant's latency and TF/s and the Triton variant's
speed as a multiple of every peer's; the plot shows TF/s per variant, one panel per mode.
"""
import json
import math
from collections import defaultdict


def load(path):
    with open(path) as f:
        return json.load(f)


def _rows(report):
    return [r for r in report.get("bench", []) if r.get("timing")]


def _ratio_peers(report):
    """(subject, peers) of the report's operators: the operator's own, when it is registered here."""
    from .registry import all_operators

    ops = all_operators()
    for name in sorted({r["op"] for r in _rows(report)}):
        if name in ops:
            return ops[name].ratio_subject, ops[name].ratio_peers
    return "triton", ()


def markdown(report, subject=None, peers=None) -> str:
    if subject is None or peers is None:
        default_subject, default_peers = _ratio_peers(report)
        subject, peers = subject or default_subject, default_peers if peers is None else peers
    machine = report.get("machine", {})
    ceil = report.get("ceilings") or {}
    lines = [f"# {', '.join(sorted({r['op'] for r in _rows(report)}))} on {machine.get('device_name', '?')}", "",
             f"torch {machine.get('torch')}, triton {machine.get('triton')}, CUDA {machine.get('cuda')}."]
    if ceil:
        lines.append(f"Measured ceilings: bf16 matmul {ceil['matmul_tflops']:.0f} TF/s, "
                     f"device copy {ceil['copy_gbps']:.0f} GB/s.")
    lines += ["", f"| case | mode | {subject} ms | {subject} TF/s | " + " | ".join(f"vs {p}" for p in peers)
              + " | % roofline | max rel. error |",
              "| --- | --- | --- | --- | " + " | ".join("---" for _ in peers) + " | --- | --- |"]
    by_key = defaultdict(dict)
    for r in _rows(report):
        by_key[r["case"], r["mode"]][r["variant"]] = r
    for (case, mode), variants in by_key.items():
        ours = variants.get(subject)
        if not ours:
            continue
        ratios = []
        for p in peers:
            peer = variants.get(p)
            ratios.append(f"{peer['timing']['median_ms'] / ours['timing']['median_ms']:.2f}x" if peer else "n/a")
        roof = ours.get("roofline_pct")
        lines.append(f"| {case} | {mode} | {ours['timing']['median_ms']:.3f} | {ours['tflops']:.0f} | "
                     + " | ".join(ratios) + f" | {'-' if roof is None else f'{roof:.0f}'} | {ours['max_error']:.1e} |")
    lines += ["", f"'vs peer' is the peer's median latency over {subject}'s, measured in the same run: "
              "above 1 means ours is faster."]
    return "\n".join(lines) + "\n"


def plot(report, path):
    """Grouped bars of TF/s: one panel per mode, cases along x, one bar per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(report)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    value = {(r["case"], r["mode"], r["variant"]): r["tflops"] for r in rows}
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, 2.2 * len(cases)), 3.2 * len(modes)), squeeze=False)
    width = 0.8 / len(variants)
    for ax, mode in zip(axes[:, 0], modes):
        for i, variant in enumerate(variants):
            ys = [value.get((c, mode, variant), math.nan) for c in cases]
            ax.bar([x + i * width for x in range(len(cases))], ys, width, label=variant)
        ax.set_title(f"{mode}")
        ax.set_ylabel("TF/s")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(ncol=min(4, len(variants)), fontsize=8)
    fig.suptitle(f"{report.get('machine', {}).get('device_name', '')}: throughput by variant (FA FLOP convention)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
