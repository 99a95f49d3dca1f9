"""attnbench/kernels/sparse/split_matmul.py on a GPU (skipped without CUDA; scripts/gpu_gate.sh runs it), in fp16 and
bf16 with every launch config forced in turn, to the a-priori bound of tests/sparse/helpers.py's check_split_matmul
(the interpreter's side: tests/sparse/test_split_matmul.py)."""
import pytest
import torch

from attnbench.kernels import outputs as kernel_outputs
from attnbench.kernels.sparse.split_matmul import split_matmul_kernel

from .helpers import check_split_matmul

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("config", range(len(split_matmul_kernel.configs)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_config_on_the_gpu(config, dtype, monkeypatch):
    """Each config forced in turn, NaN-poisoned output: the fold's widths (288: L 2 C 32; 1568: L 6 C 32) and a
    ragged shape, batches that leave the last tile short."""
    monkeypatch.setattr(kernel_outputs, "_poisoning", lambda: True)
    monkeypatch.setattr(split_matmul_kernel, "configs", [split_matmul_kernel.configs[config]])
    monkeypatch.setattr(split_matmul_kernel, "cache", {})
    generator = torch.Generator(device="cuda").manual_seed(config)
    for n, k, m in [(4001, 288, 288), (1003, 1568, 1568), (777, 37, 201)]:
        a = torch.randn(n, k, device="cuda", generator=generator).to(dtype)
        check_split_matmul(a, torch.randn(k, m, device="cuda", generator=generator) / k ** 0.5)

