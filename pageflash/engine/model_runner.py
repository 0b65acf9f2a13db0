"""Turns a SchedulerOutput into one flat varlen forward over the paged KV cache.

Owns the model, the attention backend and the KV cache tensors. Per step it builds
(token ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens), plans the backend once,
runs the model, and returns float32 logits only at the rows that need sampling or verification.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pageflash.config import ModelConfig
from pageflash.engine.scheduler import SchedulerOutput
from pageflash.layers.attention import AttentionMetadata, get_backend
from pageflash.model.llama import LlamaForCausalLM
from pageflash.model.loader import ModelSource, init_dummy_weights, iter_weights

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """logits: float32 [R, V]; rows[i] = (first row, count) of scheduled seq i in logits (count 0: none)."""

    logits: torch.Tensor
    rows: list[tuple[int, int]]
    hidden: Optional[torch.Tensor] = None  # [R, H] final hidden states at those rows (Medusa heads)


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        source: ModelSource,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_model_len: int,
        attention_backend: str = "auto",
        seed: int = 0,
    ) -> None:
        self.cfg = model_cfg
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.model = self._build_model(source, seed)
        self.backend = get_backend(attention_backend, device)
        self.kv_cache: Optional[torch.Tensor] = None  # [L, 2, num_blocks, block_size, Hkv, D]
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # -- setup ------------------------------------------------------------------------------------
    def _build_model(self, source: ModelSource, seed: int) -> LlamaForCausalLM:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(self.cfg, max_positions=self.max_model_len)
        finally:
            torch.set_default_dtype(prev)
        if source.kind == "config":
            init_dummy_weights(model, seed)
        else:
            loaded = model.load_weights(iter_weights(source, self.cfg))
            expected = {n for n, _ in model.named_parameters()}
            missing = expected - loaded
            if missing:
                raise ValueError(f"checkpoint {source.path!r} is missing weights: {sorted(missing)[:5]}...")
        return model.eval()

    def kv_bytes_per_block(self) -> int:
        c = self.cfg
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def auto_num_blocks(self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """KV blocks that fit: on CUDA, the share of device memory left after weights and a peak-activation
        estimate; on CPU, PAGEFLASH_CPU_KV_CACHE_GB (default 1) GiB."""
        import os

        per_block = self.kv_bytes_per_block()
        if self.device.type != "cuda":
            gb = float(os.environ.get("PAGEFLASH_CPU_KV_CACHE_GB", "1"))
            return max(1, int(gb * (1 << 30)) // per_block)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        c = self.cfg
        act = max_num_batched_tokens * (6 * c.hidden_size + 3 * c.intermediate_size + c.q_size + 2 * c.kv_size)
        act = act * self.dtype.itemsize + max_num_seqs * c.vocab_size * 4 * 4
        budget = int(total * gpu_memory_utilization) - used - act - (512 << 20)
        if budget < per_block:
            raise ValueError(
                f"no device memory left for the KV cache: {used / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB "
                f"with gpu_memory_utilization={gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
            )
        return budget // per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.cfg
        self.kv_cache = torch.zeros(
            c.num_hidden_layers, 2, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim,
            dtype=self.dtype, device=self.device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(c.num_hidden_layers)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # -- the step ---------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, block_tables: list[list[int]]):
        """Host-side index arithmetic for one step. block_tables[i]: physical blocks of seq i."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        seq_lens: list[int] = []
        logit_idx: list[int] = []
        rows: list[tuple[int, int]] = []
        for s, bt in zip(sched.seqs, block_tables):
            r = s.request
            c, n = r.num_computed_tokens, s.num_new_tokens
            real = n - s.num_spec_tokens
            ids.extend(r.token_ids[c : c + real])
            ids.extend(r.spec_token_ids[: s.num_spec_tokens])
            pos.extend(range(c, c + n))
            p = c
            while p < c + n:  # slots block by block
                blk, off = divmod(p, bs)
                take = min(bs - off, c + n - p)
                base = bt[blk] * bs + off
                slots.extend(range(base, base + take))
                p += take
            off0 = len(ids) - n
            if s.samples:
                k = s.num_spec_tokens + 1
                rows.append((len(logit_idx), k))
                logit_idx.extend(range(off0 + n - k, off0 + n))
            else:
                rows.append((len(logit_idx), 0))
            qlens.append(n)
            seq_lens.append(c + n)
        return ids, pos, slots, qlens, seq_lens, logit_idx, rows

    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        block_tables: list[list[int]],
        tree_mask: Optional[torch.Tensor] = None,
        positions_override: Optional[list[int]] = None,
        num_layers: Optional[int] = None,
        kv_caches: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
    ) -> StepResult:
        """Run one step. block_tables[i]: physical blocks of scheduled seq i.
        tree_mask / positions_override serve token-tree verification; num_layers early-exit drafts."""
        self.copy_blocks(sched.block_copies)
        ids, pos, slots, qlens, seq_lens, logit_idx, rows = self.prepare(sched, block_tables)
        if positions_override is not None:
            pos = positions_override
        dev = self.device
        width = max(len(b) for b in block_tables)
        bt = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, b in enumerate(block_tables):
            bt[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(qlens, dtype=torch.int32).cumsum(0)
        nb = dev.type == "cuda"
        meta = AttentionMetadata(
            query_start_loc=qsl.to(dev, non_blocking=nb),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=nb),
            block_tables=bt.to(dev, non_blocking=nb),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=nb),
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
            tree_mask=tree_mask,
        )
        plan = self.backend.plan(meta)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=nb)
        positions = torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=nb)
        hidden = self.model(input_ids, positions, kv_caches or self.kv_caches, self.backend, plan, num_layers)
        idx = torch.tensor(logit_idx, dtype=torch.int64).to(dev, non_blocking=nb)
        h = hidden[idx]
        return StepResult(self.model.compute_logits(h), rows, h)

