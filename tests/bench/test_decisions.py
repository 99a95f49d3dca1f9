"""attnbench.bench.decisions: the seed's rule as data, verdicts computed from bench rows (generic over
operators; tested here with shared_context's comparisons and with made-up rows)."""
import json
import math

import pytest

import attnbench
from attnbench.bench import decisions
from attnbench.bench.decisions import BEST_PEER, Comparison, decide, verdict


@pytest.mark.parametrize("speedup,expected", [(0.5, "defer"), (1.0, "defer"), (1.0999, "defer"), (1.10, "implement"),
                                              (1.2999, "implement"), (1.30, "prioritize"), (31.0, "prioritize")])
def test_rule_boundaries(speedup, expected):
    assert verdict(speedup) == expected


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, None])
def test_rule_rejects_non_speedups(bad):
    with pytest.raises(ValueError, match="speedup"):
        verdict(bad)


def _row(variant, ms, case="c1", mode="fwd", op="shared_context"):
    return {"op": op, "case": case, "mode": mode, "variant": variant,
            "timing": None if ms is None else {"median_ms": ms}}


KINDS = {"shared_context": {"reference": "reference", "split": "split", "triton": "triton",
                            "per_batch_flash": "peer", "fold_flash": "peer", "per_batch_cudnn": "peer"}}


def test_default_comparisons_and_best_peer():
    rows = [_row("reference", 10.0), _row("split", 2.5), _row("triton", 0.5), _row("per_batch_flash", 0.6),
            _row("fold_flash", 0.55), _row("per_batch_cudnn", None)]
    got = {v.comparison: v for v in decide(rows, decisions.DEFAULT_COMPARISONS, KINDS)}
    assert got["split vs reference"].speedup == pytest.approx(4.0)
    assert got["split vs reference"].verdict == "prioritize"
    assert got["triton vs split"].speedup == pytest.approx(5.0)
    best = got["triton vs best peer"]
    assert best.baseline == "fold_flash" and best.speedup == pytest.approx(1.1) and best.verdict == "implement"


def test_best_of_a_named_set_skips_what_did_not_run():
    rows = [_row("split", 0.9), _row("triton", 1.0), _row("per_batch_flash", None), _row("fold_flash", 1.25)]
    (v,) = decide(rows, (Comparison("triton", ("per_batch_flash", "split", "fold_flash")),), KINDS)
    assert v.baseline == "split" and v.verdict == "defer" and v.speedup == pytest.approx(0.9)
    assert v.comparison == "triton vs best of {per_batch_flash, split, fold_flash}"


def test_missing_candidate_or_baseline_gives_no_verdict():
    rows = [_row("triton", None), _row("split", 1.0), _row("reference", None, case="c2"), _row("split", 1.0, case="c2")]
    assert decide(rows, decisions.DEFAULT_COMPARISONS, KINDS) == []


def test_only_comparable_clocks_are_divided():
    """An interpreter timing is no speed; CUDA events and CPU wall clocks do not divide either."""
    rows = [_row("triton", 1.0), _row("split", 2.0), _row("reference", 3.0)]
    rows[0]["timing"]["method"] = "interpreter"
    rows[1]["timing"]["method"] = rows[2]["timing"]["method"] = "cpu-wall"
    got = {v.comparison for v in decide(rows, decisions.DEFAULT_COMPARISONS, KINDS)}
    assert got == {"split vs reference"}


def test_shared_context_declares_its_gate():
    op = attnbench.get("shared_context")
    comps = decisions.comparisons_for(op)
    assert comps[:3] == decisions.DEFAULT_COMPARISONS
    assert comps[3] == Comparison("triton", op.gate_baselines)
    assert {"per_batch_flash", "split", "fold_flash"} <= set(op.gate_baselines)


def test_registry_kinds_are_used_by_default():
    rows = [_row("triton", 1.0), _row("fold_flash", 2.0), _row("split", 1.5), _row("reference", 3.0)]
    verdicts = decide(rows)
    peer = next(v for v in verdicts if v.comparison == "triton vs best peer")
    assert peer.baseline == "fold_flash" and peer.verdict == "prioritize"
    gate = next(v for v in verdicts if v.comparison.startswith("triton vs best of"))
    assert gate.baseline == "split" and gate.verdict == "prioritize"


def test_write_and_main(tmp_path, capsys):
    report = {"machine": {"device_name": "test"}, "bench": [_row("split", 2.0), _row("reference", 2.1),
                                                            _row("triton", 1.0)]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert decisions.main([str(path), "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "decisions.json").read_text())
    assert {v["comparison"] for v in data["verdicts"]} >= {"split vs reference", "triton vs split"}
    assert data["rule"][0] == {"verdict": "defer", "lower": 0.0, "upper": 1.1}
    md = (tmp_path / "out" / "decisions.md").read_text()
    assert "| shared_context | c1 | fwd | split vs reference | reference |" in md and "**defer**" in md
    assert decisions.main([str(path)]) == 0
    assert "triton vs split" in capsys.readouterr().out
