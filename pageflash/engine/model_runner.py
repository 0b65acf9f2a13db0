"""Turns a SchedulerOutput into one flat varlen forward over the paged KV cache.

Owns the model, the attention backend and the KV cache tensors. Per step it builds
(token ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens), plans the backend once,
runs the model, and returns float32 logits only at the rows that need sampling or verification.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from pageflash.config import ModelConfig
from pageflash.engine.scheduler import SchedulerOutput
from pageflash.envs import int_env
from pageflash.kernels.launch import precompile
from pageflash.transfer import HostStage, copy_to, h2d, to_device
from pageflash.layers.attention import KV_CACHE_DTYPES, AttentionMetadata, get_backend, kv_bytes_view
from pageflash.model.llama import LlamaForCausalLM
from pageflash.model.loader import ModelSource, init_dummy_weights, iter_weights

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """logits: float32 [R, V]; rows[i] = (first row, count) of scheduled seq i in logits (count 0: none)."""

    logits: torch.Tensor
    rows: list[tuple[int, int]]
    hidden: Optional[torch.Tensor] = None  # [R, H] final hidden states at those rows (Medusa heads)
    greedy: Optional[torch.Tensor] = None  # int64 [R]: each logits row's argmax, computed in the decode graph
    # SamplingParams.prompt_logprobs: per scheduled seq (first row, count) of prompt_hidden's rows, the
    # final hidden states whose logits score its next prompt tokens (count 0: none); None when no seq
    # asked. Hidden states, not logits: the caller computes the logits a slice at a time (a long
    # prompt's chunk times the vocabulary would be gigabytes of float32).
    prompt_rows: Optional[list[tuple[int, int]]] = None
    prompt_hidden: Optional[torch.Tensor] = None


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
        quantization: Optional[str] = None,
        kv_cache_dtype: str = "auto",
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """tp_size > 1: this runner is tensor-parallel rank tp_rank (engine/parallel.py starts the
        ranks): its model, KV cache (its share of the KV heads) and cfg are that rank's shard."""
        self.cfg = model_cfg.shard(tp_size)
        self.full_cfg = model_cfg  # the checkpoint's shapes (GGUF rows are un-permuted per full head count)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.quantization = quantization
        if model_cfg.checkpoint_quantization == "fp8":  # weights stored in FP8 (model/fp8_checkpoint.py)
            if quantization not in (None, "fp8"):
                raise ValueError("this checkpoint's weights are FP8 (its config.json has a quantization_config); "
                                 f"quantization must be None or 'fp8', got {quantization!r}")
            if quantization is None and tp_rank == 0:
                logger.info("the checkpoint's weights are FP8: running with quantization='fp8'")
            self.quantization = "fp8"
        if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        # the cache's element type: the model's, or the codes' of a quantized cache
        self.kv_dtype = dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]
        self.backend = get_backend(attention_backend, device)
        if self.kv_dtype == torch.float8_e4m3fn and device.type == "cuda" and self.backend.name == "triton" \
                and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU of compute capability 8.9 or newer "
                             f"(Ada, Hopper) for the Triton kernels' float8 conversions; this one is "
                             f"{torch.cuda.get_device_capability(device)}: use kv_cache_dtype='int8'")
        self.model = self._build_model(source, seed)
        self.kv_cache: Optional[torch.Tensor] = None  # [L, 2, num_blocks, block_size, Hkv, D]
        # a quantized cache's scales: float32 [L, 2, num_blocks, Hkv, block_size], one per (token, KV head)
        self.kv_scale: Optional[torch.Tensor] = None
        # per layer: (k_cache, v_cache), or (k_cache, v_cache, k_scale, v_scale) for a quantized cache
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.graphs: Optional[DecodeGraphs] = None
        self.step_graphs: Optional[StepGraphs] = None
        self.prefill_graphs: Optional[PrefillGraphs] = None
        self.graph_pool = None  # CUDA graph memory pool shared by every graph of this runner
        self.captured: list[Any] = []  # every CUDA graph captured (release_graphs destroys them)
        self.lora: Any = None  # a lora.layers.LoRAContext once enable_lora has run

    # -- setup ------------------------------------------------------------------------------------
    def _build_model(self, source: ModelSource, seed: int) -> LlamaForCausalLM:
        # A checkpoint to quantize onto a GPU is loaded into host memory first and moved over one
        # decoder layer at a time, each quantized on arrival: the GPU then never holds more than the
        # quantized model plus one layer in its 16-bit dtype (dummy weights are made on the device).
        staged = self.quantization is not None and source.kind != "config" and self.device.type != "cpu"
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device("cpu" if staged else self.device):
                model = LlamaForCausalLM(self.cfg, max_positions=self.max_model_len, tp_rank=self.tp_rank,
                                         tp_size=self.tp_size)
        finally:
            torch.set_default_dtype(prev)
        if source.kind == "config":
            init_dummy_weights(model, seed)
        else:
            model.load_weights(iter_weights(source, self.full_cfg), origin=f"checkpoint {source.path!r}")
        if self.quantization is not None:
            # an FP8 checkpoint: only what came dequantized (block scales, experts) is quantized again
            only = model.fp8_requantize if source.kind != "config" and self.cfg.checkpoint_quantization else None
            model.quantize_(self.quantization, device=self.device if staged else None, only=only)
        if staged:  # the rotary tables as the device computes them (as an unstaged model has them)
            with torch.device(self.device):
                model.make_rotary(self.max_model_len)
        return model.eval()

    @property
    def kv_quantized(self) -> bool:
        return self.kv_dtype != self.dtype

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over all layers: K and V, plus a quantized cache's float32 scale per
        (token, KV head)."""
        c = self.cfg
        per_row = c.head_dim * self.kv_dtype.itemsize + (4 if self.kv_quantized else 0)
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * per_row

    def auto_num_blocks(self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """KV blocks that fit: on CUDA, the share of device memory left after weights and a peak-activation
        estimate; on CPU, PAGEFLASH_CPU_KV_CACHE_GB (default 1) GiB."""
        per_block = self.kv_bytes_per_block()
        if self.device.type != "cuda":
            gb = float(os.environ.get("PAGEFLASH_CPU_KV_CACHE_GB", "1"))
            return max(1, int(gb * (1 << 30)) // per_block)
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        c = self.cfg
        act = max_num_batched_tokens * (6 * c.hidden_size + 3 * c.intermediate_size + c.q_size + 2 * c.kv_size
                                        # MoE: per (token, expert) pair the SiLU output and the expert's output;
                                        # Qwen2-MoE's shared expert as a dense MLP
                                        + c.num_experts_per_tok * (c.moe_intermediate_size + c.hidden_size)
                                        + 3 * c.shared_expert_intermediate_size)
        act = act * self.dtype.itemsize + max_num_seqs * c.vocab_size * 4 * 4
        if self.quantization is not None:  # large products dequantize one weight at a time (kernels/w8_linear.py)
            act += self.dtype.itemsize * max((m.out_features * m.in_features for m in self.model.modules()
                                               if getattr(m, "weight_scale", None) is not None), default=0)
        budget = int(total * gpu_memory_utilization) - used - act - (512 << 20)
        if budget < per_block:
            raise ValueError(
                f"no device memory left for the KV cache: {used / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB "
                f"with gpu_memory_utilization={gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
            )
        return budget // per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.cfg
        shape = (c.num_hidden_layers, 2, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        try:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            if self.kv_quantized:
                self.kv_scale = torch.zeros(shape[:3] + (c.num_key_value_heads, self.block_size),
                                            dtype=torch.float32, device=self.device)
        except RuntimeError as e:  # out of memory (torch.OutOfMemoryError is one) or too large to address
            self.kv_cache = self.kv_scale = None
            nbytes = num_blocks * self.kv_bytes_per_block()
            raise ValueError(
                f"the KV cache of {num_blocks} blocks of {self.block_size} tokens ({nbytes / 2**30:.1f} GiB) does not "
                f"fit on {self.device}: lower num_kv_blocks (or gpu_memory_utilization), block_size or max_model_len"
            ) from e
        if self.kv_scale is None:
            self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(c.num_hidden_layers)]
        else:
            self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1], self.kv_scale[i, 0], self.kv_scale[i, 1])
                              for i in range(c.num_hidden_layers)]

    def enable_lora(self, max_loras: int, max_rank: int, max_tokens: int) -> None:
        """Slot weights for max_loras LoRA adapters of rank <= max_rank in every targeted projection
        (before the KV cache is sized and the decode graphs are captured, which then include the
        LoRA kernels); max_tokens: the most tokens a step runs."""
        self.lora = self.model.enable_lora(max_loras, max_rank, max_tokens)

    def load_loras(self, loads: Sequence[tuple[int, Any]]) -> None:
        """Copy adapters into their slots ((slot, LoRAAdapter) pairs from the scheduler), in stream
        order before the step that first uses them."""
        for slot, adapter in loads:
            self.model.load_lora(slot, adapter)

    def _set_lora_slots(self, slots: Sequence[int], num_tokens: int) -> None:
        """Each of the step's first num_tokens tokens' adapter slot (slots: per token, padded with 0
        up to num_tokens), then the step's grouping; a step without adapter tokens skips LoRA."""
        ctx = self.lora
        active = bool(np.any(slots))  # (vectorized: a prefill step has thousands of tokens)
        if active:
            h = np.zeros(num_tokens, dtype=np.int32)
            h[: len(slots)] = slots
            copy_to(ctx.token_slots[:num_tokens], torch.from_numpy(h))
        ctx.begin_step(num_tokens, active)

    def release_graphs(self) -> None:
        """Destroy every captured CUDA graph, wait for the device and hand the graphs' memory pool back.
        A tensor-parallel rank does this before leaving its NCCL group: NCCL's communicator teardown
        waits until every graph that captured one of its collectives is destroyed (pytorch/pytorch#115388;
        NCCL counts them as the communicator's persistent references), so dropping our references is not
        enough when anything else still holds a graph: each one is reset explicitly."""
        self.graphs = None
        self.step_graphs = None
        self.prefill_graphs = None
        graphs, self.captured = self.captured, []
        for g in graphs:
            g.reset()
        self.graph_pool = None
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def time_decode_graph(self, bucket: int, iters: int = 20) -> float:
        """ms per replay of bucket's decode graph (the full-context one), back to back on the device,
        its static inputs as they are (a probe: scripts/tp_graph_probe.py; tensor-parallel ranks must
        all run it at once, their graphs' all-reduces pair up)."""
        if self.graphs is None or bucket not in self.graphs.full:
            raise ValueError(f"no decode graph of bucket {bucket} (buckets: "
                             f"{[] if self.graphs is None else sorted(self.graphs.full)})")
        g = self.graphs.full[bucket].graph
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    def capture_decode_graphs(self, max_batch: int) -> None:
        """Capture decode-step CUDA graphs for batch sizes up to max_batch (CUDA + graph-safe backend)."""
        if self.device.type != "cuda" or self.backend.name != "triton":
            return
        graphs = DecodeGraphs(self, max_batch)
        # the first prefill's kernels are queued with the decode graphs' (precompile): prompt lengths
        # that are and are not multiples of 16 (Triton specializes ints divisible by 16)
        graphs.capture(also=[functools.partial(self._prefill_once, n) for n in _PRECOMPILE_PROMPTS
                             if n <= self.max_model_len])
        self.graphs = graphs
        if self.tp_size == 1:  # (lazily captured: the ranks would have to capture in step)
            self.enable_prefill_graphs()

    @torch.inference_mode()
    def _prefill_once(self, n: int) -> None:
        """One sequence's prefill of n tokens over blocks 0.., as a first request's step runs it. Only
        run under precompile (its kernels compile, nothing is written); at engine start, before any
        block holds a sequence's K/V."""
        nb = -(-n // self.block_size)
        meta = self.metadata([n], [n], list(range(n)), [list(range(nb))])
        plan = self.backend.plan(meta)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, dtype=torch.int64, device=self.device)
        if self.lora is not None:
            self.lora.begin_step(n, active=False)
        hidden = self.model(ids, pos, self.kv_caches, self.backend, plan)
        self.model.compute_logits(hidden[-1:])

    def enable_prefill_graphs(self, max_tokens: Optional[int] = None, cuda_graphs: bool = True) -> None:
        """Lazily captured graphs of one sequence's prefill step of up to max_tokens tokens (default
        PAGEFLASH_PREFILL_GRAPH_TOKENS, 512; 0: none): see :class:`PrefillGraphs`. cuda_graphs=False runs
        the same static-buffer path eagerly (the tests' way to check it where there is no CUDA)."""
        if max_tokens is None:
            max_tokens = int_env("PAGEFLASH_PREFILL_GRAPH_TOKENS", _PREFILL_GRAPH_TOKENS, minimum=0)
        max_tokens = min(max_tokens, self.max_model_len)
        if self.backend.name != "triton" or (cuda_graphs and self.device.type != "cuda") \
                or self.model.rotary.long_offset is not None or max_tokens < PrefillGraphs.MIN_BUCKET:
            self.prefill_graphs = None
            return
        self.prefill_graphs = PrefillGraphs(self, max_tokens, cuda_graphs)

    def enable_step_graphs(self, max_batch: int, cuda_graphs: bool = True) -> None:
        """Lazily captured graphs of small multi-token steps (speculative verify, draft chains,
        early-exit drafts): see :class:`StepGraphs`. cuda_graphs=False runs the same static-buffer
        path eagerly (the tests' way to check it where there is no CUDA)."""
        if self.backend.name != "triton" or (cuda_graphs and self.device.type != "cuda"):
            return
        self.step_graphs = StepGraphs(self, max_batch, cuda_graphs)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            codes = kv_bytes_view(self.kv_cache)
            codes[:, :, dst] = codes[:, :, src]
            if self.kv_scale is not None:
                self.kv_scale[:, :, dst] = self.kv_scale[:, :, src]

    def move_kv_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copy the K/V of cache slots src_slots (and a quantized cache's scales) to dst_slots, in every
        layer: speculative tree compaction, the accepted nodes' KV moved next to the root."""
        if not src_slots:
            return
        bs = self.block_size
        kvc = kv_bytes_view(self.kv_cache)  # [L, 2, num_blocks, block_size, H, D]
        flat = kvc.view(kvc.shape[0], 2, -1, kvc.shape[4], kvc.shape[5])
        src = torch.tensor(src_slots, device=self.device)
        dst = torch.tensor(dst_slots, device=self.device)
        flat[:, :, dst] = flat[:, :, src]
        if self.kv_scale is not None:  # [L, 2, num_blocks, H, block_size]
            sc = self.kv_scale
            sc[:, :, dst // bs, :, dst % bs] = sc[:, :, src // bs, :, src % bs]

    # -- the step ---------------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, block_tables: list[list[int]], fixes: Optional[list] = None):
        """Host-side index arithmetic for one step. block_tables[i]: physical blocks of seq i.
        fixes: where given, (input index, pending row) pairs are appended for input tokens still on
        the device (async scheduling); their ids are placeholders the caller overwrites."""
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
            known = r.token_ids[c : c + real]
            ids.extend(known)
            if len(known) < real:  # the newest token was sampled by the step still in flight
                if fixes is None or len(known) + 1 != real or r.num_pending == 0:
                    raise RuntimeError(f"{r.request_id}: input tokens not known yet")
                fixes.append((len(ids), r.pending_row))
                ids.append(0)
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

    def metadata(
        self, qlens: list[int], seq_lens: list[int], slots: list[int], block_tables: list[list[int]],
        tree_mask: Optional[torch.Tensor] = None,
    ) -> AttentionMetadata:
        """A step's AttentionMetadata on the device, from prepare()'s host lists."""
        dev = self.device
        width = max(len(b) for b in block_tables)
        bt = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, b in enumerate(block_tables):
            bt[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(qlens, dtype=torch.int32).cumsum(0)
        return AttentionMetadata(
            query_start_loc=to_device(qsl, dev),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), dev),
            block_tables=to_device(bt, dev),
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.int64), dev),
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
            tree_mask=tree_mask,
        )

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
        prev_tokens: Optional[torch.Tensor] = None,
    ) -> StepResult:
        """Run one step. block_tables[i]: physical blocks of scheduled seq i.
        tree_mask / positions_override serve token-tree verification; num_layers early-exit drafts;
        need_hidden: the result must carry hidden states (Medusa): not the decode graphs (StepGraphs
        carry them). prev_tokens: the sampled token ids of the step still in flight, on the device,
        which the requests with a pending token read at their pending_row (async scheduling)."""
        self.copy_blocks(sched.block_copies)
        loads = getattr(sched, "lora_loads", None)  # (a tensor-parallel worker's compact step has none)
        if loads:
            self.load_loras(loads)
        if (
            self.graphs is not None and tree_mask is None and positions_override is None and num_layers is None
            and kv_caches is None and not need_hidden and sched.is_decode
            and len(sched.seqs) <= self.graphs.max_batch
        ):
            return self.graphs.run(sched, block_tables, prev_tokens)
        fixes: list[tuple[int, int]] = []
        ids, pos, slots, qlens, seq_lens, logit_idx, rows = self.prepare(
            sched, block_tables, fixes if prev_tokens is not None else None)
        prompt_idx, prompt_rows = self._prompt_logprob_rows(sched)
        if positions_override is not None:
            pos = positions_override
        rope_rows = self.rope_rows(sched, pos)
        sg = self.step_graphs
        if sg is not None and kv_caches is None and not fixes and prompt_rows is None:
            res = sg.run(ids, pos, slots, qlens, seq_lens, logit_idx, rows, block_tables, tree_mask, num_layers,
                         rope_rows)
            if res is not None:
                return res
        pg = self.prefill_graphs
        if pg is not None and kv_caches is None and not fixes and prompt_rows is None and tree_mask is None \
                and positions_override is None and num_layers is None and rope_rows is None:
            res = pg.run(sched, ids, pos, slots, seq_lens, rows, logit_idx, block_tables)
            if res is not None:
                return res
        meta = self.metadata(qlens, seq_lens, slots, block_tables, tree_mask)
        dev = self.device
        plan = self.backend.plan(meta)
        input_ids = to_device(torch.tensor(ids, dtype=torch.int64), dev)
        if fixes:
            _fill_pending(input_ids, fixes, prev_tokens)
        positions = to_device(torch.tensor(pos, dtype=torch.int64), dev)
        if self.lora is not None:  # (drafters' Feeds have no adapter)
            slots = [getattr(s.request, "lora_slot", 0) for s in sched.seqs]
            self._set_lora_slots(np.repeat(slots, [s.num_new_tokens for s in sched.seqs]), len(ids))
        if rope_rows is not None:
            rope_rows = to_device(torch.tensor(rope_rows, dtype=torch.int64), dev)
        hidden = self.model(input_ids, positions, kv_caches or self.kv_caches, self.backend, plan, num_layers,
                            rope_rows)
        idx = to_device(torch.tensor(logit_idx, dtype=torch.int64), dev)
        h = hidden[idx]
        ph = None
        if prompt_rows is not None:
            ph = hidden[to_device(torch.tensor(prompt_idx, dtype=torch.int64), dev)]
        return StepResult(self.model.compute_logits(h), rows, h, prompt_rows=prompt_rows, prompt_hidden=ph)

    def rope_rows(self, sched: SchedulerOutput, pos: Sequence[int]) -> Optional[list[int]]:
        """LongRoPE models: each input token's row of the rotary tables (pos: the step's positions,
        seq by seq), position + P for the tokens of requests longer than the original context
        (ModelConfig.rope_long_after: the scheduler has recomputed a request whose KV was computed
        shorter); None for the other models, whose rows are their positions."""
        rot = self.model.rotary
        if rot.long_offset is None:
            return None
        out: list[int] = []
        after = self.cfg.rope_long_after  # (set: long_offset exists for LongRoPE only)
        for s in sched.seqs:
            off = rot.long_offset if s.request.num_tokens > after else 0
            out.extend(p + off for p in pos[len(out): len(out) + s.num_new_tokens])
        return out

    @staticmethod
    def _prompt_logprob_rows(sched: SchedulerOutput) -> tuple[list[int], Optional[list[tuple[int, int]]]]:
        """The input rows whose logits score prompt tokens that still lack their prompt logprobs (the
        row at position q scores token q + 1; the last prompt position's row is the sampling row),
        and their (first, count) per seq among them; ([], None) when no seq asks."""
        if not any(getattr(s.request, "needs_prompt_logprobs", False) for s in sched.seqs):
            return [], None  # (drafters' Feeds have no such attribute)
        idx: list[int] = []
        out: list[tuple[int, int]] = []
        off = 0
        for s in sched.seqs:
            r, c, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            want = getattr(r, "needs_prompt_logprobs", False)
            lo = max(c, len(r.prompt_logprobs) - 1) if want else 0
            hi = min(c + n, r.num_prompt_tokens - 1) if want else 0
            out.append((len(idx), max(0, hi - lo)))
            idx.extend(range(off + lo - c, off + hi - c))
            off += n
        return idx, out



