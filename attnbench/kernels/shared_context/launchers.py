"""The launchers: grids, outputs and scratch, autotuned launches and the plans that repeat them.

``fused_launch`` (the shipped path), ``context_launch`` and ``buffer_launch`` (the halves alone)
and ``composed_launch`` (the halves and a merge). A call signature seen before launches from its
plan (attnbench/kernels/launch.py); a new one picks its split count (split_count.py) and tile
config first.
"""
import functools
import types

import torch

from ..launch import LaunchPlan, forget_plans, on_device, plan, remember, tensor_signature
from ..merge_states import merge_stack_launch, merge_two_launch
from ..outputs import new_output
from ..precision import STATE_LSE_DTYPE, accumulator_dtype, dot_precision, lse_dtype, split_scale
from ..tuning import autotune_enabled, cdiv, next_pow2, seq_bucket
from .buffer_phase import buffer_steps
from .kernels import BUFFER, CONTEXT, FUSED, _head_dim_class, _tune_key
from .scratch import _capturing, _kept_scratch, _new_scratch, _state_dtype, forget_kept_scratch
from .split_count import _split_count, forget_split_picks


def _sizes(q, heads_kv):
    batch, heads_q, n_q, head_dim = q.shape
    group = heads_q // heads_kv
    return batch, heads_q, n_q, head_dim, group, batch * group * n_q


@functools.lru_cache(maxsize=256)
def _constexprs(dtype, device_type, head_dim, causal, full_lens, rows_per_sample, n_buf):
    """The kernels' compile-time flags for one call signature (read-only; cached, being host time
    paid on every decode step)."""
    block_r, rows_pad, samples, keys = buffer_steps(rows_per_sample, n_buf, head_dim, dtype.itemsize, device_type)
    return types.MappingProxyType(dict(
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)), CAUSAL=bool(causal), FULL_LENS=full_lens,
        ACC_DTYPE=accumulator_dtype(dtype), DOT_PRECISION=dot_precision(dtype), BLOCK_R=block_r, ROWS_PAD=rows_pad,
        SAMPLES=samples, KEYS=keys))


def _common(q, head_dim, causal, full_lens, rows_per_sample, n_buf):
    return _constexprs(q.dtype, q.device.type, head_dim, causal, full_lens, rows_per_sample, n_buf)


def _launch(kernel, grid, args, constexprs, config):
    """Autotuned launch, or one explicit configuration (a dict with BLOCK_M, BLOCK_N, BLOCK_NB,
    num_warps, num_stages) for tuning studies. Returns what a LaunchPlan needs to repeat it:
    (JIT function, compiled kernel or None, grid, keyword arguments)."""
    if config is None:
        compiled = kernel[grid](*args, **constexprs)
        chosen = kernel.best_config
        return kernel.fn, compiled, grid(chosen.kwargs), {**constexprs, **chosen.all_kwargs()}
    config = dict(config)
    launch = dict(num_warps=config.pop("num_warps", 4), num_stages=config.pop("num_stages", 2))
    names = kernel.fn.arg_names
    takes = [n for n in ("BLOCK_M", "BLOCK_N", "BLOCK_NB") if n in names and n not in constexprs]
    if missing := [n for n in takes if n not in config]:
        raise ValueError(f"config for {kernel.fn.__name__} lacks {', '.join(missing)} (it takes {', '.join(takes)})")
    config = {k: v for k, v in config.items() if k in names}  # e.g. BLOCK_N means nothing to the buffer kernel
    kwargs = {**constexprs, **config, **launch}
    return kernel.fn, kernel.fn[grid](*args, **kwargs), grid(kwargs), kwargs


def _repeatable(made, n_tensors, scalars):
    """A LaunchPlan repeating the launch ``_launch`` made; the split-count candidates are timed
    through it, so that their launches cost little host time and the pick compares kernels, not
    launch paths (time_ms keeps host time out of the samples as well:
    docs/measurements/shared_context.md)."""
    fn, compiled, grid, kwargs = made
    return LaunchPlan(fn, compiled, grid, n_tensors, scalars, kwargs)


