"""A small TabPFN-like transformer whose KV cache is split into a shared context and per-sample buffers.

Tokens are table rows. Context rows (x, y) attend to each other (bidirectional) once, in
``prefill_context``; their keys and values per layer form the *shared* part of the cache,
[Hkv, Nctx, Dh], one copy for the whole batch. B samples (parallel chains of joint sampling)
then predict target rows one at a time. Two kinds of tokens, as in AR-TabPFN:

- a *buffer* token is a completed target row (x_t, y_t) plus a learned position embedding; it
  attends to the context and to the earlier buffer tokens and itself (causal), and its keys and
  values are appended to the sample's buffer;
- a *query* token is a target row with its y unknown (x_t plus a learned target embedding); it
  attends to the context and to every completed buffer token, never to itself, and is not stored.

A decode step therefore runs Lq = 2 tokens per sample, [buffer token of step t-1, query token of
step t], which both see exactly the buffer (the new entry included): shared_context attention with
no causal mask. The first step runs the query alone (Lq = 1, empty buffer); batched point
prediction is the same with one query per test row. Teacher forcing (``evaluate_joint_density``)
runs all T buffer tokens (causal in the buffer) and all T query tokens (causal with the buffer cut
to T - 1, so query t sees buffer tokens < t) in one pass per layer; it gives the same numbers as the
step-by-step decode. The head is a Gaussian mixture over y.

The attention backend is switchable: ``reference`` (today's per-batch cache: the context copied to
every sample and concatenated with its buffer), ``split`` (the seed's PyTorch), ``triton`` (the
fused kernel) and ``triton_composed``; they give the same numbers and, for the same seed, the same
samples. Inference only: every public method runs under ``torch.no_grad()``.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import require_tensor


def _reference(q, k_ctx, v_ctx, k_buf, v_buf, causal, scale):
    from ..shared_context import reference

    return reference.attention(q, k_ctx, v_ctx, k_buf, v_buf, None, causal, scale)[0]


def _split(q, k_ctx, v_ctx, k_buf, v_buf, causal, scale):
    from ..shared_context import split

    return split.shared_context_fwd(q, k_ctx, v_ctx, k_buf, v_buf, None, causal, scale)[0]


def _triton(q, k_ctx, v_ctx, k_buf, v_buf, causal, scale):
    from ..shared_context import shared_context_attention

    return shared_context_attention(q, k_ctx, v_ctx, k_buf, v_buf, causal=causal, scale=scale)[0]


def _triton_composed(q, k_ctx, v_ctx, k_buf, v_buf, causal, scale):
    from ..shared_context import shared_context_attention_composed

    return shared_context_attention_composed(q, k_ctx, v_ctx, k_buf, v_buf, causal=causal, scale=scale)[0]


# (q [B, H, Lq, Dh], k_ctx/v_ctx [Hkv, Nctx, Dh], k_buf/v_buf [B, Hkv, n, Dh], causal, scale) -> o
BACKENDS = {"reference": _reference, "split": _split, "triton": _triton, "triton_composed": _triton_composed}


@dataclass(frozen=True)
class TabPFNConfig:
    num_features: int = 8
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: n_heads (no GQA)
    n_layers: int = 12
    d_ff: int = 256
    n_components: int = 8  # Gaussian mixture components of the head
    max_positions: int = 512  # buffer position embeddings; positions past it reuse them cyclically

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def __post_init__(self):
        for name in ("num_features", "d_model", "n_heads", "n_layers", "d_ff", "n_components", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_kv_heads is not None and (isinstance(self.n_kv_heads, bool) or not isinstance(self.n_kv_heads, int)
                                            or self.n_kv_heads < 1):
            raise ValueError(f"n_kv_heads must be a positive int or None, got {self.n_kv_heads!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.kv_heads})")


@dataclass
class SharedKVCache:
    """Per layer: the context's keys/values [Hkv, Nctx, Dh] (shared) and each sample's buffer
    [B, Hkv, capacity, Dh]; ``length`` entries of every buffer are valid (samples decode in step)."""

    k_ctx: list
    v_ctx: list
    k_buf: list
    v_buf: list
    length: int = 0
    pending: int = field(default=0, repr=False)  # entries written this step, committed by advance()

    @property
    def batch(self) -> int:
        return self.k_buf[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k_buf[0].shape[2]

    def reserve(self, n: int):
        """Check that n more entries fit, before anything is written."""
        if self.length + n > self.capacity:
            raise ValueError(f"buffer full: {self.length} of {self.capacity} entries used, {n} more asked for; "
                             "prefill with a larger buffer_capacity (entries are never overwritten)")
        self.pending = n

    def write(self, layer: int, k, v):
        """Store this step's entries ([B, Hkv, n, Dh]) after the valid ones."""
        n = k.shape[2]
        if n != self.pending:
            raise ValueError(f"writing {n} entries, {self.pending} reserved")
        self.k_buf[layer][:, :, self.length:self.length + n] = k
        self.v_buf[layer][:, :, self.length:self.length + n] = v

    def buffer(self, layer: int):
        """The valid entries, this step's pending ones included, as views."""
        end = self.length + self.pending
        return self.k_buf[layer][:, :, :end], self.v_buf[layer][:, :, :end]

    def advance(self):
        self.length += self.pending
        self.pending = 0


