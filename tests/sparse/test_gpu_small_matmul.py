"""GPU gate for ``kernels.small_matmul``: every launch config against float64, in every dtype pairing.

The correctness gate runs with ATTNBENCH_AUTOTUNE=0 (one config per key), but the autotuner may pick any config
on a user's shapes, so each config is forced in turn here: the dense route's shapes (49 x 49 at L 6 times 128
channels; the Gram matrix's 128-deep inner dim), a ragged one (70 x 33 x 18: two row tiles, partial inner and
column tiles), shared, broadcast and transposed operands (LAYOUTS), with a batch that leaves the last program a
sample past the end.

Bounds are a priori (Higham, ch. 3), elementwise against A = |a| @ |b| in float64: an fp32 accumulation of K
products adds at most gamma_{K+1}(2**-24) A; an fp32 ``a`` split into bf16 hi + lo misses at most 2**-16 |a|;
a 16-bit output rounds once more (u_out |exact|). fp64 operands: gamma_{K+1}(2**-53) A.
"""
import pytest
import torch

from attnbench.kernels import outputs as kernel_outputs
from attnbench.kernels.sparse import small_matmul as module
from attnbench.bench.verify import gamma

pytestmark = pytest.mark.gpu

# (a dtype, b dtype, out dtype): fp32 on the FMA units, M in fp32 against 16-bit vectors (hi + lo), the Gram
# matrix of 16-bit inputs (fp32 out), fp64 (the gradcheck path)
PAIRINGS = [(torch.float32, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.bfloat16),
            (torch.float32, torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16, torch.float32),
            (torch.float64, torch.float64, torch.float64)]
SHAPES = [(49, 49, 128), (49, 128, 49), (70, 33, 18), (16, 16, 32)]  # (P, K, Q)
BATCH = 37
# a or b shared (2-D), both shared (one output matrix), a batch of one broadcast (torch.matmul's rule), b transposed
LAYOUTS = ("none", "a", "b", "both", "a1", "b_t")


def _bound(a64, b64, exact, a_dtype, b_dtype, out_dtype):
    k = a64.shape[-1]
    fp64 = b_dtype == torch.float64
    factor = gamma(k + 1, 2.0 ** -53 if fp64 else 2.0 ** -24)
    if a_dtype != b_dtype:
        factor += 2.0 ** -16
    out = 0.0 if out_dtype in (torch.float32, torch.float64) else torch.finfo(out_dtype).eps / 2
    return factor * (a64.abs() @ b64.abs()) + out * exact.abs() + 1e-300


@pytest.fixture
def one_config(monkeypatch):
    """Force a single launch config (and poison outputs: an element the kernel misses is NaN)."""
    kernel = module.small_matmul_kernel
    monkeypatch.setattr(kernel_outputs, "_poisoning", lambda: True)
    monkeypatch.setenv("ATTNBENCH_AUTOTUNE", "0")

    def force(config):
        monkeypatch.setattr(kernel, "configs", [config])
        monkeypatch.setattr(kernel, "cache", {})

    return force


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pairing", PAIRINGS, ids=lambda p: "-".join(str(d).split(".")[1] for d in p))
def test_every_config_matches_float64(pairing, one_config):
    a_dtype, b_dtype, out_dtype = pairing
    generator = torch.Generator(device="cuda").manual_seed(0)
    failures = []
    for index, config in enumerate(module._CONFIGS):
        one_config(config)
        for p, k, q in SHAPES:
            for shared in LAYOUTS:
                a_shape = {"a": (p, k), "both": (p, k), "a1": (1, p, k)}.get(shared, (BATCH, p, k))
                b_shape = (k, q) if shared in ("b", "both") else (BATCH, k, q)
                a = torch.randn(a_shape, device="cuda", generator=generator).to(a_dtype)
                if shared == "b_t":  # column-major b: the Gram matrix's y^T, unit stride along the inner dim
                    b = torch.randn(BATCH, q, k, device="cuda", generator=generator).to(b_dtype).transpose(-1, -2)
                else:
                    b = torch.randn(b_shape, device="cuda", generator=generator).to(b_dtype)
                out = module.small_matmul(a, b, out_dtype)
                a64, b64 = a.double(), b.double()
                exact = a64 @ b64
                excess = ((out.double() - exact).abs() / _bound(a64, b64, exact, a_dtype, b_dtype, out_dtype)).max()
                if not bool(excess <= 1):  # NaN (an unwritten element) fails too
                    failures.append(f"config {index} {config}, shape {(p, k, q)}, shared {shared}: "
                                    f"{float(excess):.3g} of the bound")
    assert not failures, "\n".join(failures)


# gram_stack (attnbench/kernels/sparse/dense.py): x [N, P, C] times y's transposed view, P and Q <= 16 (L 2 and 3), deep C
GRAM_SHAPES = [(9, 9, 32), (16, 16, 128), (7, 13, 37), (1, 16, 200)]  # (P, Q, C)


@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=str)
@pytest.mark.parametrize("shared", ["none", "x", "y"])
def test_gram_stack_matches_float64(shape, shared, monkeypatch):
    """fp32 Gram matrices BLOCK_N samples at a time, a batch that leaves the last program partly empty, ragged
    rows, columns and channel steps, one operand shared, NaN-poisoned output: within gamma_{C+1}(2**-24) |x| |y|^T
    of float64 (the FMA dot, no TF32)."""
    from attnbench.kernels.sparse.dense import gram_stack

    monkeypatch.setattr(kernel_outputs, "_poisoning", lambda: True)
    p, q, c = shape
    generator = torch.Generator(device="cuda").manual_seed(p * q + c)
    batch = 8 * 1000 + 3
    x = torch.randn(*(() if shared == "x" else (batch,)), p, c, device="cuda", generator=generator)
    y = torch.randn(*(() if shared == "y" else (batch,)), q, c, device="cuda", generator=generator)
    gram = gram_stack(x, y.transpose(-1, -2))
    x64, y64 = x.double(), y.double().transpose(-1, -2)
    exact = x64 @ y64
    bound = gamma(c + 1, 2.0 ** -24) * (x64.abs() @ y64.abs())
    assert gram.shape == (batch, p, q) and gram.dtype == torch.float32
    assert bool(((gram.double() - exact).abs() <= bound).all()), float((gram.double() - exact).abs().max())
