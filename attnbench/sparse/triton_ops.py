"""The sparse kernels (``attnbench/kernels/sparse/segment.py``) as PyTorch custom ops.

``attnbench::sparse_product`` and ``attnbench::sparse_scale`` take the info's tensors one by one (custom ops
take no dataclasses) and keep each launch opaque to torch.compile: a fake implementation gives the output
shape, so Dynamo and AOTAutograd trace through the autograd Functions without tracing into Triton. A vmap rule
runs the op once per mapped slice and stacks the results (simple and correct; vmap over these ops is a test
path, not a fast one).

Launches run on the tensors' own GPU, or on the CPU through Triton's interpreter (TRITON_INTERPRET=1), where
bfloat16 runs as a float32 upcast rounded back to bfloat16, as the attention kernels do
(``attnbench.attention.ops.interpreter_upcasts``).
"""
import contextlib
from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from ..attention.ops import interpreter_upcasts
from ..kernels import unavailable_reason as kernels_unavailable_reason
from ..kernels.offsets import INT32_MAX
from ..kernels.sparse.bilinear import MAX_HELD, bilinear_launch
from ..kernels.sparse.channelwise import channelwise_fits, channelwise_launch, program_of
from ..kernels.sparse.dense import DENSE_OPS, dense_product_launch
from ..kernels.sparse.dense import FUSED as FUSED_DENSE
from ..kernels.sparse.fold import FOLD_OPS, SPLIT_MATMUL, fold_outer_sum_launch, fold_product_launch, folded_entries
from ..kernels.sparse.outer_sum import outer_sum_launch
from ..kernels.sparse.segment import (CHANNEL_RANKS, product_out_shape, scale_out_shape, sparse_product_launch,
                                      sparse_scale_launch)
from ..kernels.tuning import next_pow2

__all__ = ["sparse_product_triton", "sparse_scale_triton", "unavailable_reason", "dense_route", "gather_by_matmul",
           "outer_sum_by_dot", "fused_dense", "fold_route", "fold_split_matmul", "bilinear_route", "channelwise"]

# vecsca, scavec and inner take the dense route (attnbench/kernels/sparse/dense.py) where the info has its table and the
# output is not summed over a batch; tests turn it off to check the segment kernel on the same cases.
DENSE_ROUTE = {"enabled": True}
# Terms per entry of the dense matrix below which the segment kernel stays: in fp32 the route is at least even with
# the segment kernel from Clebsch-Gordan L 2 (1.7 terms an entry) and far ahead from L 3 (2.4) up, and with M's hi
# and lo parts in one small_matmul program bf16 gains at L 2 too, so one threshold serves every dtype
# (docs/measurements/sparse.md).
MIN_DENSITY = 1.0


# Within the dense route, vecsca, scavec and inner with the table's structure compiled into the kernel, every term a
# multiply-add on the CUDA cores (attnbench/kernels/sparse/channelwise.py), where the table unrolls (Clebsch-Gordan
# L <= 3), in fp32 and fp64 at every size and in 16 bits up to MAX_16BIT_ENTRIES entries of the table's dense grid.
# Measured beside the matrix-unit kernels and cuEquivariance on an H200 (vecsca anchors, every mode; docs/measurements/
# sparse.md): at L 2 (81 entries) 1.3-2.9x the matrix-unit route's speed in fp32 and bf16; at L 3 (256) 0.94-1.62x in
# fp32 (against the two-launch route) but 0.46-1.00x in bf16, where the fused dense kernel's 16 x 16 tiles are full.
CHANNELWISE = {"enabled": True, "max_16bit_entries": 128}

# The dense route's per-sample sums (M, and inner's gather from the Gram matrix) as one GEMM on the table's matrix
# form where it has one, else the CSR gather kernel; tests turn the GEMM off to check the kernel on the same cases.
GATHER_BY_MATMUL = {"enabled": True}

# outer summed over the batch with both inputs batched (the FC layer's weight gradient) as tl.dot with the batch
# as the contraction dim (attnbench/kernels/sparse/outer_sum.py), except in fp64; tests turn it off to check the segment
# kernel on the same cases.
OUTER_SUM_BY_DOT = {"enabled": True}

