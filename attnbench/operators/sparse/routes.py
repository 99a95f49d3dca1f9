"""sparse's forced routes: the Triton variant with a route of the ops switched off, or taken beyond its caps.

By default a product takes the fastest route measured for it (attnbench/sparse/triton_ops.py): vecsca, scavec
and inner the dense route (its two steps fused in one program where small), mul the bilinear route, the shared-
weight vecmat and mat_t_vec the fold route (16-bit products on split_matmul up to a size), batch sums of outer
products on the matrix units, and the CSR segment kernel for the rest. Each route here is the ``triton`` variant
inside the switches that force another path, so that ``attnbench bench --variant triton --variant
triton@segment`` measures a route against what it replaced, side by side, and ``attnbench check`` verifies the
path that is no longer the default. A route declines the ops it does not change (scale has one kernel path).
"""
import contextlib

import torch

from ...bench.registry import forced_route

DENSE_OPS = ("vecsca", "scavec", "inner")
FOLD_CASES = {"vecmat": "y", "mat_t_vec": "x"}  # the op and the shared operand its fold route takes


def _updated(mapping, **values):
    """A context manager setting keys of a module's switch dict for the block."""
    @contextlib.contextmanager
    def scope():
        before = dict(mapping)
        mapping.update(values)
        try:
            yield
        finally:
            mapping.clear()
            mapping.update(before)
    return scope()


def _attribute(module, name, value):
    @contextlib.contextmanager
    def scope():
        before = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, before)
    return scope()


def _all(*managers):
    """Enter every context manager made by ``managers`` (factories) for the block."""
    @contextlib.contextmanager
    def scope():
        with contextlib.ExitStack() as stack:
            for make in managers:
                stack.enter_context(make())
            yield
    return scope


def _products(case):
    return "scale has one kernel route (the CSR segment kernel)" if case.is_scale else None


def _only(ops, what):
    def declines(case):
        if case.op in ops or (case.is_layer and "vecsca" in ops):  # the layer's coupling is a vecsca
            return None
        return f"{what} takes {', '.join(ops)}, not {case.op}"
    return declines


def _folded(case):
    if case.is_layer:  # its mixing is a vecmat with the weight shared
        return None
    if FOLD_CASES.get(case.op) != case.shared:
        return "the fold route takes vecmat with a shared y and mat_t_vec with a shared x only"
    return None


def _folded_16bit(case):
    if case.dtype not in ("bfloat16", "float16"):
        return f"the fold's 16-bit products only: {case.dtype} does not split"
    return _folded(case)


def _needs_cuda_16bit(device):
    if device.type != "cuda":
        return "16-bit products run as fp32 off CUDA (the interpreter upcasts, torch.mm(out_dtype) is CUDA-only)"
    return None


def sparse_routes(triton):
    """The forced routes of sparse's ``triton`` variant."""
    from ...kernels.sparse import fold, fused_dense, segment
    from ...sparse import triton_ops

    every_product = frozenset(segment.CHANNEL_RANKS)
    return [
        forced_route(triton, "segment", _all(lambda: triton_ops.dense_route(False),
                                             lambda: triton_ops.bilinear_route(False),
                                             lambda: triton_ops.fold_route(False),
                                             lambda: triton_ops.outer_sum_by_dot(False)),
                     "every product on the CSR segment kernel: the dense, bilinear, fold and outer-sum routes off",
                     declines=_products),
        forced_route(triton, "all-rows", lambda: _updated(segment.ALL_ROWS, enabled=True, min_batch=0,
                                                          ops=every_product),
                     "the segment kernel walking every output row in one program, for every op at every batch "
                     "(the default: mul from N 1e4)", declines=_products),
        forced_route(triton, "two-launch", _all(lambda: triton_ops.fused_dense(False),
                                                lambda: triton_ops.channelwise(False)),
                     "the dense route as two launches (the per-sample matrices through memory), never fused",
                     declines=_only(DENSE_OPS, "the dense route")),
        forced_route(triton, "fused-dense", _all(lambda: _updated(fused_dense.FUSED_ROWS, max=32),
                                                 lambda: _attribute(fused_dense, "FUSED_DTYPES",
                                                                    fused_dense.FUSED_DTYPES + (torch.float32,)),
                                                 lambda: triton_ops.channelwise(False)),
                     "the dense route's two steps in one program beyond its caps: fp32 too, up to 32 padded rows "
                     "(L 4)", declines=_only(DENSE_OPS, "the fused dense route")),
        forced_route(triton, "channelwise", lambda: triton_ops.channelwise(True, max_16bit_entries=float("inf")),
                     "the dense route's ops with the structure compiled into the kernel, every term a multiply-add "
                     "on the CUDA cores, wherever the table unrolls (L <= 3), 16-bit inputs too (the default: up to "
                     "128 entries of the table's grid, L 2)", declines=_only(DENSE_OPS, "the channel-wise route")),
        forced_route(triton, "matrix-units", lambda: triton_ops.channelwise(False),
                     "the dense route's ops on the matrix-unit kernels (fused dense, or the two launches), never the "
                     "channel-wise ones: the default before them", declines=_only(DENSE_OPS, "the matrix-unit route")),
        forced_route(triton, "gather-kernel", _all(lambda: triton_ops.gather_by_matmul(False),
                                                   lambda: triton_ops.channelwise(False)),
                     "the dense route's per-sample sums on the CSR gather kernel instead of one GEMM",
                     declines=_only(DENSE_OPS, "the dense route")),
        forced_route(triton, "unfolded", lambda: triton_ops.fold_route(False),
                     "the shared-weight products without the fold route (segment and outer-sum kernels)",
                     declines=_folded),
        forced_route(triton, "cublas-pair", lambda: triton_ops.fold_split_matmul(False),
                     "the fold route's 16-bit products as two cuBLAS GEMMs with fp32 outputs, summed and cast",
                     declines=_folded_16bit, unavailable_reason=_needs_cuda_16bit),
        forced_route(triton, "split-matmul", lambda: _updated(fold.SPLIT_MATMUL, enabled=True,
                                                              max_entries=float("inf")),
                     "the fold route's 16-bit products on split_matmul at every size (the default stops at "
                     "2**21 entries)", declines=_folded_16bit, unavailable_reason=_needs_cuda_16bit),
    ]
