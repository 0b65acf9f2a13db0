"""Row-streaming GEMV for decode at batch 1-4: y = x @ W^T, memory-bound on W.

Each program owns ROWS consecutive rows of W -- one contiguous piece of memory, since W is
row-major with K contiguous -- and walks it in [R, BK] tiles, row group by row group, through one
software-pipelined loop, so that several tiles of one contiguous stream are in flight at once. The
products are plain fp32 multiply-adds (no tensor cores: at M <= 4 there is nothing for them to
gain, and no padding of x to 16 rows); a row group's sums are reduced and stored when its last K
tile has been added.

On an H100, in CUDA-graph chains that read every weight from HBM, it streams llama-3-8b's
projections at 96-98% of a pure read of the same bytes, against cuBLAS's 93-95% for gate_up/down
and the tensor-core skinny kernel's 93-95% for qkv/o (docs/BENCHMARKS.md). Which kernel a shape
uses is still decided by timing (`skinny_gemm.SkinnyDispatch`).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from pageflash.kernels.activation import gelu_tanh_f32, silu_f32
from pageflash.kernels.device_info import has_fp8
from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.launch import fast_launch

__all__ = ["gemv", "gemv_ref", "GemvLoRA", "MAX_M", "CODE_DTYPES"]

MAX_M = 4
# the 8-bit weight codes read with a per-row scale: int8 (kernels/w8_linear.py) and float8_e4m3fn
# (kernels/fp8_linear.py); both widen exactly to bf16 / fp16 / float32. Also w8_gemm's and fused_moe's.
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)




@triton.jit
def i8x4_to_f32(w):
    """int32 words of 4 int8 codes each (little-endian: code 4i + j in byte j) -> the 4 codes as float32
    tensors (byte 0's, 1's, 2's, 3's), without I2F, a quarter-rate conversion on sm_8x / sm_9x that
    caps an int8 GEMV below the HBM's bandwidth: flip the 4 sign bits (code + 128 as a byte), place
    each byte under the exponent of 2^23 with one PRMT (the float 2^23 + code + 128) and subtract
    2^23 + 128. Exact: the values ``.to(tl.float32)`` gives. CUDA only (inline PTX)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t;
        xor.b32 t, $4, 0x80808080;
        prmt.b32 $0, t, 0x4B000000, 0x7440;
        prmt.b32 $1, t, 0x4B000000, 0x7441;
        prmt.b32 $2, t, 0x4B000000, 0x7442;
        prmt.b32 $3, t, 0x4B000000, 0x7443;
        sub.f32 $0, $0, 0f4B000080;
        sub.f32 $1, $1, 0f4B000080;
        sub.f32 $2, $2, 0f4B000080;
        sub.f32 $3, $3, 0f4B000080;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True, pack=1)


@triton.jit
def e4m3x4_to_f32(w):
    """int32 words of 4 float8_e4m3fn codes each (code 4i + j in byte j) -> the 4 codes as float32
    tensors, two codes per cvt.rn.f16x2.e4m3x2 (sm_89+) and then each half widened: no byte-wise
    shared-memory loads. Exact (every e4m3 value is an fp16 one). CUDA only (inline PTX)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi, a, b, c, d;
        .reg .b32 h01, h23;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 h01, lo;
        cvt.rn.f16x2.e4m3x2 h23, hi;
        mov.b32 {a, b}, h01;
        mov.b32 {c, d}, h23;
        cvt.f32.f16 $0, a;
        cvt.f32.f16 $1, b;
        cvt.f32.f16 $2, c;
        cvt.f32.f16 $3, d;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True, pack=1)


@triton.jit
def _act_rounded(gate, GELU: tl.constexpr, LIBDEVICE: tl.constexpr, DT: tl.constexpr):
    """The gate's activation (SiLU, or GELU's tanh form) of sums rounded to DT, rounded to DT and widened:
    the activation kernel's arithmetic step for step."""
    if GELU:
        act = gelu_tanh_f32(gate, LIBDEVICE)
    else:
        act = silu_f32(gate, LIBDEVICE)
    return act.to(DT).to(tl.float32)


