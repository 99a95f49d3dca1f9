"""The capability matrix: which attention implementation differentiates which way, and correctly.

    attnbench capabilities [--json PATH] [--markdown PATH]

Rows: our Triton op, the eager reference, SDPA's four backends, compiled FlexAttention and
jvp-flash-attention (when installed). Columns: fwd, bwd, jvp (forward mode), jvp∘vjp
(forward-over-reverse HVP), vjp∘vjp (double backward), vjp∘jvp (gradient of a tangent output)
and torch.compile (fullgraph forward and backward). Each cell, computed on the device at hand on
shapes chosen to expose silent errors (a length off every block size, Nq != Nk, D = 80, plus an
aligned shape every implementation should handle), is one of
    verified                within the dtype's bound of the float64 oracle
    wrong: rel. err X       ran, and returned a wrong answer without an error
    error: <first line>     raised (the implementation's own message)
    unavailable: <reason>   cannot run on this device at all
Peers run here without the case filters check and bench apply (jvp-flash-attention declines its
known-bad shapes there): the point is to show what a user calling them directly would get.
"""
import functools
import json
from dataclasses import dataclass, field

import torch

from ...bench import verify
from ..flash import FlashCase
from ..flash import reference as flash_reference
from ..flash.peers import SDPA_BACKENDS, flex_forward, flex_unavailable, sdpa_forward, sdpa_unavailable
from . import peers, reference, routes

COLUMNS = ("fwd", "bwd", "jvp", "jvp∘vjp", "vjp∘vjp", "vjp∘jvp", "torch.compile")
ROUTE_OF = {"jvp": "fwd_jvp", "jvp∘vjp": "hvp_fwd_rev", "vjp∘vjp": "hvp_rev_rev", "vjp∘jvp": "vjp_of_jvp"}


def shapes(device):
    """(name, case) pairs: odd shapes first; bf16 on a GPU, fp32 (tiny) in the interpreter."""
    if torch.device(device).type == "cuda":
        dt = "bfloat16"
        return [("N=1000", FlashCase(2, 4, 4, 1000, 1000, 64, None, dt)),
                ("Nq=384 Nk=640", FlashCase(2, 4, 4, 384, 640, 64, None, dt)),
                ("D=80 causal", FlashCase(2, 4, 4, 512, 512, 80, "top_left", dt)),
                ("aligned N=1024 causal", FlashCase(2, 4, 4, 1024, 1024, 64, "top_left", dt))]
    dt = "float32"
    return [("N=37", FlashCase(1, 2, 2, 37, 37, 16, None, dt)), ("Nq=20 Nk=33", FlashCase(1, 2, 2, 20, 33, 16, None, dt)),
            ("D=24 causal", FlashCase(1, 2, 2, 32, 32, 24, "top_left", dt))]


def _ours(case):
    from . import triton_forward

    return lambda q, k, v: triton_forward(case)(q, k, v)[0]


def implementations():
    """name -> (make_forward(case) -> f(q, k, v) -> o, unavailable(device) -> reason or None)."""
    from ...attention import unavailable_reason

    impls = {OURS: (_ours, unavailable_reason),
             "eager reference": (lambda c: lambda q, k, v: reference.forward(c.softmax_scale, c.causal_offset)(q, k, v)[0],
                                 lambda d: None)}
    for name, backend in SDPA_BACKENDS.items():
        impls[name] = (lambda c, b=backend: sdpa_forward(b, c, c.causal_offset), functools.partial(sdpa_unavailable, backend))
    impls["flex"] = (lambda c: flex_forward(c, c.causal_offset, "cuda"), flex_unavailable)
    impls["jvp-flash-attention"] = (lambda c: peers.jvp_flash_forward(c, checked=False), peers.jvp_flash_unavailable)
    return impls


def _first_line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _oracle(case, x):
    """Every output a column needs, from the eager reference in float64."""
    want = dict(flash_reference.evaluate(x["q"], x["k"], x["v"], x["do"], case.softmax_scale, case.causal_offset,
                                         torch.float64))
    for mode in ("fwd_jvp", "hvp_fwd_rev", "vjp_of_jvp"):
        want.update(reference.evaluate(mode, x, case.softmax_scale, case.causal_offset, torch.float64))
    return want


def _bwd(f, x):
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v")]
    with torch.enable_grad():
        return dict(zip(("dq", "dk", "dv"), torch.autograd.grad(f(*leaves), leaves, x["do"])))


