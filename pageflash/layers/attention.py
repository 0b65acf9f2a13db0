"""Attention over the paged KV cache, behind a small backend interface.

The model runner builds one :class:`AttentionMetadata` per step (a flat varlen batch), the backend
turns it into a plan once per step (``backend.plan(meta)``), and every layer calls
``backend.forward(q, k, v, k_cache, v_cache, plan, scale)``.

Conventions shared by every backend:

- KV cache of one layer: ``k_cache`` and ``v_cache`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``. Slot ``s`` is block ``s // block_size``,
  offset ``s % block_size``.
- Quantized KV cache (``kv_cache_dtype`` "int8" or "fp8"): the caches hold codes (int8 /
  float8_e4m3fn) and ``forward`` gets ``kv_scales=(k_scale, v_scale)``, float32
  ``[num_blocks, num_kv_heads, block_size]``: one scale per (token, KV head), symmetric
  (``quantize_kv_ref``). A key reads as ``code * scale``. Every read of the cache dequantizes; a
  prefill with nothing cached (every query's keys are this step's) attends over the unquantized
  k and v it was given, as vLLM's backends do.
- A step holds ``num_seqs`` sequences. Sequence ``i`` contributes ``query_len_i`` new tokens
  (rows ``query_start_loc[i]:query_start_loc[i+1]`` of q/k/v) and, after this step, holds
  ``seq_len_i`` tokens of KV: ``context_len_i = seq_len_i - query_len_i`` tokens already in the cache
  plus the new ones. ``forward`` first writes the new K/V into ``slot_mapping`` and then lets new
  token ``j`` (0-based within its sequence) attend to all context tokens and to new tokens
  ``0..j`` (causal) -- or, when ``tree_mask`` is given, to the new tokens ``t`` with
  ``tree_mask[row, t]`` (SpecInfer's topology-aware mask; the diagonal must be set).
- Sliding-window layers pass ``window=W`` (and ``positions``, the new tokens' positions): a query at
  position p then sees only the keys at positions > p - W (transformers' mask). A key's position is
  its index in the sequence's cache, except a token tree's new keys, which sit at ``positions`` (the
  depth of their node past the context); causal queries sit at ``context_len + j``.
- Gemma 2's layers pass ``softcap=c``: each score ``s = scale * q . k`` becomes ``c * tanh(s / c)``
  before the mask and the softmax (transformers' attn_logit_softcapping).

Covers prefill, chunked prefill, prefix-cache hits, decode and multi-token (speculative) decode
with one mechanism.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
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
        kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        window: Optional[int] = None,
        positions: Optional[torch.Tensor] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches (and, for a quantized cache, kv_scales), window,
        positions and softcap as in the module doc. Returns [T, Hq, D].

        A backend with ``fuses_rope = True`` also accepts ``rope=(positions, cos, sin)``: q and k
        arrive unrotated and it applies the rotary embedding (kernels/rotary.py's arithmetic) itself."""


# kv_cache_dtype -> the codes' dtype (vLLM's names; "fp8" is e4m3)
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
}


def kv_code_max(dtype: torch.dtype) -> float:
    """The largest code magnitude a scale maps a row's absolute maximum to (int8: 127, e4m3: 448)."""
    if dtype == torch.int8:
        return 127.0
    if dtype == torch.float8_e4m3fn:
        return 448.0
    raise TypeError(f"no KV quantization to {dtype}; use one of int8, float8_e4m3fn")


def quantize_kv_ref(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] of dtype, scale [...] float32), one symmetric scale per row:
    scale = max|x| / code_max; int8 codes = clamp(floor(x / scale + 0.5), -127, 127), e4m3 codes =
    x / scale rounded to nearest; a row of zeros gets scale 0. The Triton stores compute the same
    operations in the same order (kernels/kv_store.py ``store_quantized_rows``)."""
    qmax = kv_code_max(dtype)
    xf = x.float()
    s = xf.abs().amax(-1) / qmax
    y = xf / torch.where(s > 0, s, 1.0).unsqueeze(-1)
    if dtype == torch.int8:
        return torch.floor(y + 0.5).clamp_(-qmax, qmax).to(torch.int8), s
    return y.to(dtype), s


def dequantize_kv_ref(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [..., D] * scale [...] in float32."""
    return codes.float() * scale.unsqueeze(-1)


