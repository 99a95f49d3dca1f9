"""The split-KV decode, the merge of its states, forward-mode attention, the HVP kernels and the launchers' head copies at head dims whose rows are not 16-element multiples (40, 72):
compiled for sm_90 on this machine (Triton compiles to PTX without a GPU; nothing runs), their K/V reads must be
16-byte asynchronous copies and their state reads 16-byte vectors, not 2-byte loads (tiling.aligned). Without the
launcher's alignment hint the decode at D 40 read 19% of copy bandwidth on an H200 (docs/measurements/flash.md)."""
import json
import os
import subprocess
import sys

import pytest

# Runs in a process of its own: attnbench turns the interpreter on at import on a machine without CUDA.
COMPILE = r"""
import json, re, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnbench.kernels.attention import flash_decode
from attnbench.kernels import merge_states
from attnbench.kernels.tiling import stride_align

def jit_function(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel

def compiled(kernel, values, constexprs, pointers, num_warps=4, num_stages=3):
    # specialised as Triton's launcher would: pointers and integers divisible by 16 carry tt.divisibility
    fn = jit_function(kernel)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name], attrs[(i,)] = pointers[name], [["tt.divisibility", 16]]
        elif isinstance(values[name], float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if values[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages}).asm

def ptx(kernel, values, constexprs, pointers, num_warps=4, num_stages=3):
    asm = compiled(kernel, values, constexprs, pointers, num_warps, num_stages)["ptx"]
    kinds = {}
    for op in re.findall(r"(ld\.global[\w.]*|cp\.async\.c[ag]\.shared\.global)", asm):
        kinds[op] = kinds.get(op, 0) + 1
    return kinds

head_dim, n_q, n_k, heads, splits = int(sys.argv[1]), 4, 1962, 16, 2
rows = dict(stride_qn=head_dim, stride_qh=n_q * head_dim, stride_qb=heads * n_q * head_dim,
            stride_kn=head_dim, stride_kh=n_k * head_dim, stride_kb=heads * n_k * head_dim)
values = dict(rows, stride_vn=head_dim, stride_vh=n_k * head_dim, stride_vb=heads * n_k * head_dim,
              stride_on=head_dim, stride_oh=n_q * head_dim, stride_ob=heads * n_q * head_dim,
              stride_os=12 * heads * n_q * head_dim, stride_ls=12 * heads * n_q, stride_lb=heads * n_q, stride_lh=n_q,
              N_Q=n_q, N_K=n_k, HEAD_DIM=head_dim, H_KV=heads, GROUP=1, causal_offset=0, scale_hi=0.125,
              scale_lo=0.0, NUM_SPLITS=splits, ROWS_BUCKET=16, SEQ_BUCKET=1024)
align = stride_align(*(v for k, v in values.items() if k.startswith("stride_") and not k.startswith("stride_l")),
                     head_dim)
decode = ptx(flash_decode.flash_decode_kernel, values,
             dict(BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_D2=0, CAUSAL=False, ACC_DTYPE=tl.float32,
                  DOT_PRECISION="ieee", BLOCK_M=16, BLOCK_N=64, ALIGN=align),
             dict(Q="*fp16", K="*fp16", V="*fp16", O="*fp32", LSE="*fp64"))
state = values["stride_oh"] * heads
merge_values = dict(NUM_STATES=splits, N_ROWS=12 * heads * n_q, DIM_Y=heads, DIM_Z=n_q, HEAD_DIM=head_dim,
                    SEE_FROM=0, s_os_s=12 * state, s_os_x=state, s_os_y=values["stride_oh"], s_os_z=head_dim,
                    s_ls_s=12 * heads * n_q, s_ls_x=heads * n_q, s_ls_y=n_q, s_ls_z=1, s_o_x=state,
                    s_o_y=values["stride_oh"], s_o_z=head_dim, s_l_x=heads * n_q, s_l_y=n_q, s_l_z=1)
merge_pointers = dict(OS="*fp32", LS="*fp64", O="*fp16", L="*fp32")
merge = ptx(merge_states.merge_stack_kernel, merge_values,
            dict(BLOCK_R=16, BLOCK_D=triton.next_power_of_2(head_dim), ACC_DTYPE=tl.float32,
                 ALIGN=stride_align(head_dim, state, 12 * state)), merge_pointers)
merge_chunks = ptx(merge_states.merge_stack_chunks_kernel, merge_values,
                   dict(BLOCK_R=4, BLOCK_D=64, CHUNK=4, ACC_DTYPE=tl.float32,
                        ALIGN=stride_align(head_dim, state, 12 * state)), merge_pointers)
from attnbench.kernels.attention import copies
copy_values = dict(HEADS=2, N=3660, D=head_dim, WIDTH=head_dim + 8, ROW_BLOCKS=115, s_b=2 * 3660 * head_dim,
                   s_h=3660 * head_dim, s_n=head_dim, s_d=1)
repeats = {}
for repeat, count in ((1, 1), (4, 1), (1, 3)):  # REPEAT 1 is a specialization of its own (Triton makes an int
    # argument equal to 1 a constant); COUNT 3 picks one of three grouped sources by scalar branches
    constexprs = dict(BLOCK_N=32, BLOCK_W=triton.next_power_of_2(head_dim + 8), s_d=1, COUNT=count,
                      ALIGN=stride_align(head_dim, head_dim + 8, *(copy_values[k] for k in ("s_b", "s_h", "s_n"))))
    if repeat == 1:
        constexprs["REPEAT"] = 1
    repeats[f"repeat {repeat}, {count} sources"] = ptx(
        copies.copy_heads_kernel, dict(copy_values, REPEAT=repeat), constexprs,
        {name: "*bf16" for name in ("SRC", "DST", "SRC1", "DST1", "SRC2", "DST2")}, num_stages=1)
from attnbench.kernels.attention import attention_jvp
jvp_values = dict(N_Q=1962, N_K=1962, HEAD_DIM=head_dim, H_Q=heads, GROUP=1, causal_offset=0, scale_hi=0.125,
                  scale_lo=0.0, SEQ_BUCKET=2048)
for name in ("q", "k", "v", "tq", "tk", "tv", "o", "ot"):
    jvp_values.update({f"stride_{name}n": head_dim, f"stride_{name}h": 1962 * head_dim,
                       f"stride_{name}b": heads * 1962 * head_dim})
jvp = ptx(attention_jvp.attention_jvp_kernel, jvp_values,
          dict(BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=False, LSE_GIVEN=False, HAS_TQ=True, HAS_TK=True,
               HAS_TV=True, ACC_DTYPE=tl.float32, DOT_PRECISION="ieee", BLOCK_M=64, BLOCK_N=64,
               ALIGN=stride_align(head_dim, 1962 * head_dim, heads * 1962 * head_dim)),
          dict(Q="*bf16", K="*bf16", V="*bf16", TQ="*bf16", TK="*bf16", TV="*bf16", O="*bf16", LSE="*fp32",
               OT="*bf16", LSET="*fp32"), num_stages=2)
from attnbench.kernels.attention import attention_bwd_jvp
bwd_values = dict(jvp_values)
for name in ("do", "tdo", "dk", "dv", "dq"):
    bwd_values.update({f"stride_{name}n": head_dim, f"stride_{name}h": 1962 * head_dim,
                       f"stride_{name}b": heads * 1962 * head_dim})
bwd_constexprs = dict(BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=False, HAS_TQ=True, HAS_TK=True, HAS_TV=True,
                      HAS_TDO=True, ACC_DTYPE=tl.float32, DOT_PRECISION="ieee", BLOCK_M=64, BLOCK_N=64,
                      ALIGN=stride_align(head_dim, 1962 * head_dim, heads * 1962 * head_dim))
bwd_pointers = {name: "*bf16" for name in ("Q", "K", "V", "DO", "TQ", "TK", "TV", "TDO", "DKT", "DVT", "DQT")}
bwd_pointers.update({name: "*fp32" for name in ("LSE", "MU", "DELTA", "TDELTA")})
bwd_jvp = {name: ptx(kernel, bwd_values, bwd_constexprs,
                     {k: v for k, v in bwd_pointers.items() if k in jit_function(kernel).arg_names}, num_stages=2)
           for name, kernel in (("dkdv", attention_bwd_jvp.bwd_jvp_dkdv_kernel),
                                ("dq", attention_bwd_jvp.bwd_jvp_dq_kernel))}
# the share sum's integer products (TTIR): its four-share loop must step by INNER, an int32 argument, one share at a
# time (4 * INNER in int32 wraps at INNER 2**29)
sums = compiled(copies.sum_shares_kernel, dict(SHARES=5, INNER=2688, BLOCKS=11), dict(BLOCK=256, ACC_DTYPE=tl.float32),
                dict(SRC="*fp32", DST="*fp32"))["ttir"]
products = [line.strip().split(" loc(")[0] for line in sums.splitlines() if "arith.muli" in line]
print(json.dumps(dict(align=align, decode=decode, merge=merge, merge_chunks=merge_chunks, copies=repeats, jvp=jvp,
                      bwd_jvp=bwd_jvp, sum_products=products)))
"""