@dataclass
class Mixture:
    """A Gaussian mixture over y per row: logits, means and log scales, each [..., K]."""

    logits: torch.Tensor
    means: torch.Tensor
    log_scales: torch.Tensor

    @property
    def mean(self):
        return (torch.softmax(self.logits, dim=-1) * self.means).sum(dim=-1)

    def log_density(self, y):
        require_tensor("y", y)
        log_w = torch.log_softmax(self.logits, dim=-1)
        z = (y.unsqueeze(-1) - self.means) * torch.exp(-self.log_scales)
        log_normal = -0.5 * z * z - self.log_scales - 0.5 * math.log(2 * math.pi)
        return torch.logsumexp(log_w + log_normal, dim=-1)

    def sample(self, u, z):
        """Inverse-CDF pick of a component with uniforms u, then mean + scale * z (standard normals)."""
        require_tensor("u", u)
        require_tensor("z", z)
        cdf = torch.cumsum(torch.softmax(self.logits, dim=-1), dim=-1)
        comp = torch.searchsorted(cdf, u.unsqueeze(-1).to(cdf.dtype)).clamp(max=cdf.shape[-1] - 1)
        mean = self.means.gather(-1, comp).squeeze(-1)
        scale = torch.exp(self.log_scales.gather(-1, comp).squeeze(-1))
        return mean + scale * z.to(mean.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: TabPFNConfig):
        super().__init__()
        self.cfg = cfg
        d, dh = cfg.d_model, cfg.head_dim
        self.norm1 = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, cfg.n_heads * dh)
        self.k_proj = nn.Linear(d, cfg.kv_heads * dh)
        self.v_proj = nn.Linear(d, cfg.kv_heads * dh)
        self.out_proj = nn.Linear(cfg.n_heads * dh, d)
        self.norm2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, d))

    def qkv(self, h):
        """[B, L, d] -> q [B, H, L, Dh] and k, v [B, Hkv, L, Dh] (views of [B, L, H, Dh])."""
        b, n, _ = h.shape
        x = self.norm1(h)
        dh = self.cfg.head_dim
        q = self.q_proj(x).view(b, n, self.cfg.n_heads, dh).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.cfg.kv_heads, dh).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.cfg.kv_heads, dh).transpose(1, 2)
        return q, k, v

    def finish(self, h, o):
        """Residual attention output o [B, H, L, Dh], then the feed-forward block."""
        b, _, n, _ = o.shape
        h = h + self.out_proj(o.transpose(1, 2).reshape(b, n, -1))
        return h + self.ff(self.norm2(h))