# vecmat with a shared y and mat_t_vec with a shared x (the FC layer and its input gradient) as one GEMM against the
# weight folded into the coefficients, and outer summed over the batch (its weight gradient) as one GEMM over the
# batch and the fold transposed (attnbench/kernels/sparse/fold.py), where the info's table has its matrix form, holds at
# least MIN_DENSITY terms a folded entry, the batch repays the fold (its FLOPs at most the kernels') and the folded
# matrix stays under FOLD_MAX_ENTRIES; tests turn it off to check the other kernels on the same cases.
FOLD_ROUTE = {"enabled": True}
FOLD_MAX_ENTRIES = 2 ** 27  # 512 MiB in fp32 (L 6 C 128: 39.3M entries)


# mul as dense bilinear forms on the matrix units (attnbench/kernels/sparse/bilinear.py) where the info's gram table has its
# matrix form (and its split for the dtype), one operand has at most MAX_HELD rows, the output is not summed over a
# batch and the terms are at least MIN_BILINEAR_DENSITY of the route's multiply-adds on the matrix units (P_out P1 P2,
# the dims as the kernel pads them); tests turn it off to check the segment kernel on the same cases.
BILINEAR_ROUTE = {"enabled": True}
MIN_BILINEAR_DENSITY = 1 / 64
# fp32 (three TF32 products a dot) takes the route from this many terms an output row: against the segment kernel
# it is no steady gain at Clebsch-Gordan L 2 (15 terms a row) and well ahead from L 3 (38 terms) up, while bf16 (two
# bf16 products) gains from L 2 and has no such floor (docs/measurements/sparse.md).
FP32_MIN_TERMS_PER_ROW = 24


