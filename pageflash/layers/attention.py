"""Attention over the paged KV cache, behind a small backend interface.

The model runner builds one :class:`AttentionMetadata` per step (a flat varlen batch), the backend
turns it into a plan once per step (``backend.plan(meta)``), and every layer calls
``backend.forward(q, k, v, k_cache, v_cache, plan, scale)``.

Conventions shared by every backend:

- KV cache of one layer: ``k_cache`` and ``v_cache`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``. Slot ``s`` is block ``s // block_size``,
  offset ``s % block_size``.
- A step holds ``num_seqs`` sequences. Sequence ``i`` contributes ``query_len_i`` new tokens
  (rows ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v) and, after this step, holds
  ``seq_len_i`` tokens of KV: ``context_len_i = seq_len_i - query_len_i`` tokens already in the cache
  plus the new ones. ``forward`` first writes the new K/V into ``slot_mapping`` and then lets new
  token ``j`` (0-based within its sequence) attend to all context tokens and to new tokens
  ``0..j`` (causal) -- or, when ``tree_mask`` is given, to the new tokens ``t`` with
  ``tree_mask[row, t]`` (SpecInfer's topology-aware mask; the diagonal must be set).

Covers prefill, chunked prefill, prefix-cache hits, decode and multi-token (speculative) decode
with one mechanism.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch


@dataclass
class AttentionMetadata:
    """One step's attention inputs (all tensors on the model's device).

    query_start_loc: int32 [num_seqs + 1], cumulative query lengths (cu_seqlens_q).
    seq_lens:        int32 [num_seqs], KV length of each sequence after this step.
    block_tables:    int32 [num_seqs, max_blocks_per_seq], physical block ids (padding: 0).
    slot_mapping:    int64 [num_tokens], cache slot of each new token (-1: do not store).
    tree_mask:       bool  [num_tokens, max_query_len] or None (None = causal among new tokens).
    query_lens_cpu / seq_lens_cpu: the same lengths as Python lists, so that planning needs no sync.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    tree_mask: Optional[torch.Tensor] = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.tree_mask is None and all(q == 1 for q in self.query_lens_cpu)


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata) -> Any:
        """Index arithmetic once per step; the result is passed to every layer's forward."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: Any,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches as in the module doc. Returns [T, Hq, D].

        A backend with ``fuses_rope = True`` also accepts ``rope=(positions, cos, sin)``: q and k
        arrive unrotated and it applies the rotary embedding (kernels/rotary.py's arithmetic) itself."""


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v ([T, Hkv, D]) into the caches at slot_mapping ([T], -1 = skip)."""
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(nb * bs, h, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, h, d)[slots] = v[keep].to(v_cache.dtype)


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence's KV, contiguous: [seq_len, Hkv, D]."""
    bs = cache.shape[1]
    nblocks = (seq_len + bs - 1) // bs
    return cache[block_table[:nblocks].long()].flatten(0, 1)[:seq_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Plain PyTorch attention of the new queries over the paged cache (K/V already stored).

    Computes in float32 and returns q's dtype. One sequence at a time: the reference, not the fast path.
    """
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    group = hq // hkv
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        s = starts[i]
        if qlen == 0:
            continue
        kk = gather_kv_ref(k_cache, meta.block_tables[i], slen).float()  # [L, Hkv, D]
        vv = gather_kv_ref(v_cache, meta.block_tables[i], slen).float()
        qq = q[s : s + qlen].float()  # [qlen, Hq, D]
        ctx = slen - qlen
        # [Hkv, group, qlen, D] x [Hkv, D, L] -> [Hkv, group, qlen, L]
        qh = qq.view(qlen, hkv, group, -1).permute(1, 2, 0, 3)
        scores = torch.matmul(qh, kk.permute(1, 2, 0).unsqueeze(1)) * scale
        allowed = torch.ones(qlen, slen, dtype=torch.bool, device=q.device)
        if meta.tree_mask is None:
            allowed[:, ctx:] = torch.ones(qlen, qlen, dtype=torch.bool, device=q.device).tril()
        else:
            allowed[:, ctx:] = meta.tree_mask[s : s + qlen, :qlen]
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = torch.matmul(p, vv.permute(1, 0, 2).unsqueeze(1))  # [Hkv, group, qlen, D]
        out[s : s + qlen] = o.permute(2, 0, 1, 3).reshape(qlen, hq, -1).to(q.dtype)
    return out


@dataclass
class _CpuDecodePlan:
    """What every layer of one CPU decode step shares: the block ids to gather (int64, [B, blocks of
    the longest sequence]), that length, and the length mask (None when all sequences are that long)."""

    meta: AttentionMetadata
    index: torch.Tensor
    max_len: int
    mask: Optional[torch.Tensor]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> "_CpuDecodePlan":
        index, max_len = _decode_index(meta)
        mask = None
        if min(meta.seq_lens_cpu) != max_len:
            pos = torch.arange(max_len, device=index.device)
            mask = (pos[None, :] < meta.seq_lens[:, None].to(pos.dtype)).view(-1, 1, 1, max_len)
        return cls(meta, index, max_len, mask)


class TorchBackend:
    """Pure-PyTorch backend: runs on CPU and CUDA, and is the reference for the Triton kernels."""

    name = "torch"

    def plan(self, meta: AttentionMetadata) -> Any:
        """meta itself, or for a CPU decode step the gather index and mask its layers share."""
        if meta.slot_mapping.device.type == "cpu" and meta.is_decode_only:
            return _CpuDecodePlan.of(meta)
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: Any,
        scale: float,
    ) -> torch.Tensor:
        """plan: from `plan(meta)`, or the metadata itself."""
        meta = plan.meta if isinstance(plan, _CpuDecodePlan) else plan
        if q.device.type == "cpu":  # the CPU's serving path: fewer, larger ops than the reference
            _store_kv_cpu(k, v, k_cache, v_cache, meta.slot_mapping)
            if meta.is_decode_only:
                p = plan if isinstance(plan, _CpuDecodePlan) else _CpuDecodePlan.of(meta)
                return _decode_sdpa(q, k_cache, v_cache, p, scale)
            return paged_attention_ref(q, k_cache, v_cache, meta, scale)
        store_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return _decode_batched_ref(q, k_cache, v_cache, meta, scale)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)


def _store_kv_cpu(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """store_kv_ref as one index_copy_ per cache when every slot is real (no -1), as in decode steps
    (checking that costs no device sync on the CPU); otherwise store_kv_ref."""
    if k.dtype != k_cache.dtype or not bool((slot_mapping >= 0).all()):
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def _decode_index(meta: AttentionMetadata) -> tuple[torch.Tensor, int]:
    """The block ids that hold the batch's keys (int64 [B, ceil(L / block_size)]) and L, the longest length."""
    max_len = meta.max_seq_len
    return meta.block_tables[:, : (max_len + meta.block_size - 1) // meta.block_size].long(), max_len


def _gather(cache: torch.Tensor, index: torch.Tensor, max_len: int) -> torch.Tensor:
    """Each sequence's first max_len slots of one cache, contiguous: [B, max_len, Hkv, D]."""
    return cache[index].flatten(1, 2)[:, :max_len]


def _decode_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _CpuDecodePlan, scale: float
) -> torch.Tensor:
    """Decode on the CPU: the batch's pages gathered as in _decode_batched_ref, then torch's SDPA
    (GQA without repeating K/V; the plan's length mask). Tested against _decode_batched_ref."""
    b, hq, d = q.shape
    kk = _gather(k_cache, plan.index, plan.max_len).transpose(1, 2)  # [B, Hkv, L, D]
    vv = _gather(v_cache, plan.index, plan.max_len).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.view(b, hq, 1, d), kk.to(q.dtype), vv.to(q.dtype), attn_mask=plan.mask, scale=scale,
        enable_gqa=hq != k_cache.shape[2],
    )
    return o.view(b, hq, d)