@triton.jit
def _gemv_rows(
    X, W, S, Y, M, N, K, ROWS, HALF, stride_xm, stride_wn, stride_ym, pid,
    BM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    SILU: tl.constexpr, LIBDEVICE: tl.constexpr, SCALED: tl.constexpr, GELU: tl.constexpr,
    CODE_WORDS: tl.constexpr, STORE_RAW: tl.constexpr,
):
    """Program pid's rows of the product (the GEMV proper). STORE_RAW (with SILU): the gate and up
    rows' sums go to Y [M, 2 * HALF] as they are, for _lora_epilogue to finish."""
    # CODE_WORDS 1 / 2: W is int8 / float8_e4m3fn codes seen as int32 words of 4 (K and BK count
    # words; x's column of code j of word i is 4i + j), widened by i8x4_to_f32 / e4m3x4_to_f32: 16-byte
    # loads of the staged tile instead of one shared-memory load (and, for int8, one I2F) per code
    # SCALED: W holds int8 codes and S one float32 scale per row (kernels/w8_linear.py): a row's sums
    # are multiplied by its scale before rounding, so the codes are read as they are (half the bytes)
    # SILU: W is a fused [gate; up] projection (2 * HALF rows) and Y = silu(x W_gate^T) * (x W_up^T),
    # [M, HALF]. The program owns ROWS / 2 output features; its row groups alternate between R gate
    # rows and the R up rows HALF further, and an up group's sums meet the gate group's, kept in
    # registers, in the epilogue (no [M, 2 * HALF] intermediate, no SiLU launch). GELU: the gate's
    # activation is GELU's tanh form instead (GeGLU: Gemma).
    if SILU:
        r0 = pid * (ROWS // 2)
    else:
        r0 = pid * ROWS
    offs_m = tl.arange(0, BM)
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BK)
    n_k = tl.cdiv(K, BK)
    acc = tl.zeros([BM, R, BK], dtype=tl.float32)
    gate = tl.zeros([BM, R], dtype=tl.float32)
    for t in tl.range(0, (ROWS // R) * n_k, num_stages=STAGES):
        g = t // n_k
        kc = t - g * n_k
        if SILU:
            feats = r0 + (g // 2) * R + offs_r  # output features of this group pair
            rows = feats + (g % 2) * HALF
            row_ok = feats < HALF
        else:
            rows = r0 + g * R + offs_r
            row_ok = rows < N
        kk = kc * BK + offs_k
        w_ptr = W + rows[:, None].to(tl.int64) * stride_wn + kk[None, :]
        w_ok = row_ok[:, None] & (kk[None, :] < K)
        if CODE_WORDS > 0:
            if CODE_WORDS == 1:
                w0, w1, w2, w3 = i8x4_to_f32(tl.load(w_ptr, mask=w_ok, other=0))
            else:
                w0, w1, w2, w3 = e4m3x4_to_f32(tl.load(w_ptr, mask=w_ok, other=0))
            kx = kc * (4 * BK) + tl.arange(0, 4 * BK)
            x = tl.load(X + offs_m[:, None] * stride_xm + kx[None, :], mask=(offs_m[:, None] < M) & (kx[None, :] < 4 * K),
                        other=0.0).to(tl.float32)
            x02, x13 = tl.split(tl.reshape(x, [BM, BK, 2, 2]))  # x[.., 4i + j]: j = 2p + q, q split first
            x0, x2 = tl.split(x02)
            x1, x3 = tl.split(x13)
            acc += w0[None, :, :] * x0[:, None, :]
            acc += w1[None, :, :] * x1[:, None, :]
            acc += w2[None, :, :] * x2[:, None, :]
            acc += w3[None, :, :] * x3[:, None, :]
        else:
            w = tl.load(w_ptr, mask=w_ok, other=0.0)
            x = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :],
                        mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
            acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        if kc == n_k - 1:
            out = tl.sum(acc, axis=2)  # [BM, R]
            if SCALED:
                out = out * tl.load(S + rows, mask=row_ok, other=0.0)[None, :]
            if SILU and STORE_RAW:
                # the gate and up sums as the unfused projection would store them (LoRA: its delta is
                # added before the activation, in _lora_epilogue)
                tl.store(Y + offs_m[:, None] * stride_ym + rows[None, :], out.to(Y.dtype.element_ty),
                         mask=(offs_m[:, None] < M) & row_ok[None, :])
            elif SILU:
                # rounded to the output dtype as the unfused projection would store it, then the
                # SiLU kernel's arithmetic step for step
                v = out.to(Y.dtype.element_ty).to(tl.float32)
                act = _act_rounded(gate, GELU, LIBDEVICE, Y.dtype.element_ty)
                is_up = (tl.zeros([BM, R], dtype=tl.int32) + (g % 2)) > 0
                tl.store(Y + offs_m[:, None] * stride_ym + feats[None, :], (act * v).to(Y.dtype.element_ty),
                         mask=(offs_m[:, None] < M) & row_ok[None, :] & is_up)
                gate = v  # a gate group's sums, for the up group that follows (an up group's are overwritten)
            else:
                # rounded to x's dtype even where Y is float32 (the LM head's logits): as the product's
                # .float() would be
                tl.store(Y + offs_m[:, None] * stride_ym + rows[None, :],
                         out.to(X.dtype.element_ty).to(Y.dtype.element_ty), mask=(offs_m[:, None] < M) & row_ok[None, :])
            acc = tl.zeros([BM, R, BK], dtype=tl.float32)




@triton.jit
def _lora_rows(X, LA, LS, LP, LCNT, M, K, LNR, stride_xm, stride_las, stride_lar, stride_lss, slot, pid,
               BM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, LRANK: tl.constexpr):
    """A LoRA program: R rows of the token's scaled shrink, p = scale * (x A^T), into LP float32
    [M, LNR]; then one more on the count of finished LoRA programs (LCNT[1], released after a
    barrier: every thread's stores first)."""
    offs_m = tl.arange(0, BM)
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BK)
    prow = pid * R + offs_r
    p_ok = prow < LNR
    a_base = LA + slot.to(tl.int64) * stride_las + prow[:, None].to(tl.int64) * stride_lar
    acc = tl.zeros([BM, R, BK], dtype=tl.float32)
    for kc in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
        kk = kc * BK + offs_k
        a = tl.load(a_base + kk[None, :], mask=p_ok[:, None] & (kk[None, :] < K), other=0.0)
        x = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=(offs_m[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        acc += a.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    p = tl.sum(acc, axis=2) * tl.load(LS + slot * stride_lss + prow // LRANK, mask=p_ok, other=0.0)[None, :]
    tl.store(LP + offs_m[:, None] * LNR + prow[None, :], p, mask=(offs_m[:, None] < M) & p_ok[None, :])
    tl.debug_barrier()
    tl.atomic_add(LCNT + 1, 1, sem="release", scope="gpu")


@triton.jit
def _lora_b(LB, rows, ok, slot, stride_lbs, stride_lbn, LRANK: tl.constexpr, BRANK: tl.constexpr):
    """[R, BRANK] float32: the rows of the slot's B (zero past the rank)."""
    offs_q = tl.arange(0, BRANK)
    return tl.load(LB + slot.to(tl.int64) * stride_lbs + rows[:, None].to(tl.int64) * stride_lbn + offs_q[None, :],
                   mask=ok[:, None] & (offs_q < LRANK)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _lora_delta(LP, bv, ok, piece, LRANK: tl.constexpr, BRANK: tl.constexpr, DTYPE: tl.constexpr):
    """[R] float32: the LoRA delta of output rows whose B rows are bv (their slice piece's p, rounded to
    B's dtype as lora_expand rounds it, times bv)."""
    offs_q = tl.arange(0, BRANK)
    pv = tl.load(LP + piece[:, None] * LRANK + offs_q[None, :], mask=ok[:, None] & (offs_q < LRANK)[None, :],
                 other=0.0, cache_modifier=".cg")
    return tl.sum(pv.to(DTYPE).to(tl.float32) * bv, axis=1)


@triton.jit
def _lora_wait(LCNT, NP):
    """Until the NP LoRA programs have written p (LCNT[1], acquire)."""
    done = tl.atomic_add(LCNT + 1, 0, sem="acquire", scope="gpu")
    while done < NP:
        done = tl.atomic_add(LCNT + 1, 0, sem="acquire", scope="gpu")


@triton.jit
def _lora_epilogue(Y, GU, LB, LP, LCNT, N, ROWS, HALF, LN0, LN1, NP, stride_lbs, stride_lbn, slot, live, pid,
                   R: tl.constexpr, SILU: tl.constexpr, GELU: tl.constexpr, LIBDEVICE: tl.constexpr,
                   LRANK: tl.constexpr, BRANK: tl.constexpr):
    """After a product program's rows are stored (M = 1): wait until the NP LoRA programs have
    written p, then add each row's delta to what the program stored -- rounded to the output dtype
    as lora_expand adds it to a stored product; SILU: to the gate and up sums in GU [2 * HALF], then
    the activation and the product as the fused epilogue computes them, into Y. The first group's
    stored sums and B rows are loaded before the wait, so that their latency and the wait's overlap."""
    offs_r = tl.arange(0, R)
    DT: tl.constexpr = LB.dtype.element_ty
    tl.debug_barrier()  # this program's stores of its rows, before any thread reads them back
    if SILU:
        r0 = pid * (ROWS // 2)
        for g in range(0, ROWS // (2 * R)):
            feats = r0 + g * R + offs_r
            ok = feats < HALF
            gate = tl.load(GU + feats, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            up = tl.load(GU + HALF + feats, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            if live:
                b_gate = _lora_b(LB, feats, ok, slot, stride_lbs, stride_lbn, LRANK, BRANK)
                b_up = _lora_b(LB, feats + HALF, ok, slot, stride_lbs, stride_lbn, LRANK, BRANK)
                if g == 0:
                    _lora_wait(LCNT, NP)
                zero = tl.zeros([R], dtype=tl.int32)
                gate += _lora_delta(LP, b_gate, ok, zero, LRANK, BRANK, DT)
                up += _lora_delta(LP, b_up, ok, zero + 1, LRANK, BRANK, DT)
            gate = gate.to(Y.dtype.element_ty).to(tl.float32)
            up = up.to(Y.dtype.element_ty).to(tl.float32)
            act = _act_rounded(gate, GELU, LIBDEVICE, Y.dtype.element_ty)
            tl.store(Y + feats, (act * up).to(Y.dtype.element_ty), mask=ok)
    elif live:
        r0 = pid * ROWS
        for g in range(0, ROWS // R):
            rows = r0 + g * R + offs_r
            ok = rows < N
            y = tl.load(Y + rows, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            bv = _lora_b(LB, rows, ok, slot, stride_lbs, stride_lbn, LRANK, BRANK)
            if g == 0:
                _lora_wait(LCNT, NP)
            piece = (rows >= LN0).to(tl.int32) + (rows >= LN0 + LN1).to(tl.int32)
            d = _lora_delta(LP, bv, ok, piece, LRANK, BRANK, DT)
            tl.store(Y + rows, (y + d).to(Y.dtype.element_ty), mask=ok)


# M, ROWS and HALF are not specialized: one compile per tile config serves every shape (cold start)
@triton.jit(do_not_specialize=["M", "ROWS", "HALF", "LN0", "LN1", "LNR", "NP"])
def _gemv_kernel(
    X, W, S, Y, M, N, K, ROWS, HALF, stride_xm, stride_wn, stride_ym,
    LA, LB, LS, LSLOT, LP, LCNT, GU, LN0, LN1, LNR, NP, stride_las, stride_lar, stride_lbs, stride_lbn, stride_lss,
    BM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    SILU: tl.constexpr, LIBDEVICE: tl.constexpr, SCALED: tl.constexpr, GELU: tl.constexpr = False,
    CODE_WORDS: tl.constexpr = 0, LORA: tl.constexpr = False, LRANK: tl.constexpr = 16, BRANK: tl.constexpr = 16,
):
    # LORA (M = 1, 16-bit or float32 W): the token's LoRA delta added in the same launch (no shrink
    # and expand launches). LSLOT holds the token's adapter slot (0: none, no delta; the counters
    # run all the same). The first NP programs to
    # start (a ticket from LCNT[0], so that every program waiting on them has started after them and
    # none can wait on a program that is not resident) compute p = scale * (x A[slot]^T), R rows each
    # (_lora_rows); the others compute the product's rows as without LoRA, then wait for p and add
    # their rows' deltas (_lora_epilogue). The last program to finish (LCNT[2]) zeroes the counters
    # for the next launch: a launch's counters must not be shared by two launches in flight. A SILU
    # product stores its gate and up sums in GU [2 * HALF] first.
    if LORA:
        # (the ticket does not wait for the slot's load: one round trip before the rows start, not two)
        pid = tl.atomic_add(LCNT, 1, sem="relaxed", scope="gpu")
        slot = tl.load(LSLOT)
        live = slot != 0
        if pid < NP:
            if live:
                _lora_rows(X, LA, LS, LP, LCNT, M, K, LNR, stride_xm, stride_las, stride_lar, stride_lss, slot, pid,
                           BM, R, BK, STAGES, LRANK)
            else:
                tl.atomic_add(LCNT + 1, 1, sem="release", scope="gpu")  # (slot 0: nothing to write)
        else:
            if SILU:
                _gemv_rows(X, W, S, GU, M, N, K, ROWS, HALF, stride_xm, stride_wn, 2 * HALF, pid - NP, BM, R, BK,
                           STAGES, SILU, LIBDEVICE, SCALED, GELU, CODE_WORDS, True)
            else:
                _gemv_rows(X, W, S, Y, M, N, K, ROWS, HALF, stride_xm, stride_wn, stride_ym, pid - NP, BM, R, BK,
                           STAGES, SILU, LIBDEVICE, SCALED, GELU, CODE_WORDS, False)
            _lora_epilogue(Y, GU, LB, LP, LCNT, N, ROWS, HALF, LN0, LN1, NP, stride_lbs, stride_lbn, slot, live, pid - NP,
                           R, SILU, GELU, LIBDEVICE, LRANK, BRANK)
        tl.debug_barrier()
        if tl.atomic_add(LCNT + 2, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.atomic_xchg(LCNT, 0, sem="relaxed", scope="gpu")  # every program has its ticket and p
            tl.atomic_xchg(LCNT + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(LCNT + 2, 0, sem="relaxed", scope="gpu")
    else:
        _gemv_rows(X, W, S, Y, M, N, K, ROWS, HALF, stride_xm, stride_wn, stride_ym, tl.program_id(0), BM, R, BK,
                   STAGES, SILU, LIBDEVICE, SCALED, GELU, CODE_WORDS, False)


_gemv_kernel = fast_launch(_gemv_kernel)  # host launches via the cached CompiledKernel


def code_words(w: torch.Tensor) -> int:
    """How the GEMV reads 8-bit codes w: 1 (int8) / 2 (float8_e4m3fn, sm_89+) as int32 words of 4
    (i8x4_to_f32 / e4m3x4_to_f32), on CUDA outside Triton's interpreter where w's rows are whole words
    (K, the row stride and the address multiples of 4); else 0, one code at a time (also for
    PAGEFLASH_CODE_WORDS=0, for A/Bs: the same values, summed in another order)."""
    kind = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(w.dtype, 0)
    if not kind or not w.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1" \
            or os.environ.get("PAGEFLASH_CODE_WORDS", "1") == "0":
        return 0
    if w.shape[1] % 4 or w.stride(0) % 4 or w.data_ptr() % 4:
        return 0
    if kind == 2 and not has_fp8(w.device.index if w.device.index is not None else torch.cuda.current_device()):
        return 0
    return kind


class GemvLoRA(NamedTuple):
    """What the GEMV needs to add one token's LoRA delta in its own launch (lora/layers.py's LoRASlots):
    a [S, n x rank, K], b [S, N, rank] and scale float32 [S, n] (slot 0: no adapter), slot int32 [>= 1]
    (the token's slot, read on the device: graph-safe), p float32 [n x rank] and counters int32 [3]
    (zero; scratch of this projection's launches, which must not overlap), gu [2 x I] in x's dtype
    (the gate and up sums of a SiLU launch; else unused), slices: the output slices' sizes."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    slot: torch.Tensor
    p: torch.Tensor
    counters: torch.Tensor
    gu: Optional[torch.Tensor]
    slices: tuple


def _check_lora(lo: GemvLoRA, x: torch.Tensor, w: torch.Tensor, silu_mul: bool) -> int:
    """The rank, after checking lo against x [1, K] and w [N, K]."""
    n, k = w.shape
    s, nr, ka = lo.a.shape
    n_slices = len(lo.slices)
    if x.shape[0] != 1 or w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"gemv: LoRA needs one row of x and a 16-bit or float32 w, got {x.shape[0]} rows, {w.dtype}")
    if not 1 <= n_slices <= 3 or sum(lo.slices) != n or (silu_mul and n_slices != 2) or nr % n_slices:
        raise ValueError(f"gemv: LoRA slices {list(lo.slices)} do not fit N={n}" + (" (gate/up: two)" if silu_mul else ""))
    rank = nr // n_slices
    if ka != k or lo.a.dtype != w.dtype or lo.b.dtype != w.dtype or lo.b.shape != (s, n, rank) \
            or lo.scale.shape != (s, n_slices) or lo.scale.dtype != torch.float32:
        raise ValueError(f"gemv: LoRA a {tuple(lo.a.shape)} {lo.a.dtype}, b {tuple(lo.b.shape)} {lo.b.dtype}, scale "
                         f"{tuple(lo.scale.shape)} {lo.scale.dtype} do not fit w {tuple(w.shape)} {w.dtype}")
    if lo.a.stride(2) != 1 or lo.b.stride(2) != 1 or lo.p.numel() < nr or lo.p.dtype != torch.float32 \
            or lo.counters.numel() < 3 or lo.counters.dtype != torch.int32 or lo.slot.dtype != torch.int32:
        raise ValueError("gemv: LoRA a / b rows must be contiguous, p float32 [n x rank], counters int32 [3], slot int32")
    if silu_mul and (lo.gu is None or lo.gu.numel() < n or lo.gu.dtype != x.dtype):
        raise ValueError(f"gemv: a LoRA gate/up launch needs gu [{n}] {x.dtype}")
    return rank


def gemv(x: torch.Tensor, w: torch.Tensor, rows: int = 16, r: int = 4, bk: int = 512, num_stages: int = 4,
         num_warps: int = 4, out: torch.Tensor | None = None, silu_mul: bool = False,
         scale: torch.Tensor | None = None, act: str = "silu", lora: GemvLoRA | None = None) -> torch.Tensor:
    """x: [M, K] with M <= MAX_M, w: [N, K] (rows contiguous along K), same float dtype. Returns [M, N]
    in x's dtype, or in out ([M, N], x's dtype or float32: the product rounded to x's dtype, then
    widened). rows: rows of W per program (a multiple of r); r x bk: the tile.

    scale: float32 [N], one per row of w, which then holds int8 (or float8_e4m3fn) codes: the product
    is x (w * scale[:, None])^T, the scale applied to each row's fp32 sum (weight-only INT8 / FP8).

    silu_mul: w is a fused gate/up projection ([gate; up], N = 2 * I): returns silu(x gate^T) * (x up^T),
    [M, I], exactly as ``silu_and_mul`` of the plain product would (rows must be a multiple of 2 * r);
    with act="gelu_pytorch_tanh", gelu_tanh(x gate^T) * (x up^T) as ``gelu_tanh_and_mul`` would.

    lora (M = 1, no scale): also the token's LoRA delta scale (x A^T) B^T of its slot, in the same
    launch (GemvLoRA; the kernel's LORA comment), added as lora_expand adds it to the stored product
    (silu_mul: to gate and up, before the activation)."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemv: expected 2-D x and w, got {tuple(x.shape)} and {tuple(w.shape)}")
    m, k = x.shape
    n, k2 = w.shape
    if k != k2:
        raise ValueError(f"gemv: x has K={k}, w has K={k2}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv is for 1 <= M <= {MAX_M} rows, got {m}")
    if scale is not None:
        if w.dtype not in CODE_DTYPES or scale.dtype != torch.float32 or scale.shape != (n,) or scale.stride(0) != 1:
            raise ValueError(f"gemv: a scale needs int8 or float8_e4m3fn w and a contiguous float32 [{n}] scale; got w {w.dtype}, "
                             f"scale {scale.dtype} {tuple(scale.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"gemv: x must be a float tensor, got {x.dtype}")
    elif x.dtype != w.dtype:
        raise ValueError(f"gemv: dtype mismatch: x {x.dtype}, w {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: x and w must be contiguous along K")
    if rows % r:
        raise ValueError(f"gemv: rows ({rows}) must be a multiple of r ({r})")
    if silu_mul and (n % 2 or rows % (2 * r)):
        raise ValueError(f"gemv: silu_mul needs an even N (got {n}) and rows a multiple of 2 * r (got {rows}, r {r})")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"gemv: act must be 'silu' or 'gelu_pytorch_tanh', got {act!r}")
    n_out = n // 2 if silu_mul else n
    if out is not None and (out.shape != (m, n_out) or out.stride(1) != 1
                            or out.dtype not in ((x.dtype,) if silu_mul else (x.dtype, torch.float32))):
        raise ValueError(f"gemv: out must be [{m}, {n_out}] {x.dtype}" + ("" if silu_mul else " or float32")
                         + f", contiguous along N; got {tuple(out.shape)} {out.dtype}")
    if lora is not None:
        if scale is not None or (out is not None and out.dtype != x.dtype):
            raise ValueError("gemv: LoRA is for unquantized w and an output in x's dtype")
        rank = _check_lora(lora, x, w, silu_mul)
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device) if out is None else out
    bm = 1 if m == 1 else (2 if m == 2 else 4)
    per = rows // 2 if silu_mul else rows
    words = code_words(w) if bk % 4 == 0 else 0
    wk = w.view(torch.int32) if words else w  # (codes as words of 4: K, BK and the row stride in words)
    programs = cdiv(n_out, per)
    lo_args: tuple = (None,) * 7 + (0, 0, 0, 0) + (0,) * 5
    extra = {}
    if lora is not None:
        lo = lora
        nr = lo.a.shape[1]
        n_p = cdiv(nr, r)  # LoRA programs: r rows of p each
        programs += n_p
        n0, n1 = (list(lo.slices) + [0])[:2]
        lo_args = (lo.a, lo.b, lo.scale, lo.slot, lo.p, lo.counters, lo.gu, n0, n1, nr, n_p, lo.a.stride(0),
                   lo.a.stride(1), lo.b.stride(0), lo.b.stride(1), lo.scale.stride(0))
        extra = dict(LORA=True, LRANK=rank, BRANK=max(16, next_pow2(rank)))
    _gemv_kernel[(programs,)](
        x, wk, w if scale is None else scale, y, m, n, wk.shape[1], rows, n_out, x.stride(0), wk.stride(0),
        y.stride(0), *lo_args, BM=bm, R=r, BK=bk // 4 if words else bk, STAGES=num_stages, SILU=silu_mul,
        LIBDEVICE=x.is_cuda, SCALED=scale is not None, GELU=silu_mul and act == "gelu_pytorch_tanh",
        CODE_WORDS=words, num_warps=num_warps, **extra,
    )
    return y


def gemv_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    return (y if scale is None else y * scale).to(x.dtype)
