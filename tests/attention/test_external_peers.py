"""flash's FlashAttention-4 and FlashInfer peers on the CPU, through stand-ins of the libraries
(tests/peer_fakes.py): the arguments and layouts each adapter hands its library, the LSE base, what each
declines and why, and the check machinery's verdict against the float64 oracle."""
import dataclasses

import pytest
import torch

import attnbench
from attnbench.bench.registry import Unsupported
from attnbench.bench.verify import check_variant
from attnbench.operators import external
from attnbench.operators.flash import FlashCase, peers

from .. import peer_fakes

OP = attnbench.get("flash")
CPU = torch.device("cpu")


def _check(case, variant, mode, oracles):
    x, oracle, lowp = oracles(case)
    return check_variant(OP, variant, case, mode, x, oracle, lowp)


# ---------------------------------------------------------------- availability


def test_registered_and_unavailable_here_with_the_reason():
    for name in ("fa4", "fa4_deterministic", "flashinfer"):
        assert OP.variants[name].kind == "peer" and name not in OP.available_variants("cpu")
    assert OP.variants["flashinfer"].modes == ("fwd",)  # FlashInfer has no backward
    assert OP.variants["fa4"].modes == OP.modes
    assert OP.variants["fa4_deterministic"].modes == ("bwd", "fwd_bwd")  # deterministic=True changes the backward only


