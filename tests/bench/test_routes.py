"""Forced routes (``triton@tma``, ``triton@splits8``, ``triton@segment``): variants that force one kernel path,
registered beside an operator's default set, run by check and bench when named, declining with a reason where
the route cannot run. The GPU studies in scripts/ forced these by hand; the CPU gate runs each through the
interpreter on one tiny case."""
import contextlib
import json

import pytest
import torch

import attnbench
from attnbench.bench.registry import Operator, Unsupported, Variant, forced_route
from attnbench.cli import main

CPU = torch.device("cpu")


def _toy():
    op = Operator()
    op.name = "toy"
    base = Variant("triton", "triton", lambda case, x, mode: (lambda: {"z": x}), ("fwd",))
    op.add_variant(base)
    return op, base


def test_routes_stay_out_of_the_default_set_and_resolve_by_name():
    op, base = _toy()
    route = forced_route(base, "fast", contextlib.nullcontext, "the fast path")
    op.add_route(route)
    assert list(op.variants) == ["triton"] and list(op.available_variants(CPU)) == ["triton"]
    assert op.variant("triton@fast") is route and op.knows("triton@fast")
    assert op.variant_names() == ["triton", "triton@fast"]
    assert route.kind == "triton" and route.modes == ("fwd",)
    with pytest.raises(ValueError, match="<variant>@<route>"):
        op.add_route(Variant("plain", "triton", base.prepare, ("fwd",)))
    with pytest.raises(ValueError, match="registered twice"):
        op.add_route(route)
    with pytest.raises(KeyError, match="known: triton, triton@fast"):
        op.variant("triton@slow")


def test_a_forced_route_wraps_every_call_and_turns_refusals_into_skips():
    _, base = _toy()
    entered = []

    @contextlib.contextmanager
    def switch():
        entered.append(1)
        yield

    refusing = Variant("triton", "triton", lambda case, x, mode: (lambda: (_ for _ in ()).throw(
        ValueError("forward route 'x' needs a GPU"))), ("fwd",))
    fn = forced_route(base, "a", switch, "")
    assert fn.prepare(None, 3, "fwd")() == {"z": 3} and len(entered) == 2  # prepare, then the timed call
    skip = forced_route(refusing, "x", switch, "", refused=lambda exc: "route" in str(exc)).prepare(None, 1, "fwd")
    with pytest.raises(Unsupported, match="forward route 'x' needs a GPU"):
        skip()
    other = forced_route(refusing, "x", switch, "", refused=lambda exc: False).prepare(None, 1, "fwd")
    with pytest.raises(ValueError):  # not a refusal: a failure stays a failure
        other()
    declined = forced_route(base, "d", switch, "", declines=lambda case: "not this case")
    with pytest.raises(Unsupported, match="not this case"):
        declined.prepare(None, 1, "fwd")
    gone = forced_route(base, "g", switch, "", unavailable_reason=lambda device: "no such unit")
    assert gone.unavailable_reason(CPU) == "no such unit"


def test_every_operator_registers_its_routes():
    expected = {
        "flash": {"triton@tiles", "triton@tma", "triton@hopper", "triton@decode", "triton@dq-atomic",
                  "triton@dq-tma-atomic", "triton@dkdv-tiles", "triton@dkdv-split", "triton@dkdv-hopper",
                  "triton@dkdv-per-head", "triton@dq-split", "triton@copies"},
        "shared_context": {f"triton@splits{n}" for n in (1, 2, 4, 8, 16, 32)}
        | {f"triton_composed@splits{n}" for n in (1, 2, 8)},
        "sparse": {"triton@segment", "triton@all-rows", "triton@two-launch", "triton@fused-dense", "triton@channelwise", "triton@matrix-units",
                   "triton@gather-kernel", "triton@unfolded", "triton@cublas-pair", "triton@split-matmul"},
    }
    for name, routes in expected.items():
        op = attnbench.get(name)
        assert set(op.routes) >= routes, name
        assert not set(op.routes) & set(op.variants)
        for route in op.routes.values():
            assert route.kind == "triton" and route.name.split("@")[0] in op.variants


def test_gpu_only_routes_say_why_on_the_cpu():
    flash = attnbench.get("flash")
    for name in ("triton@hopper", "triton@dkdv-hopper"):
        assert "sm_90" in flash.variant(name).unavailable_reason(CPU)
    assert "bulk reduction" in flash.variant("triton@dq-tma-atomic").unavailable_reason(CPU)
    for name in ("triton@tiles", "triton@tma", "triton@decode", "triton@dq-atomic", "triton@dkdv-split"):
        assert flash.variant(name).unavailable_reason(CPU) is None, name