def _compiled(head_dim):
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", COMPILE, str(head_dim)], capture_output=True, text=True, env=env,
                         timeout=600)
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.fail(f"Triton could not compile for sm_90 here: {run.stderr[-2000:]}")
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("head_dim", [40, 72])
def test_decode_and_merge_read_16_byte_vectors_at_narrow_row_strides(head_dim):
    found = _compiled(head_dim)
    assert found["align"] == 8
    decode, merge = found["decode"], found["merge"]
    assert decode.get("cp.async.cg.shared.global", 0) > 0, decode  # K and V pipelined, 16 bytes a copy
    assert "ld.global.b16" not in decode, decode  # q too: no 2-byte loads
    for merge in (merge, found["merge_chunks"]):  # state by state, and several states a load
        assert "ld.global.b32" not in merge and merge.get("ld.global.v4.b32", 0) > 0, merge
    # the launchers' pads and the per-head route's K/V repeats (copies.py), both specializations: they compile for
    # sm_90 (the repeat has run on the interpreter only) and read whole 16-byte vectors
    for repeat, copy in found["copies"].items():
        assert copy.get("ld.global.v4.b32", 0) > 0 and "ld.global.b16" not in copy, (repeat, copy)
    # forward-mode attention (jvp_attention): before its hint it read K, V and their tangents with 2-byte loads
    jvp = found["jvp"]
    assert jvp.get("cp.async.cg.shared.global", 0) > 0 and "ld.global.b16" not in jvp, jvp
    # the backward's tangent (the HVP kernels): the same hint, the same loads
    for name, kinds in found["bwd_jvp"].items():
        assert "ld.global.b16" not in kinds and any(k.startswith(("cp.async", "ld.global.v4")) for k in kinds), (name,
                                                                                                               kinds)
    # the share sum steps one INNER at a time: 4 * INNER in int32 wrapped at INNER 2**29 (found by review: a segfault
    # under the interpreter at five shares); its TTIR multiplies no int32
    products = found["sum_products"]
    assert products and not [p for p in products if p.endswith(": i32")], products