def _plan_key(kind, q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, *scalars):
    """A launch plan's key (attnbench/kernels/launch.py): every tensor's signature and the call's scalars;
    None (no plan) under autotuning studies' explicit configs, which the callers pass as a scalar."""
    return (kind, tensor_signature(q), tensor_signature(k_ctx), tensor_signature(v_ctx), tensor_signature(k_buf),
            tensor_signature(v_buf), tensor_signature(buf_lens), autotune_enabled(), *scalars)


def _fused_tensors(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, splits, out_dtype, scratch=None):
    """The fused kernel's 13 pointer arguments: the inputs (q as the stand-in for an absent part),
    fresh outputs, and the scratch of ``_new_scratch`` (``scratch``: kept from an earlier call)."""
    batch, heads_q, n_q, _ = q.shape
    n_ctx, n_buf = k_ctx.shape[1], 0 if k_buf is None else k_buf.shape[2]
    o = new_output(q.shape, out_dtype, q.device)
    lse = new_output((batch, heads_q, n_q), lse_dtype(q.dtype), q.device)
    if scratch is None:
        scratch = _new_scratch(q, k_ctx.shape[0], n_buf, splits, (o, lse))
    return (q, k_ctx if n_ctx else q, v_ctx if n_ctx else q, k_buf if n_buf else q, v_buf if n_buf else q,
            buf_lens if n_buf and buf_lens is not None else q, o, lse, *scratch)


def fused_launch(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, sm_scale, *, num_splits=None, config=None,
                 out_dtype=None, signature=None):
    """Buffer, context and merge in one launch on checked inputs. Returns (o, lse). ``signature``:
    the caller's key for the tensors as it was given them, when what it passes here is a function
    of it (saves recomputing it on the hot path)."""
    out_dtype = out_dtype or q.dtype
    if config is not None:
        key = None
    elif signature is not None:
        key = ("fused", signature, autotune_enabled(), causal, sm_scale, num_splits, out_dtype)
    else:
        key = _plan_key("fused", q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, sm_scale, num_splits, out_dtype)
    if key is not None and (known := plan(key)) is not None:  # the decode loop's every call after the first
        splits, launch_plan, kept = known
        with on_device(q):
            scratch = _kept_scratch(kept, q, k_ctx.shape[0], 0 if k_buf is None else k_buf.shape[2], splits)
            tensors = _fused_tensors(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, splits, out_dtype, scratch)
            launch_plan(tensors)
        return tensors[6], tensors[7]
    heads_kv, n_ctx = k_ctx.shape[0], k_ctx.shape[1]
    batch, heads_q, n_q, head_dim, group, rows = _sizes(q, heads_kv)
    n_buf = 0 if k_buf is None else k_buf.shape[2]
    full = n_buf == 0 or buf_lens is None
    common = _common(q, head_dim, causal, full, group * n_q, n_buf)
    tune_key = _tune_key(rows, n_ctx, n_buf, common, config)

    def runner(splits, plan_key=None):
        """Fresh outputs for this split count, and the launch that writes them (and, given a
        plan_key, remembers how)."""
        tensors = _fused_tensors(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, splits, out_dtype)
        _, kc, vc, kb, vb, _, o, lse, wb_o, wb_l, ws_o, ws_l, _ = tensors
        merge = splits > 1
        scalars = (*q.stride()[:3], *(kc.stride()[:2] if n_ctx else (0, 0)), *(vc.stride()[:2] if n_ctx else (0, 0)),
                   *(kb.stride()[:3] if n_buf else (0, 0, 0)), *(vb.stride()[:3] if n_buf else (0, 0, 0)),
                   *o.stride()[:3], *lse.stride(), *(wb_o.stride()[:3] if n_buf else (0, 0, 0)),
                   *(wb_l.stride() if n_buf else (0, 0, 0)), *(ws_o.stride()[:4] if merge else (0, 0, 0, 0)),
                   *(ws_l.stride() if merge else (0, 0, 0, 0)), rows, group * n_q, n_q, group, n_ctx, n_buf, splits,
                   *split_scale(sm_scale), seq_bucket(rows), seq_bucket(n_ctx), seq_bucket(n_buf))
        constexprs = dict(common, HAS_CONTEXT=n_ctx > 0, HAS_BUFFER=n_buf > 0, IN_KERNEL_MERGE=merge)
        made = []

        def launch():
            # Every launch runs to completion, so its last arrivals leave the merge tickets at zero.
            with on_device(q):
                if made:  # a timed repeat: the plan's launch (see _repeatable)
                    made[0](tensors)
                    return o, lse
                made.append(_repeatable(_launch(FUSED[_head_dim_class(head_dim)],
                                                lambda meta: (cdiv(rows, meta["BLOCK_M"]), splits, heads_kv),
                                                (*tensors, *scalars), constexprs, config), len(tensors), scalars))
            if plan_key is not None:
                remember(plan_key, (splits, made[0], {}))
            return o, lse

        return launch

    splits = _split_count("fused", num_splits, rows, heads_kv, n_ctx + n_buf, q, tune_key, runner)
    return runner(splits, _plannable(key, q))()  # the caller's own outputs, untouched by any timing run