class DecodeGraphs:
    """CUDA graphs of the decode step (one token per sequence), one per batch-size bucket.

    Static input buffers are refilled in place before each replay; a batch is padded up to its bucket
    with rows that store nothing (slot -1) and attend to one token of block 0. The attention backend's
    plan must depend only on shapes (the Triton backend sizes its decode splits from the block-table
    width, which is fixed here at max_model_len / block_size).

    Short contexts: where the decode split count planned for ``short_kv`` keys differs from the one
    planned for max_model_len, a bucket gets a second graph, planned over the first short_kv /
    block_size columns of the same block-table buffer, and a step whose longest sequence fits takes
    it. Split programs past a sequence's last key still cost their launch (H100, llama-3-8b batch 1
    over 129-384 keys: 32 splits 8.0-8.7 us per layer, 16 splits 7.2-7.3 us; at 8000 keys 32 splits
    16.2 us, 16 splits 20.5 us). H200 (run 60, docs/BENCHMARKS.md): the best split count for each
    length would gain <= 1.3% of a step, in bands of lengths, and needs more tiers with their own split
    rule; a 512-key tier under the rule before DECODE_MIN_SPLITS (2 splits) was 1.6% slower at batch 1.

    LoRA: the graphs run every targeted projection's shrink / expand kernels (8 launches a layer,
    whatever the rows' adapters). With LoRA on, the graphs of buckets up to
    ``PAGEFLASH_LORA_FREE_GRAPHS`` (default 64; 0: none) get a twin captured without them (and with
    the batch-1 GEMV's SiLU epilogue, which LoRA turns off), which a step whose requests all run the
    base model replays. Not every bucket: each twin holds its own logits (bucket x vocab float32;
    llama-3's vocab over buckets <= 64: 90 MB, over all 20 buckets to 256: 1.05 GiB).
    """

    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.runner = runner
        dev = runner.device
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.buckets = _buckets(max_batch)
        self.max_batch = self.buckets[-1]
        n = self.max_batch
        # The static inputs are views of two buffers, so that a step refills them with two copies
        # (each buffer's prefix up to the bucket's last row) instead of five: int64 ids | positions |
        # slots, int32 seq_lens | block tables.
        self._i64 = torch.zeros(3 * n, dtype=torch.int64, device=dev)
        self._i32 = torch.zeros(n + n * self.max_blocks, dtype=torch.int32, device=dev)
        self.input_ids, self.positions, self.slots = self._i64[:n], self._i64[n: 2 * n], self._i64[2 * n:]
        # LongRoPE models: the tokens' rows of the rotary tables (ModelRunner.rope_rows), a third copy
        self.rope_rows = torch.zeros(n, dtype=torch.int64, device=dev) \
            if runner.model.rotary.long_offset is not None else None
        self.seq_lens = self._i32[:n]
        self.block_tables = self._i32[n:].view(n, self.max_blocks)
        bt_copy = os.environ.get("PAGEFLASH_DECODE_BT_COPY", "used")
        if bt_copy not in ("used", "full"):
            raise ValueError(f"PAGEFLASH_DECODE_BT_COPY must be 'used' or 'full', got {bt_copy!r}")
        # block-table columns a step copies (bt_cols); "full": all of them from the start
        self.bt_mark = self.max_blocks if bt_copy == "full" else 0
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        # the host images a step fills and copies from: the two buffers (the narrowed block tables, when
        # narrower, after the int32 one's seq_lens), the LoRA slots and LongRoPE rows (HostStage:
        # persistent, pinned, no allocation per step)
        self._stage = HostStage(dev, [(torch.int64, 3 * n), (torch.int32, n + n * self.max_blocks),
                                      (torch.int32, n), (torch.int64, n)])
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.argmax = os.environ.get("PAGEFLASH_GRAPH_ARGMAX", "1") != "0"
        short_kv = _short_kv_from_env()
        self.short_blocks = min(self.max_blocks, -(-short_kv // runner.block_size)) if short_kv > 0 else 0
        self.short_kv = self.short_blocks * runner.block_size
        self.full: dict[int, CapturedStep] = {}  # per bucket
        self.short: dict[int, CapturedStep] = {}  # per bucket whose short-context splits differ
        # LoRA on: the same graphs without the LoRA kernels, for steps without adapter rows
        self.lora_free = int_env("PAGEFLASH_LORA_FREE_GRAPHS", 64, minimum=0) if runner.lora is not None else 0
        self.full_base: dict[int, CapturedStep] = {}
        self.short_base: dict[int, CapturedStep] = {}

    def _meta(self, b: int, width: Optional[int] = None) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.qsl[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b, : width or self.max_blocks],
            slot_mapping=self.slots[:b], query_lens_cpu=[1] * b, seq_lens_cpu=[1] * b,
            block_size=self.runner.block_size,
        )

    @torch.inference_mode()
    def capture(self, also: Sequence[Callable[[], Any]] = ()) -> None:
        """Capture every bucket's graph (and short-context graph). With precompile on, the steps'
        kernels, and those of the callables in `also`, are first compiled together on a thread pool."""
        r = self.runner
        pf = _prefetcher_from_env(r.device)
        r.model.set_prefetcher(pf)  # only while capturing: eager steps skip the fork calls
        try:
            hkv = r.model.cfg.num_key_value_heads
            windows = sorted({r.model.cfg.layer_window(i) for i in range(r.model.cfg.num_hidden_layers)},
                             key=lambda w: -1 if w is None else w)
            steps = []  # (bucket, plan, short?) in capture order
            for b in reversed(self.buckets):  # largest first: the pool then fits the smaller ones
                plan = r.backend.plan(self._meta(b))
                steps.append((b, plan, False))
                if 0 < self.short_blocks < self.max_blocks:
                    short = r.backend.plan(self._meta(b, self.short_blocks))
                    if _decode_splits(short, hkv, windows) != _decode_splits(plan, hkv, windows):
                        steps.append((b, short, True))
            if _precompile_from_env():
                # every step's Triton kernels compiled at once on a thread pool (their first launches
                # below then find them), instead of one after another inside the warm-up runs
                t0 = time.perf_counter()
                with precompile():
                    for b, plan, _ in steps:
                        if pf is not None:
                            pf.active = b <= pf.max_batch
                        self._step_fn(b, plan)()
                        if self.lora_free and b == 1:  # (the SiLU epilogue's GEMV)
                            self._step_fn(b, plan, lora=False)()
                    for fn in also:
                        fn()
                logger.info("decode graphs: kernels precompiled in %.2f s", time.perf_counter() - t0)
            for b, plan, short in steps:
                if pf is not None:
                    pf.active = b <= pf.max_batch
                (self.short if short else self.full)[b] = self._capture(b, plan)
                if b <= self.lora_free:
                    (self.short_base if short else self.full_base)[b] = self._capture(b, plan, lora=False)
        finally:
            r.model.set_prefetcher(None)
        torch.cuda.synchronize()

    def run(
        self, sched: SchedulerOutput, block_tables: list[list[int]], prev_tokens: Optional[torch.Tensor] = None,
    ) -> StepResult:
        b = len(sched.seqs)
        bucket = next(x for x in self.buckets if x >= b)
        bs = self.runner.block_size
        n, w = self.max_batch, self.max_blocks
        # host images of the two buffers' prefixes; padding rows: id 0, position 0, slot -1, length 1.
        # The block tables: only their first `cols` columns (bt_cols), through a second copy when that
        # is narrower than the buffer
        cols = self.bt_cols(block_tables)
        t64, t32, tlora, trope = self._stage.take()
        n64, n32 = 2 * n + bucket, n + bucket * (w if cols == w else 0)
        h64, h32 = t64[:n64].numpy(), t32[:n32].numpy()
        h64.fill(0)
        h32.fill(0)
        ids, pos, slots = h64[:bucket], h64[n: n + bucket], h64[2 * n:]
        lens = h32[:bucket]
        tbt = t32[n: n + bucket * cols].view(bucket, cols)  # = h32's block tables at full width
        bt = tbt.numpy()
        if cols < w:
            bt.fill(0)
        slots[:] = -1
        lens[:] = 1
        fixes: list[tuple[int, int]] = []
        for i, (s, table) in enumerate(zip(sched.seqs, block_tables)):
            req = s.request
            p = req.num_computed_tokens
            if p < len(req.token_ids):
                ids[i] = req.token_ids[p]
            elif prev_tokens is not None and req.num_pending:
                fixes.append((i, req.pending_row))
            else:
                raise RuntimeError(f"{req.request_id}: input token not known yet")
            pos[i] = p
            slots[i] = table[p // bs] * bs + p % bs
            lens[i] = p + 1
            bt[i, : len(table)] = table
        h2d(self._i64[:n64], t64[:n64])
        h2d(self._i32[:n32], t32[:n32])
        if cols < w:
            h2d(self.block_tables[:bucket, :cols], tbt)
        lora = self.runner.lora is not None
        if lora:
            slots = [s.request.lora_slot for s in sched.seqs]
            lora = bucket > self.lora_free or any(slots)  # no adapter row: the twin without the LoRA kernels
        if lora:  # each row's adapter slot (padding rows: 0), read in the graph
            h = tlora[:bucket].numpy()
            h.fill(0)
            h[:b] = slots
            h2d(self.runner.lora.token_slots[:bucket], tlora[:bucket])
        if self.rope_rows is not None:
            rr = trope[:bucket].numpy()
            rr.fill(0)
            rr[: len(sched.seqs)] = self.runner.rope_rows(sched, pos[: len(sched.seqs)].tolist())
            h2d(self.rope_rows[:bucket], trope[:bucket])
        self._stage.done()
        if fixes:
            _fill_pending(self.input_ids, fixes, prev_tokens)
        c = self.select(bucket, int(lens.max()), lora)
        c.graph.replay()
        return StepResult(c.logits[:b], [(i, 1) for i in range(b)], greedy=None if c.greedy is None else c.greedy[:b])

    def bt_cols(self, block_tables: list[list[int]]) -> int:
        """How many block-table columns a step copies: the most any step has filled so far (a high-water
        mark that never shrinks; PAGEFLASH_DECODE_BT_COPY=full starts it at every column). Columns past the
        mark have only ever held zeros, so the rows a step writes end up exactly as a full-width copy
        leaves them. Why: the full width is bucket x max_model_len / block_size int32 a step (131 KB at
        bucket 64, llama-3-8b's 8192 positions), mostly zeros. (Run 48's two-GPU cliff at bucket 64,
        which this was first written for, was the per-step pin_memory() of that image: HostStage, run 49.)"""
        self.bt_mark = max(self.bt_mark, max(map(len, block_tables), default=0))
        return self.bt_mark

    def select(self, bucket: int, max_len: int, lora: bool = True) -> "CapturedStep":
        """The graph a step of this bucket takes when its longest sequence has max_len keys (lora=False
        with LoRA on: the twin without the LoRA kernels, for a step without adapter rows)."""
        full, short = (self.full, self.short) if lora or bucket > self.lora_free else (self.full_base, self.short_base)
        c = short.get(bucket)
        return c if c is not None and max_len <= self.short_kv else full[bucket]

    def _capture(self, b: int, plan: Any, lora: bool = True) -> "CapturedStep":
        """The step captured: logits, and their row argmax for the greedy fast path (kernels/argmax.py:
        two launches inside the graph instead of five PyTorch reductions after it;
        PAGEFLASH_GRAPH_ARGMAX=0 turns it off)."""
        graph, (logits, greedy) = _capture_graph(self.runner, self._step_fn(b, plan, lora))
        return CapturedStep(graph, logits, greedy, plan)

    def _step_fn(self, b: int, plan: Any, lora: bool = True):
        """The decode step of bucket b under plan: () -> (logits, greedy or None); lora=False: without
        the LoRA kernels (LoRAContext.begin_step(active=False))."""
        r = self.runner
        argmax = self.argmax and b <= _GRAPH_ARGMAX_MAX_BATCH

        rows = None if self.rope_rows is None else self.rope_rows[:b]

        def fwd():
            if r.lora is not None:  # grouped by slot inside the graph, from the rows' slots of the step
                r.lora.begin_step(b, active=lora)
            logits = r.model.compute_logits(
                r.model(self.input_ids[:b], self.positions[:b], r.kv_caches, r.backend, plan, rope_rows=rows))
            if not argmax:
                return logits, None
            from pageflash.kernels.argmax import argmax as argmax_kernel

            return logits, argmax_kernel(logits)

        return fwd


class CapturedStep(NamedTuple):
    """One captured decode graph and what lives with it: its outputs in the graph's memory
    (logits [bucket, V] float32, greedy int64 [bucket] or None) and the plan whose tensors its
    kernels read."""

    graph: Any
    logits: torch.Tensor
    greedy: Optional[torch.Tensor]
    plan: Any


# The in-graph argmax only where a step's launches are what it saves (latency-bound small batches):
# at batch 256 it is work that sampled batches never use (smollm2 W-offline measured -10% with it
# in every bucket, H100).
_GRAPH_ARGMAX_MAX_BATCH = 8

# Decode graphs for short contexts: planned for this many keys (PAGEFLASH_DECODE_SHORT_KV; 0: off).
# At 2048 the split rule (at least DECODE_MIN_SPLITS = 16) gives batch 1 16 splits where
# max_model_len 8192 gives 32. 16 splits are faster than 32 up to ~1.5k keys and slower from 2048 on
# (H200, 32 / 8 heads: 6.39 vs 5.82 us at 2048 keys, 9.17 vs 7.45 at 4096; run 60). Before run 60 the
# tier was 4096 keys (H100: 16 splits as fast as 32 at 4096 keys).
_SHORT_KV = 2048


# prompt lengths whose prefill kernels the engine precompiles at start (DecodeGraphs.capture)
_PRECOMPILE_PROMPTS = (128, 100)


def _precompile_from_env() -> bool:
    """PAGEFLASH_PRECOMPILE=0: no parallel precompile before the decode graphs' capture."""
    return os.environ.get("PAGEFLASH_PRECOMPILE", "1") != "0"


def _short_kv_from_env() -> int:
    return int_env("PAGEFLASH_DECODE_SHORT_KV", _SHORT_KV)


def _decode_splits(plan: Any, num_kv_heads: int, windows: Sequence[Optional[int]] = (None,)) -> Optional[tuple]:
    """The decode split counts a plan gives the model's layers (one per attention window), or None
    for a backend that does not split."""
    f = getattr(plan, "splits_for", None)
    return tuple(f(num_kv_heads, w) for w in windows) if f is not None else None


# Batch-1 decode graphs prefetch the head of the o, qkv and gate_up weights into L2 while the
# latency-bound kernels before them run (kernels/prefetch.py). H100, llama-3-8b batch 1: the decode
# graph 1.9% shorter (5702 vs 5810 us); more bytes (o=16..24) lost part of the gain to contention
# with the attention kernels. At batch 8 it measured -0.7% (158.2 vs 159.4 tok/s per sequence), so
# larger buckets do not prefetch by default (docs/BENCHMARKS.md run 17).
_PREFETCH_DEFAULT = "o=8,qkv=8,gate_up=8"
_PREFETCH_MAX_BATCH = 1


def _prefetcher_from_env(device: torch.device):
    """The decode graphs' weight prefetcher, or None. PAGEFLASH_L2_PREFETCH: sizes in MiB per
    projection kind ("o=16,qkv=8"; "0" or "off": none; unset: the default on sm_90+, whose bulk
    prefetch instruction it uses, none elsewhere); _MODE: bulk/line/load; _MAX_BATCH: the largest
    decode bucket that prefetches."""
    from pageflash.kernels.prefetch import WeightPrefetcher, parse_sizes

    spec = os.environ.get("PAGEFLASH_L2_PREFETCH")
    mode = os.environ.get("PAGEFLASH_L2_PREFETCH_MODE", "bulk")
    sm90 = torch.cuda.get_device_capability(device) >= (9, 0)
    if spec is None:
        spec = _PREFETCH_DEFAULT if sm90 else ""
    if spec.strip().lower() in ("", "0", "off", "none"):
        return None
    if mode == "bulk" and not sm90:
        raise ValueError("PAGEFLASH_L2_PREFETCH_MODE=bulk needs compute capability 9.0+; use line or load")
    return WeightPrefetcher(parse_sizes(spec), mode,
                            int_env("PAGEFLASH_L2_PREFETCH_MAX_BATCH", _PREFETCH_MAX_BATCH))


def _fill_pending(input_ids: torch.Tensor, fixes: list[tuple[int, int]], prev_tokens: torch.Tensor) -> None:
    """input_ids[i] = prev_tokens[row] for each (i, row): tokens sampled by the step in flight, copied
    on the device in stream order (no sync). The common case, a decode batch in the same order as
    the previous step's, is one slice copy."""
    n = len(fixes)
    if all(i == j and i == r for j, (i, r) in enumerate(fixes)):
        input_ids[:n].copy_(prev_tokens[:n])
        return
    dev = input_ids.device
    idx = to_device(torch.tensor([i for i, _ in fixes], dtype=torch.int64), dev)
    src = to_device(torch.tensor([r for _, r in fixes], dtype=torch.int64), dev)
    input_ids[idx] = prev_tokens[src]


def _capture_graph(runner: ModelRunner, fwd) -> tuple[Any, Any]:
    """(CUDA graph of fwd, fwd's output in the graph's memory), captured into the runner's shared pool
    after one warm-up run (Triton compiles, the skinny-GEMM choice, plan caches) outside the capture.
    capture_begin/end on a side stream: what torch.cuda.graph does, minus its gc.collect() and
    empty_cache(), which cost tens of ms when a graph is captured in the middle of serving."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fwd()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=runner.graph_pool)
        try:
            out = fwd()
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    if runner.graph_pool is None:
        runner.graph_pool = g.pool()
    runner.captured.append(g)
    return g, out


def _buckets(max_batch: int) -> list[int]:
    b = [x for x in (1, 2, 4, 8) if x < max_batch] + list(range(16, max_batch + 1, 16))
    if not b or b[-1] < max_batch:
        b.append(max_batch)
    return b


class StepGraphs:
    """CUDA graphs of small multi-token steps, captured lazily: speculative verify steps (1 + k
    tokens per sequence, chains or trees), draft-model and early-exit draft steps, and mixed steps
    whose sequences all feed few tokens.

    A step with S sequences feeding n_i tokens each (max n_i <= MAX_Q) runs the graph of key
    (bucket(S), Q, num_layers), Q the smallest query size >= max n_i (powers of two and the sizes the
    speculative config registers): the tokens are packed as in the eager path and padded to
    bucket(S) x Q rows that store nothing (slot -1); padded sequences have no queries and no keys.
    Attention always goes through the paged kernel with a tree mask (the causal mask of a chain is
    a lower triangle), so one graph serves chains, trees and mixed batches; its work list has
    ceil(Q / queries per tile) tiles for every sequence slot, whatever the step's real lengths,
    which the kernel reads from the static buffers. Logits are computed at every row (verify needs
    them all) and copied into one output buffer shared by every graph.

    A key is captured the CAPTURE_AFTER-th time it is seen (one-off shapes, like short prompts,
    stay eager) and at most MAX_GRAPHS keys are captured.
    """

    MAX_Q = 16
    MAX_TOKENS = 1024  # also: the shared float32 logits buffer stays under LOGITS_BYTES
    LOGITS_BYTES = 256 << 20
    MAX_GRAPHS = 64  # lazily captured ones (capture_all's come on top)
    CAPTURE_AFTER = 2

    def __init__(self, runner: ModelRunner, max_batch: int, cuda_graphs: bool = True) -> None:
        self.runner = runner
        self.cuda_graphs = cuda_graphs
        dev = runner.device
        c = runner.cfg
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.buckets = _buckets(max_batch)
        n = self.buckets[-1]
        t = self.max_tokens = max(self.MAX_Q, min(self.MAX_TOKENS, self.LOGITS_BYTES // (4 * c.vocab_size)))
        # The graphs' inputs are views of two buffers, [ids | positions | slots] and [query starts |
        # lengths | block tables], each filled by one host-to-device copy of its used prefix per
        # step (plus the mask's), instead of one copy per input.
        self._i64 = torch.zeros(3 * t, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slots = self._i64[:t], self._i64[t: 2 * t], self._i64[2 * t:]
        self.slots.fill_(-1)
        # LongRoPE models: the tokens' rows of the rotary tables (ModelRunner.rope_rows), a third copy
        self.rope_rows = torch.zeros(t, dtype=torch.int64, device=dev) \
            if runner.model.rotary.long_offset is not None else None
        self._i32 = torch.zeros(2 * n + 1 + n * self.max_blocks, dtype=torch.int32, device=dev)
        self.qsl, self.seq_lens = self._i32[: n + 1], self._i32[n + 1: 2 * n + 1]
        self.block_tables = self._i32[2 * n + 1:].view(n, self.max_blocks)
        self.mask = torch.zeros(t, self.MAX_Q, dtype=torch.uint8, device=dev)
        # the two buffers' host images, filled in place (HostStage: no allocation or pin_memory() a step)
        self._stage = HostStage(dev, [(torch.int64, 3 * t), (torch.int32, 2 * n + 1 + n * self.max_blocks)])
        self.packed_copies = True  # False: one copy per input (the reference the packed path is tested against)
        self.out_logits = torch.zeros(t, c.vocab_size, dtype=torch.float32, device=dev)
        self.out_hidden = torch.zeros(t, c.hidden_size, dtype=runner.dtype, device=dev)
        self.graphs: dict[tuple[int, int, int], Any] = {}
        self.seen: dict[tuple[int, int, int], int] = {}
        self.q_sizes = [x for x in (1, 2, 4, 8, 16) if x <= self.MAX_Q]
        self.registered: set[int] = set()
        self.replays = 0  # steps served by this class (tests and stats)

    def add_query_size(self, q: int) -> None:
        """A query length of verify steps (1 + k of a chain, 1 + nodes of a tree, 1 + the adaptive
        controller's probe k): graphs are keyed by the smallest registered size >= the step's longest
        query, so steps with fewer drafts (near max_tokens, adaptive k) pad up to a registered size
        and share the graphs captured up front. The default powers of two below the largest
        registered size are dropped; those above it stay (longer steps)."""
        if 1 <= q <= self.MAX_Q:
            self.registered.add(q)
            top = max(self.registered)
            self.q_sizes = sorted({1} | self.registered | {x for x in self.q_sizes if x > top})

    def capture_all(self, q: int, num_layers: Optional[int] = None) -> None:
        """Capture now the graphs of every sequence bucket for steps of up to q tokens per sequence."""
        nl = num_layers or self.runner.cfg.num_hidden_layers
        q = next((x for x in self.q_sizes if x >= q), q)
        t0 = time.perf_counter()
        for b in reversed(self.buckets):
            key = (b, q, nl)
            if b * q <= self.max_tokens and key not in self.graphs and q <= self.MAX_Q:
                self.graphs[key] = self._capture(key)
        logger.info("captured verify-step graphs for %d tokens per sequence in %.2f s", q, time.perf_counter() - t0)

    def _key(self, qlens: list[int], tree_mask: Optional[torch.Tensor], num_layers: Optional[int]):
        s, q = len(qlens), max(qlens)
        if s > self.buckets[-1] or q > self.MAX_Q:
            return None
        q = next(x for x in self.q_sizes if x >= q)
        if tree_mask is not None and tree_mask.shape[1] > self.MAX_Q:
            return None
        b = next(x for x in self.buckets if x >= s)
        if b * q > self.max_tokens:
            return None
        nl = num_layers or self.runner.cfg.num_hidden_layers
        return b, q, nl

    def _forward(self, key) -> None:
        b, q, nl = key
        r = self.runner
        t = b * q
        meta = AttentionMetadata(
            query_start_loc=self.qsl[: b + 1], seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            slot_mapping=self.slots[:t], query_lens_cpu=[q] * b, seq_lens_cpu=[q + 1] * b,
            block_size=r.block_size, tree_mask=self.mask[:t],
        )
        plan = r.backend.plan(meta)
        layers = None if nl == r.cfg.num_hidden_layers else nl
        rows = None if self.rope_rows is None else self.rope_rows[:t]

        def fwd() -> None:
            h = r.model(self.input_ids[:t], self.positions[:t], r.kv_caches, r.backend, plan, layers, rows)
            self.out_hidden[:t].copy_(h)
            self.out_logits[:t].copy_(r.model.compute_logits(h))

        return fwd

    def _capture(self, key) -> tuple[Any, Any]:
        """(graph or None, the forward). The forward -- and through it the plan, whose tile list the
        captured kernels read -- must live as long as the graph."""
        fwd = self._forward(key)
        if not self.cuda_graphs:
            return None, fwd
        # warm-up with no sequence: nothing is read or stored
        self.qsl.zero_()
        self.seq_lens.zero_()
        self.slots.fill_(-1)
        g, _ = _capture_graph(self.runner, fwd)
        return g, fwd

    def _copy_packed(self, ids, pos, slots, qlens, seq_lens, block_tables, b: int, t: int) -> np.ndarray:
        """The step's inputs into the graphs' buffers, two copies (host images of the buffers' used
        prefixes; padding: id 0, position 0, slot -1, no query, length 0). Returns the query starts."""
        s, n, T, N, w = len(qlens), len(ids), self.max_tokens, self.buckets[-1], self.max_blocks
        t64, t32 = self._stage.take()
        n64, n32 = 2 * T + t, 2 * N + 1 + b * w
        h64, h32 = t64[:n64].numpy(), t32[:n32].numpy()
        h64.fill(0)
        h32.fill(0)
        h64[:n] = ids
        h64[T: T + n] = pos
        h64[2 * T: 2 * T + n] = slots
        h64[2 * T + n:] = -1
        qsl = h32[: b + 1]
        np.cumsum(qlens, out=qsl[1: s + 1])
        qsl[s + 1:] = n
        h32[N + 1: N + 1 + s] = seq_lens
        bt = h32[2 * N + 1:].reshape(b, w)
        for i, table in enumerate(block_tables):
            bt[i, : len(table)] = table
        h2d(self._i64[:n64], t64[:n64])
        h2d(self._i32[:n32], t32[:n32])
        self._stage.done()
        return qsl

    def _copy_each(self, ids, pos, slots, qlens, seq_lens, block_tables, b: int, t: int) -> np.ndarray:
        """The same as _copy_packed, one copy per input (its reference)."""
        s, n = len(qlens), len(ids)
        pad = t - n
        qsl = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1 : s + 1])
        qsl[s + 1 :] = n
        lens = np.zeros(b, dtype=np.int32)
        lens[:s] = seq_lens
        bt = np.zeros((b, self.max_blocks), dtype=np.int32)
        for i, table in enumerate(block_tables):
            bt[i, : len(table)] = table
        copy_to(self.input_ids[:t], torch.tensor(ids + [0] * pad))
        copy_to(self.positions[:t], torch.tensor(list(pos) + [0] * pad))
        copy_to(self.slots[:t], torch.tensor(slots + [-1] * pad))
        copy_to(self.qsl[: b + 1], torch.from_numpy(qsl))
        copy_to(self.seq_lens[:b], torch.from_numpy(lens))
        copy_to(self.block_tables[:b], torch.from_numpy(bt))
        return qsl

    def run(self, ids, pos, slots, qlens, seq_lens, logit_idx, rows, block_tables, tree_mask, num_layers,
            rope_rows=None):
        """The step through a graph, or None (not eligible / not captured yet: run it eagerly).
        rope_rows: ModelRunner.rope_rows' (LongRoPE models)."""
        key = self._key(qlens, tree_mask, num_layers)
        if key is None:
            return None
        entry = self.graphs.get(key)
        if entry is None:
            seen = self.seen[key] = self.seen.get(key, 0) + 1
            if seen < self.CAPTURE_AFTER or len(self.graphs) >= self.MAX_GRAPHS:
                return None
            entry = self.graphs[key] = self._capture(key)
        b, q, _ = key
        s, n, t = len(qlens), len(ids), b * q
        if self.packed_copies:
            qsl = self._copy_packed(ids, pos, slots, qlens, seq_lens, block_tables, b, t)
        else:
            qsl = self._copy_each(ids, pos, slots, qlens, seq_lens, block_tables, b, t)
        if self.rope_rows is not None:
            copy_to(self.rope_rows[:t], torch.tensor(list(rope_rows) + [0] * (t - n), dtype=torch.int64))
        if tree_mask is None:  # causal within each sequence's new tokens
            local = np.arange(n) - np.repeat(qsl[:s], qlens)
            m = (np.arange(self.MAX_Q)[None, :] <= local[:, None]).astype(np.uint8)
            copy_to(self.mask[:n], torch.from_numpy(m))
        else:
            self.mask[:n].zero_()
            self.mask[:n, : tree_mask.shape[1]].copy_(tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool
                                                       else tree_mask)
        graph, fwd = entry
        if graph is not None:
            graph.replay()
        else:
            fwd()
        self.replays += 1
        out_rows = [(logit_idx[first], cnt) if cnt else (0, 0) for first, cnt in rows]
        # views of the shared output buffers: valid until the next step (a consumer that keeps rows copies them)
        return StepResult(self.out_logits[:n], out_rows, self.out_hidden[:n])


# Prefill graphs: the largest step they take (PAGEFLASH_PREFILL_GRAPH_TOKENS; 0: no prefill graphs)
_PREFILL_GRAPH_TOKENS = 512


class PrefillGraphs:
    """CUDA graphs of a step that feeds one sequence 2..max_tokens tokens: a prompt's prefill (or its
    last chunk, or what a prefix-cache hit leaves) when it is the step's only sequence, as W-decode1's
    first token and a chat request arriving at an idle server are.

    Why: such a step is launch-bound on the host, not bound by the GPU. llama-3-8b on an H200, a
    128-token prompt: 5.2 ms of kernels but 14.0 ms to the first token, 24.9 ms under a LoRA adapter
    (eight more launches a layer; docs/BENCHMARKS.md run 66).

    A step of n tokens runs the graph of the smallest bucket T >= n (powers of two from 16), with the
    tokens padded to T rows that store nothing (slot -1) and belong to no sequence. Attention goes
    through the paged kernel, causal over the cached context plus the new keys, its work list sized
    for T queries; it reads the real lengths from the static buffers. Logits are computed at one row
    (the last token's). With LoRA on, each bucket has a graph with the LoRA kernels and a twin
    without them, for base-model requests. A key is captured the CAPTURE_AFTER-th time it is seen
    (the first run of a bucket stays eager), into the runner's shared graph pool. Not taken: prompt
    logprobs, async steps whose input token is still on the device, LongRoPE models, tensor
    parallelism (ModelRunner.capture_decode_graphs)."""

    CAPTURE_AFTER = 2
    MIN_BUCKET = 16

    def __init__(self, runner: ModelRunner, max_tokens: int, cuda_graphs: bool = True) -> None:
        self.runner = runner
        self.cuda_graphs = cuda_graphs
        dev = runner.device
        self.buckets = []
        t = self.MIN_BUCKET
        while t <= max_tokens:
            self.buckets.append(t)
            t *= 2
        m = self.max_tokens = self.buckets[-1] if self.buckets else 0
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        # inputs: int64 [ids | positions | slots | the logits row], int32 [query starts | length |
        # block table], each refilled by one copy a step from a persistent pinned image
        self._i64 = torch.zeros(3 * m + 1, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slots = self._i64[:m], self._i64[m: 2 * m], self._i64[2 * m: 3 * m]
        self.logit_row = self._i64[3 * m:]
        self._i32 = torch.zeros(3 + self.max_blocks, dtype=torch.int32, device=dev)
        self.qsl, self.seq_lens = self._i32[:2], self._i32[2:3]
        self.block_tables = self._i32[3:].view(1, self.max_blocks)
        self._stage = HostStage(dev, [(torch.int64, 3 * m + 1), (torch.int32, 3 + self.max_blocks), (torch.int32, m)])
        self.graphs: dict[tuple[int, bool], Any] = {}
        self.seen: dict[tuple[int, bool], int] = {}
        self.replays = 0  # steps served by this class (tests and stats)

    def _forward(self, t: int, lora: bool):
        r = self.runner
        meta = AttentionMetadata(
            query_start_loc=self.qsl, seq_lens=self.seq_lens, block_tables=self.block_tables,
            slot_mapping=self.slots[:t], query_lens_cpu=[t], seq_lens_cpu=[t + 1],  # (not a fresh prefill:
            block_size=r.block_size,                                                 # the paged kernel)
        )
        plan = r.backend.plan(meta)

        def fwd():
            if r.lora is not None:
                r.lora.begin_step(t, active=lora)
            h = r.model(self.input_ids[:t], self.positions[:t], r.kv_caches, r.backend, plan)
            h = h.index_select(0, self.logit_row)
            return r.model.compute_logits(h), h

        return fwd

    def _capture(self, t: int, lora: bool) -> tuple[Any, Any, Any]:
        """(graph or None, the forward, its outputs in the graph's memory or None). The forward holds
        the plan, whose work list the captured kernels read: it lives as long as the graph."""
        fwd = self._forward(t, lora)
        if not self.cuda_graphs:
            return None, fwd, None
        # warm-up and capture with no sequence: nothing is read or stored
        self.qsl.zero_()
        self.seq_lens.zero_()
        self.slots.fill_(-1)
        self.logit_row.zero_()
        g, out = _capture_graph(self.runner, fwd)
        return g, fwd, out

    def run(self, sched: SchedulerOutput, ids, pos, slots, seq_lens, rows, logit_idx, block_tables):
        """The step through a graph, or None (not eligible / not captured yet: run it eagerly)."""
        n = len(ids)
        if len(sched.seqs) != 1 or n < 2 or n > self.max_tokens or len(logit_idx) > 1 \
                or len(block_tables[0]) > self.max_blocks:
            return None
        t = next(x for x in self.buckets if x >= n)
        r = self.runner
        lslot = getattr(sched.seqs[0].request, "lora_slot", 0) if r.lora is not None else 0
        if r.lora is not None and t > r.lora.token_slots.shape[0]:
            return None
        key = (t, bool(lslot))
        entry = self.graphs.get(key)
        if entry is None:
            seen = self.seen[key] = self.seen.get(key, 0) + 1
            if seen < self.CAPTURE_AFTER:
                return None
            entry = self.graphs[key] = self._capture(t, bool(lslot))
        m = self.max_tokens
        t64, t32, tlora = self._stage.take()
        h64, h32 = t64.numpy(), t32.numpy()
        h64[:n], h64[m: m + n], h64[2 * m: 2 * m + n] = ids, pos, slots
        h64[2 * m + n: 3 * m] = -1  # padding rows store nothing
        h64[3 * m] = logit_idx[0] if logit_idx else n - 1
        cols = len(block_tables[0])
        h32[:3] = (0, n, seq_lens[0])
        h32[3: 3 + cols] = block_tables[0]  # (columns past the sequence's are never read)
        h2d(self._i64, t64)
        h2d(self._i32[: 3 + cols], t32[: 3 + cols])
        if lslot:
            hl = tlora[:t].numpy()
            hl.fill(0)
            hl[:n] = lslot
            h2d(r.lora.token_slots[:t], tlora[:t])
        self._stage.done()
        graph, fwd, out = entry
        if graph is not None:
            graph.replay()
            logits, h = out
        else:
            logits, h = fwd()
        self.replays += 1
        return StepResult(logits, rows, h)
