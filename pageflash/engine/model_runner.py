"""Turns a SchedulerOutput into one flat varlen forward over the paged KV cache.

Owns the model, the attention backend and the KV cache tensors. Per step it builds
(token ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens), plans the backend once,
runs the model, and returns float32 logits only at the rows that need sampling or verification.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
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
        self.graphs: Optional[DecodeGraphs] = None

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

    def capture_decode_graphs(self, max_batch: int) -> None:
        """Capture decode-step CUDA graphs for batch sizes up to max_batch (CUDA + graph-safe backend)."""
        if self.device.type != "cuda" or self.backend.name != "triton":
            return
        graphs = DecodeGraphs(self, max_batch)
        graphs.capture()
        self.graphs = graphs

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
        need_hidden: bool = False,
    ) -> StepResult:
        """Run one step. block_tables[i]: physical blocks of scheduled seq i.
        tree_mask / positions_override serve token-tree verification; num_layers early-exit drafts;
        need_hidden: the result must carry hidden states (Medusa), so no CUDA-graph replay."""
        self.copy_blocks(sched.block_copies)
        if (
            self.graphs is not None and tree_mask is None and positions_override is None and num_layers is None
            and kv_caches is None and not need_hidden and all(s.num_new_tokens == 1 and s.samples for s in sched.seqs)
            and len(sched.seqs) <= self.graphs.max_batch
        ):
            return self.graphs.run(sched, block_tables)
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



class DecodeGraphs:
    """CUDA graphs of the decode step (one token per sequence), one per batch-size bucket.

    Static input buffers are refilled in place before each replay; a batch is padded up to its bucket
    with rows that store nothing (slot -1) and attend to one token of block 0. The attention backend's
    plan must depend only on shapes (the Triton backend sizes its decode splits from the block-table
    width, which is fixed here at max_model_len / block_size).
    """

    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.runner = runner
        dev = runner.device
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch + 1, 16))
        if not self.buckets or self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        self.max_batch = self.buckets[-1]
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.qsl[: b + 1], seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            slot_mapping=self.slots[:b], query_lens_cpu=[1] * b, seq_lens_cpu=[1] * b,
            block_size=self.runner.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        for b in reversed(self.buckets):  # largest first: the pool then fits the smaller ones
            meta = self._meta(b)
            plan = r.backend.plan(meta)
            fwd = lambda: r.model.compute_logits(  # noqa: E731
                r.model(self.input_ids[:b], self.positions[:b], r.kv_caches, r.backend, plan))
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fwd()  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.logits[b] = fwd()
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()

    def run(self, sched: SchedulerOutput, block_tables: list[list[int]]) -> StepResult:
        b = len(sched.seqs)
        bucket = next(x for x in self.buckets if x >= b)
        bs = self.runner.block_size
        ids = [0] * bucket
        pos = [0] * bucket
        slots = [-1] * bucket
        lens = [1] * bucket
        bt = np.zeros((bucket, self.max_blocks), dtype=np.int32)
        for i, (s, table) in enumerate(zip(sched.seqs, block_tables)):
            req = s.request
            p = req.num_computed_tokens
            ids[i] = req.token_ids[p]
            pos[i] = p
            slots[i] = table[p // bs] * bs + p % bs
            lens[i] = p + 1
            bt[i, : len(table)] = table
        self.input_ids[:bucket].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(pos), non_blocking=True)
        self.slots[:bucket].copy_(torch.tensor(slots), non_blocking=True)
        self.seq_lens[:bucket].copy_(torch.tensor(lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:bucket].copy_(torch.from_numpy(bt), non_blocking=True)
        self.graphs[bucket].replay()
        return StepResult(self.logits[bucket][:b], [(i, 1) for i in range(b)])
