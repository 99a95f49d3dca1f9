"""shared_context's Triton functions under torch.compile(fullgraph=True): each call is one custom op
(attnbench::shared_context) that runs the eager path when the compiled code runs. Dynamo had failed on the checks'
functorch queries ("Attempted to call function marked as skipped"), and without fullgraph it traced into the
launch (found by review)."""
import pytest
import torch

from attnbench.shared_context import (buffer_attention, context_attention, shared_context_attention,
                                      shared_context_attention_composed)

pytestmark = pytest.mark.interpreter


def inputs(batch=2, n_q=2, n_ctx=5, n_buf=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 2, n_q, 16, generator=g)
    kc, vc = (torch.randn(1, n_ctx, 16, generator=g) for _ in range(2))
    kb, vb = (torch.randn(batch, 1, n_buf, 16, generator=g) for _ in range(2))
    lens = torch.arange(batch, dtype=torch.int32) % (n_buf + 1)
    return q, kc, vc, kb, vb, lens


CALLS = {
    "fused": lambda q, kc, vc, kb, vb, lens: shared_context_attention(q, kc, vc, kb, vb, lens, causal=True),
    "fused-forced": lambda q, kc, vc, kb, vb, lens: shared_context_attention(
        q, kc, vc, kb, vb, lens, num_splits=2, config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_NB": 16}),
    "composed": lambda q, kc, vc, kb, vb, lens: shared_context_attention_composed(q, kc, vc, kb, vb, lens, scale=0.3),
    "context": lambda q, kc, vc, kb, vb, lens: context_attention(q, kc, vc),
    "buffer": lambda q, kc, vc, kb, vb, lens: buffer_attention(q, kb, vb, lens, causal=True),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_fullgraph_compile_matches_eager(name):
    torch._dynamo.reset()
    call = CALLS[name]
    compiled = torch.compile(lambda *x: [2 * t for t in call(*x)], fullgraph=True, dynamic=name == "fused")
    with torch.no_grad():
        for size in ((2, 2, 5, 4), (3, 1, 7, 6)) if name == "fused" else ((2, 2, 5, 4),):  # a second shape: dynamic
            x = inputs(*size)
            got, want = compiled(*x), [2 * t for t in call(*x)]
            assert all(torch.equal(a, b) for a, b in zip(got, want)), name


def test_bad_calls_fail_while_compiling_with_the_eager_message():
    torch._dynamo.reset()
    q, kc, vc, kb, vb, lens = inputs()
    with pytest.raises(Exception, match="causal must be True or False"):
        torch.compile(lambda *x: shared_context_attention(*x, causal="yes"), fullgraph=True)(q, kc, vc, kb, vb, lens)
    with pytest.raises(Exception, match="no backward"):
        torch.compile(lambda q: shared_context_attention(q, kc, vc, kb, vb, lens), fullgraph=True)(
            q.requires_grad_())
