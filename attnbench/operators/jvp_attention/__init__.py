"""The ``jvp_attention`` operator: attention that differentiates every way.

Modes (routes.py): ``fwd_jvp`` -> (o, lse, o_t, lse_t), the forward and its tangent;
``hvp_fwd_rev`` and ``hvp_rev_rev`` -> (hq, hk, hv), the Hessian of <dO, O> along a tangent by
forward-over-reverse (torch.func.jvp of torch.func.grad) and by reverse-over-reverse
(autograd.grad twice), and ``hvp_func`` the same as a torch.func user writes it
(torch.func.jvp(torch.func.grad(...))); ``vjp_of_jvp`` -> the gradient of a tangent output in
(q, k, v) and in the tangent (gq, gk, gv, gtq, gtk, gtv).

Variants: ``reference`` (eager math, PyTorch's AD), ``split`` (explicit formulas, no autograd),
``triton`` (flash_attention through the same AD routes as the reference and the peers: what a user
runs), ``triton_fused`` (the kernels called directly: attention_jvp, and flash_fwd +
attention_bwd_jvp for the HVPs: the kernels' time without autograd's bookkeeping), and peers.

Cost model, in matmul units of 2 B Hq D per visible (query, key) pair (the forward is 2 units,
F = 4 B Hq D pairs FLOPs): ``fwd_jvp`` 3F (6 units: S, the two halves of S_t, P V, (P*S_t) V,
P V_t; the convention of jvp-flash-attention's benchmarks); the HVPs and ``vjp_of_jvp`` 8.5F,
the fewest units any of them needs: forward 2 + backward 5 + forward tangent 4 + backward
tangent 6 (dO_t = 0). Minimum bytes read each input once and write each output once.
"""
import functools
from collections.abc import Mapping

import torch

from ...bench.cases import seeded_inputs, table_sets
from ...bench.registry import Operator, Unsupported, Variant, first_line, register
from ..flash import ATTENTION_GPU_SHAPES, HOST_SHAPES, ODD_SHAPES, FlashCase, _random, _shapes
from ..flash.peers import SDPA_BACKENDS
from . import peers, reference, routes, split

FLOP_FACTOR = {"fwd_jvp": 3.0, "hvp_fwd_rev": 8.5, "hvp_rev_rev": 8.5, "hvp_func": 8.5, "vjp_of_jvp": 8.5}
HVP_MODES = ("hvp_fwd_rev", "hvp_rev_rev", "hvp_func")

# Tiny shapes for the CPU gate: lengths off the interpreter's 16-blocks, Nq != Nk both ways, GQA
# and MQA, a head dim that is not a power of two, both causal alignments, rows that see no key.
TINY_SHAPES = [
    (1, 2, 1, 19, 23, 16, None),
    (2, 2, 2, 17, 17, 24, "top_left"),
    (1, 4, 2, 21, 12, 16, "bottom_right"),  # Nq > Nk: the first 9 rows see no key
    (1, 2, 1, 9, 33, 32, "bottom_right"),
]
# Real sizes for the GPU gate: flash's shared coverage at scale, and a long D 80 case.
GPU_SHAPES = ATTENTION_GPU_SHAPES + [(1, 8, 8, 1536, 1536, 80, "top_left")]
# Issue 6's performance targets: fwd+JVP at the first three, both HVP routes at the last.
ANCHOR_SHAPES = [
    (4, 16, 16, 2048, 2048, 64, None),
    (4, 16, 16, 4096, 4096, 64, "top_left"),
    (2, 16, 16, 4096, 4096, 128, None),
    (2, 8, 8, 2048, 2048, 64, None),
]


