"""vecsca, scavec and inner with the structure compiled into the kernel: every term a multiply-add on the CUDA
cores, one program per (samples, channels) tile, no per-sample matrices anywhere.

The dense route (dense.py, fused_dense.py) multiplies each sample's [rows, rows] matrix M by its [rows, channels]
block on the matrix units. At Clebsch-Gordan L 2-3 those matrices are 9 x 9 and 16 x 16, padded to the matrix
units' 16 and tiled per sample: the route reaches 22-50% of its byte floor there, where cuEquivariance's channel-
wise kernel (one fused loop over the paths, the structure known when it compiles) reaches 77% of copy bandwidth
(docs/measurements/sparse.md). Here the info's table is unrolled into the kernel as a constexpr: for each output row
the (vector row, its scalar terms) pairs, so a program loads its samples' scalars and vector rows once, in
registers, and forms

    vecsca, scavec   z[n, o, c] = sum_{(o, v)} (sum_k coef[k] S[n, a_k]) V[n, v, c]
    inner            z[n, o]    = sum_c sum_{t: o} coef[t] X[n, a_t, c] Y[n, b_t, c]

with only the multiply-adds the structure holds (81 pairs at L 2, 256 at L 3: 2.25-4 FLOPs a byte of fp32 vectors,
well under the FMA units' rate at copy bandwidth). The coefficients stay in memory (a fp64 kernel reads them in
fp64; Triton rounds a constexpr float to fp32) and the structure's indices are constexpr, so a structure compiles
once a dtype and tile. Sums run in a fixed order (deterministic), in fp32 (fp64 for fp64); an output row reads only
the rows its terms name, so a non-finite entry reaches only those outputs (as the segment kernel and split).

Structures are unrolled only while small (``UNROLL``): every sparse size at most 16 rows (the vector rows stay in
registers) and at most 1024 coefficients (compile time grows with them).
"""
import torch
import triton
import triton.language as tl

from ..launch import on_device
from ..offsets import INT32_MAX, sample_int32, sample_strides
from ..outputs import new_output
from ..precision import accumulator_dtype
from .. import interpreting
from ..tuning import (autotune, autotune_enabled, cdiv, cfg, config_list, next_pow2, registers_per_thread,
                      tile_pruner)

__all__ = ["UNROLL", "Unrolled", "unrolled_pairs", "unrolled_gram", "program_of", "channelwise_fits",
           "channelwise_launch", "channelwise_rows_kernel", "channelwise_gram_kernel"]

UNROLL = {"max_rows": 16, "max_coefficients": 1024, "max_channels": 256}
# fp32 registers a thread may hold for a program's vector rows (all of them live while the outputs are formed):
# vecsca's and scavec's one operand, inner's two
ROW_REGISTERS = {"rows": 64, "gram": 128}

# (warps, samples a program, channel tile): 2-8 values a thread per vector row. Few: each compiles for seconds at
# L 3 (611 coefficients unrolled), and the autotuner compiles every config that fits
_SHAPES = [(4, 16, 32), (4, 8, 64), (4, 4, 128), (8, 16, 64), (2, 8, 32), (8, 8, 128)]
_CONFIGS = config_list(
    [cfg(w, 1, BLOCK_N=n, BLOCK_C=c) for w, n, c in _SHAPES],
    cfg(1, 1, BLOCK_N=2, BLOCK_C=2),  # the interpreter: tiny batches and channels still span several programs
)


class Unrolled:
    """A table's structure for the kernels here: ``program``, the kernel's constexpr (a flat tuple of int tuples:
    Triton 3.6 cannot index a constexpr tuple three deep nor take the length of a nested one), the same as an int64
    CPU tensor (``program_tensor``: what the custom op takes, so that a compiled or exported graph holds the structure
    itself, not a name for it), and the coefficients it indexes as a float64 and a float32 tensor on ``device``."""

    def __init__(self, program, coefficients, device):
        self.program = program
        self.program_tensor = _encoded(program)
        self.coef64 = coefficients.to(device)
        self.coef32 = self.coef64.float()

    def coefficients(self, dtype):
        return self.coef64 if dtype == torch.float64 else self.coef32


def _coefficient_count(program):
    """The coefficients a program indexes: k is each one's place, 0 .. count - 1 (-1 in a row without terms)."""
    return sum(1 for entry in program if entry[3] >= 0)


