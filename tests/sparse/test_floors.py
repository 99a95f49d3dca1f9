"""scripts/sparse_floors.py: the copy-bandwidth bar of the sparse products against the card's peaks and against the
sibling-product design of the derivatives (a model: no GPU)."""
import pytest

from attnbench.operators.sparse import SparseCase

from ..helpers import load_script


@pytest.fixture(scope="module")
def floors():
    return load_script("sparse_floors")


def test_clebsch_gordan_blocks_count_every_path(floors):
    """L 1: paths (0,0,0), (0,1,1), (1,0,1), (1,1,0), (1,1,1): 1 + 9 + 9 + 9 + 27."""
    assert floors.cg_block_macs(1) == 55
    assert floors.cg_block_macs(6) == 98245  # 84% of 49**3: the triangle rule excludes little


def test_design_caps_count_the_sibling_products(floors):
    """vecsca (z as large as x, y small): backward reads g twice, 2 (X + Z) against 2X + Z, 3/4; double backward
    4X + 7Z against 3X + 2Z, 5/11. mul (X = Y = Z): 5/6 and 8/15. inner (z small): all but 1 and 6/8."""
    cases = {op: SparseCase(op, 3, 10_000, 128, "bfloat16") for op in ("vecsca", "mul", "inner")}
    expected = {"vecsca": (3 / 4, 5 / 11), "mul": (5 / 6, 8 / 15), "inner": (1.0, 6 / 8)}
    for op, (bwd, double_bwd) in expected.items():
        assert floors.design_cap_pct(cases[op], "fwd") == pytest.approx(100.0)
        assert floors.design_cap_pct(cases[op], "bwd") == pytest.approx(100 * bwd, abs=1.0), op
        assert floors.design_cap_pct(cases[op], "double_bwd") == pytest.approx(100 * double_bwd, abs=1.0), op


def test_peaks_bound_mul_at_l6_and_the_shared_weight_at_c128(floors):
    args = floors.parse([])
    mul = floors.floors(SparseCase("mul", 6, 100_000, 32, "bfloat16"), "fwd", args)
    # 294 bytes a column at 3020 GB/s against 98245 multiply-adds at 989 TF/s
    assert mul["attainable_pct"] == pytest.approx(100 * (294 / 3020e9) / (2 * 98245 / 989e12), rel=0.01)
    assert mul["at_most_pct"] < 60
    fc = floors.floors(SparseCase("vecmat", 3, 100_000, 128, "bfloat16", "y"), "fwd", args)
    assert fc["attainable_pct"] < 60 and fc["matrix_us"] < fc["fma_us"]
    small = floors.floors(SparseCase("vecsca", 2, 1_000_000, 32, "bfloat16"), "fwd", args)
    assert small["attainable_pct"] == 100.0 and small["at_most_pct"] == 100.0


def test_script_writes_the_table(floors, tmp_path, capsys):
    out = tmp_path / "floors.md"
    assert floors.main(["--ops", "mul,vecsca", "--markdown", str(out)]) == 0
    text = out.read_text()
    assert "| mul L6 N100000 C32 bf16 | fwd |" in text and "vecmat" not in text
    assert "cannot reach the bar" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown ops"):
        floors.main(["--ops", "mull"])
