"""The TabPFN-like decode loop end to end on the CPU: every attention backend gives the same numbers
and the same samples, decoding step by step equals teacher forcing, and the cache's edge cases
(first step, empty buffer, full buffer) behave. float64, so backends agree to rounding; the
Triton backends run through the interpreter (small models keep this gate fast)."""
import pytest
import torch

from attnbench.models.tabpfn import BACKENDS, SharedKVCache, TabPFNConfig, TabPFNLike

SMALL = dict(num_features=3, d_model=32, n_heads=2, n_layers=2, d_ff=48, n_components=4)


def data(n_ctx=13, steps=4, features=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_ctx = torch.randn(n_ctx, features, generator=g, dtype=torch.float64)
    y_ctx = torch.randn(n_ctx, generator=g, dtype=torch.float64)
    x_tgt = torch.randn(steps, features, generator=g, dtype=torch.float64)
    return x_ctx, y_ctx, x_tgt


def model(backend="reference", seed=0, **overrides):
    return TabPFNLike(TabPFNConfig(**{**SMALL, **overrides}), seed=seed, backend=backend).double()


def test_defaults_are_the_issues_model():
    m = TabPFNLike()
    assert (m.cfg.d_model, m.cfg.n_heads, m.cfg.n_layers, m.cfg.head_dim) == (128, 4, 12, 32)
    assert len(m.layers) == 12


def test_seeded_weights_and_state_dict_round_trip():
    a, b, c = model(seed=1), model(seed=1), model(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    c.load_state_dict(a.state_dict())
    x_ctx, y_ctx, x_tgt = data()
    assert torch.equal(a.predict(x_ctx, y_ctx, x_tgt).means, c.predict(x_ctx, y_ctx, x_tgt).means)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="backend must be one of"):
        model(backend="flex")


@pytest.mark.parametrize("overrides", [{}, {"d_model": 64, "n_heads": 4, "n_kv_heads": 2}], ids=["mha", "gqa"])
def test_step_by_step_decode_equals_teacher_forcing(overrides):
    m = model(**overrides)
    x_ctx, y_ctx, x_tgt = data(steps=5)
    y, logp = m.sample_sequence(x_ctx, y_ctx, x_tgt, num_samples=3, seed=7, return_log_density=True)
    assert y.shape == (3, 5) and torch.isfinite(y).all()
    assert not torch.equal(y[0], y[1])  # the chains differ
    teacher = m.evaluate_joint_density(x_ctx, y_ctx, x_tgt, y)
    torch.testing.assert_close(teacher, logp, rtol=0, atol=1e-11)


@pytest.mark.interpreter
@pytest.mark.parametrize("overrides", [{}, {"d_model": 64, "n_heads": 4, "n_kv_heads": 2}], ids=["mha", "gqa"])
def test_every_backend_gives_the_same_numbers_and_samples(overrides):
    x_ctx, y_ctx, x_tgt = data(steps=3)
    runs = {}
    for backend in BACKENDS:
        m = model(backend, **overrides)
        y, logp = m.sample_sequence(x_ctx, y_ctx, x_tgt, num_samples=2, seed=11, return_log_density=True)
        runs[backend] = (y, logp, m.evaluate_joint_density(x_ctx, y_ctx, x_tgt, y),
                         m.predict(x_ctx, y_ctx, x_tgt).mean)
    ref = runs["reference"]
    for backend, outs in runs.items():
        for got, want in zip(outs, ref):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-11, msg=backend)


def test_first_step_sees_the_context_only_and_predict_is_it():
    """Step 0 has an empty buffer: its prediction is batched point prediction of the first row."""
    m = model()
    x_ctx, y_ctx, x_tgt = data()
    cache = m.prefill_context(x_ctx, y_ctx, batch_size=2, buffer_capacity=3)
    first = m.decode_step(cache, x_tgt[:1].expand(2, -1))
    assert cache.length == 0
    point = m.predict(x_ctx, y_ctx, x_tgt[:1])
    torch.testing.assert_close(first.means[0], point.means[0], rtol=0, atol=1e-13)


def test_full_buffer_raises_before_writing():
    m = model()
    x_ctx, y_ctx, x_tgt = data()
    cache = m.prefill_context(x_ctx, y_ctx, batch_size=2, buffer_capacity=1)
    xq = x_tgt[:2]
    m.decode_step(cache, xq)
    m.decode_step(cache, xq, xq, torch.zeros(2, dtype=torch.float64))
    assert cache.length == 1
    snapshot = [t.clone() for t in cache.k_buf]
    with pytest.raises(ValueError, match="buffer full: 1 of 1 entries used"):
        m.decode_step(cache, xq, xq, torch.ones(2, dtype=torch.float64))
    assert cache.length == 1 and all(torch.equal(a, b) for a, b in zip(snapshot, cache.k_buf))
    with pytest.raises(ValueError, match="buffer full"):
        m.sample_sequence(x_ctx, y_ctx, x_tgt, num_samples=2, buffer_capacity=1)


def test_single_target_needs_no_buffer():
    m = model()
    x_ctx, y_ctx, x_tgt = data(steps=1)
    y, logp = m.sample_sequence(x_ctx, y_ctx, x_tgt, num_samples=4, seed=0, return_log_density=True)
    torch.testing.assert_close(m.evaluate_joint_density(x_ctx, y_ctx, x_tgt, y), logp, rtol=0, atol=1e-12)


def test_bad_arguments_are_named():
    m = model()
    x_ctx, y_ctx, x_tgt = data()
    with pytest.raises(ValueError, match="x_ctx must be"):
        m.prefill_context(x_ctx[0], y_ctx, 2, 2)
    cache = m.prefill_context(x_ctx, y_ctx, 2, 2)
    with pytest.raises(ValueError, match="x_prev and y_prev"):
        m.decode_step(cache, x_tgt[:2], x_prev=x_tgt[:2])
    with pytest.raises(ValueError, match="x_query must be"):
        m.decode_step(cache, x_tgt[:3])
    with pytest.raises(ValueError, match="x_tgt must be"):
        m.sample_sequence(x_ctx, y_ctx, x_tgt[None].expand(3, -1, -1), num_samples=2)
    with pytest.raises(ValueError, match="must be a multiple"):
        TabPFNConfig(d_model=30, n_heads=4)
    assert isinstance(cache, SharedKVCache) and cache.capacity == 2 and cache.batch == 2