def test_unavailable_reasons(monkeypatch):
    monkeypatch.setattr(external, "_spec", lambda name: None)
    assert "flash-attn-4" in external.fa4_unavailable(CPU)
    assert "flashinfer-python" in external.flashinfer_unavailable(CPU)
    monkeypatch.undo()
    peer_fakes.install(monkeypatch, flashinfer=True, fa4=True, cutlass=False)
    assert "CuTe DSL" in external.fa4_unavailable(CPU) and "dsl_packages" in external.fa4_unavailable(CPU)
    peer_fakes.install(monkeypatch, fa4=True)
    assert "CUDA device" in external.fa4_unavailable(CPU)
    assert "CUDA device" in external.flashinfer_unavailable(CPU)
    cuda = torch.device("cuda")
    for capability, reason in (((9, 0), None), ((10, 0), "sm_100"), ((8, 0), "sm_80")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert external.fa4_unavailable(cuda) == reason or reason in external.fa4_unavailable(cuda)
    monkeypatch.setattr(external, "nvcc_path", lambda: None)
    assert "nvcc" in external.flashinfer_unavailable(cuda)
    monkeypatch.setattr(external, "nvcc_path", lambda: "/usr/local/cuda/bin/nvcc")
    assert external.flashinfer_unavailable(cuda) is None


def test_nvcc_is_found_as_flashinfer_finds_it(monkeypatch, tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("")
    for name in ("FLASHINFER_NVCC", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert external.nvcc_path() == str(nvcc)
    monkeypatch.setenv("FLASHINFER_NVCC", "/opt/nvcc")
    assert external.nvcc_path() == "/opt/nvcc"


def test_lse_bases():
    """FlashInfer's base-2 LSE times ln 2 is torch's natural logsumexp."""
    s = torch.randn(5, 7, dtype=torch.float64)
    base2 = torch.log2(torch.exp2(s * 1.4426950408889634).sum(-1))  # log2 sum 2^(log2(e) s)
    assert torch.allclose(external.lse_from_log2(base2), torch.logsumexp(s, -1))


# ---------------------------------------------------------------- FlashAttention-4


FA4_CASES = [
    FlashCase(2, 4, 2, 33, 17, 16, "top_left", "float16"),  # top-left is bottom-right only when Nq == Nk: declined
    FlashCase(1, 2, 1, 40, 23, 80, "bottom_right", "bfloat16"),  # Nq > Nk: 17 rows see no key
    FlashCase(1, 3, 1, 20, 50, 16, "bottom_right", "float16"),
    FlashCase(1, 2, 2, 37, 29, 24, None, "bfloat16"),
    FlashCase(1, 1, 1, 19, 19, 32, "top_left", "float16"),
]


@pytest.mark.parametrize("variant, mode", [("fa4", "fwd"), ("fa4", "bwd"), ("fa4", "fwd_bwd"),
                                           ("fa4_deterministic", "bwd"), ("fa4_deterministic", "fwd_bwd")])
@pytest.mark.parametrize("case", FA4_CASES[1:], ids=lambda c: c.label)
def test_fa4_verified_against_the_oracle(monkeypatch, oracles, case, mode, variant):
    fake = peer_fakes.install(monkeypatch, fa4=True)["fa4"]
    result = _check(case, variant, mode, oracles)
    assert result.passed and not result.skipped, result
    call = fake.calls[0]
    q, k = call["q"], call["k"]
    # [B, N, H, D] views of our [B, H, N, D] tensors: no copy
    ours = oracles(case)[0]["q"]
    assert q.shape == (case.batch, case.seqlen_q, case.heads_q, case.head_dim)
    assert q.data_ptr() == ours.data_ptr() and q.stride() == ours.transpose(1, 2).stride()
    assert k.shape == (case.batch, case.seqlen_k, case.heads_kv, case.head_dim)
    assert call["causal"] == (case.causal is not None) and call["return_lse"]
    assert call["softmax_scale"] == case.softmax_scale
    assert call["deterministic"] == (variant == "fa4_deterministic")
    names = {"fwd": ["o", "lse"], "bwd": ["dq", "dk", "dv"], "fwd_bwd": ["o", "dq", "dk", "dv"]}[mode]
    assert [o.name for o in result.outputs] == names


@pytest.mark.parametrize("case, reason", [
    (FA4_CASES[0], "bottom-right aligned"),
    (dataclasses.replace(FA4_CASES[3], dtype="float32"), "fp16/bf16, not float32"),
    (dataclasses.replace(FA4_CASES[3], head_dim=20), "steps of 8, not 20"),
    (dataclasses.replace(FA4_CASES[3], head_dim=264), "not 264"),
], ids=lambda v: v if isinstance(v, str) else v.label)
def test_fa4_declines_with_the_reason(monkeypatch, case, reason):
    fake = peer_fakes.install(monkeypatch, fa4=True)["fa4"]
    assert reason in peers.fa4_declines(case)
    with pytest.raises(Unsupported, match=reason):
        peers.fa4_forward(case, case.causal_offset)
    assert not fake.calls


# ---------------------------------------------------------------- FlashInfer decode


DECODE_CASES = [
    FlashCase(3, 4, 2, 1, 70, 64, None, "float16"),  # Nq = 1: CUDA-core decode
    FlashCase(2, 16, 2, 1, 41, 128, "bottom_right", "bfloat16"),  # group 8: tensor-core decode; Nq = 1 sees all keys
    FlashCase(2, 4, 1, 5, 33, 64, "bottom_right", "bfloat16"),  # Nq > 1: the append kernel, causal bottom-right
    FlashCase(2, 2, 2, 7, 7, 64, "top_left", "float16"),  # Nq == Nk: top-left is bottom-right
    FlashCase(1, 4, 4, 16, 30, 256, None, "bfloat16"),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.label)
def test_flashinfer_decode_verified_against_the_oracle(monkeypatch, oracles, case):
    fi = peer_fakes.install(monkeypatch, flashinfer=True)["flashinfer"]
    result = _check(case, "flashinfer", "fwd", oracles)
    assert result.passed and not result.skipped, result
    assert [o.name for o in result.outputs] == ["o", "lse"]
    (wrapper,) = fi.PagedWrapper.instances
    x = oracles(case)[0]
    plan, run = wrapper.plan_args, wrapper.runs[0]
    assert wrapper.kv_layout == "HND" and wrapper.backend == "fa2" and wrapper.decode == (case.seqlen_q == 1)
    assert wrapper.use_tensor_cores == (case.heads_q // case.heads_kv > 4)
    # one page per sequence: our [B, Hkv, Nk, D] K and V themselves, read in place
    assert plan["page_size"] == case.seqlen_k and plan["kv_indices"].tolist() == list(range(case.batch))
    assert run["k_cache"] is x["k"] and run["v_cache"] is x["v"]
    assert plan["causal"] == (case.causal is not None and case.seqlen_q > 1)
    assert plan["sm_scale"] == case.softmax_scale and plan["q_data_type"] == case.torch_dtype
    assert run["q"].shape == (case.batch * case.seqlen_q, case.heads_q, case.head_dim)


@pytest.mark.parametrize("case, reason", [
    (FlashCase(1, 2, 2, 65, 100, 64, None, "float16"), "Nq <= 64, not 65"),
    (FlashCase(1, 2, 2, 1, 100, 64, None, "float32"), "fp16/bf16, not float32"),
    (FlashCase(1, 2, 2, 1, 100, 80, None, "float16"), "64, 128, 256, not 80"),
    (FlashCase(1, 2, 2, 1, 100, 64, "top_left", "float16"), "bottom-right aligned"),
    (FlashCase(1, 2, 2, 9, 5, 64, "bottom_right", "float16"), "see no key"),
], ids=lambda v: v if isinstance(v, str) else v.label)
def test_flashinfer_decode_declines_with_the_reason(monkeypatch, case, reason):
    fi = peer_fakes.install(monkeypatch, flashinfer=True)["flashinfer"]
    with pytest.raises(Unsupported, match=reason):
        peers.flashinfer_decode_forward(case, case.causal_offset, CPU)
    assert not fi.PagedWrapper.instances
