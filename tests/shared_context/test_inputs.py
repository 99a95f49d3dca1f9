"""Bad input gets a clear error naming the argument, before any shared_context kernel launches."""
import pytest
import torch

import attnbench.shared_context as api
from attnbench.shared_context.spec import check_inputs

APIS = (api.shared_context_attention, api.shared_context_attention_composed)


@pytest.fixture(autouse=True)
def no_kernel_may_run(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a kernel was launched before the inputs were checked")

    for name in ("fused_launch", "composed_launch", "context_launch", "buffer_launch"):
        monkeypatch.setattr(api, name, boom)


def make(b=2, h=4, hkv=2, lq=1, n_ctx=8, n_buf=5, d=16, dtype=torch.float32):
    return dict(q=torch.randn(b, h, lq, d).to(dtype), k_ctx=torch.randn(hkv, n_ctx, d).to(dtype),
                v_ctx=torch.randn(hkv, n_ctx, d).to(dtype), k_buf=torch.randn(b, hkv, n_buf, d).to(dtype),
                v_buf=torch.randn(b, hkv, n_buf, d).to(dtype), buf_lens=torch.tensor([0, n_buf][:b], dtype=torch.int32))


def with_(**changes):
    def build():
        x = make()
        for k, v in changes.items():
            x[k] = v(x) if callable(v) else v
        return x
    return build


def escaped(words):
    return words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")


@pytest.mark.parametrize("build,exc,words", [
    (with_(q=lambda x: x["q"][0]), ValueError, "q must have 4 dimensions"),
    (with_(k_ctx=lambda x: x["k_ctx"][None]), ValueError, "k_ctx must have 3 dimensions"),
    (with_(v_ctx=[1.0]), TypeError, "v_ctx must be a torch.Tensor"),
    # a strided nested tensor failed inside the memo's shape read, PyTorch's internal error
    (with_(k_ctx=lambda x: torch.nested.nested_tensor([x["k_ctx"][0], x["k_ctx"][0, :3]])), TypeError,
     "k_ctx must be a dense tensor, got a nested one"),
    (with_(k_buf=lambda x: x["k_buf"][0]), ValueError, "k_buf must have 4 dimensions"),
    (with_(v_buf=None), ValueError, "k_buf and v_buf must both be tensors or both be None"),
    (with_(q=lambda x: x["q"].to(torch.int32)), TypeError, "q has dtype torch.int32"),
    (with_(v_buf=lambda x: x["v_buf"].half()), TypeError, "must share a dtype"),
    (with_(v_ctx=lambda x: x["v_ctx"][:, :5]), ValueError, "k_ctx and v_ctx must have the same shape"),
    (with_(v_buf=lambda x: x["v_buf"][:, :, :3]), ValueError, "k_buf and v_buf must have the same shape"),
    (with_(k_ctx=lambda x: x["k_ctx"][..., :8], v_ctx=lambda x: x["v_ctx"][..., :8]), ValueError,
     "k_ctx head_dim (8) must equal q head_dim (16)"),
    (with_(k_buf=lambda x: x["k_buf"][:1], v_buf=lambda x: x["v_buf"][:1]), ValueError,
     "k_buf batch (1) must equal q batch (2)"),
    (with_(k_buf=lambda x: x["k_buf"][:, :1], v_buf=lambda x: x["v_buf"][:, :1]), ValueError,
     "k_buf heads (1) must equal k_ctx heads (2)"),
    (with_(k_buf=lambda x: x["k_buf"][..., :8], v_buf=lambda x: x["v_buf"][..., :8]), ValueError,
     "k_buf head_dim (8) must equal q head_dim (16)"),
    (with_(q=lambda x: torch.randn(2, 3, 1, 16)), ValueError, "q heads (3) must be a multiple of k_ctx heads (2)"),
    (lambda: make(d=8), ValueError, "head_dim 8 is unsupported"),
    (lambda: make(d=264), ValueError, "head_dim 264 is unsupported"),
    (lambda: make(lq=0), ValueError, "empty input"),
    (lambda: make(n_ctx=0, n_buf=0), ValueError, "no keys"),
    (with_(buf_lens=[1, 2]), TypeError, "buf_lens must be a torch.Tensor"),
    (with_(buf_lens=lambda x: x["buf_lens"].float()), TypeError, "buf_lens has dtype torch.float32"),
    (with_(buf_lens=lambda x: x["buf_lens"][:1]), ValueError, "buf_lens must have shape (2,)"),
    (with_(buf_lens=torch.tensor([0, 6], dtype=torch.int32)), ValueError, "buf_lens must lie in [0, n_buf = 5]"),
    (with_(buf_lens=torch.tensor([-1, 2])), ValueError, "buf_lens must lie in [0, n_buf = 5]"),
    (with_(buf_lens=lambda x: x["buf_lens"].to("meta")), ValueError, "buf_lens must be on cpu"),
    (with_(k_ctx=lambda x: x["k_ctx"].to("meta")), ValueError, "must be on one device"),
])
def test_bad_inputs_are_rejected_by_name(build, exc, words):
    for fn in APIS:
        x = build()
        with pytest.raises(exc, match=escaped(words)):
            fn(x["q"], x["k_ctx"], x["v_ctx"], x["k_buf"], x["v_buf"], x["buf_lens"])


@pytest.mark.parametrize("causal", [1, None, "bottom_right", "yes"])
def test_causal_must_be_a_bool(causal):
    x = make()
    for fn in APIS:
        with pytest.raises(TypeError, match="causal must be True or False"):
            fn(*x.values(), causal=causal)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "0.1", True, 1e39, 1e-50])
