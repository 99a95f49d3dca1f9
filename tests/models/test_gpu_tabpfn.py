"""GPU gate for attnbench.models.tabpfn (skipped without CUDA; scripts/gpu_gate.sh runs it): the decode loop's
attention backends agree on a GPU (tests/models/test_tabpfn.py runs them on the CPU)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_decode_loop_backends_agree_on_gpu():
    from attnbench.models.tabpfn import BACKENDS, TabPFNConfig, TabPFNLike

    gen = torch.Generator().manual_seed(0)
    x_ctx = torch.randn(300, 8, generator=gen, dtype=torch.float64).cuda()
    y_ctx = torch.randn(300, generator=gen, dtype=torch.float64).cuda()
    x_tgt = torch.randn(6, 8, generator=gen, dtype=torch.float64).cuda()
    runs = {}
    for backend in BACKENDS:  # float64: same samples, same densities to rounding
        m = TabPFNLike(TabPFNConfig(n_layers=4), seed=0, backend=backend).double().cuda()
        y, logp = m.sample_sequence(x_ctx, y_ctx, x_tgt, num_samples=64, seed=3, return_log_density=True)
        runs[backend] = (y, logp, m.evaluate_joint_density(x_ctx, y_ctx, x_tgt, y))
    for backend, outs in runs.items():
        for got, want in zip(outs, runs["reference"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=backend)