def _plannable(key, q):
    """``key`` when a plan may be made now: not while a CUDA graph is being captured or
    torch.compile traces (a split count picked there is provisional: nothing could be timed)."""
    if key is None or torch.compiler.is_compiling():
        return None
    with on_device(q):
        return None if _capturing(q.device) else key


def context_launch(q, k_ctx, v_ctx, sm_scale, *, num_splits=None, config=None, out_dtype=None, as_state=False):
    """Attention of every sample's queries over the shared context alone. Returns (o, lse); with
    several splits the partial states are reduced by ``merge_stack_launch`` (a second launch).
    ``as_state``: a half to be merged, its LSE in precision.STATE_LSE_DTYPE."""
    out_dtype = out_dtype or q.dtype
    out_lse_dtype = STATE_LSE_DTYPE if as_state else lse_dtype(q.dtype)
    key = None if config is not None else _plan_key("context", q, k_ctx, v_ctx, None, None, None, sm_scale,
                                                    num_splits, out_dtype, as_state)
    heads_kv, n_ctx = k_ctx.shape[0], k_ctx.shape[1]
    batch, heads_q, n_q, head_dim, group, rows = _sizes(q, heads_kv)

    def partials(splits):
        part_dtype = _state_dtype(q) if splits > 1 else out_dtype
        part_lse_dtype = STATE_LSE_DTYPE if splits > 1 else out_lse_dtype
        return (q, k_ctx, v_ctx, new_output((splits, batch, heads_q, n_q, head_dim), part_dtype, q.device),
                new_output((splits, batch, heads_q, n_q), part_lse_dtype, q.device))

    def reduced(splits, o, lse):
        return (merge_stack_launch(o, lse, out_dtype, out_lse_dtype=out_lse_dtype, state_lse=True) if splits > 1
                else (o[0], lse[0]))

    if key is not None and (known := plan(key)) is not None:
        splits, launch_plan = known
        tensors = partials(splits)
        with on_device(q):
            launch_plan(tensors)
            return reduced(splits, *tensors[3:])
    common = _common(q, head_dim, False, True, group * n_q, 0)
    tune_key = _tune_key(rows, n_ctx, 0, common, config)

    def runner(splits, plan_key=None):
        """Fresh partial states for this split count, and the launches (kernel, then the
        reduction) that write them and return (o, lse)."""
        tensors = partials(splits)
        o, lse = tensors[3:]
        scalars = (*q.stride()[:3], *k_ctx.stride()[:2], *v_ctx.stride()[:2], *o.stride()[:4], *lse.stride(), rows,
                   group * n_q, n_q, group, n_ctx, splits, *split_scale(sm_scale), seq_bucket(rows), seq_bucket(n_ctx),
                   seq_bucket(0))

        made = []

        def launch():
            with on_device(q):
                if made:  # a timed repeat: the plan's launch (see _repeatable)
                    made[0](tensors)
                    return reduced(splits, o, lse)
                made.append(_repeatable(_launch(CONTEXT[_head_dim_class(head_dim)],
                                                lambda meta: (cdiv(rows, meta["BLOCK_M"]), splits, heads_kv),
                                                (*tensors, *scalars), common, config), len(tensors), scalars))
                if plan_key is not None:
                    remember(plan_key, (splits, made[0]))
                return reduced(splits, o, lse)

        return launch

    splits = _split_count("context", num_splits, rows, heads_kv, n_ctx, q, tune_key, runner)
    return runner(splits, _plannable(key, q))()