class TabPFNLike(nn.Module):
    def __init__(self, config: TabPFNConfig | None = None, *, seed: int = 0, backend: str = "reference", **overrides):
        super().__init__()
        if config is not None and not isinstance(config, TabPFNConfig):
            raise TypeError(f"config must be a TabPFNConfig or None, got {type(config).__name__}")
        if config is not None and overrides:
            raise ValueError("pass either a config or keyword overrides, not both")
        cfg = config or TabPFNConfig(**overrides)
        self.cfg = cfg
        d = cfg.d_model
        self.embed_x = nn.Linear(cfg.num_features, d)
        self.embed_y = nn.Linear(1, d)
        self.target_token = nn.Parameter(torch.zeros(d))
        self.positions = nn.Parameter(torch.zeros(cfg.max_positions, d))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3 * cfg.n_components)
        self.backend = backend
        self.reset_parameters(seed)

    # ------------------------------------------------------------ set-up

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str):
        if name not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
        self._backend = name

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0):
        """Seeded random weights (drawn on the CPU, so a seed gives one model everywhere)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                values = torch.zeros(p.shape)
            elif ".norm" in name or name.startswith("norm"):
                values = torch.ones(p.shape)
            elif p.dim() == 2 and name.endswith("weight"):
                values = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
            else:  # target token, position embeddings
                values = 0.5 * torch.randn(p.shape, generator=gen)
            p.copy_(values.to(p.dtype))

    def _attend(self, q, k_ctx, v_ctx, k_buf, v_buf, causal):
        return BACKENDS[self.backend](q, k_ctx, v_ctx, k_buf, v_buf, causal, 1.0 / math.sqrt(self.cfg.head_dim))

    def _rows(self, x, y=None):
        x = x.to(self.embed_x.weight.dtype)
        h = self.embed_x(x)
        if y is None:
            return h + self.target_token
        return h + self.embed_y(y.to(h.dtype).unsqueeze(-1))

    def _head(self, h) -> Mixture:
        out = self.head(self.norm(h))
        logits, means, log_scales = out.chunk(3, dim=-1)
        return Mixture(logits, means, log_scales.clamp(-7.0, 7.0))

    # ------------------------------------------------------------ the KV cache

    @torch.no_grad()
    def prefill_context(self, x_ctx, y_ctx, batch_size: int, buffer_capacity: int) -> SharedKVCache:
        """Encode the context rows once (x [Nctx, F], y [Nctx]) and allocate B buffers of
        ``buffer_capacity`` entries per layer."""
        require_tensor("x_ctx", x_ctx)
        require_tensor("y_ctx", y_ctx)
        if x_ctx.dim() != 2 or y_ctx.shape != x_ctx.shape[:1]:
            raise ValueError(f"x_ctx must be [Nctx, F] and y_ctx [Nctx]; got {tuple(x_ctx.shape)} and "
                             f"{tuple(y_ctx.shape)}")
        if batch_size < 1 or buffer_capacity < 0:
            raise ValueError(f"batch_size must be >= 1 and buffer_capacity >= 0; got {batch_size}, {buffer_capacity}")
        cfg = self.cfg
        h = self._rows(x_ctx, y_ctx).unsqueeze(0)  # [1, Nctx, d]
        dtype, device = h.dtype, h.device
        k_ctx, v_ctx, k_buf, v_buf = [], [], [], []
        for layer in self.layers:
            q, k, v = layer.qkv(h)
            k_ctx.append(k[0].contiguous())
            v_ctx.append(v[0].contiguous())
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=cfg.kv_heads != cfg.n_heads)
            h = layer.finish(h, o)
            shape = (batch_size, cfg.kv_heads, buffer_capacity, cfg.head_dim)
            k_buf.append(torch.zeros(shape, dtype=dtype, device=device))
            v_buf.append(torch.zeros(shape, dtype=dtype, device=device))
        return SharedKVCache(k_ctx, v_ctx, k_buf, v_buf)

    @torch.no_grad()
    def decode_step(self, cache: SharedKVCache, x_query, x_prev=None, y_prev=None) -> Mixture:
        """One step for every sample: append the completed row (x_prev [B, F], y_prev [B]) to the
        buffers (unless None: the first step), then predict y for x_query [B, F]."""
        if not isinstance(cache, SharedKVCache):
            raise TypeError(f"cache must be a SharedKVCache (prefill_context), got {type(cache).__name__}")
        require_tensor("x_query", x_query)
        if (x_prev is None) != (y_prev is None):
            raise ValueError("x_prev and y_prev must be given together (or both None on the first step)")
        if x_prev is not None:
            require_tensor("x_prev", x_prev)
            require_tensor("y_prev", y_prev)
        if x_query.dim() != 2 or x_query.shape[0] != cache.batch:
            raise ValueError(f"x_query must be [B = {cache.batch}, F]; got {tuple(x_query.shape)}")
        query = self._rows(x_query).unsqueeze(1)  # [B, 1, d]
        if x_prev is None:
            h, n_new = query, 0
        else:
            position = self.positions[cache.length % self.cfg.max_positions]
            h, n_new = torch.cat([(self._rows(x_prev, y_prev) + position).unsqueeze(1), query], dim=1), 1
        cache.reserve(n_new)  # a full buffer raises here, before anything is written
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h)
            if n_new:
                cache.write(i, k[:, :, :n_new], v[:, :, :n_new])
            k_buf, v_buf = cache.buffer(i)
            # both tokens see the whole buffer (the new entry included), the query never itself
            o = self._attend(q, cache.k_ctx[i], cache.v_ctx[i], k_buf, v_buf, causal=False)
            h = layer.finish(h, o)
        cache.advance()
        return self._head(h[:, -1])

    # ------------------------------------------------------------ the three uses

    @torch.no_grad()
    def predict(self, x_ctx, y_ctx, x_test) -> Mixture:
        """Batched point prediction: every test row x_test [N, F] against the context alone."""
        require_tensor("x_test", x_test)
        cache = self.prefill_context(x_ctx, y_ctx, x_test.shape[0], 0)
        return self.decode_step(cache, x_test)

    def _targets(self, x_tgt, batch):
        require_tensor("x_tgt", x_tgt)
        if x_tgt.dim() == 2:
            x_tgt = x_tgt.unsqueeze(0).expand(batch, *x_tgt.shape)
        if x_tgt.dim() != 3 or x_tgt.shape[0] != batch:
            raise ValueError(f"x_tgt must be [T, F] or [B = {batch}, T, F]; got {tuple(x_tgt.shape)}")
        return x_tgt

    @torch.no_grad()
    def sample_sequence(self, x_ctx, y_ctx, x_tgt, num_samples: int, seed: int = 0, return_log_density=False,
                        buffer_capacity: int | None = None):
        """Joint samples y [B, T] for the target rows x_tgt ([T, F] shared, or [B, T, F]), drawn
        autoregressively; the noise comes from a CPU generator seeded with ``seed``, so every
        backend (and device) draws the same numbers. With ``return_log_density`` also the
        per-target log densities [B, T] of the drawn values."""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        x_tgt = self._targets(x_tgt, num_samples)
        steps = x_tgt.shape[1]
        capacity = max(steps - 1, 0) if buffer_capacity is None else buffer_capacity
        cache = self.prefill_context(x_ctx, y_ctx, num_samples, capacity)
        gen = torch.Generator().manual_seed(seed)
        ys, logps = [], []
        x_prev = y_prev = None
        for t in range(steps):
            mix = self.decode_step(cache, x_tgt[:, t], x_prev, y_prev)
            u = torch.rand(num_samples, generator=gen, dtype=torch.float64).to(x_tgt.device)
            z = torch.randn(num_samples, generator=gen, dtype=torch.float64).to(x_tgt.device)
            y = mix.sample(u, z)
            ys.append(y)
            logps.append(mix.log_density(y))
            x_prev, y_prev = x_tgt[:, t], y
        y = torch.stack(ys, dim=1)
        return (y, torch.stack(logps, dim=1)) if return_log_density else y

    @torch.no_grad()
    def evaluate_joint_density(self, x_ctx, y_ctx, x_tgt, y_tgt):
        """Teacher-forced per-target log densities [B, T] of y_tgt [B, T] (their sum is the joint
        log density), in one pass per layer over all T buffer and T query tokens."""
        require_tensor("y_tgt", y_tgt)
        if y_tgt.dim() != 2:
            raise ValueError(f"y_tgt must be [B, T]; got {tuple(y_tgt.shape)}")
        batch, steps = y_tgt.shape
        x_tgt = self._targets(x_tgt, batch)
        cache = self.prefill_context(x_ctx, y_ctx, batch, 0)
        pos = self.positions[torch.arange(steps, device=x_tgt.device) % self.cfg.max_positions]
        h_buf = self._rows(x_tgt, y_tgt) + pos  # [B, T, d]
        h_query = self._rows(x_tgt)
        for i, layer in enumerate(self.layers):
            q_b, k_b, v_b = layer.qkv(h_buf)
            q_q, _, _ = layer.qkv(h_query)
            # buffer token t sees buffer tokens <= t; query token t sees buffer tokens < t, i.e. the
            # buffer cut to T - 1 entries with the same bottom-right causal alignment
            o_b = self._attend(q_b, cache.k_ctx[i], cache.v_ctx[i], k_b, v_b, causal=True)
            o_q = self._attend(q_q, cache.k_ctx[i], cache.v_ctx[i], k_b[:, :, :steps - 1], v_b[:, :, :steps - 1],
                               causal=True)
            h_buf = layer.finish(h_buf, o_b)
            h_query = layer.finish(h_query, o_q)
        return self._head(h_query).log_density(y_tgt.to(h_query.dtype))