def _sweep():
    return [FlashCase(max(1, 16384 // n), 16, 16, n, n, d, c)
            for d in (64, 128) for n in (1024, 2048, 4096, 8192) for c in (None, "top_left")]


CASE_SETS = {
    **table_sets(FlashCase, TINY_SHAPES, GPU_SHAPES, ANCHOR_SHAPES, tiny_dtypes=("float32",)),
    "sweep": _sweep,
    # compute-sanitizer's set (scripts/gpu_gate.sh): the JVP and backward-JVP kernels on flash's odd fp16 shapes
    # (lengths off every block, GQA, head dims in one and two column blocks and masked ones, D 256)
    "odd": lambda: _shapes(ODD_SHAPES["float16"], ("float16",)),
    # flash's host-bound shapes and the fwd+JVP / HVP targets' B2 H8 N2048 D64, for the eager clock
    "host": lambda: _shapes(HOST_SHAPES + [ANCHOR_SHAPES[3]], ("bfloat16",)),
    # flash's seeded random shapes (decode, self and cross lengths, GQA, head dims off the powers of two)
    "random": _random,
}


class LazyOracle(Mapping):
    """Every output of every mode from the eager reference in ``dtype``, each mode computed on
    first use (a float64 Hessian-vector product of a long sequence is not free); the two HVP
    routes share one computation, their outputs being the same function."""

    def __init__(self, case, inputs, dtype):
        self.case, self.inputs, self.dtype, self._done = case, inputs, dtype, {}

    def _mode_of(self, name):
        return next(m for m in ("fwd_jvp", "hvp_fwd_rev", "vjp_of_jvp") if name in routes.OUTPUTS[m])

    def __getitem__(self, name):
        if name not in self:
            raise KeyError(name)
        mode = self._mode_of(name)
        if mode not in self._done:
            self._done[mode] = reference.evaluate(mode, self.inputs, self.case.softmax_scale, self.case.causal_offset,
                                                  self.dtype)
        return self._done[mode][name]

    def __iter__(self):
        return iter(dict.fromkeys(n for outs in routes.OUTPUTS.values() for n in outs))

    def __len__(self):
        return len(list(iter(self)))

    def __contains__(self, name):
        return any(name in outs for outs in routes.OUTPUTS.values())


def route_variant(make_forward, check_first=False):
    """prepare() for variants differentiated by PyTorch's AD: make_forward(case) -> f(q, k, v).
    ``check_first``: run the route once so that a peer's failure becomes Unsupported with its reason."""

    def prepare(case, x, mode):
        try:
            f = make_forward(case)
        except (RuntimeError, ValueError, NotImplementedError, ImportError) as exc:
            raise Unsupported(first_line(exc)) from None
        run = functools.partial(routes.run, mode, f, x)
        if check_first:
            try:
                out = run()
            except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, with its reason
                raise Unsupported(f"{type(exc).__name__}: {first_line(exc, 200)}") from None
            if any(torch.isnan(t).any() for t in out.values()):
                raise Unsupported("returns NaN on this case")
        return run

    return prepare


def declining(prepare, declines_mode):
    """A prepare() that first asks ``declines_mode(mode)`` for a reason not to run (a peer's known
    silent wrong answer), and raises Unsupported with it."""
    def guarded(case, x, mode):
        if reason := declines_mode(mode):
            raise Unsupported(reason)
        return prepare(case, x, mode)

    return guarded


def split_prepare(case, x, mode):
    q, k, v, do, tq, tk, tv = (x[n] for n in ("q", "k", "v", "do", "tq", "tk", "tv"))
    s, off = case.softmax_scale, case.causal_offset
    if mode == "fwd_jvp":
        return lambda: dict(zip(routes.OUTPUTS[mode], split.attention_jvp(q, k, v, tq, tk, tv, s, off)))
    if mode in HVP_MODES:
        return lambda: dict(zip(routes.OUTPUTS[mode], split.hvp(do, q, k, v, tq, tk, tv, s, off)))
    return lambda: dict(zip(routes.OUTPUTS[mode], split.vjp_of_jvp(do, q, k, v, tq, tk, tv, s, off)))


def triton_forward(case):
    from ...attention import flash_attention

    return functools.partial(flash_attention, scale=case.softmax_scale, causal=case.causal, return_lse=True)


def triton_fused_prepare(case, x, mode):
    """The kernels called directly, no autograd: one fused launch for fwd+JVP; forward then
    kernel 3 (which computes its own tangents) for a Hessian-vector product."""
    from ...attention import attention_bwd_jvp, attention_jvp, flash_bwd, flash_fwd

    q, k, v, do, tq, tk, tv = (x[n] for n in ("q", "k", "v", "do", "tq", "tk", "tv"))
    kw = dict(scale=case.softmax_scale, causal=case.causal)
    if mode == "fwd_jvp":
        return lambda: dict(zip(routes.OUTPUTS[mode], attention_jvp(q, k, v, tq, tk, tv, **kw)))
    if mode in HVP_MODES:
        def hvp():
            o, lse = flash_fwd(q, k, v, **kw)
            return dict(zip(routes.OUTPUTS[mode], attention_bwd_jvp(do, q, k, v, o, lse, tq, tk, tv, **kw)))
        return hvp

    def vjp_of_jvp():
        o, lse, o_t, lse_t = attention_jvp(q, k, v, tq, tk, tv, **kw)
        gx = attention_bwd_jvp(do, q, k, v, o, lse, tq, tk, tv, o_t=o_t, lse_t=lse_t, **kw)
        return dict(zip(routes.OUTPUTS[mode], (*gx, *flash_bwd(do, q, k, v, o, lse, **kw))))
    return vjp_of_jvp


class JvpAttentionOperator(Operator, cases=CASE_SETS):
    name = "jvp_attention"
    description = "attention differentiated every way: fwd+JVP, both Hessian-vector routes, grad of a tangent"
    modes = routes.MODES
    baselines = ("sdpa_math", "reference")
    ratio_subject = "triton"
    ratio_peers = ("sdpa_math", "jvp_flash")

    def make_inputs(self, case, device, seed=0):
        """q, k, v, the output cotangent do, and a tangent (tq, tk, tv), seeded (bench.cases.seeded_inputs)."""
        q_shape = (case.batch, case.heads_q, case.seqlen_q, case.head_dim)
        kv_shape = (case.batch, case.heads_kv, case.seqlen_k, case.head_dim)
        shapes = {"q": q_shape, "k": kv_shape, "v": kv_shape, "do": q_shape, "tq": q_shape, "tk": kv_shape,
                  "tv": kv_shape}
        return seeded_inputs(seed, shapes, device, case.torch_dtype)

    def flops(self, case, mode):
        self.check_mode(mode)
        return FLOP_FACTOR[mode] * case.forward_flops

    def bytes(self, case, mode):
        self.check_mode(mode)
        q_like, kv_like, rows = case.tensor_bytes
        return {
            "fwd_jvp": 2 * q_like + 4 * kv_like + 2 * q_like + 2 * rows,  # read x, x_t; write o, o_t, lse, lse_t
            "hvp_fwd_rev": 3 * q_like + 4 * kv_like + q_like + 2 * kv_like,  # read x, dO, u; write H u
            "hvp_rev_rev": 3 * q_like + 4 * kv_like + q_like + 2 * kv_like,
            "hvp_func": 3 * q_like + 4 * kv_like + q_like + 2 * kv_like,
            "vjp_of_jvp": 3 * q_like + 4 * kv_like + 2 * q_like + 4 * kv_like,  # read x, x_t, c; write 6 grads
        }[mode]

    def outputs(self, mode):
        self.check_mode(mode)
        return routes.OUTPUTS[mode]

    def oracle(self, case, inputs, dtype=torch.float64):
        return LazyOracle(case, inputs, dtype)

    def tunables(self):
        from ...bench.tune import tunable_table

        return tunable_table("attnbench.kernels.attention", [
            ("jvp", "the fused forward + JVP (attention_jvp_kernel)", "attention_jvp.attention_jvp_kernel", "fwd_jvp",
             "triton_fused"),
            ("bwd_jvp_dkdv", "kernel 3's dK_t/dV_t pass (bwd_jvp_dkdv_kernel)", "attention_bwd_jvp.bwd_jvp_dkdv_kernel",
             "hvp_rev_rev", "triton_fused"),
            ("bwd_jvp_dq", "kernel 3's dQ_t pass (bwd_jvp_dq_kernel)", "attention_bwd_jvp.bwd_jvp_dq_kernel",
             "hvp_rev_rev", "triton_fused"),
        ])

    def extra_checks(self, device, seed=0):
        """Second-order consistency (seed 003): forward-over-reverse vs reverse-over-reverse vs
        finite differences, per dtype, for our attention and PyTorch's layer/batch/rms norms."""
        from ...bench.second_order import consistency_checks

        return consistency_checks(device, seed=seed, op_name=self.name)

    def register_variants(self):
        from ...attention import unavailable_reason

        self.add_variant(Variant(
            "reference", "reference",
            route_variant(lambda case: reference.forward(case.softmax_scale, case.causal_offset)), self.modes,
            "eager PyTorch math through PyTorch's AD (the oracle, run in the case dtype)"))
        self.add_variant(Variant(
            "split", "split", split_prepare, self.modes,
            "explicit formulas in PyTorch: softmax JVP identity, O_t = P_t V + P V_t, the backward's tangent "
            "(HVP_Q/K/V), no autograd"))
        self.add_variant(Variant(
            "triton", "triton", route_variant(triton_forward), self.modes,
            "flash_attention through torch.func / autograd: the fused kernels as a user's AD runs them",
            unavailable_reason))
        self.add_variant(Variant(
            "triton_fused", "triton", triton_fused_prepare, self.modes,
            "the Triton kernels called directly (attention_jvp, attention_bwd_jvp): no autograd bookkeeping",
            unavailable_reason))
        for name, backend in SDPA_BACKENDS.items():
            self.add_variant(Variant(
                name, "peer",
                route_variant(lambda case, b=backend: peers.sdpa_forward(b, case, case.causal_offset), check_first=True),
                self.modes, f"torch SDPA pinned to the {backend} backend, through PyTorch's AD",
                functools.partial(peers.sdpa_unavailable, backend)))
        self.add_variant(Variant(
            "flex", "peer", route_variant(lambda case: peers.flex_forward(case, case.causal_offset, "cuda"), check_first=True),
            self.modes, "torch.compile(flex_attention) through PyTorch's AD", peers.flex_unavailable))
        self.add_variant(Variant(
            "jvp_flash", "peer", declining(route_variant(peers.jvp_flash_forward, check_first=True),
                                           peers.jvp_flash_declines_mode), self.modes,
            "jvp-flash-attention (PyPI): JVPAttn.fwd_dual under torch.func", peers.jvp_flash_unavailable))


JVP_ATTENTION = register(JvpAttentionOperator())
