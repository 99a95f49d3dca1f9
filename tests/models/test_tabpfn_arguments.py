"""The TabPFN model names a bad argument (each method had read an attribute of a list first)."""
import pytest
import torch

from attnbench.models.tabpfn import Mixture, TabPFNConfig, TabPFNLike


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_tabpfn_model_names_a_bad_argument():
    """Each public method had read .dim() or .shape of a list (AttributeError); a config of zero
    heads had divided by zero."""
    model = TabPFNLike(num_features=3, d_model=16, n_heads=2, n_layers=1, d_ff=16, n_components=2)
    x_ctx, y_ctx, x_test = torch.randn(5, 3), torch.randn(5), torch.randn(2, 3)
    for call, name in [(lambda: model.predict([1.0], y_ctx, x_test), "x_ctx"),
                       (lambda: model.predict(x_ctx, [1.0], x_test), "y_ctx"),
                       (lambda: model.predict(x_ctx, y_ctx, [1.0]), "x_test"),
                       (lambda: model.sample_sequence(x_ctx, y_ctx, [1.0], 2), "x_tgt"),
                       (lambda: model.evaluate_joint_density(x_ctx, y_ctx, x_test, [1.0]), "y_tgt"),
                       (lambda: model.decode_step(model.prefill_context(x_ctx, y_ctx, 2, 1), [1.0]), "x_query"),
                       (lambda: model.decode_step("cache", x_test), "cache"),
                       (lambda: Mixture(*torch.randn(3, 2, 2)).log_density([0.0]), "y")]:
        with pytest.raises(TypeError, match=f"^{name} must be a"):
            call()
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        TabPFNConfig(n_heads=0)
    with pytest.raises(TypeError, match="config must be a TabPFNConfig"):
        TabPFNLike({"d_model": 32})
    with pytest.raises(ValueError, match="num_samples"):
        model.sample_sequence(x_ctx, y_ctx, x_test, 0)

