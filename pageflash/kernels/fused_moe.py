"""Mixture-of-experts FFN over a flat token batch: a grouped GEMM in Triton (as vLLM's fused_moe).

For x [T, H], w13 [E, 2I, H] (each expert's gate rows, then its up rows: HF ``gate_up_proj``),
w2 [E, H, I], topk_weights [T, k] float32 and topk_ids [T, k] (values in [0, E)):

    out[t] = sum_j topk_weights[t, j] * (silu_and_mul(x[t] @ w13[e]^T) @ w2[e]^T),  e = topk_ids[t, j]

``fused_moe`` works on the T*k (token, slot) *pairs*, pair p = t*k + j:

1. ``moe_align`` groups the pairs by expert, each expert's group padded to a multiple of block_m, so
   that every block of block_m rows belongs to one expert (``sorted_ids``, ``block_expert``,
   ``num_rows``). Torch ops, static shapes, no host sync. For decode-sized steps ``route_align`` does
   the routing (``layers.moe.route``) and this grouping in one launch (``routed_moe``).
2. ``_moe_gemm_kernel`` (GATED): act[p] = silu(x[p // k] @ w_gate[e]^T) * (x[p // k] @ w_up[e]^T)
   ([T*k, I], rows gathered through sorted_ids; each product rounded to x's dtype, then the SiLU as
   kernels/activation.py computes it);
3. ``_moe_gemm_kernel``: C2[p] = topk_weights[p] * (act[p] @ w2[e]^T), the weight applied in fp32
   before rounding to x's dtype ([T*k, H]);
4. ``_ksum_kernel``: out[t] = sum_j C2[t*k + j] in fp32, rounded to x's dtype.

Launch shapes depend only on T, k, E, H, I (never on the routing), so the whole of ``fused_moe`` is
CUDA-graph capturable. topk_ids out of [0, E) are not checked (that would need a sync): they leave the
rows of their pairs unwritten (garbage output for those tokens).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.kernels.activation import silu_f32
from pageflash.kernels.fp8_linear import fast_accum, fp8_tensor_cores
from pageflash.kernels.fp8_quant import quantize_rows_fp8
from pageflash.kernels.gemv import CODE_DTYPES
from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.launch import fast_launch
from pageflash.layers.moe import experts_ref, route

__all__ = ["fused_moe", "fused_moe_ref", "moe_align", "route_align", "routed_moe"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------ reference


fused_moe_ref = experts_ref  # plain PyTorch, expert by expert (as transformers): layers/moe.py


# ------------------------------------------------------------------------------------------ alignment


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the number of block_m-row blocks ``moe_align`` can use: each used expert
    wastes less than one block on padding, and at most min(num_pairs, num_experts) experts are used."""
    return cdiv(num_pairs, block_m) + min(num_pairs, num_experts)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the T*k (token, slot) pairs (pair p = t*k + j) by expert, each group padded to a multiple
    of block_m.

    Returns (sorted_ids, block_expert, num_rows):
    - sorted_ids int32 [max_blocks * block_m]: pair ids, expert by expert (ascending expert, ascending
      pair id within an expert); padding slots hold the sentinel T*k;
    - block_expert int32 [max_blocks]: the expert of each block of block_m rows (blocks at or past
      num_rows hold num_experts - 1; kernels must skip them);
    - num_rows int32 [1]: the padded rows in use, sum_e ceil(count_e / block_m) * block_m.
    max_blocks = cdiv(T*k, block_m) + min(T*k, num_experts). Static shapes and no host sync: capturable
    in a CUDA graph. topk_ids must lie in [0, num_experts) (unchecked)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"moe_align: topk_ids must be [T, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"moe_align: num_experts ({num_experts}) and block_m ({block_m}) must be >= 1")
    dev = topk_ids.device
    p = topk_ids.numel()
    nblk = max_blocks(p, num_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, device=dev, dtype=torch.int64)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # inclusive
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    sorted_exp = flat[order]
    rank = torch.arange(p, device=dev) - count_start[sorted_exp]
    dest = padded_start[sorted_exp] + rank
    sorted_ids = torch.full((nblk * block_m,), p, device=dev, dtype=torch.int32)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(nblk, device=dev, dtype=torch.int64) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    num_rows = padded_end[-1:].to(torch.int32)
    return sorted_ids, block_expert, num_rows


