"""Write the new tokens' K/V into the paged KV cache (one Triton program per token).

Cache layout (see pageflash.layers.attention): ``[num_blocks, block_size, num_kv_heads, head_dim]``;
slot ``s`` is block ``s // block_size``, offset ``s % block_size``. A slot of -1 means "do not store"
(padding tokens, e.g. in a CUDA-graph-padded batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import next_pow2
from pageflash.kernels.launch import fast_launch
from pageflash.layers.attention import store_kv_ref

__all__ = ["store_kv", "store_kv_ref"]


@triton.jit
def slot_page(SLOTS, t, PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Token t's slot as (block, offset in the block, keep [ROWS, COLS]); slot -1 keeps nothing."""
    slot = tl.load(SLOTS + t).to(tl.int64)
    blk = tl.maximum(slot, 0) // PAGE_SIZE
    off = tl.maximum(slot, 0) % PAGE_SIZE
    # (the slot is broadcast before the comparison: the interpreter rejects scalar-bool & block-bool)
    keep = (tl.zeros([ROWS, COLS], dtype=tl.int64) + slot) >= 0
    return blk, off, keep


@triton.jit
def _store_kv_kernel(
    K, V, KC, VC, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk, off, keep = slot_page(SLOTS, t, PAGE_SIZE, BLOCK_H, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = keep & (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(KC + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :],
             k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :],
             v.to(VC.dtype.element_ty), mask=mask)


_store_kv_kernel = fast_launch(_store_kv_kernel)  # host launches via the cached CompiledKernel


def check_store_args(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Shapes, dtypes and strides store_kv (and the rotary kernel's fused store) accept."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"store_kv: k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            f"store_kv: caches must both be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    t, h, d = k.shape
    if k_cache.shape[2:] != (h, d):
        raise ValueError(f"store_kv: cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {(h, d)}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"store_kv: slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"store_kv: slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in head_dim (stride {x.stride(-1)})")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v ([T, Hkv, D]) into k_cache, v_cache ([num_blocks, block_size, Hkv, D]) at
    slot_mapping ([T] int32/int64, -1 = skip). In place; no host synchronisation."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    t, h, d = k.shape
    if t == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=h, HEAD_DIM=d,
        BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(d), PAGE_SIZE=k_cache.shape[1],
        num_warps=4 if h * d >= 2048 else 2,
    )