@contextlib.contextmanager
def _switched(switch, enabled, **values):
    """``switch["enabled"]`` and the given keys (those not None) set for the block."""
    before = dict(switch)
    switch.update({"enabled": bool(enabled)}, **{k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        switch.update(before)


def dense_route(enabled: bool):
    """Within the block, the dense route of vecsca, scavec and inner is on (the default) or off."""
    return _switched(DENSE_ROUTE, enabled)


def gather_by_matmul(enabled: bool):
    """Within the block, the dense route's per-sample sums run as a GEMM on the table's matrix form where it has
    one (the default) or on the CSR gather kernel."""
    return _switched(GATHER_BY_MATMUL, enabled)


def fused_dense(enabled: bool):
    """Within the block, the dense route runs both steps in one program (attnbench/kernels/sparse/fused_dense.py) where the
    table has its matrix form (and ``gather_by_matmul`` is on) and the sparse sizes are small (the default), or as
    two launches with the per-sample matrices in memory."""
    return _switched(FUSED_DENSE, enabled)


def channelwise(enabled: bool, max_16bit_entries=None):
    """Within the block, the dense route's ops run on the channel-wise kernels where their table unrolls (on: the
    default, 16-bit inputs up to ``max_16bit_entries`` entries of the table's grid, default as measured) or on the
    matrix-unit kernels (off)."""
    return _switched(CHANNELWISE, enabled, max_16bit_entries=max_16bit_entries)


def outer_sum_by_dot(enabled: bool):
    """Within the block, outer summed over the batch (both inputs batched, not fp64) runs on the matrix-unit kernel
    (the default) or on the segment kernel."""
    return _switched(OUTER_SUM_BY_DOT, enabled)


def fold_route(enabled: bool):
    """Within the block, the fold route of vecmat (shared y), mat_t_vec (shared x) and outer summed over the batch
    (both inputs batched) is on (the default) or off."""
    return _switched(FOLD_ROUTE, enabled)


def fold_split_matmul(enabled: bool):
    """Within the block, the fold route's 16-bit products run on split_matmul.py (both halves of the fp32
    fold in one program) where the fold has at most ``SPLIT_MATMUL["max_entries"]`` entries (the default), or
    always as two cuBLAS GEMMs with fp32 outputs."""
    return _switched(SPLIT_MATMUL, enabled)


def bilinear_route(enabled: bool):
    """Within the block, mul runs as dense bilinear forms on the matrix units where it applies (the default) or on
    the segment kernel."""
    return _switched(BILINEAR_ROUTE, enabled)


def unavailable_reason(device) -> Optional[str]:
    """Why the Triton sparse kernels cannot run on ``device`` in this process, or None."""
    return kernels_unavailable_reason(device, "sparse")


def _launch(launcher, *tensors_then_args):
    tensors = [t for t in tensors_then_args if isinstance(t, Tensor)]
    if reason := unavailable_reason(tensors[0].device):
        raise ValueError(reason)
    dtype = tensors[0].dtype
    upcast = interpreter_upcasts(dtype)
    args = [a.float() if upcast and isinstance(a, Tensor) and a.dtype == torch.bfloat16 else a
            for a in tensors_then_args]
    out = launcher(*args)  # the kernels' launchers make the tensors' GPU current
    return out.to(torch.bfloat16) if upcast else out


@torch.library.custom_op("attnbench::sparse_product", mutates_args=())
def sparse_product_op(x: Tensor, y: Tensor, scale: Optional[Tensor], index1: Tensor, index2: Tensor,
                      row_bounds: Tensor, gather_index: Optional[Tensor], out_size: int, op: str,
                      out_accumulated: bool, dense_bounds: Optional[Tensor] = None,
                      dense_index: Optional[Tensor] = None, dense_scale: Optional[Tensor] = None,
                      dense_rows: int = 0, dense_max_len: int = 0,
                      dense_matrix: Optional[Tensor] = None, outer_by_dot: bool = False,
                      fold_matrix: Optional[Tensor] = None, bilinear_matrix: Optional[Tensor] = None,
                      bilinear_hi: Optional[Tensor] = None, bilinear_lo: Optional[Tensor] = None,
                      bilinear_scale: Optional[Tensor] = None, channelwise_program: Optional[Tensor] = None,
                      channelwise_coefficients: Optional[Tensor] = None) -> Tensor:
    info = SimpleNamespace(scale=scale, index1=index1, index2=index2, row_bounds=row_bounds,
                           gather_index=gather_index, out_size=out_size)
    if bilinear_matrix is not None:  # sparse_product_triton decided; hi, lo, scale: 16-bit inputs' split
        def bilinear(a, b, hi, lo, split_scale):  # (an interpreter's bf16 upcast runs in fp32 on the fp32 matrix)
            split = (hi, lo, split_scale) if a.dtype in (torch.float16, torch.bfloat16) else None
            return bilinear_launch(a, b, bilinear_matrix, out_size, split)

        return _launch(bilinear, x, y, bilinear_hi, bilinear_lo, bilinear_scale)
    if fold_matrix is not None and op == "outer":  # sparse_product_triton decided
        return _launch(lambda a, b: fold_outer_sum_launch(a, b, fold_matrix, out_size), x, y)
    if fold_matrix is not None:
        return _launch(lambda a, b: fold_product_launch(op, a, b, fold_matrix, out_size), x, y)
    if outer_by_dot:  # sparse_product_triton decided
        return _launch(lambda a, b: outer_sum_launch(a, b, info), x, y)
    if channelwise_program is not None:  # sparse_product_triton decided: the table's structure as a CPU tensor
        program = program_of(channelwise_program, channelwise_coefficients)
        rank_x, rank_y, _ = CHANNEL_RANKS[op]
        return _launch(lambda a, b: channelwise_launch(op, a, b, program, channelwise_coefficients, out_size,
                                                       a.dim() == rank_x + 1, b.dim() == rank_y + 1), x, y)
    if dense_bounds is not None:  # the dense route (sparse_product_triton decided)
        table = SimpleNamespace(bounds=dense_bounds, index=dense_index, scale=dense_scale, rows=dense_rows,
                                max_len=dense_max_len, matrix=dense_matrix)
        rank_x, rank_y, _ = CHANNEL_RANKS[op]
        return _launch(lambda a, b: dense_product_launch(op, a, b, table, out_size, a.dim() == rank_x + 1,
                                                         b.dim() == rank_y + 1), x, y)
    return _launch(lambda a, b: sparse_product_launch(op, a, b, info, out_accumulated), x, y)


@sparse_product_op.register_fake
def _(x, y, scale, index1, index2, row_bounds, gather_index, out_size, op, out_accumulated, dense_bounds=None,
      dense_index=None, dense_scale=None, dense_rows=0, dense_max_len=0, dense_matrix=None, outer_by_dot=False,
      fold_matrix=None, bilinear_matrix=None, bilinear_hi=None, bilinear_lo=None, bilinear_scale=None,
      channelwise_program=None, channelwise_coefficients=None):
    return x.new_empty(product_out_shape(op, x.shape, y.shape, out_size, out_accumulated))


@torch.library.custom_op("attnbench::sparse_scale", mutates_args=())
def sparse_scale_op(x: Tensor, scale: Optional[Tensor], index: Tensor, seg_out: Tensor, out_size: int) -> Tensor:
    info = SimpleNamespace(scale=scale, index=index, seg_out=seg_out, out_size=out_size)
    return _launch(lambda a: sparse_scale_launch(a, info), x)


@sparse_scale_op.register_fake
def _(x, scale, index, seg_out, out_size):
    return x.new_empty(scale_out_shape(x.shape, out_size))


def _slice_and_stack(op, num_mapped):
    """vmap rule: call ``op`` once per index of the mapped dim (on the first ``num_mapped`` args) and stack."""
    def rule(info, in_dims, *args):
        outs = []
        for i in range(info.batch_size):
            sliced = [a if d is None else a.select(d, i) for a, d in zip(args[:num_mapped], in_dims[:num_mapped])]
            outs.append(op(*sliced, *args[num_mapped:]))
        return torch.stack(outs), 0

    return rule


torch.library.register_vmap(sparse_product_op, _slice_and_stack(sparse_product_op, 2))
torch.library.register_vmap(sparse_scale_op, _slice_and_stack(sparse_scale_op, 1))


def _dense_table(op, x, y, info, out_accumulated):
    """The info's table for the dense route of ``op``, or None where the segment kernel runs."""
    if op not in DENSE_OPS or not DENSE_ROUTE["enabled"]:
        return None
    rank_x, rank_y, _ = CHANNEL_RANKS[op]
    batched = x.dim() == rank_x + 2 or y.dim() == rank_y + 2
    table = getattr(info, "dense_rows", {}).get(DENSE_OPS[op])
    if (out_accumulated and batched) or table is None:
        return None
    density = table.index.numel() / max(table.dense_entries, 1)  # sparse multiply-adds per dense one, per channel
    return table if density >= MIN_DENSITY else None


def _fold_table(op, x, y, info, out_accumulated):
    """The info's table for the fold route of ``op``, or None where another route runs."""
    if not FOLD_ROUTE["enabled"]:
        return None
    if _batch_summed_outer(op, x, y, out_accumulated):  # the FC layer's weight gradient
        table = getattr(info, "dense_rows", {}).get("gram")
        if table is None or table.matrix is None:
            return None
        batch, terms = x.shape[0], table.index.numel()
        # fold FLOPs (N + out) P1 P2 a b against the kernel's N terms a b
        pays = batch * terms >= MIN_DENSITY * (batch + info.out_size) * table.dense_entries
        entries = x.shape[1] * x.shape[2] * y.shape[1] * y.shape[2]
        return table if pays and entries <= FOLD_MAX_ENTRIES else None
    if op not in FOLD_OPS or out_accumulated:
        return None
    name, shared = FOLD_OPS[op]
    ranks = CHANNEL_RANKS[op]
    operands = (x, y)
    if operands[shared].dim() != ranks[shared] + 1 or operands[1 - shared].dim() != ranks[1 - shared] + 2:
        return None
    table = getattr(info, "dense_rows", {}).get(name)
    if table is None or table.matrix is None or table.index.numel() < MIN_DENSITY * table.rows:
        return None
    batch = operands[1 - shared].shape[0]
    if batch * table.index.numel() < table.matrix.numel() or folded_entries(op, x, y, info.out_size) > FOLD_MAX_ENTRIES:
        return None
    return table


def _bilinear_table(op, x, y, info, out_accumulated):
    """The info's gram table for mul's bilinear route, or None where the segment kernel runs."""
    if op != "mul" or not BILINEAR_ROUTE["enabled"]:
        return None
    if out_accumulated and 3 in (x.dim(), y.dim()):  # a batch sum
        return None
    table = getattr(info, "dense_rows", {}).get("gram")
    if table is None or table.matrix is None or min(info.size1, info.size2) > MAX_HELD or \
            table.matrix.numel() > INT32_MAX:
        return None
    if x.dtype in (torch.float16, torch.bfloat16) and x.dtype not in table.splits:  # the split would lose precision
        return None
    if x.dtype == torch.float32 and info.num_terms < FP32_MIN_TERMS_PER_ROW * info.out_size:
        return None
    held, looped = sorted((info.size1, info.size2))
    macs = max(16, next_pow2(info.out_size)) * looped * max(16, next_pow2(held))  # tl.dot's dims: 16 at least
    return table if info.num_terms >= MIN_BILINEAR_DENSITY * macs else None


def _channelwise(op, x, y, table, out_size):
    """Whether the dense route's ``op`` runs on the channel-wise kernels (its table unrolled; see CHANNELWISE)."""
    if not CHANNELWISE["enabled"]:
        return False
    if x.dtype in (torch.float16, torch.bfloat16) and table.dense_entries > CHANNELWISE["max_16bit_entries"]:
        return False
    rank_x, rank_y, _ = CHANNEL_RANKS[op]
    return channelwise_fits(op, x, y, table.unrolled, out_size, x.dim() == rank_x + 1,
                            y.dim() == rank_y + 1)


def _batch_summed_outer(op, x, y, out_accumulated):
    """Whether ``op`` is outer summed over the batch with both inputs batched (the FC layer's weight gradient)."""
    return op == "outer" and bool(out_accumulated) and x.dim() == 3 and y.dim() == 3


def _outer_sum(op, x, y, out_accumulated):
    """Whether ``op`` is the batch-summed outer product for the matrix-unit kernel (not fp64)."""
    return OUTER_SUM_BY_DOT["enabled"] and _batch_summed_outer(op, x, y, out_accumulated) and x.dtype != torch.float64


def sparse_product_triton(op, x, y, info, out_accumulated=False):
    """``sparse_product_split`` on the Triton kernels (same shapes and dtype): the fold route (attnbench/kernels/sparse/fold.py)
    for vecmat with a shared y and mat_t_vec with a shared x, mul's bilinear route (attnbench/kernels/sparse/bilinear.py), the
    dense route (attnbench/kernels/sparse/dense.py) for vecsca, scavec and inner, where they apply; outer summed over the batch
    on attnbench/kernels/sparse/outer_sum.py, else the segment kernel."""
    route = {}
    if (table := _fold_table(op, x, y, info, out_accumulated)) is not None:
        route = {"fold_matrix": table.matrix if x.dtype == torch.float64 else table.matrix32}
    elif (table := _bilinear_table(op, x, y, info, out_accumulated)) is not None:
        hi, lo, split_scale = table.splits.get(x.dtype, (None, None, None))
        route = {"bilinear_matrix": table.matrix if x.dtype == torch.float64 else table.matrix32, "bilinear_hi": hi,
                 "bilinear_lo": lo, "bilinear_scale": split_scale}
    elif _outer_sum(op, x, y, out_accumulated):
        route = {"outer_by_dot": True}
    elif (table := _dense_table(op, x, y, info, out_accumulated)) is not None and \
            _channelwise(op, x, y, table, info.out_size):
        route = {"channelwise_program": table.unrolled.program_tensor,
                 "channelwise_coefficients": table.unrolled.coefficients(x.dtype)}
    elif table is not None:
        matrix = (table.matrix if x.dtype == torch.float64 else table.matrix32) if GATHER_BY_MATMUL["enabled"] else None
        route = {"dense_bounds": table.bounds, "dense_index": table.index, "dense_scale": table.scale,
                 "dense_rows": table.rows, "dense_max_len": table.max_len, "dense_matrix": matrix}
    return sparse_product_op(x, y, info.scale, info.index1, info.index2, info.row_bounds, info.gather_index,
                             info.out_size, op, bool(out_accumulated), **route)


def sparse_scale_triton(x, info):
    """``sparse_scale_split`` on the Triton kernel (same shapes and dtype)."""
    return sparse_scale_op(x, info.scale, info.index, info.seg_out, info.out_size)