@triton.jit
def _expert_range(counts, e, E_PAD: tl.constexpr, BM: tl.constexpr):
    # expert e's rows in sorted_ids from every expert's pair count: its group starts after the padded
    # groups of experts < e; (start, count, padded end, total padded rows)
    offs_e = tl.arange(0, E_PAD)
    padded = (counts + BM - 1) // BM * BM
    start = tl.cumsum(padded, 0) - padded
    my_start = tl.sum(tl.where(offs_e == e, start, 0), axis=0)
    my_count = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
    return my_start, my_count, my_start + (my_count + BM - 1) // BM * BM, tl.sum(padded, axis=0)


@triton.jit
def _label_blocks(SortedIds, BlockExpert, NumRows, e, E, NBLK, P, my_start, my_count, my_end, total,
                  BM: tl.constexpr, NB_CHUNK: tl.constexpr):
    # expert e's padding rows get the sentinel P, its blocks its id; the last expert also labels the
    # unused blocks up to NBLK (their rows: the sentinel, as moe_align leaves them); program 0 the total
    pad = my_start + my_count + tl.arange(0, BM)
    tl.store(SortedIds + pad, tl.zeros((BM,), tl.int32) + P, mask=pad < my_end)
    first = my_start // BM
    last = tl.where(e == E - 1, NBLK, my_end // BM)
    for c in range(0, tl.cdiv(last - first, NB_CHUNK)):
        offs_b = first + c * NB_CHUNK + tl.arange(0, NB_CHUNK)
        tl.store(BlockExpert + offs_b, tl.zeros((NB_CHUNK,), tl.int32) + e, mask=offs_b < last)
        if e == E - 1:
            rows = (offs_b * BM)[:, None] + tl.arange(0, BM)[None, :]
            tl.store(SortedIds + rows, tl.zeros((NB_CHUNK, BM), tl.int32) + P,
                     mask=(offs_b[:, None] < last) & (rows >= my_end))
    if e == 0:
        tl.store(NumRows, total)


@triton.jit
def _route_align_kernel(
    Logits, Weights, Ids, SortedIds, BlockExpert, NumRows,
    T, E, NBLK, stride_lt,
    K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr,
    T_PAD: tl.constexpr, E_PAD: tl.constexpr, NB_CHUNK: tl.constexpr,
):
    # grid (E,): program e routes every token (route(): softmax in float32, the top K by repeated
    # argmax, renormalized if asked; program 0 stores the result), then places expert e's pairs:
    # its padded start is the padded counts of experts < e summed, a pair's slot within it the number
    # of earlier pairs of expert e (moe_align's stable order). No program waits for another.
    e = tl.program_id(0)
    offs_t = tl.arange(0, T_PAD)
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    tm = offs_t < T
    lg = tl.load(Logits + offs_t[:, None] * stride_lt + offs_e[None, :],
                 mask=tm[:, None] & (offs_e[None, :] < E), other=float("-inf")).to(tl.float32)
    lg = tl.where(tm[:, None], lg, 0.0)  # padding rows: finite, never stored
    mx = tl.max(lg, axis=1)
    den = tl.sum(tl.exp(lg - mx[:, None]), axis=1)
    w = tl.zeros((T_PAD, K_PAD), tl.float32)
    ids = tl.zeros((T_PAD, K_PAD), tl.int32)
    rest = lg
    for j in tl.static_range(K):
        top = tl.argmax(rest, axis=1)
        val = tl.max(rest, axis=1)
        w = tl.where(offs_k[None, :] == j, (tl.exp(val - mx) / den)[:, None], w)
        ids = tl.where(offs_k[None, :] == j, top[:, None].to(tl.int32), ids)
        rest = tl.where(offs_e[None, :] == top[:, None], float("-inf"), rest)
    if RENORM:
        w = w / tl.sum(tl.where(offs_k[None, :] < K, w, 0.0), axis=1)[:, None]
    km = tm[:, None] & (offs_k[None, :] < K)
    pair2 = offs_t[:, None] * K + offs_k[None, :]
    if e == 0:
        tl.store(Weights + pair2, w, mask=km)
        tl.store(Ids + pair2, ids, mask=km)

    # the pairs in pair order (row-major over [T_PAD, K_PAD], the padding masked)
    flat = tl.reshape(tl.where(km, ids, E_PAD - 1), (T_PAD * K_PAD,))
    valid = tl.reshape(km, (T_PAD * K_PAD,))
    pair = tl.reshape(pair2, (T_PAD * K_PAD,))
    counts = tl.histogram(flat, E_PAD)
    counts = counts - tl.where(offs_e == E_PAD - 1, T_PAD * K_PAD - T * K, 0)  # the padding's bin
    my_start, my_count, my_end, total = _expert_range(counts, e, E_PAD, BM)
    mine = valid & (flat == e)
    slot = my_start + tl.cumsum(mine.to(tl.int32), 0) - 1
    tl.store(SortedIds + slot, pair, mask=mine)
    _label_blocks(SortedIds, BlockExpert, NumRows, e, E, NBLK, T * K, my_start, my_count, my_end, total,
                  BM, NB_CHUNK)


@triton.jit
def _route_kernel(Logits, Weights, Ids, E, stride_lt, K: tl.constexpr, K_PAD: tl.constexpr,
                  RENORM: tl.constexpr, E_PAD: tl.constexpr):
    # grid (T,): route() for one token (softmax in float32, the top K by repeated argmax)
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    offs_k = tl.arange(0, K_PAD)
    lg = tl.load(Logits + t * stride_lt + offs_e, mask=offs_e < E, other=float("-inf")).to(tl.float32)
    mx = tl.max(lg, axis=0)
    den = tl.sum(tl.exp(lg - mx), axis=0)
    w = tl.zeros((K_PAD,), tl.float32)
    ids = tl.zeros((K_PAD,), tl.int32)
    rest = lg
    for j in tl.static_range(K):
        top = tl.argmax(rest, axis=0)
        val = tl.max(rest, axis=0)
        w = tl.where(offs_k == j, tl.exp(val - mx) / den, w)
        ids = tl.where(offs_k == j, top.to(tl.int32), ids)
        rest = tl.where(offs_e == top, float("-inf"), rest)
    if RENORM:
        w = w / tl.sum(tl.where(offs_k < K, w, 0.0), axis=0)
    tl.store(Weights + t * K + offs_k, w, mask=offs_k < K)
    tl.store(Ids + t * K + offs_k, ids, mask=offs_k < K)


@triton.jit
def _align_kernel(Ids, SortedIds, BlockExpert, NumRows, P, E, NBLK,
                  BM: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, NB_CHUNK: tl.constexpr,
                  HIST: tl.constexpr):
    # grid (E,): moe_align for expert e over the routed pairs, CHUNK pairs at a time (the second half
    # of _route_align_kernel, for any number of pairs)
    e = tl.program_id(0)
    offs_c = tl.arange(0, CHUNK)
    offs_e = tl.arange(0, E_PAD)
    n_chunks = tl.cdiv(P, CHUNK)
    counts = tl.zeros((E_PAD,), tl.int32)
    for c in range(0, n_chunks):
        offs_p = c * CHUNK + offs_c
        valid = offs_p < P
        flat = tl.load(Ids + offs_p, mask=valid, other=E_PAD - 1)
        if HIST:
            counts += tl.histogram(flat, E_PAD)
        else:
            counts += tl.sum(((flat[None, :] == offs_e[:, None]) & valid[None, :]).to(tl.int32), axis=1)
    if HIST:
        counts -= tl.where(offs_e == E_PAD - 1, n_chunks * CHUNK - P, 0)  # the padding's bin
    my_start, my_count, my_end, total = _expert_range(counts, e, E_PAD, BM)
    base = my_start
    for c in range(0, n_chunks):
        offs_p = c * CHUNK + offs_c
        mine = (offs_p < P) & (tl.load(Ids + offs_p, mask=offs_p < P, other=-1) == e)
        inc = tl.cumsum(mine.to(tl.int32), 0)
        tl.store(SortedIds + base + inc - 1, offs_p, mask=mine)
        base += tl.sum(mine.to(tl.int32), axis=0)
    _label_blocks(SortedIds, BlockExpert, NumRows, e, E, NBLK, P, my_start, my_count, my_end, total, BM, NB_CHUNK)


def route_align_fits(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether route_align covers this routing (any step; up to 4096 experts, top-k <= 64)."""
    return num_experts <= 4096 and top_k <= 64


# T_PAD * E_PAD up to which routing and grouping share one launch (H100, scripts/moe_probe.py --align:
# one launch 2.8 µs against two 3.6 at T 1 / E 128; 8.2 against 4.1 at T 4)
ROUTE_ALIGN_FUSED_MAX = 256
ALIGN_HIST = True  # counts per expert by tl.histogram (else a [E, P] comparison)


def route_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                fused: Optional[bool] = None):
    """route() then moe_align(), in one launch of E programs (fused: each program routes every token;
    tiny steps) or two (one program per token routes it, then one per expert groups, reading the
    pairs in chunks): (weights float32
    [T, k], ids int32 [T, k], sorted_ids, block_expert, num_rows) as those two return them (weights to
    float rounding; the same experts but where two logits tie exactly). Only where route_align_fits."""
    if router_logits.dim() != 2:
        raise ValueError(f"route_align: router_logits must be [T, E], got {tuple(router_logits.shape)}")
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"route_align: top_k ({top_k}) must be in [1, num_experts={e}]")
    if not route_align_fits(t, e, top_k):
        raise ValueError(f"route_align: {e} experts (top {top_k}) exceed its programs; use route() and moe_align()")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    dev = router_logits.device
    p = t * top_k
    nblk = max_blocks(p, e, block_m)
    weights = torch.empty((t, top_k), device=dev, dtype=torch.float32)
    ids = torch.empty((t, top_k), device=dev, dtype=torch.int32)
    sorted_ids = torch.empty((nblk * block_m,), device=dev, dtype=torch.int32)
    block_expert = torch.empty((nblk,), device=dev, dtype=torch.int32)
    num_rows = torch.empty((1,), device=dev, dtype=torch.int32)
    if t == 0:  # no pairs: every block unused (moe_align's output for an empty step)
        sorted_ids.fill_(0)
        block_expert.fill_(e - 1)
        num_rows.zero_()
        return weights, ids, sorted_ids, block_expert, num_rows
    t_pad, e_pad = next_pow2(max(t, 1)), next_pow2(e)
    if fused is None:
        fused = t_pad * e_pad <= ROUTE_ALIGN_FUSED_MAX
    if fused and t_pad * e_pad > 16384:
        raise ValueError(f"route_align: fused routing of {t} tokens x {e} experts exceeds one program")
    if fused:
        _route_align_kernel[(e,)](
            router_logits, weights, ids, sorted_ids, block_expert, num_rows, t, e, nblk, router_logits.stride(0),
            K=top_k, K_PAD=next_pow2(top_k), RENORM=renormalize, BM=block_m, T_PAD=t_pad, E_PAD=e_pad,
            NB_CHUNK=32, num_warps=1 if t_pad * e_pad <= 1024 else (2 if t_pad * e_pad <= 4096 else 4),
        )
    else:
        _route_kernel[(t,)](router_logits, weights, ids, e, router_logits.stride(0), K=top_k,
                            K_PAD=next_pow2(top_k), RENORM=renormalize, E_PAD=e_pad, num_warps=1)
        chunk = min(next_pow2(p), 1024)
        _align_kernel[(e,)](ids, sorted_ids, block_expert, num_rows, p, e, nblk, BM=block_m, CHUNK=chunk,
                            E_PAD=e_pad, NB_CHUNK=32, HIST=ALIGN_HIST, num_warps=1 if chunk <= 256 else 4)
    return weights, ids, sorted_ids, block_expert, num_rows


# ------------------------------------------------------------------------------------------ kernel


@triton.jit
def _mma(a, b, acc, A_SCALED: tl.constexpr, W_SCALED: tl.constexpr, FAST_ACCUM: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b for one K tile: e4m3 x e4m3 (A_SCALED) in the tensor cores' running FP8 sum
    (FAST_ACCUM) or added to the float32 sum on its own (fp8_linear.fast_accum); else 16/32-bit dots,
    W_SCALED's int8 / e4m3 codes widened to a's dtype first."""
    if A_SCALED:
        if FAST_ACCUM:
            acc = tl.dot(a, b, acc)
        else:
            acc += tl.dot(a, b)
    else:
        if W_SCALED:
            b = b.to(a.dtype)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _moe_gemm_kernel(
    A, W, C, SortedIds, BlockExpert, NumRows, Scale, WScale, AScale,
    N, K, NUM_PAIRS, A_ROW_DIV, NUM_M_BLOCKS,
    stride_am, stride_we, stride_wn, stride_cm, stride_se,
    MUL_SCALE: tl.constexpr, PREC: tl.constexpr, GATED: tl.constexpr, LIBDEVICE: tl.constexpr,
    W_SCALED: tl.constexpr, A_SCALED: tl.constexpr, FAST_ACCUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # GATED: W holds [gate; up] rows ([E, 2N, K]); C[pair] = silu(A W_gate^T) * (A W_up^T), N columns,
    # each product rounded to C's dtype first and the SiLU computed as kernels/activation.py does.
    # C[pair] = A[pair // A_ROW_DIV] @ W[expert of the block]^T (* Scale[pair]); W is [E, N, K].
    # W_SCALED: W holds INT8 (or e4m3) codes, widened to A's dtype in registers; the products are multiplied by
    # WScale[expert, row] (float32, one per weight row) before anything else.
    # A_SCALED (with e4m3 W): W8A8, A holds e4m3 codes of its rows with AScale[row] (float32, one per row
    # of A: kernels/fp8_quant.py); e4m3 x e4m3 dots, the products times both scales.
    # 1-D grid over NUM_M_BLOCKS * cdiv(N, BLOCK_N), grouped GROUP_M m-blocks at a time.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(NUM_M_BLOCKS - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    num_rows = tl.load(NumRows)
    if pid_m * BLOCK_M >= num_rows:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedIds + offs_m)
    row_mask = pair < NUM_PAIRS
    a_row = tl.where(row_mask, pair // A_ROW_DIV, 0).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_row[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    w_ptrs = W + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_off = N * stride_wn
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _mma(a, b, acc, A_SCALED, W_SCALED, FAST_ACCUM, PREC)
        if GATED:
            bu = tl.load(w_ptrs + up_off, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = _mma(a, bu, acc_up, A_SCALED, W_SCALED, FAST_ACCUM, PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALED:
        s_ptrs = WScale + expert * stride_se + offs_n
        acc = acc * tl.load(s_ptrs, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(s_ptrs + N, mask=n_mask, other=0.0)[None, :]
    if A_SCALED:
        sa = tl.load(AScale + a_row, mask=row_mask, other=0.0)[:, None]
        acc = acc * sa
        if GATED:
            acc_up = acc_up * sa
    if GATED:
        g = acc.to(C.dtype.element_ty).to(tl.float32)
        act = silu_f32(g, LIBDEVICE).to(C.dtype.element_ty).to(tl.float32)
        acc = act * acc_up.to(C.dtype.element_ty).to(tl.float32)

    if MUL_SCALE:
        s = tl.load(Scale + tl.where(row_mask, pair, 0), mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * s[:, None]
    c_ptrs = C + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


_moe_gemm_kernel = fast_launch(_moe_gemm_kernel)  # host launches via the cached CompiledKernel


def _config(num_pairs: int, num_experts: int, fp8: bool = False) -> dict:
    """Tiles and launch options of the grouped GEMMs, by the (host-known) number of pairs and experts
    only, never by the routing: rows per expert if the routing were uniform pick the row tile (H100
    sweep, scripts/moe_probe.py, docs/BENCHMARKS.md). BLOCK_M is also moe_align's alignment; the gated
    first GEMM takes half of BLOCK_N (two accumulators). fp8: e4m3 x e4m3 (W8A8) operands, one byte an
    element: K tiles of 128 bytes and wider N tiles from 16 rows an expert on (run 57, H200 sweep,
    ``python -m pageflash.bench.moe --configs --quant fp8-w8a8``: 1.26-1.82x the 2-byte tiles there)."""
    rows = num_pairs / max(1, min(num_experts, num_pairs))
    if rows <= 8:  # decode: a few rows per expert; the weights spread over many programs
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3)
    if fp8:
        if rows <= 48:
            return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
        if rows <= 128:
            return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
    if rows <= 48:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    if rows <= 256:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
    num_rows: torch.Tensor, scale: Optional[torch.Tensor], a_row_div: int, cfg: dict, gated: bool = False,
    w_scale: Optional[torch.Tensor] = None, a_scale: Optional[torch.Tensor] = None,
) -> None:
    """gated: w is [E, 2N, K] ([gate; up]) and c [pairs, N] receives silu(gate) * up. w_scale: float32
    [E, rows of w] when w holds INT8 codes. a_scale: float32 [rows of a, 1] when a holds e4m3 codes
    (W8A8, with e4m3 w; the sum over K as fp8_linear.fast_accum says)."""
    num_pairs, n = c.shape
    k = a.shape[1]
    num_m = block_expert.shape[0]
    grid = (num_m * cdiv(n, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, w, c, sorted_ids, block_expert, num_rows, scale if scale is not None else c,
        w_scale if w_scale is not None else c, a_scale,
        n, k, num_pairs, a_row_div, num_m,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0), w_scale.stride(0) if w_scale is not None else 0,
        MUL_SCALE=scale is not None, PREC=_prec(c.dtype), GATED=gated, LIBDEVICE=a.is_cuda,
        W_SCALED=w_scale is not None, A_SCALED=a_scale is not None,
        FAST_ACCUM=a_scale is not None and fast_accum(), **cfg,
    )


# ------------------------------------------------------------------------------------------ public


def _check(x, w13, w2, topk_weights, topk_ids, out, w13_scale=None, w2_scale=None) -> tuple[int, int, int, int, int]:
    """Returns (T, H, E, I, k) after validating shapes, dtypes, devices and contiguity."""
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be [T, H], got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"fused_moe: x dtype must be float16/bfloat16/float32, got {x.dtype}")
    t, h = x.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    e, two_i, h13 = w13.shape
    if h13 != h:
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} has hidden size {h13}, x has {h}")
    if two_i % 2:
        raise ValueError(f"fused_moe: w13's second dim must be 2*I (gate rows, then up rows), got {two_i}")
    inter = two_i // 2
    if tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"fused_moe: w2 must be [E, H, I] = {(e, h, inter)} to match x and w13, got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"fused_moe: topk_ids must be [T={t}, k], got {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (t, k):
        raise ValueError(f"fused_moe: topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"fused_moe: topk_weights must be float32, got {topk_weights.dtype}")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fused_moe: INT8 experts need both w13_scale and w2_scale")
    if w13_scale is not None:
        if w13.dtype not in CODE_DTYPES or w2.dtype != w13.dtype:
            raise ValueError(f"fused_moe: with scales, w13 and w2 hold int8 codes or float8_e4m3fn codes of "
                             f"one dtype, got {w13.dtype} and {w2.dtype}")
        for name, sc, rows in (("w13_scale", w13_scale, two_i), ("w2_scale", w2_scale, h)):
            if tuple(sc.shape) != (e, rows) or sc.dtype != torch.float32 or not sc.is_contiguous():
                raise ValueError(f"fused_moe: {name} must be contiguous float32 [{e}, {rows}], got "
                                 f"{tuple(sc.shape)} {sc.dtype}")
    elif w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: w13 ({w13.dtype}) and w2 ({w2.dtype}) must have x's dtype ({x.dtype})")
    for name, a in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if a.device != x.device:
            raise ValueError(f"fused_moe: {name} is on {a.device}, x on {x.device}")
    for name, a in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not a.is_contiguous():
            raise ValueError(f"fused_moe: {name} must be contiguous (shape {tuple(a.shape)}, strides {a.stride()})")
    if out is not None:
        if tuple(out.shape) != (t, h) or out.dtype != x.dtype or out.device != x.device or out.stride(-1) != 1:
            raise ValueError(f"fused_moe: out must be [{t}, {h}] {x.dtype} on {x.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    return t, h, e, inter, k


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    out: Optional[torch.Tensor] = None, config: Optional[dict] = None,
    w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
    w8a8: Optional[bool] = None,
) -> torch.Tensor:
    """w13_scale / w2_scale: float32 [E, 2I] / [E, H] when w13 / w2 hold INT8 or e4m3 codes (W = codes *
    scale per row, as ``layers.moe.SparseMoE.quantize_`` makes them). w8a8 (e4m3 codes only): the
    activations quantized per row too, e4m3 x e4m3 on the tensor cores; None: ``w8a8_applies``.
    config: the tiles of both GEMMs (``_config``'s keys; probes sweep it), else ``_config``'s choice.
    x [T, H] float16/bfloat16/float32; w13 [E, 2I, H] and w2 [E, H, I] in x's dtype; topk_weights
    [T, k] float32; topk_ids [T, k] int32/int64 in [0, E) (unchecked). All contiguous, one device.
    Returns [T, H] in x's dtype (written to out if given). No host sync: CUDA-graph capturable."""
    t, h, e, inter, k = _check(x, w13, w2, topk_weights, topk_ids, out, w13_scale, w2_scale)
    if out is None:
        out = torch.empty((t, h), device=x.device, dtype=x.dtype)
    num_pairs = t * k
    if num_pairs == 0 or h == 0:
        return out
    if inter == 0:
        return out.zero_()
    w8a8 = _w8a8(w8a8, x, w13, w13_scale)
    cfg1, cfg2 = _configs(num_pairs, e, config, w8a8)
    sorted_ids, block_expert, num_rows = moe_align(topk_ids, e, cfg1["BLOCK_M"])
    return _experts(x, w13, w2, topk_weights, sorted_ids, block_expert, num_rows, k, cfg1, cfg2, out,
                    w13_scale, w2_scale, w8a8)


def _w8a8(w8a8: Optional[bool], x, w13, w13_scale) -> bool:
    if w8a8 is None:
        return w13_scale is not None and w8a8_applies(x, w13)
    if w8a8 and (w13.dtype != torch.float8_e4m3fn or w13_scale is None):
        raise ValueError(f"fused_moe: w8a8 needs e4m3 expert codes with their scales, got {w13.dtype} experts")
    return w8a8


def _configs(num_pairs: int, num_experts: int, config: Optional[dict], fp8: bool = False) -> tuple[dict, dict]:
    """(gated first GEMM's config, second GEMM's config) from one config (``_config``'s or given)."""
    cfg = config or _config(num_pairs, num_experts, fp8)
    return dict(cfg, BLOCK_N=max(16, cfg["BLOCK_N"] // 2)), cfg


def w8a8_applies(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether e4m3 experts run W8A8 (each activation row quantized to e4m3 with its own scale, e4m3 x
    e4m3 dots on the FP8 tensor cores) rather than weight-only (codes widened to x's dtype): bf16 x on
    a GPU with FP8 tensor cores (compute capability >= 8.9), at every token count (run 56: 1.19-2.33x
    the weight-only experts from 1 to 4096 tokens at qwen3-30b-a3b and mixtral shapes, H200).
    PAGEFLASH_FP8_MOE_W8A8=0 keeps them weight-only."""
    import os

    if w13.dtype != torch.float8_e4m3fn or x.dtype != torch.bfloat16 or not x.is_cuda \
            or os.environ.get("PAGEFLASH_FP8_MOE_W8A8", "1") == "0":
        return False
    return fp8_tensor_cores(x.device)


def _experts(x, w13, w2, topk_weights, sorted_ids, block_expert, num_rows, k, cfg1, cfg2, out,
             w13_scale=None, w2_scale=None, w8a8: bool = False) -> torch.Tensor:
    """The two grouped GEMMs, the SiLU between them and the sum over each token's k experts. w8a8 (e4m3
    experts): x's rows and the SiLU's output rows quantized to e4m3 per row (quantize_rows_fp8) and
    multiplied on the FP8 tensor cores."""
    t, h = x.shape
    num_pairs, inter = t * k, w2.shape[2]
    act = torch.empty((num_pairs, inter), device=x.device, dtype=x.dtype)  # silu(x gate^T) * (x up^T)
    a, a_scale = quantize_rows_fp8(x) if w8a8 else (x, None)
    _grouped_gemm(a, w13, act, sorted_ids, block_expert, num_rows, None, k, cfg1, gated=True, w_scale=w13_scale,
                  a_scale=a_scale)
    c2 = torch.empty((num_pairs, h), device=x.device, dtype=x.dtype)
    a, a_scale = quantize_rows_fp8(act) if w8a8 else (act, None)
    _grouped_gemm(a, w2, c2, sorted_ids, block_expert, num_rows, topk_weights, 1, cfg2, w_scale=w2_scale,
                  a_scale=a_scale)
    block = min(1024, next_pow2(h))
    _ksum_kernel[(t, cdiv(h, block))](c2, out, h, out.stride(0), K=k, BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out


@triton.jit
def _ksum_kernel(C, Out, H, stride_ot, K: tl.constexpr, BLOCK: tl.constexpr):
    # Out[t] = sum_j C[t * K + j] in float32 (pair order), rounded once to Out's dtype
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(C + (t * K + j) * H + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_ot + cols, acc.to(Out.dtype.element_ty), mask=m)


_ksum_kernel = fast_launch(_ksum_kernel)


def routed_moe(
    x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
    renormalize: bool, out: Optional[torch.Tensor] = None, config: Optional[dict] = None,
    w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
    w8a8: Optional[bool] = None,
) -> torch.Tensor:
    """The whole MoE block after the router's GEMM: route() + fused_moe(), with the routing and the
    grouping in Triton (route_align: one or two launches; moe_align's torch ops took 60-96 µs on an
    H100), else route() and moe_align(). router_logits: [T, E]. Capturable in a CUDA graph. w8a8: as
    fused_moe's."""
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"routed_moe: top_k ({top_k}) must be in [1, num_experts={e}]")
    if router_logits.shape[0] != x.shape[0]:
        raise ValueError(f"routed_moe: router_logits {tuple(router_logits.shape)} do not match x {tuple(x.shape)}")
    if w13.dim() != 3 or w13.shape[0] != e:
        raise ValueError(f"routed_moe: router_logits score {e} experts, w13 {tuple(w13.shape)} holds "
                         f"{w13.shape[0] if w13.dim() == 3 else '?'}")
    w8a8 = _w8a8(w8a8, x, w13, w13_scale)
    cfg1, cfg2 = _configs(t * top_k, e, config, w8a8)
    if route_align_fits(t, e, top_k) and t > 0:
        weights, ids, sorted_ids, block_expert, num_rows = route_align(router_logits, top_k, renormalize,
                                                                      cfg1["BLOCK_M"])
    else:
        weights, ids = route(router_logits, top_k, renormalize)
        sorted_ids = None
    t, h, e, inter, k = _check(x, w13, w2, weights, ids, out, w13_scale, w2_scale)
    if out is None:
        out = torch.empty((t, h), device=x.device, dtype=x.dtype)
    if t * k == 0 or h == 0:
        return out
    if inter == 0:
        return out.zero_()
    if sorted_ids is None:
        sorted_ids, block_expert, num_rows = moe_align(ids, e, cfg1["BLOCK_M"])
    return _experts(x, w13, w2, weights, sorted_ids, block_expert, num_rows, k, cfg1, cfg2, out,
                    w13_scale, w2_scale, w8a8)