def kv_bytes_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache itself, or for float8 codes its bytes (uint8): indexing float8 tensors (gathers,
    index_put, index_copy_) is not implemented on every device and torch version."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor,
                    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]], who: str) -> None:
    """A quantized cache (int8 / float8_e4m3fn codes) comes with its scales, float32
    [num_blocks, Hkv, block_size] contiguous in the block, both with the same strides; a cache of
    another dtype comes without. Raises naming the problem."""
    codes = (torch.int8, torch.float8_e4m3fn)
    if kv_scales is None:
        if k_cache.dtype in codes or v_cache.dtype in codes:
            raise ValueError(f"{who}: a {k_cache.dtype} cache holds quantized codes and needs kv_scales")
        return
    ks, vs = kv_scales
    nb, bs, h, _ = k_cache.shape
    if k_cache.dtype not in codes or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"{who}: kv_scales go with int8 / float8_e4m3fn caches, got {k_cache.dtype}/{v_cache.dtype}")
    for name, x in (("k_scale", ks), ("v_scale", vs)):
        if x.shape != (nb, h, bs) or x.dtype != torch.float32 or x.stride(2) != 1:
            raise ValueError(f"{who}: {name} must be float32 [{nb}, {h}, {bs}] contiguous in the block, got "
                             f"{x.dtype} {tuple(x.shape)}")
    if ks.stride() != vs.stride():
        raise ValueError(f"{who}: k_scale and v_scale must share strides, got {ks.stride()} and {vs.stride()}")


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """Write k, v ([T, Hkv, D]) into the caches at slot_mapping ([T], -1 = skip); with kv_scales
    (k_scale, v_scale [num_blocks, Hkv, block_size]) as codes and scales (quantize_kv_ref)."""
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, i in ((k, k_cache, 0), (v, v_cache, 1)):
        if kv_scales is None:
            cache.view(nb * bs, h, d)[slots] = x[keep].to(cache.dtype)
        else:
            codes, s = quantize_kv_ref(x[keep], cache.dtype)
            kv_bytes_view(cache).view(nb * bs, h, d)[slots] = kv_bytes_view(codes)
            kv_scales[i][slots // bs, :, slots % bs] = s


def gather_kv_ref(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scales: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The first seq_len tokens of one sequence's KV, contiguous: [seq_len, Hkv, D] (with the cache's
    scales [num_blocks, Hkv, block_size]: dequantized, float32)."""
    bs = cache.shape[1]
    nblocks = (seq_len + bs - 1) // bs
    blocks = block_table[:nblocks].long()
    x = kv_bytes_view(cache)[blocks].view(cache.dtype).flatten(0, 1)[:seq_len]
    if scales is None:
        return x
    return dequantize_kv_ref(x, scales[blocks].transpose(1, 2).flatten(0, 1)[:seq_len])


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    window: Optional[int] = None,
    positions: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Plain PyTorch attention of the new queries over the paged cache (K/V already stored; with
    kv_scales, a quantized cache, dequantized; with window, sliding-window attention: the module doc,
    ``positions`` [T] needed with a tree mask; softcap: scores -> softcap * tanh(scores / softcap)).

    Computes in float32 and returns q's dtype. One sequence at a time: the reference, not the fast path.
    """
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    group = hq // hkv
    starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        s = starts[i]
        if qlen == 0:
            continue
        kk = gather_kv_ref(k_cache, meta.block_tables[i], slen, ks).float()  # [L, Hkv, D]
        vv = gather_kv_ref(v_cache, meta.block_tables[i], slen, vs).float()
        qq = q[s : s + qlen].float()  # [qlen, Hq, D]
        ctx = slen - qlen
        # [Hkv, group, qlen, D] x [Hkv, D, L] -> [Hkv, group, qlen, L]
        qh = qq.view(qlen, hkv, group, -1).permute(1, 2, 0, 3)
        scores = soft_cap(torch.matmul(qh, kk.permute(1, 2, 0).unsqueeze(1)) * scale, softcap)
        allowed = torch.ones(qlen, slen, dtype=torch.bool, device=q.device)
        if meta.tree_mask is None:
            allowed[:, ctx:] = torch.ones(qlen, qlen, dtype=torch.bool, device=q.device).tril()
        else:
            allowed[:, ctx:] = meta.tree_mask[s : s + qlen, :qlen]
        if window is not None:
            kpos = torch.arange(slen, device=q.device)
            if meta.tree_mask is None:
                qpos = kpos[ctx:]
            else:
                if positions is None:
                    raise ValueError("paged_attention_ref: a sliding window over a token tree needs the positions")
                qpos = positions[s : s + qlen].to(kpos.dtype)
                kpos = torch.cat([kpos[:ctx], qpos])
            allowed &= kpos[None, :] > qpos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = torch.matmul(p, vv.permute(1, 0, 2).unsqueeze(1))  # [Hkv, group, qlen, D]
        out[s : s + qlen] = o.permute(2, 0, 1, 3).reshape(qlen, hq, -1).to(q.dtype)
    return out


@dataclass
class _CpuDecodePlan:
    """What every layer of one CPU decode step shares: the block ids to gather (int64, [B, blocks of
    the longest sequence]), that length, and the length mask (None when all sequences are that long);
    ``window_mask(W)`` that of a sliding-window layer."""

    meta: AttentionMetadata
    index: torch.Tensor
    max_len: int
    mask: Optional[torch.Tensor]
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: Optional[int]) -> Optional[torch.Tensor]:
        if window is None or window >= self.max_len:
            return self.mask
        m = self.window_masks.get(window)
        if m is None:
            m = _window_valid(self.meta.seq_lens, self.max_len, window).view(-1, 1, 1, self.max_len)
            self.window_masks[window] = m
        return m

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
        kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        window: Optional[int] = None,
        positions: Optional[torch.Tensor] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """plan: from `plan(meta)`, or the metadata itself. kv_scales: a quantized cache's scales.
        window, positions: a sliding-window layer's; softcap: Gemma 2's score capping (module doc)."""
        meta = plan.meta if isinstance(plan, _CpuDecodePlan) else plan
        check_kv_scales(k_cache, v_cache, kv_scales, "TorchBackend.forward")
        if kv_scales is not None:
            store_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
            if is_fresh_prefill(meta):
                return causal_varlen_ref(q, k, v, meta, scale, window, softcap)
        elif q.device.type == "cpu":  # the CPU's serving path: fewer, larger ops than the reference
            _store_kv_cpu(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            store_kv_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode_only:
            if q.device.type == "cpu" and softcap is None:  # (SDPA has no score capping)
                p = plan if isinstance(plan, _CpuDecodePlan) else _CpuDecodePlan.of(meta)
                return _decode_sdpa(q, k_cache, v_cache, p, scale, kv_scales, window)
            return _decode_batched_ref(q, k_cache, v_cache, meta, scale, kv_scales, window, softcap)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, kv_scales, window, positions, softcap)