def _encoded(program):
    width = len(program[0]) if program else 1
    tensor = torch.tensor(program, dtype=torch.int64).reshape(-1, width)
    # read back without a pass over the values (program_of), its coefficient count with it
    tensor._attnbench_program = program, _coefficient_count(program)
    return tensor


def program_of(tensor, coefficients=None):
    """The constexpr program a ``program_tensor`` holds: the one kept on it where it was made, else (a tensor loaded
    from an exported or pickled graph) read from its values once and kept on it. With ``coefficients``, raises
    ValueError unless they hold every coefficient the program indexes (a kernel would read past them)."""
    kept = getattr(tensor, "_attnbench_program", None)
    if kept is None:
        program = tuple(tuple(row) for row in tensor.tolist())
        kept = tensor._attnbench_program = program, _coefficient_count(program)
    program, needed = kept
    if coefficients is not None and coefficients.numel() < needed:
        raise ValueError(f"sparse_product: the channel-wise program indexes {needed} coefficients, "
                         f"{coefficients.numel()} given")
    return program


def _nonzeros(matrix):
    """(row, column, value) of a float64 CPU matrix's nonzero entries, row-major."""
    rows, cols = torch.nonzero(matrix, as_tuple=True)
    return rows.tolist(), cols.tolist(), matrix[rows, cols]


def _flags(index, group):
    """(first, last) of entry ``index`` in its run of equal ``group`` keys, as 0/1."""
    return int(index == 0 or group[index - 1] != group[index]), int(index == len(group) - 1 or
                                                                     group[index + 1] != group[index])


