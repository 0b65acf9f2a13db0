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
from pageflash.kernels.gemv_scratch import LORA_CHUNK, gemv_lora_scratch  # noqa: F401 (re-exported)
from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.launch import fast_launch

__all__ = ["gemv", "gemv_ref", "GemvLoRA", "gemv_lora_scratch", "MAX_M", "CODE_DTYPES"]

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
    rows' sums go to Y [M, 2 * HALF] as they are, for _lora_close to finish."""
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
                # added before the activation, in _lora_close)
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
def _lora_rows(X, LA, LS, LP, K, LNR, stride_las, stride_lar, stride_lss, slot, pid,
               R: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, LRANK: tl.constexpr):
    """A LoRA p program (M = 1): R rows of the token's scaled shrink, p = scale * (x A^T), into LP
    float32 [LNR] ([1, R, BK] tiles: the product's layout, no more registers than it)."""
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BK)
    prow = pid * R + offs_r
    p_ok = prow < LNR
    a_base = LA + slot.to(tl.int64) * stride_las + prow[:, None].to(tl.int64) * stride_lar
    acc = tl.zeros([1, R, BK], dtype=tl.float32)
    for kc in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
        kk = kc * BK + offs_k
        a = tl.load(a_base + kk[None, :], mask=p_ok[:, None] & (kk[None, :] < K), other=0.0)
        x = tl.load(X + kk[None, :], mask=kk[None, :] < K, other=0.0)
        acc += a.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    p = tl.sum(acc, axis=2) * tl.load(LS + slot * stride_lss + prow // LRANK, mask=p_ok, other=0.0)[None, :]
    tl.store(LP + prow[None, :], p, mask=p_ok[None, :])


@triton.jit
def _lora_b(LB, rows, ok, slot, stride_lbs, stride_lbn, LRANK: tl.constexpr, BRANK: tl.constexpr):
    """[rows, BRANK] float32: the rows of the slot's B (zero past the rank)."""
    offs_q = tl.arange(0, BRANK)
    return tl.load(LB + slot.to(tl.int64) * stride_lbs + rows[:, None].to(tl.int64) * stride_lbn + offs_q[None, :],
                   mask=ok[:, None] & (offs_q < LRANK)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _lora_p(LP, s, LRANK: tl.constexpr, BRANK: tl.constexpr, DT: tl.constexpr):
    """[BRANK] float32: slice s's p, rounded to B's dtype as lora_expand rounds it (zero past the rank)."""
    offs_q = tl.arange(0, BRANK)
    pv = tl.load(LP + s * LRANK + offs_q, mask=offs_q < LRANK, other=0.0, cache_modifier=".cg")
    return pv.to(DT).to(tl.float32)


@triton.jit
def _lora_close(Y, GU, LB, LP, N, HALF, LN0, LN1, NSL, CH, stride_lbs, stride_lbn, c, slot, live,
                SILU: tl.constexpr, GELU: tl.constexpr, LIBDEVICE: tl.constexpr, LRANK: tl.constexpr,
                BRANK: tl.constexpr, CHB: tl.constexpr):
    """Chunk c's last arrival (its products' sums and p are stored, acquired): each feature's delta,
    p of its slice times its B row, added to the stored product and rounded to the output dtype as
    lora_expand adds it; SILU: to the gate and up sums in GU [2 * HALF], then the activation and the
    product as the fused epilogue computes them, into Y. Slot 0 (not live): no delta (SILU: only the
    activation)."""
    DT: tl.constexpr = LB.dtype.element_ty
    f_lo = c * CH
    f_hi = tl.minimum(f_lo + CH, HALF)
    for f0 in range(f_lo, f_hi, CHB):
        f = f0 + tl.arange(0, CHB)
        ok = f < f_hi
        if SILU:
            gate = tl.load(GU + f, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            up = tl.load(GU + HALF + f, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            if live:
                b_gate = _lora_b(LB, f, ok, slot, stride_lbs, stride_lbn, LRANK, BRANK)
                b_up = _lora_b(LB, f + HALF, ok, slot, stride_lbs, stride_lbn, LRANK, BRANK)
                gate += tl.sum(b_gate * _lora_p(LP, 0, LRANK, BRANK, DT)[None, :], axis=1)
                up += tl.sum(b_up * _lora_p(LP, 1, LRANK, BRANK, DT)[None, :], axis=1)
            gate = gate.to(Y.dtype.element_ty).to(tl.float32)
            up = up.to(Y.dtype.element_ty).to(tl.float32)
            act = _act_rounded(gate, GELU, LIBDEVICE, Y.dtype.element_ty)
            tl.store(Y + f, (act * up).to(Y.dtype.element_ty), mask=ok)
        elif live:
            y = tl.load(Y + f, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            bv = _lora_b(LB, f, ok, slot, stride_lbs, stride_lbn, LRANK, BRANK)
            piece = (f >= LN0).to(tl.int32) + (f >= LN0 + LN1).to(tl.int32)
            d = tl.zeros([CHB], dtype=tl.float32)
            for s in tl.static_range(3):  # (the chunk may reach two slices)
                if s < NSL:
                    d += tl.where(piece == s, tl.sum(bv * _lora_p(LP, s, LRANK, BRANK, DT)[None, :], axis=1), 0.0)
            tl.store(Y + f, (y + d).to(Y.dtype.element_ty), mask=ok)


# M, ROWS and HALF are not specialized: one compile per tile config serves every shape (cold start)
@triton.jit(do_not_specialize=["M", "ROWS", "HALF", "LN0", "LN1", "LNR", "NSL", "NP", "NCH", "PPC", "CH"])
def _gemv_kernel(
    X, W, S, Y, M, N, K, ROWS, HALF, stride_xm, stride_wn, stride_ym,
    LA, LB, LS, LSLOT, LP, LCNT, GU, LN0, LN1, LNR, NSL, NP, NCH, PPC, CH,
    stride_las, stride_lar, stride_lbs, stride_lbn, stride_lss,
    BM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
    SILU: tl.constexpr, LIBDEVICE: tl.constexpr, SCALED: tl.constexpr, GELU: tl.constexpr = False,
    CODE_WORDS: tl.constexpr = 0, LORA: tl.constexpr = False, LRANK: tl.constexpr = 16, BRANK: tl.constexpr = 16,
    CHB: tl.constexpr = 128, CB: tl.constexpr = 128, P_LAST: tl.constexpr = False,
):
    # LORA (M = 1, 16-bit or float32 W): the token's LoRA delta added in the same launch (no shrink
    # and expand launches). LSLOT holds the token's adapter slot (0: none, no delta; the counters run
    # all the same). NP programs compute p = scale * (x A[slot]^T), R rows each (_lora_rows), and
    # count themselves on LCNT[0]; the others compute the product's rows as without LoRA (a SILU
    # product stores its gate and up sums in GU [2 * HALF] first). The output is cut in NCH chunks of
    # CH features, PPC product programs each, counted on LCNT[1 + c]; the last p program adds one to
    # every chunk's count. Each count is acq_rel after a barrier (every thread's stores first), and
    # a chunk's last arrival adds its deltas (_lora_close) and zeroes its count for the next launch
    # (the last p program zeroes LCNT[0]). No program waits for another: none can wait on one that is
    # not resident, and Triton's interpreter, which runs programs one after another, runs it too. The
    # p programs are the first NP (P_LAST: the last, for tests of a late p). A launch's scratch must
    # not be shared by two launches in flight.
    if LORA:
        pid = tl.program_id(0)
        slot = tl.load(LSLOT)
        live = slot != 0
        nprod = tl.num_programs(0) - NP
        if P_LAST:
            is_p = pid >= nprod
            q = tl.where(is_p, pid - nprod, pid)
        else:
            is_p = pid < NP
            q = tl.where(is_p, pid, pid - NP)
        if is_p:
            if live:
                _lora_rows(X, LA, LS, LP, K, LNR, stride_las, stride_lar, stride_lss, slot, q, R, BK, STAGES, LRANK)
            tl.debug_barrier()
            if tl.atomic_add(LCNT, 1, sem="acq_rel", scope="gpu") == NP - 1:  # the last p program
                tl.atomic_xchg(LCNT, 0, sem="relaxed", scope="gpu")
                offs_c = tl.arange(0, CB)
                for c0 in range(0, NCH, CB):
                    cc = c0 + offs_c
                    c_ok = cc < NCH
                    arrivals = tl.minimum(PPC, nprod - cc * PPC) + 1
                    old = tl.atomic_add(LCNT + 1 + cc, tl.full([CB], 1, tl.int32), mask=c_ok, sem="acq_rel",
                                        scope="gpu")
                    last = (c_ok & (old == arrivals - 1)).to(tl.int32)
                    if tl.max(last, axis=0) > 0:  # p came after some chunks' products: close those here
                        for c in range(c0, tl.minimum(c0 + CB, NCH)):
                            if tl.sum(tl.where(cc == c, last, 0), axis=0) > 0:
                                _lora_close(Y, GU, LB, LP, N, HALF, LN0, LN1, NSL, CH, stride_lbs, stride_lbn, c,
                                            slot, live, SILU, GELU, LIBDEVICE, LRANK, BRANK, CHB)
                                tl.atomic_xchg(LCNT + 1 + c, 0, sem="relaxed", scope="gpu")
        else:
            if SILU:
                _gemv_rows(X, W, S, GU, M, N, K, ROWS, HALF, stride_xm, stride_wn, 2 * HALF, q, BM, R, BK,
                           STAGES, SILU, LIBDEVICE, SCALED, GELU, CODE_WORDS, True)
            else:
                _gemv_rows(X, W, S, Y, M, N, K, ROWS, HALF, stride_xm, stride_wn, stride_ym, q, BM, R, BK,
                           STAGES, SILU, LIBDEVICE, SCALED, GELU, CODE_WORDS, False)
            c = q // PPC
            arrivals = tl.minimum(PPC, nprod - c * PPC) + 1
            tl.debug_barrier()
            if tl.atomic_add(LCNT + 1 + c, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
                _lora_close(Y, GU, LB, LP, N, HALF, LN0, LN1, NSL, CH, stride_lbs, stride_lbn, c, slot, live,
                            SILU, GELU, LIBDEVICE, LRANK, BRANK, CHB)
                tl.atomic_xchg(LCNT + 1 + c, 0, sem="relaxed", scope="gpu")
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
    (the token's slot, read on the device: graph-safe), and this projection's scratch, from
    gemv_lora_scratch (its launches must not overlap): p float32 [n x rank], counters int32
    [1 + chunks] (zero), gu [N] in x's dtype (the gate and up sums of a SiLU launch; else unused);
    slices: the output slices' sizes."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    slot: torch.Tensor
    p: torch.Tensor
    counters: torch.Tensor
    gu: Optional[torch.Tensor]
    slices: tuple


def _check_lora(lo: GemvLoRA, x: torch.Tensor, w: torch.Tensor, silu_mul: bool, nch: int) -> int:
    """The rank, after checking lo against x [1, K], w [N, K] and the launch's nch chunks."""
    n, k = w.shape
    s, nr, ka = lo.a.shape
    n_slices = len(lo.slices)
    if x.shape[0] != 1 or w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"gemv: LoRA needs one row of x and a 16-bit or float32 w, got {x.shape[0]} rows, {w.dtype}")
    if not 1 <= n_slices <= 3 or sum(lo.slices) != n or (silu_mul and n_slices != 2) or nr % n_slices \
            or (silu_mul and lo.slices[0] != lo.slices[1]):
        raise ValueError(f"gemv: LoRA slices {list(lo.slices)} do not fit N={n}" + (" (gate/up: two)" if silu_mul else ""))
    rank = nr // n_slices
    if ka != k or lo.a.dtype != w.dtype or lo.b.dtype != w.dtype or lo.b.shape != (s, n, rank) \
            or lo.scale.shape != (s, n_slices) or lo.scale.dtype != torch.float32:
        raise ValueError(f"gemv: LoRA a {tuple(lo.a.shape)} {lo.a.dtype}, b {tuple(lo.b.shape)} {lo.b.dtype}, scale "
                         f"{tuple(lo.scale.shape)} {lo.scale.dtype} do not fit w {tuple(w.shape)} {w.dtype}")
    if lo.a.stride(2) != 1 or lo.b.stride(2) != 1 or lo.scale.stride(1) != 1 or lo.slot.dtype != torch.int32 \
            or lo.p.numel() < nr or lo.p.dtype != torch.float32 or lo.counters.numel() < 1 + nch \
            or lo.counters.dtype != torch.int32:
        raise ValueError(f"gemv: LoRA a / b rows must be contiguous, slot int32, scratch from gemv_lora_scratch "
                         f"(p float32 [>= {nr}], counters int32 [>= {1 + nch}])")
    if silu_mul and (lo.gu is None or lo.gu.numel() < n or lo.gu.dtype != x.dtype):
        raise ValueError(f"gemv: a LoRA gate/up launch needs gu [{n}] {x.dtype}")
    return rank


def gemv(x: torch.Tensor, w: torch.Tensor, rows: int = 16, r: int = 4, bk: int = 512, num_stages: int = 4,
         num_warps: int = 4, out: torch.Tensor | None = None, silu_mul: bool = False,
         scale: torch.Tensor | None = None, act: str = "silu", lora: GemvLoRA | None = None,
         lora_chunk: int = LORA_CHUNK, _lora_p_last: bool = False) -> torch.Tensor:
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
    (silu_mul: to gate and up, before the activation); lora_chunk: about how many output features a
    chunk of it holds (the kernel's LORA comment; smaller in tests); _lora_p_last (tests): the p
    programs last in the grid, so that under the interpreter p comes after every product."""
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
        if lora_chunk < 1:
            raise ValueError(f"gemv: lora_chunk must be >= 1, got {lora_chunk}")
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device) if out is None else out
    bm = 1 if m == 1 else (2 if m == 2 else 4)
    per = rows // 2 if silu_mul else rows
    words = code_words(w) if bk % 4 == 0 else 0
    wk = w.view(torch.int32) if words else w  # (codes as words of 4: K, BK and the row stride in words)
    programs = cdiv(n_out, per)
    lo_args: tuple = (None,) * 7 + (0,) * 8 + (0,) * 5
    extra = {}
    if lora is not None:
        lo = lora
        nr = lo.a.shape[1]
        ppc = max(1, lora_chunk // per)  # product programs a chunk
        nch = cdiv(programs, ppc)
        rank = _check_lora(lo, x, w, silu_mul, nch)
        n_p = cdiv(nr, r)  # p programs: r rows of p each
        programs += n_p
        n0, n1 = (list(lo.slices) + [0])[:2]
        lo_args = (lo.a, lo.b, lo.scale, lo.slot, lo.p, lo.counters, lo.gu, n0, n1, nr, len(lo.slices), n_p, nch, ppc,
                   ppc * per, lo.a.stride(0), lo.a.stride(1), lo.b.stride(0), lo.b.stride(1), lo.scale.stride(0))
        extra = dict(LORA=True, LRANK=rank, BRANK=max(16, next_pow2(rank)), CHB=min(128, next_pow2(ppc * per)),
                     P_LAST=bool(_lora_p_last))
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