def soft_cap(scores: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """Gemma 2's attention-logit softcapping: cap * tanh(scores / cap) (scores as they are when cap is None)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def is_fresh_prefill(meta: AttentionMetadata) -> bool:
    """A step of prompts with nothing cached: every sequence's keys are its new tokens (causal)."""
    return (meta.tree_mask is None and not meta.is_decode_only
            and all(q == s for q, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu)))


def causal_varlen_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: Optional[int] = None, softcap: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its new keys only (a fresh prefill), from
    k and v as given (not from the cache): torch's SDPA in float32 per sequence, q's dtype out.
    window: sliding-window attention (query i sees keys i - window + 1 .. i); softcap: capped scores
    (then without SDPA, which has no such option)."""
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    start = 0
    for n in meta.query_lens_cpu:
        if n:
            qq, kk, vv = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
            if softcap is not None:
                i = torch.arange(n, device=q.device)
                mask = i[None, :] <= i[:, None]
                if window is not None:
                    mask &= i[None, :] > i[:, None] - window
                if gqa:
                    kk, vv = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=0) for x in (kk, vv))
                scores = soft_cap(torch.matmul(qq, kk.transpose(1, 2)) * scale, softcap)
                o = torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), vv)
            elif window is not None and window < n:
                i = torch.arange(n, device=q.device)
                mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
                o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale,
                                                                     enable_gqa=gqa)
            else:
                o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale,
                                                                     enable_gqa=gqa)
            out[start:start + n] = o.transpose(0, 1).to(q.dtype)
        start += n
    return out


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


def _gather(cache: torch.Tensor, index: torch.Tensor, max_len: int, scales: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
    """Each sequence's first max_len slots of one cache, contiguous: [B, max_len, Hkv, D] (with the
    cache's scales [num_blocks, Hkv, block_size]: dequantized, float32)."""
    x = kv_bytes_view(cache)[index].view(cache.dtype).flatten(1, 2)[:, :max_len]
    if scales is None:
        return x
    return dequantize_kv_ref(x, scales[index].transpose(2, 3).flatten(1, 2)[:, :max_len])


def _window_valid(seq_lens: torch.Tensor, max_len: int, window: Optional[int]) -> torch.Tensor:
    """[B, max_len] bool: the key slots a decode query sees (its sequence's length, and the last
    ``window`` of them for a sliding-window layer)."""
    pos = torch.arange(max_len, device=seq_lens.device)
    lens = seq_lens[:, None].to(pos.dtype)
    valid = pos[None, :] < lens
    if window is not None:
        valid &= pos[None, :] >= lens - window
    return valid


def _decode_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _CpuDecodePlan, scale: float,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None, window: Optional[int] = None,
) -> torch.Tensor:
    """Decode on the CPU: the batch's pages gathered as in _decode_batched_ref, then torch's SDPA
    (GQA without repeating K/V; the plan's length mask). Tested against _decode_batched_ref."""
    b, hq, d = q.shape
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    kk = _gather(k_cache, plan.index, plan.max_len, ks).transpose(1, 2)  # [B, Hkv, L, D]
    vv = _gather(v_cache, plan.index, plan.max_len, vs).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.view(b, hq, 1, d), kk.to(q.dtype), vv.to(q.dtype), attn_mask=plan.window_mask(window), scale=scale,
        enable_gqa=hq != k_cache.shape[2],
    )
    return o.view(b, hq, d)


def _decode_batched_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None, window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Decode (one query per sequence) for the whole batch at once: gather, pad, mask.

    Same function as paged_attention_ref, batched so that CPU decode is not a Python loop per sequence.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    index, max_len = _decode_index(meta)
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    kk = _gather(k_cache, index, max_len, ks).float()  # [B, L, Hkv, D]
    vv = _gather(v_cache, index, max_len, vs).float()
    qh = q.float().view(b, hkv, group, d)
    scores = soft_cap(torch.einsum("bhgd,blhd->bhgl", qh, kk) * scale, softcap)
    valid = _window_valid(meta.seq_lens, max_len, window)  # [B, L]
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