def _decode_batched_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Decode (one query per sequence) for the whole batch at once: gather, pad, mask.

    Same function as paged_attention_ref, batched so that CPU decode is not a Python loop per sequence.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    index, max_len = _decode_index(meta)
    kk = _gather(k_cache, index, max_len).float()  # [B, L, Hkv, D]
    vv = _gather(v_cache, index, max_len).float()
    qh = q.float().view(b, hkv, group, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qh, kk) * scale
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < meta.seq_lens[:, None].to(pos.dtype)  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhgl,blhd->bhgd", p, vv)
    return o.reshape(b, hq, d).to(q.dtype)


_BACKENDS: dict[str, type] = {"torch": TorchBackend}


def register_backend(name: str, cls: type) -> None:
    _BACKENDS[name] = cls


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """'auto' picks Triton on CUDA (when importable) and the PyTorch reference elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            try:
                from pageflash.kernels.backend import TritonBackend  # noqa: F401  (registers itself)

                return _BACKENDS["triton"]()
            except ImportError:
                return TorchBackend()
        return TorchBackend()
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(f"attention_backend='triton' needs a CUDA device, got {device.type!r}: use 'torch' or "
                         f"'auto' there (or TRITON_INTERPRET=1, the slow Triton interpreter the tests use)")
    if name == "triton" and "triton" not in _BACKENDS:
        from pageflash.kernels.backend import TritonBackend  # noqa: F401
    if name not in _BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(_BACKENDS) + ['auto']}, got {name!r}")
    return _BACKENDS[name]()
