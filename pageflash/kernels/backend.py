"""The Triton attention backend ("triton"): store K/V, then Flash-Decoding for decode-only steps,
the contiguous varlen FlashAttention-2 kernel for prefills with nothing cached yet, and the paged
prefill kernel for everything else (chunked prefill, prefix hits, multi-token and tree decode) --
except that a step mixing prefill chunks with decodes sends its leading decode sequences (the
scheduler puts running requests first) to Flash-Decoding (``TritonPlan.decode_prefix``).
Interface and conventions: pageflash.layers.attention.

``plan`` does the per-step index arithmetic once (host-side, from the metadata's CPU lists); the
pieces that depend on the model's head counts (decode split count, prefill work list, which depends
on queries per tile = BLOCK_M / padded GQA group) are computed at the first layer's ``forward`` and
cached in the plan for the other layers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from pageflash.kernels.flash_attention import flash_attn_varlen_fwd
from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode
from pageflash.kernels.host_math import next_pow2
from pageflash.kernels.kv_store import store_kv
from pageflash.kernels.paged_attention import build_tiles, paged_attention, prefill_config
from pageflash.kernels.rotary import apply_rotary
from pageflash.layers.attention import AttentionMetadata, is_fresh_prefill, register_backend

__all__ = ["TritonBackend", "TritonPlan"]

# Steps whose longest query is at most this many tokens (speculative verify, small mixed steps) split
# each sequence's keys over several programs like Flash-Decoding when the tiles alone leave SMs idle;
# the split count comes from static quantities only (tile count, block-table width), so CUDA graphs
# of these steps stay valid. Longer queries (prefill chunks) have tiles enough.
MAX_SPLIT_QUERY_LEN = 16
# A sliding window's keys start inside a key tile (at most 128 keys: decode_config's largest BLOCK_N):
# the static bound of the keys one windowed query reads is the window plus that tile.
WINDOW_TILE_SLACK = 128


@dataclass
class TritonPlan:
    """One step's plan. ``meta``: the step's metadata; ``decode``: decode-only step; ``fresh_prefill``:
    causal prefill with no context in the cache (the new K/V are all there is: the contiguous varlen
    FlashAttention kernel reads them directly, no block-table gathers); ``max_kv_len``: static bound of the KV length (block-table width x block size), which sizes the
    decode splits; the caches below are filled by the first forward of the step."""

    meta: AttentionMetadata
    decode: bool
    fresh_prefill: bool
    max_kv_len: int
    num_sms: int
    # a step with prefill chunks (queries > MAX_SPLIT_QUERY_LEN) whose first sequences are decodes (one
    # query each, as the scheduler puts running requests first): that many may go to Flash-Decoding
    # (TritonBackend.mixed_decode_min), the rest to the paged kernel (whose query tiles a single
    # query would leave mostly empty)
    decode_prefix: int = 0
    # (num_kv_heads, window) -> decode splits; ("prefix", num_kv_heads, window) -> those of the
    # decode_prefix sequences
    num_splits: dict = field(default_factory=dict)
    # (queries per tile, first sequence with tiles) -> work list
    tiles: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.meta.slot_mapping

    def kv_bound(self, window: Optional[int]) -> int:
        """Static bound of the keys one query reads: the block-table span, or a sliding window's
        (plus the partial tile it starts in)."""
        return self.max_kv_len if window is None else min(self.max_kv_len, window + WINDOW_TILE_SLACK)

    def splits_for(self, num_kv_heads: int, window: Optional[int] = None) -> int:
        s = self.num_splits.get((num_kv_heads, window))
        if s is None:
            s = choose_num_splits(self.meta.num_seqs, num_kv_heads, self.kv_bound(window), self.num_sms)
            self.num_splits[(num_kv_heads, window)] = s
        return s

    def tiles_for(self, queries_per_tile: int, device: torch.device, first_seq: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tiles.get((queries_per_tile, first_seq))
        if t is None:
            t = build_tiles(self.meta.query_lens_cpu, self.meta.seq_lens_cpu, queries_per_tile, device,
                            first_seq=first_seq)
            self.tiles[(queries_per_tile, first_seq)] = t
        return t


class TritonBackend:
    """Triton kernels on CUDA (and under TRITON_INTERPRET=1 on CPU, for tests).

    Decode steps given ``rope=`` run rotary, the K/V store and attention in one launch
    (``flash_decode(rope=...)``; PAGEFLASH_DECODE_ROPE=0: the rotary + store launch first).

    fused_combine: let the last decode split program combine the partials (one launch instead of
    two); off by default (PAGEFLASH_FUSED_COMBINE=1 turns it on): on H100 it was never faster than
    the combine kernel (docs/KERNELS.md)."""

    name = "triton"

    def __init__(self, num_sms: Optional[int] = None, fused_combine: Optional[bool] = None) -> None:
        self._num_sms = num_sms
        # forward(..., rope=(positions, cos, sin)): rotary and the K/V store in one launch
        self.fuses_rope = os.environ.get("PAGEFLASH_FUSED_ROPE_STORE", "1") != "0"
        # decode steps: rotary, K/V store, attention and (fused_combine) the split combine in one launch
        self.decode_rope = self.fuses_rope and os.environ.get("PAGEFLASH_DECODE_ROPE", "1") != "0"
        if fused_combine is None:
            fused_combine = os.environ.get("PAGEFLASH_FUSED_COMBINE", "0") == "1"
        self._fused_combine = fused_combine
        # mixed steps: their leading decode sequences through Flash-Decoding (TritonPlan.decode_prefix)
        # when they are at least this many (decode programs, sequences x KV heads) per SM; the two
        # kernels then run one after the other, which costs more than it saves for a few decodes. H100,
        # llama-3-8b heads, one layer of a mixed step (scripts/mixed_step_probe.py), paged -> split us:
        # 240 decodes + a 1024-token chunk: bf16 468 -> 424, int8 432 -> 341; 64 + 2048: bf16 273 -> 292,
        # int8 352 -> 359; 16 + 512: bf16 73 -> 175. PAGEFLASH_MIXED_DECODE=0: never.
        self.mixed_decode = os.environ.get("PAGEFLASH_MIXED_DECODE", "1") != "0"
        self.mixed_decode_min = 8
        self._counters: Optional[torch.Tensor] = None
        self._old_counters: list[torch.Tensor] = []  # captured graphs may still use a replaced buffer

    def _decode_counters(self, device: torch.device, n: int) -> Optional[torch.Tensor]:
        """Zeroed int32 counters for the fused split combine (kept at zero by the kernel itself);
        None (two-kernel combine) when a new buffer would have to be made during graph capture."""
        if not self._fused_combine:
            return None
        c = self._counters
        if c is None or c.numel() < n or c.device != device:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            if c is not None:
                self._old_counters.append(c)
            c = self._counters = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        return c

    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = 4  # interpreter: small, so that the tests exercise the splits
        return self._num_sms

    def plan(self, meta: AttentionMetadata) -> TritonPlan:
        dev = meta.seq_lens.device
        decode = meta.is_decode_only
        fresh = is_fresh_prefill(meta)
        prefix = 0
        if self.mixed_decode and not decode and not fresh and meta.tree_mask is None \
                and meta.max_query_len > MAX_SPLIT_QUERY_LEN:
            for n in meta.query_lens_cpu:
                if n != 1:
                    break
                prefix += 1
        return TritonPlan(
            meta=meta,
            decode=decode,
            fresh_prefill=fresh,
            max_kv_len=int(meta.block_tables.shape[1]) * meta.block_size,
            num_sms=self._sms(dev),
            decode_prefix=prefix,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TritonPlan,
        scale: float,
        rope: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
        kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        window: Optional[int] = None,
        positions: Optional[torch.Tensor] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D].
        rope: (positions [T], cos, sin): rotate q and k in the launch that stores K/V -- in place, or
        (decode steps) in registers inside the decode kernel, leaving q and k as they were.
        kv_scales: (k_scale, v_scale) of a quantized cache (pageflash.layers.attention's module doc).
        window, positions: a sliding-window layer's; softcap: Gemma 2's score capping (the same module doc)."""
        meta = plan.meta
        hkv = k_cache.shape[2]
        if plan.decode:
            splits = plan.splits_for(hkv, window)
            counters = self._decode_counters(q.device, q.shape[0] * hkv) if splits > 1 else None
            if rope is not None and self.decode_rope:  # rotary + K/V store inside the decode launch
                return flash_decode(
                    q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits=splits,
                    counters=counters, rope=rope, k_new=k, v_new=v, slot_mapping=meta.slot_mapping,
                    kv_scales=kv_scales, window=window, softcap=softcap,
                )
        if rope is not None:
            apply_rotary(q, k, *rope, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=meta.slot_mapping,
                         kv_scales=kv_scales)
        else:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        if plan.decode:
            return flash_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits=splits, counters=counters,
                kv_scales=kv_scales, window=window, softcap=softcap,
            )
        if plan.fresh_prefill:
            out, _ = flash_attn_varlen_fwd(q, k, v, meta.query_start_loc, meta.max_query_len, True, scale,
                                           window=window, softcap=softcap)
            return out
        group = q.shape[1] // hkv
        cfg = prefill_config(q.shape[2], group, meta.max_query_len, q.dtype, q.device,
                             k_cache.dtype if kv_scales is not None else None)
        per_tile = cfg["BLOCK_M"] // next_pow2(group)
        nd = plan.decode_prefix
        if nd * hkv < self.mixed_decode_min * plan.num_sms:
            nd = 0
        tiles = plan.tiles_for(per_tile, q.device, first_seq=nd)
        splits = 1
        if meta.max_query_len <= MAX_SPLIT_QUERY_LEN:  # few queries over the cache (verify steps): split the keys
            # a tile of BLOCK_M rows weighs like BLOCK_M / 16 decode programs (H100: at 64 sequences x 6
            # queries 2 splits won 41 -> 33 us, at 64 x 16 they lost 37 -> 47 us; at 1-16 sequences
            # 4-16 splits won 24 -> 9-12 us: scripts/bench_verify_attn.py)
            weight = max(1, cfg["BLOCK_M"] // 16)
            splits = choose_num_splits(tiles[0].numel() * weight, hkv, plan.kv_bound(window), plan.num_sms,
                                       min_splits=1)  # (the decode floor is measured for one query a sequence)
        out = paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
            meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask,
            tiles=tiles, config=cfg, num_splits=splits, kv_scales=kv_scales, window=window, positions=positions,
            softcap=softcap,
        )
        if nd:  # the leading decode sequences' rows (0..nd-1: one each), left unwritten above
            key = ("prefix", hkv, window)
            dsplits = plan.num_splits.get(key)
            if dsplits is None:
                dsplits = plan.num_splits[key] = choose_num_splits(nd, hkv, plan.kv_bound(window), plan.num_sms)
            flash_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                         num_splits=dsplits, kv_scales=kv_scales, out=out[:nd], window=window, softcap=softcap)
        return out


register_backend("triton", TritonBackend)