def buffer_launch(q, k_buf, v_buf, buf_lens, causal, sm_scale, *, config=None, out_dtype=None, as_state=False):
    """Attention of each sample's queries over its own buffer alone. Returns (o, lse). ``as_state``: a
    half to be merged, its LSE in precision.STATE_LSE_DTYPE."""
    out_dtype = out_dtype or q.dtype
    heads_kv = k_buf.shape[1]
    batch, heads_q, n_q, head_dim, group, rows = _sizes(q, heads_kv)
    o = new_output(q.shape, out_dtype, q.device)
    lse = new_output((batch, heads_q, n_q), STATE_LSE_DTYPE if as_state else lse_dtype(q.dtype), q.device)
    tensors = (q, k_buf, v_buf, buf_lens if buf_lens is not None else q, o, lse)
    key = None if config is not None else _plan_key("buffer", q, None, None, k_buf, v_buf, buf_lens, causal,
                                                    sm_scale, out_dtype, as_state)
    if key is not None and (known := plan(key)) is not None:
        with on_device(q):
            known(tensors)
        return o, lse
    n_buf = k_buf.shape[2]
    scalars = (*q.stride()[:3], *k_buf.stride()[:3], *v_buf.stride()[:3], *o.stride()[:3], *lse.stride(), rows,
               group * n_q, n_q, group, n_buf, *split_scale(sm_scale), seq_bucket(rows), seq_bucket(0),
               seq_bucket(n_buf), 1)
    with on_device(q):
        made = _launch(BUFFER[_head_dim_class(head_dim)], lambda meta: (cdiv(rows, meta["BLOCK_M"]), 1, heads_kv),
                       (*tensors, *scalars), _common(q, head_dim, causal, buf_lens is None, group * n_q, n_buf), config)
    if (key := _plannable(key, q)) is not None:
        fn, compiled, grid, kwargs = made
        remember(key, LaunchPlan(fn, compiled, grid, len(tensors), scalars, kwargs))
    return o, lse


def composed_launch(q, k_ctx, v_ctx, k_buf, v_buf, buf_lens, causal, sm_scale, *, num_splits=None,
                    context_config=None, buffer_config=None):
    """Path (a): context kernel (+ split reduction), buffer kernel, merge_states kernel. The two
    halves stay in fp32 (their LSEs in fp64) until the merge, so the composition rounds once, like the fused
    path."""
    n_ctx = k_ctx.shape[1]
    n_buf = 0 if k_buf is None else k_buf.shape[2]
    if not n_buf:
        return context_launch(q, k_ctx, v_ctx, sm_scale, num_splits=num_splits, config=context_config)
    if not n_ctx:
        return buffer_launch(q, k_buf, v_buf, buf_lens, causal, sm_scale, config=buffer_config)
    o_c, lse_c = context_launch(q, k_ctx, v_ctx, sm_scale, num_splits=num_splits, config=context_config,
                                out_dtype=_state_dtype(q), as_state=True)
    o_b, lse_b = buffer_launch(q, k_buf, v_buf, buf_lens, causal, sm_scale, config=buffer_config,
                               out_dtype=_state_dtype(q), as_state=True)
    return merge_two_launch(o_c, lse_c, o_b, lse_b, q.dtype, out_lse_dtype=lse_dtype(q.dtype), state_lse=True)


def clear_split_picks():
    """Forget the measured split counts and the remembered launch configs (tests clear them with
    the autotuners' picks)."""
    forget_split_picks()
    forget_plans()
    forget_kept_scratch()  # the forgotten plans' scratch goes with them