def _compiled(f, x):
    """torch.compile(fullgraph=True) of the forward, and the backward AOTAutograd compiles with it
    (taken outside the compiled function, as training loops do), against the oracle."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: f(q, k, v), fullgraph=True)
    leaves = [x[n].detach().requires_grad_() for n in ("q", "k", "v")]
    with torch.enable_grad():
        o = compiled(*leaves)
        grads = torch.autograd.grad(o, leaves, x["do"])
    return dict(zip(("o", "dq", "dk", "dv"), (o.detach(), *grads)))


def cell(column, f, x, want, dtype):
    """The verdict of one implementation on one column."""
    try:
        if column == "fwd":
            with torch.no_grad():
                got = {"o": f(x["q"], x["k"], x["v"])}
        elif column == "bwd":
            got = _bwd(f, x)
        elif column == "torch.compile":
            got = _compiled(f, x)
        else:
            got = routes.run(ROUTE_OF[column], f, x)
            got = {n: t for n, t in got.items() if n not in ("o", "lse", "lse_t")}  # the derivative itself
    except routes.DroppedDerivative as exc:
        return f"wrong: {exc}"
    except Exception as exc:  # noqa: BLE001 - a failure is the answer this matrix reports
        return f"error: {_first_line(exc)}"
    err = max(verify.relative_error(t, want[n]) for n, t in got.items())
    return "verified" if err <= verify.BOUNDS[dtype] else f"wrong: rel. err {err:.2g}"


OURS = "attnbench triton"  # our implementation's name in the matrix: a wrong cell of its fails `attnbench capabilities`


@dataclass
class Matrix:
    device: dict
    shapes: list
    cells: dict = field(default_factory=dict)  # impl -> shape -> column -> verdict

    def as_dict(self):
        return {"device": self.device, "columns": list(COLUMNS), "shapes": self.shapes, "cells": self.cells}

    @classmethod
    def from_dict(cls, data):
        return cls(data["device"], [tuple(s) for s in data["shapes"]], data["cells"])

    def summary(self):
        """impl -> column -> worst verdict over the shapes: a silent wrong answer is worse than an
        error, which at least says so (wrong > error > unavailable > verified)."""
        rank = {"wrong": 0, "error": 1, "unavailable": 2, "verified": 3}
        out = {}
        for impl, by_shape in self.cells.items():
            out[impl] = {}
            for column in COLUMNS:
                verdicts = [by_shape[s][column] for s in by_shape]
                out[impl][column] = min(verdicts, key=lambda v: rank[v.split(":")[0]])
        return out

    def markdown(self):
        lines = [f"# Capability matrix on {self.device.get('device_name')}", "",
                 f"torch {self.device.get('torch')}, triton {self.device.get('triton')}. Shapes: "
                 + "; ".join(f"{name} ({label})" for name, label in self.shapes) + ".",
                 "A cell gives the worst verdict over the shapes; the JSON has every shape.", "",
                 "| implementation | " + " | ".join(COLUMNS) + " |", "| --- |" + " --- |" * len(COLUMNS)]
        unavailable = {}
        for impl, row in self.summary().items():
            if all(v.startswith("unavailable") for v in row.values()):
                unavailable[impl] = next(iter(row.values())).split(": ", 1)[1]
                continue
            lines.append(f"| {impl} | " + " | ".join(_short(v) for v in row.values()) + " |")
        if unavailable:
            lines += ["", "Not available on this device: " + "; ".join(f"{i} ({r})" for i, r in unavailable.items()) + "."]
        wrong = [(impl, s, c, v) for impl, by in self.cells.items() for s, cols in by.items() for c, v in cols.items()
                 if v.startswith("wrong")]
        if wrong:
            lines += ["", "Silent wrong answers (values off the float64 oracle by more than the dtype's bound, "
                      "without an error; eager math in bf16 is listed by the same bar: it is the yardstick of "
                      "FlashAttention's 2x rule, not a bug):"] + [f"- {impl}, {c}, {s}: {v}" for impl, s, c, v in wrong]
        return "\n".join(lines) + "\n"


def _short(verdict, width=70):
    return verdict if len(verdict) <= width else verdict[:width - 1] + "…"


def compute(device, impl_names=None, progress=None) -> Matrix:
    from ...bench.roofline import machine_info

    device = torch.device(device)
    op_inputs = __import__("attnbench").get("jvp_attention").make_inputs
    cases = shapes(device)
    impls = implementations()
    if impl_names:
        unknown = set(impl_names) - set(impls)
        if unknown:
            raise ValueError(f"unknown implementation(s) {sorted(unknown)}; known: {', '.join(impls)}")
        impls = {n: impls[n] for n in impl_names}
    matrix = Matrix(machine_info(device), [(name, case.label) for name, case in cases])
    for shape_name, case in cases:
        x = op_inputs(case, device, seed=0)
        want = _oracle(case, x)
        for impl, (make, unavailable) in impls.items():
            row = matrix.cells.setdefault(impl, {})
            reason = unavailable(device)
            if reason:
                row[shape_name] = {c: f"unavailable: {reason}" for c in COLUMNS}
                continue
            try:
                f = make(case)
            except Exception as exc:  # noqa: BLE001
                row[shape_name] = {c: f"error: {_first_line(exc)}" for c in COLUMNS}
                continue
            row[shape_name] = {c: cell(c, f, x, want, case.torch_dtype) for c in COLUMNS}
            if progress:
                progress(f"capabilities {impl:22s} {shape_name:22s} "
                         + " ".join(v.split(":")[0] for v in row[shape_name].values()))
        del x, want
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return matrix


def write(matrix, json_path=None, markdown_path=None):
    from ...bench.results import write_atomic

    if json_path:
        write_atomic(json_path, json.dumps(matrix.as_dict(), indent=1))
    if markdown_path:
        write_atomic(markdown_path, matrix.markdown())