def unrolled_pairs(matrix, out_size, vector_rows, device):
    """The pairs table (matrix [scalar rows, out_size x vector_rows] in float64 on the CPU: M[n, o, v] =
    sum_a matrix[a, o vector_rows + v] S[n, a]) unrolled for ``channelwise_rows_kernel`` (coefficients on ``device``),
    or None where it is larger than ``UNROLL``. One entry a coefficient, by output row then vector row: (o, v, a, k, first of the row, first of
    the pair, last of the pair, last of the row), and (o, -1, -1, -1, 1, 0, 0, 1) for a row with none."""
    if max(matrix.shape[0], vector_rows, out_size) > UNROLL["max_rows"]:
        return None
    cols, a, values = _nonzeros(matrix.T.contiguous())  # by the matrix's column (o, v), then a
    if len(a) > UNROLL["max_coefficients"]:
        return None
    outs = [col // vector_rows for col in cols]
    program = []
    for o in range(out_size):
        if o not in outs:
            program.append((o, -1, -1, -1, 1, 0, 0, 1))
            continue
        for index in (i for i, out in enumerate(outs) if out == o):
            row_first, row_last = _flags(index, outs)
            pair_first, pair_last = _flags(index, cols)
            program.append((o, cols[index] % vector_rows, a[index], index, row_first, pair_first, pair_last,
                            row_last))
    return Unrolled(tuple(program), values, device)


def unrolled_gram(matrix, out_size, size2, device):
    """The gram table (matrix [size1 x size2, out_size] in float64 on the CPU: z[n, o] = sum_{a, b}
    matrix[a size2 + b, o] G[n, a, b]) unrolled for ``channelwise_gram_kernel`` (coefficients on ``device``), or None
    where it is larger than ``UNROLL``: one entry a coefficient, by output row: (o, a, b, k, first of the row, last
    of the row)."""
    if max(matrix.shape[0] // max(size2, 1), size2, out_size) > UNROLL["max_rows"]:
        return None
    outs, pairs, values = _nonzeros(matrix.T.contiguous())
    if len(outs) > UNROLL["max_coefficients"]:
        return None
    program = tuple((o, pair // size2, pair % size2, k, *_flags(k, outs))
                    for k, (o, pair) in enumerate(zip(outs, pairs)))
    return Unrolled(program, values, device)


def _rows_fit(config, constexprs):
    """The program's vector rows at most ROW_REGISTERS a thread."""
    return registers_per_thread(constexprs["ROWS_V"] * config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_C"],
                                config.num_warps) <= ROW_REGISTERS["rows"]


_prune = tile_pruner({"BLOCK_C": "C"}, 16, fits=_rows_fit)

# inner: (warps, samples a program); the channel tile is every channel (the launcher's BLOCK_C)
_GRAM_CONFIGS = config_list([cfg(w, 1, BLOCK_N=n) for w, n in [(4, 4), (4, 8), (4, 16), (8, 16), (2, 4), (4, 2)]],
                            cfg(1, 1, BLOCK_N=2))


def _prune_gram(configs, named_args, **constexprs):
    """Both operands' rows at most ROW_REGISTERS a thread (the fewest registers where none fits)."""
    if interpreting():
        return configs

    def registers(c):
        rows = constexprs["ROWS_V"] + constexprs["ROWS_Y"]
        return registers_per_thread(rows * c.kwargs["BLOCK_N"] * constexprs["BLOCK_C"], c.num_warps)

    kept = [c for c in configs if registers(c) <= ROW_REGISTERS["gram"]] or [min(configs, key=registers)]
    return kept if autotune_enabled() else kept[:1]


@autotune(_CONFIGS, key=["ROWS_S", "ROWS_V", "C"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def channelwise_rows_kernel(S, V, COEF, Z, N, C, s_sn, s_sm, s_vn, s_vm, s_vc, s_zn, s_zo, s_zc,
                            PROGRAM: tl.constexpr, ROWS_S: tl.constexpr, ROWS_V: tl.constexpr,
                            ACC_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Z[n, o, c] = sum_v (sum_a COEF[k] S[n, a]) V[n, v, c] over PROGRAM's entries (o, v, a, k, flags:
    ``unrolled_pairs``) for this program's BLOCK_N samples and BLOCK_C channels (vecsca: S = y, V = x; scavec:
    S = x, V = y)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = offs_n.to(tl.int64)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_c < C)[None, :]
    scalars = ()
    for a in tl.static_range(ROWS_S):
        scalars = scalars + (tl.load(S + n * s_sn + a * s_sm, mask=n_mask, other=0.0).to(ACC_DTYPE),)
    vectors = ()
    for v in tl.static_range(ROWS_V):
        vectors = vectors + (tl.load(V + n[:, None] * s_vn + v * s_vm + offs_c[None, :] * s_vc, mask=mask,
                                     other=0.0).to(ACC_DTYPE),)
    z_rows = Z + n[:, None] * s_zn + offs_c[None, :] * s_zc
    acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE)
    m = tl.zeros([BLOCK_N], dtype=ACC_DTYPE)
    for i in tl.static_range(len(PROGRAM)):
        if PROGRAM[i][4] == 1:  # a row's first entry
            acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE)
        if PROGRAM[i][1] >= 0:  # else a row without terms: stored as zeros
            if PROGRAM[i][5] == 1:  # a (row, vector row) pair's first coefficient
                m = tl.zeros([BLOCK_N], dtype=ACC_DTYPE)
            m += tl.load(COEF + PROGRAM[i][3]) * scalars[PROGRAM[i][2]]
            if PROGRAM[i][6] == 1:
                acc += m[:, None] * vectors[PROGRAM[i][1]]
        if PROGRAM[i][7] == 1:
            tl.store(z_rows + PROGRAM[i][0] * s_zo, acc.to(Z.dtype.element_ty), mask=mask)


@autotune(_GRAM_CONFIGS, key=["ROWS_V", "ROWS_Y", "BLOCK_C"], prune_configs_by={"early_config_prune": _prune_gram})
@triton.jit
def channelwise_gram_kernel(X, Y, COEF, Z, N, C, OUT, s_xn, s_xp, s_xc, s_yn, s_yq, s_yc, s_zn, s_zo,
                            PROGRAM: tl.constexpr, ROWS_V: tl.constexpr, ROWS_Y: tl.constexpr,
                            ACC_DTYPE: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_C: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """Z[n, o] = sum_c sum COEF[k] X[n, a, c] Y[n, b, c] over PROGRAM's entries (o, a, b, k, flags:
    ``unrolled_gram``) for BLOCK_N samples, every channel in one BLOCK_C tile (ROWS_V: X's rows, ROWS_Y: Y's; OUT:
    Z's rows, a row without entries written as zero). One tile, not a loop over channel steps: in a loop the
    compiler hoists the coefficients' loads out of it, one register each (137 at L 2: the kernel spilled)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n = offs_n.to(tl.int64)
    n_mask = offs_n < N
    offs_o = tl.arange(0, BLOCK_O)
    offs_c = tl.arange(0, BLOCK_C)
    mask = n_mask[:, None] & (offs_c < C)[None, :]
    xs = ()
    for a in tl.static_range(ROWS_V):
        xs = xs + (tl.load(X + n[:, None] * s_xn + a * s_xp + offs_c[None, :] * s_xc, mask=mask,
                           other=0.0).to(ACC_DTYPE),)
    ys = ()
    for b in tl.static_range(ROWS_Y):
        ys = ys + (tl.load(Y + n[:, None] * s_yn + b * s_yq + offs_c[None, :] * s_yc, mask=mask,
                           other=0.0).to(ACC_DTYPE),)
    out = tl.zeros([BLOCK_N, BLOCK_O], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE)
    for i in tl.static_range(len(PROGRAM)):
        if PROGRAM[i][4] == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=ACC_DTYPE)
        # (coefficient x) y, not coefficient (x y): the product x y of a pair recurs under several outputs, and the
        # compiler kept each one live from its first use to its last (255 registers at L 2)
        acc += (tl.load(COEF + PROGRAM[i][3]) * xs[PROGRAM[i][1]]) * ys[PROGRAM[i][2]]
        if PROGRAM[i][5] == 1:
            # one-hot into the [samples, outputs] accumulator: the outputs are a tile, not a Python list
            out += tl.where(offs_o[None, :] == PROGRAM[i][0], tl.sum(acc, axis=1)[:, None], 0.0)
    tl.store(Z + n[:, None] * s_zn + offs_o[None, :] * s_zo, out.to(Z.dtype.element_ty),
             mask=n_mask[:, None] & (offs_o < OUT)[None, :])


def channelwise_fits(op, x, y, unrolled, out_size, x_shared, y_shared):
    """Whether the kernels here take these operands: the table unrolled (``Unrolled``, not None), at least one
    operand batched, channels present, inner's at most ``UNROLL["max_channels"]`` (one tile of them), and one
    sample's compact rows within int32 offsets (the kernels' in-sample offsets; the output's too)."""
    channels = x.shape[-1] if op != "scavec" else y.shape[-1]
    rows = max(x.shape[-2 if op != "scavec" else -1], y.shape[-2 if op != "vecsca" else -1], out_size)
    return unrolled is not None and not (x_shared and y_shared) and channels > 0 and (
        op != "inner" or channels <= UNROLL["max_channels"]) and rows * channels <= INT32_MAX


def channelwise_launch(op, x, y, program, coefficients, out_size, x_shared, y_shared):
    """z of vecsca, scavec or inner (not accumulated over the batch) in x's dtype; the caller checked
    ``channelwise_fits``. x, y: [N, M, C] (or [M, C] shared) for the vectors, [N, M] (or [M]) for the scalars;
    ``program``: an ``Unrolled``'s program, ``coefficients``: its coefficients in x's accumulator precision."""
    x, y = sample_int32(x, x_shared), sample_int32(y, y_shared)
    batch = y.shape[0] if x_shared else x.shape[0]
    acc = accumulator_dtype(x.dtype)
    if op == "inner":
        channels = x.shape[-1]
        out = new_output((batch, out_size), x.dtype, x.device)
        if out.numel() == 0:
            return out
        with on_device(out):
            channelwise_gram_kernel[lambda meta: (cdiv(batch, meta["BLOCK_N"]),)](
                x, y, coefficients, out, batch, channels, out_size, *sample_strides(x, x_shared),
                *sample_strides(y, y_shared),                *out.stride(), PROGRAM=program, ROWS_V=x.shape[-2], ROWS_Y=y.shape[-2], ACC_DTYPE=acc,
                BLOCK_O=max(2, next_pow2(out_size)), BLOCK_C=max(2, next_pow2(channels)))
        return out
    scalars, vectors, s_shared, v_shared = (y, x, y_shared, x_shared) if op == "vecsca" else (x, y, x_shared, y_shared)
    channels = vectors.shape[-1]
    out = new_output((batch, out_size, channels), x.dtype, x.device)
    if out.numel() == 0:
        return out
    with on_device(out):
        channelwise_rows_kernel[lambda meta: (cdiv(batch, meta["BLOCK_N"]), cdiv(channels, meta["BLOCK_C"]))](
            scalars, vectors, coefficients, out, batch, channels, *sample_strides(scalars, s_shared),
            *sample_strides(vectors, v_shared), *out.stride(), PROGRAM=program, ROWS_S=scalars.shape[-1],
            ROWS_V=vectors.shape[-2], ACC_DTYPE=acc)
    return out