def test_list_names_the_routes_apart(capsys):
    assert main(["list", "--op", "flash"]) == 0
    out = capsys.readouterr().out
    head, routes = out.split("forced routes (run when named with --variant):")
    assert "triton@" not in head
    assert "triton@tma" in routes and "unavailable on cpu: the Gluon kernels run on an sm_90 GPU" in routes


@pytest.mark.interpreter
def test_check_runs_a_named_route_and_skips_the_modes_it_does_not_force(tmp_path, capsys):
    path = tmp_path / "r.json"
    rc = main(["check", "--quiet", "--op", "flash", "--variant", "triton@tma", "--variant", "triton@dq-atomic",
               "--match", "N37x29 D24 fp32", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {(r["variant"], r["mode"]): r for r in json.loads(path.read_text())["checks"]}
    assert rows["triton@tma", "fwd"]["passed"] and rows["triton@tma", "fwd_bwd"]["passed"]
    assert rows["triton@dq-atomic", "bwd"]["passed"] and rows["triton@dq-atomic", "fwd_bwd"]["passed"]
    assert "does not implement mode bwd" in rows["triton@tma", "bwd"]["skipped"]
    assert "summary: checks 4 passed, 0 failed, 2 skipped" in out


@pytest.mark.interpreter
def test_bench_times_a_route_beside_its_default(capsys):
    rc = main(["bench", "--op", "shared_context", "--variant", "triton", "--variant", "triton@splits4",
               "--match", "B5 H3/1 .* fp32", "--json", "-"])
    rows = json.loads(capsys.readouterr().out)["bench"]
    assert rc == 0 and {r["variant"] for r in rows if r["timing"]} == {"triton", "triton@splits4"}


def test_an_unavailable_route_stops_before_any_work(capsys):
    assert main(["check", "--op", "flash", "--variant", "triton@hopper"]) == 2
    err = capsys.readouterr().err
    assert "flash: variant triton@hopper cannot run on cpu: the Gluon kernels run on an sm_90 GPU only" in err
    assert main(["bench", "--op", "flash", "--baseline", "triton@dq-tma-atomic"]) == 2
    assert "--baseline triton@dq-tma-atomic: cannot run on cpu" in capsys.readouterr().err


def test_sparse_routes_decline_the_ops_they_do_not_change():
    from attnbench.operators.sparse import SparseCase

    sparse = attnbench.get("sparse")
    x = {}
    for name, case, reason in (
            ("triton@segment", SparseCase("scale", 1, 5, 4), "scale has one kernel route"),
            ("triton@two-launch", SparseCase("mul", 1, 5, 4), "the dense route takes vecsca, scavec, inner, not mul"),
            ("triton@unfolded", SparseCase("vecmat", 1, 5, 4), "the fold route takes vecmat with a shared y"),
            ("triton@cublas-pair", SparseCase("vecmat", 1, 5, 4, "float32", "y"), "float32 does not split")):
        with pytest.raises(Unsupported, match=reason):
            sparse.variant(name).prepare(case, x, "fwd")
    for name in ("triton@cublas-pair", "triton@split-matmul"):
        assert "16-bit products run as fp32 off CUDA" in sparse.variant(name).unavailable_reason(CPU)


def test_odd_case_sets_cover_what_the_sanitizer_runs():
    """The gate's memcheck stage runs `check --cases odd` of every operator: real sets with unique labels, odd
    lengths and head dims, the split-KV rows, batch sums over ragged ranges, empty buffers."""
    for name in ("flash", "jvp_attention", "shared_context", "sparse"):
        op = attnbench.get(name)
        cases = op.cases("odd")
        assert "odd" in op.case_sets and cases and len({c.label for c in cases}) == len(cases), name
    flash = attnbench.get("flash").cases("odd")
    assert {40, 72, 88, 24, 160, 256} <= {c.head_dim for c in flash}
    assert any(c.seqlen_q <= 64 for c in flash) and any(c.heads_q != c.heads_kv for c in flash)
    sparse = attnbench.get("sparse").cases("odd")
    assert {c.op for c in sparse} >= {"mul", "outer", "inner", "vecmat", "vecsca", "scavec", "mat_t_vec", "scale"}
    assert any(c.batch == 3001 and c.shared for c in sparse) and any(c.structure == "random" for c in sparse)
    assert any(c.n_buf == 0 for c in attnbench.get("shared_context").cases("odd"))