def test_bad_scale_is_rejected(scale):
    x = make()
    for fn in APIS:
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            fn(*x.values(), scale=scale)


@pytest.mark.parametrize("splits", [0, -1, 1.5, True, "2"])
def test_bad_split_count_is_rejected(splits):
    x = make()
    for fn in APIS:
        with pytest.raises(ValueError, match="num_splits must be a positive int"):
            fn(*x.values(), num_splits=splits)


def test_inputs_that_require_grad_are_refused_not_detached():
    x = make()
    x["q"].requires_grad_()
    for fn in APIS:
        with pytest.raises(RuntimeError, match="no backward"):
            fn(*x.values())


def _every_entry_point(x):
    """(name, call) for each public function on the inputs ``x`` (context_attention without the buffer,
    buffer_attention without the context)."""
    return [(fn.__name__, lambda fn=fn: fn(*x.values())) for fn in APIS] + [
        ("context_attention", lambda: api.context_attention(x["q"], x["k_ctx"], x["v_ctx"])),
        ("buffer_attention", lambda: api.buffer_attention(x["q"], x["k_buf"], x["v_buf"], x["buf_lens"]))]


@pytest.mark.parametrize("arg", ["q", "k_ctx", "v_ctx", "k_buf", "v_buf"])
@pytest.mark.parametrize("value", [[1.0, 2.0], 3], ids=["list", "int"])
def test_a_non_tensor_argument_is_a_type_error_naming_it(arg, value):
    """A list for q had raised AttributeError ('list' object has no attribute 'dtype'): q.dtype was read
    before the checks."""
    x = make()
    x[arg] = value
    for name, call in _every_entry_point(x):
        if (name, arg) in {("context_attention", "k_buf"), ("context_attention", "v_buf"),
                           ("buffer_attention", "k_ctx"), ("buffer_attention", "v_ctx")}:
            continue  # not an argument of that function
        with pytest.raises(TypeError, match=f"^{arg} must be a torch.Tensor, got {type(value).__name__}"):
            call()


def test_derivatives_are_refused_not_dropped():
    """The kernels have no derivatives: a forward-AD tangent had been dropped silently (the output came back
    without one), and torch.func transforms failed inside the launch ("Cannot access data pointer")."""
    import torch.autograd.forward_ad as fwAD

    x = make()
    with fwAD.dual_level():
        dual = dict(x, q=fwAD.make_dual(x["q"], torch.randn_like(x["q"])))
        for name, call in _every_entry_point(dual):
            with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
                call()
    transforms = {"grad": lambda f: torch.func.grad(lambda q: f(q).sum()),
                  "jvp": lambda f: lambda q: torch.func.jvp(f, (q,), (q,)),
                  "vmap": lambda f: lambda q: torch.func.vmap(f)(q.expand(2, *q.shape))}
    for transform in transforms.values():
        for index in range(4):
            def f(q, index=index):
                return _every_entry_point(dict(x, q=q))[index][1]()[0]
            with pytest.raises(NotImplementedError, match="torch.func transforms"):
                transform(f)(x["q"])


def test_cpu_tensors_without_interpreter_are_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for fn in APIS:
        with pytest.raises(ValueError, match="need CUDA tensors"):
            fn(*make().values())


def test_primitives_check_their_inputs_too():
    x = make()
    with pytest.raises(ValueError, match="q heads"):
        api.context_attention(torch.randn(2, 3, 1, 16), x["k_ctx"], x["v_ctx"])
    with pytest.raises(ValueError, match="buf_lens must lie"):
        api.buffer_attention(x["q"], x["k_buf"], x["v_buf"], torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="no keys"):
        api.buffer_attention(x["q"], x["k_buf"][:, :, :0], x["v_buf"][:, :, :0])


def test_length_range_check_can_be_skipped_for_the_hot_path():
    """check_lengths=False skips the (GPU-syncing) value check; dtype and shape are still checked."""
    x = make()
    x["buf_lens"] = torch.tensor([0, 99], dtype=torch.int32)
    shapes = check_inputs(*x.values(), check_lengths=False)
    assert shapes.n_buf == 5
    with pytest.raises(TypeError, match="buf_lens has dtype"):
        check_inputs(*list(x.values())[:5], x["buf_lens"].float(), check_lengths=False)


def test_fp64_beyond_head_dim_128_is_declined_on_cuda():
    assert api.unsupported_on_cuda(torch.float64, 256) is not None
    assert api.unsupported_on_cuda(torch.float64, 128) is None
    assert api.unsupported_on_cuda(torch.bfloat16, 256) is None


def test_huge_row_strides_are_copied_not_overflowed():
    view = torch.empty(0, device="meta", dtype=torch.float16).as_strided((2, 17, 16), (0, 2**27, 1))
    assert api._unit_stride("k_ctx", view).stride() == (272, 16, 1)
    small = torch.empty(2, 8, 16)
    assert api._unit_stride("k_ctx", small) is small
    with pytest.raises(ValueError, match="k_buf: .* exceeds 2\\*\\*31 - 1"):
        api._unit_stride("k_buf", torch.empty(0, device="meta").as_strided((1, 1, 2**27, 32), (0, 0, 32, 1)))
