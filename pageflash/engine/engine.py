"""LLMEngine: schedule -> run -> sample -> process outputs, one step at a time.

add_request() validates and queues; step() runs one continuous-batching step and returns a
RequestOutput for every request that progressed; abort_request() frees a request's blocks at once.
Not thread-safe: one thread owns an engine (the server's AsyncLLMEngine runs it in a loop thread).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import operator
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch

from pageflash.config import ModelConfig
from pageflash.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pageflash.engine.kv_cache import KVCacheManager, blocks_held_max
from pageflash.engine.model_runner import ModelRunner
from pageflash.engine.sampler import Sampler, SamplingBatch, SamplingRow, SeedStream
from pageflash.engine.scheduler import Scheduler, SchedulerOutput
from pageflash.engine.sequence import Request
from pageflash.engine.structured import StructuredOutputs
from pageflash.layers.attention import KV_CACHE_DTYPES
from pageflash.lora.manager import AdapterCache, AdapterSlots
from pageflash.lora.request import LoRARequest
from pageflash.model.loader import (
    ModelSource, generation_defaults, load_config, load_generation_config, load_tokenizer, read_generation_config,
    resolve_model,
)
from pageflash.model.registry import DEFAULT_MODEL
from pageflash.outputs import CompletionOutput, Logprob, RequestOutput
from pageflash.sampling_params import MAX_LOGPROBS, PoolingParams, SamplingParams
from pageflash.spec.config import SpeculativeConfig
from pageflash.spec.decoding import SpecDecoder

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], dict[str, Any]]

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class EngineConfig:
    """What the user asked for; derived values (resolved device, dtype, lengths) live on the engine."""

    model: str = DEFAULT_MODEL
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = True
    seed: int = 0
    load_format: str = "auto"
    attention_backend: str = "auto"
    # quantization of the decoder layers' projections at load (None: as loaded); "int8": per-row
    # symmetric int8 codes, weight-only (kernels/w8_linear.py); "fp8": per-row e4m3 codes, W8A8 for
    # larger products (kernels/fp8_linear.py); layers/linear.py QUANTIZATION_METHODS
    quantization: Optional[str] = None
    # the KV cache's element type: "auto" (the model's dtype), or quantized codes with one float32
    # scale per (token, KV head): "int8", "fp8" / "fp8_e4m3" (layers/attention.py)
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # schedule and launch step N+1 before step N's sampled tokens reach the host, and process them
    # while the device runs N+1 (None: on for CUDA). With speculative decoding only for the steps
    # the adaptive controller keeps plain.
    async_scheduling: Optional[bool] = None
    # speculative decoding: a dict / JSON string (vLLM style), parsed into a SpeculativeConfig
    speculative_config: Optional[Union[SpeculativeConfig, dict, str]] = None
    # ranks (GPUs cuda:0..N-1; on CPU, N processes over gloo) the decoder layers are split over
    # (engine/parallel.py); > 1 runs without speculative decoding
    tensor_parallel_size: int = 1
    # as vLLM's: "auto" reads the model folder's generation_config.json -- its EOS ids stop generation
    # too, and its temperature / top_p / top_k / min_p / repetition_penalty / max_new_tokens become the
    # defaults of requests that do not set them; "vllm": neither; a folder path: that folder's
    # generation_config.json instead of the model's
    generation_config: str = "auto"
    # vLLM's override_generation_config: {temperature, top_p, top_k, min_p, repetition_penalty,
    # max_new_tokens} (a dict or its JSON) merged over what generation_config gave ("vllm": over nothing);
    # its max_new_tokens is also the server's ceiling on max_tokens; other keys are ignored, as in vLLM
    override_generation_config: Optional[Union[dict, str]] = None
    # the most logprobs / prompt_logprobs one request may ask for (vLLM's; -1: the whole vocabulary)
    max_logprobs: int = MAX_LOGPROBS
    # LoRA adapters (vLLM's options): requests may run under PEFT adapters (lora_request), up to
    # max_loras of them on the device at once, each of rank <= max_lora_rank; max_cpu_loras adapters
    # kept in host memory once read (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

        positive("block_size")
        positive("max_num_seqs")
        positive("num_kv_blocks", allow_none=True)
        positive("max_num_batched_tokens", allow_none=True)
        positive("max_model_len", allow_none=True)
        positive("tensor_parallel_size")
        positive("max_loras")
        positive("max_lora_rank")
        positive("max_cpu_loras", allow_none=True)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for the whole vocabulary, got "
                             f"{self.max_logprobs!r}")  # fmt: skip
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not (0.0 < float(gmu) <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if isinstance(self.dtype, torch.dtype) and self.dtype in _DTYPES.values():  # torch.float16 etc., as vLLM
            object.__setattr__(self, "dtype", next(k for k, v in _DTYPES.items() if v == self.dtype))
        if not isinstance(self.dtype, str) or (self.dtype != "auto" and self.dtype not in _DTYPES):
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", str(self.device)):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.generation_config, (str, os.PathLike)) or (
                self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config)):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                             f"got {self.generation_config!r}")  # fmt: skip
        object.__setattr__(self, "generation_config", os.fspath(self.generation_config))
        ogc = self.override_generation_config
        if isinstance(ogc, str):
            try:
                ogc = json.loads(ogc)
            except json.JSONDecodeError as e:
                raise ValueError(f"override_generation_config is not valid JSON ({e})") from None
        if ogc is not None and not isinstance(ogc, dict):
            raise ValueError(f"override_generation_config must be a dict (JSON object), got {ogc!r}")
        object.__setattr__(self, "override_generation_config", ogc)
        for name in ("enforce_eager", "enable_prefix_caching", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.quantization is not None:
            from pageflash.layers.linear import QUANTIZATION_METHODS

            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(f"quantization must be None or one of {list(QUANTIZATION_METHODS)}, got "
                                 f"{self.quantization!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {list(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise TypeError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(f"enable_lora with tensor_parallel_size={self.tensor_parallel_size} is not supported: "
                             f"LoRA runs on one GPU (tensor_parallel_size=1)")
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("enable_lora with speculative_config is not supported: speculative decoding runs "
                             "without LoRA adapters")
        if self.tensor_parallel_size > 1:
            if re.fullmatch(r"cuda:[1-9]\d*", str(self.device)):
                raise ValueError(f"tensor_parallel_size > 1 runs on cuda:0..N-1; device={self.device!r} is not "
                                 f"supported (use 'cuda' or 'auto', and CUDA_VISIBLE_DEVICES to pick GPUs)")


class _Inflight:
    """A launched step's sampling: the requests per row, the sampled ids on the device (the next
    step's inputs), and their copies on their way to the host."""

    def __init__(self, reqs: list[Request], out: Any, may_overlap: bool) -> None:
        self.reqs = reqs
        self.tokens: torch.Tensor = out.token_ids
        self.may_overlap = may_overlap
        dev = out.token_ids.device
        parts = [out.token_ids]
        if out.logprobs is not None:
            parts += [out.logprobs, out.logprob_token_ids, out.sampled_ranks]
        self.event = None
        if dev.type == "cuda":
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in parts]
            for h, t in zip(host, parts):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(dev))
            parts = host
        self.host = parts

    def fetch(self) -> tuple[list[int], Optional[tuple]]:
        if self.event is not None:
            self.event.synchronize()
        token_ids = self.host[0].tolist()
        lp = None
        if len(self.host) > 1:
            lp = (self.host[1].tolist(), self.host[2].tolist(), self.host[3].tolist())
        return token_ids, lp


class LLMEngine:
    # prompt logprobs: logits rows computed at once (x the vocabulary, float32: 64 MB at 128k)
    PROMPT_LOGPROB_ROWS = 128

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source: ModelSource = resolve_model(config.model, config.load_format)
        self.model_config: ModelConfig = load_config(self.source)
        self.model_name = config.model
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
            if self.device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError("device='cuda' was requested but CUDA is not available on this machine")
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches, graph capture and events use the current device: make it this one
            # (the server's engine thread does the same when it starts)
            torch.cuda.set_device(self.device)
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = _DTYPES[config.dtype]
        if self.device.type == "cpu" and config.quantization is None:  # (8-bit weights take a quarter of it)
            check_host_memory(self.model_config, self.dtype, config.model, config.tensor_parallel_size)

        max_pos = self.model_config.max_context_len
        self.max_model_len = config.max_model_len or max_pos
        if self.max_model_len > max_pos:
            why = ""
            if self.model_config.rope_type == "dynamic":  # (docs/ARCHITECTURE.md, "Rotary embeddings")
                why = ("; dynamic NTK rope scaling runs up to max_position_embeddings only, where it equals the "
                       "default rope as transformers computes it (past it, transformers rotates each token by "
                       "the sequence length it was computed at)")
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's context of {max_pos} tokens{why}")
        default_budget = 8192 if self.device.type == "cuda" else 2048
        self.max_num_batched_tokens = config.max_num_batched_tokens or default_budget

        if config.tokenizer:
            try:
                tok_src = resolve_model(config.tokenizer, "auto")
            except ValueError as e:
                raise ValueError(f"tokenizer: {e}") from None
        self.tokenizer = load_tokenizer(tok_src if config.tokenizer else self.source)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        gc = config.generation_config
        if gc == "auto":
            gen = load_generation_config(self.source)
        elif gc == "vllm":
            gen = {}
        else:  # a folder named by the user: its file must be there
            gen = read_generation_config(gc)
            if not gen:
                raise ValueError(f"generation_config: folder {gc!r} holds no generation_config.json")
        eos.update(gen.get("eos_token_ids", ()))  # e.g. Gemma 2's <end_of_turn> (only there)
        self.eos_token_ids = frozenset(eos)
        # the model's default sampling parameters (requests' unset fields; SamplingParams validates them)
        self.default_sampling: dict[str, Any] = dict(gen.get("defaults", {}))
        try:
            SamplingParams(**self.default_sampling)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the model's generation_config.json: {e} (generation_config='vllm' ignores it)") from None
        override = generation_defaults(config.override_generation_config or {})
        try:
            SamplingParams(**override)
        except (ValueError, TypeError) as e:
            raise ValueError(f"override_generation_config: {e}") from None
        self.default_sampling.update(override)
        # the server's ceiling on a request's max_tokens (vLLM's: only an override's max_new_tokens)
        self.max_tokens_ceiling: Optional[int] = override.get("max_tokens")
        if self.default_sampling:
            logger.info("default sampling parameters (generation_config.json, override_generation_config): %s",
                        self.default_sampling)

        runner_kwargs = dict(
            model_cfg=self.model_config, source=self.source, device=self.device, dtype=self.dtype,
            block_size=config.block_size, max_model_len=self.max_model_len,
            attention_backend=config.attention_backend, seed=config.seed, quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        if config.tensor_parallel_size > 1:
            from pageflash.engine.parallel import TensorParallelRunner

            if self.device.type == "cuda":
                self.device = runner_kwargs["device"] = torch.device("cuda", 0)
                torch.cuda.set_device(self.device)
            self.runner = TensorParallelRunner(config.tensor_parallel_size, **runner_kwargs)
        else:
            self.runner = ModelRunner(**runner_kwargs)
        # LoRA: slot weights on the device before the KV pool is sized (and the decode graphs captured);
        # the adapters read from disk, and which of them sit in the slots
        self.lora_cache: Optional[AdapterCache] = None
        lora_slots = None
        if config.enable_lora:
            # a step runs at most the token budget, a decode graph's bucket (<= 256) or the first prefill
            self.runner.enable_lora(config.max_loras, config.max_lora_rank, max(self.max_num_batched_tokens, 256))
            self.lora_cache = AdapterCache(self.model_config, config.max_lora_rank,
                                           config.max_cpu_loras or config.max_loras)
            lora_slots = AdapterSlots(config.max_loras)
        # Speculative decoding loads its draft model / heads before the KV pool is sized.
        self.spec: Optional[SpecDecoder] = None
        if config.speculative_config is not None:
            self.spec = SpecDecoder(self, config.speculative_config)
        bs = config.block_size
        mc = self.model_config
        # every layer slides: the KV manager gives back the blocks behind each sequence's window, so
        # a sequence holds about window + one step's tokens (per_seq) whatever its length
        kv_window = mc.kv_window
        per_seq = blocks_held_max(bs, kv_window, self.max_model_len, self.max_num_batched_tokens)
        cap_per_seq = per_seq  # (a draft model's pool gets as many blocks: sized for what it holds too)
        if self.spec is not None and self.spec.draft_runner is not None:
            cap_per_seq = max(per_seq, blocks_held_max(bs, self.spec.draft_runner.cfg.kv_window, self.max_model_len,
                                                       self.max_num_batched_tokens))
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            num_blocks = self.runner.auto_num_blocks(
                config.gpu_memory_utilization, self.max_num_batched_tokens, config.max_num_seqs
            )
            num_blocks = min(num_blocks, config.max_num_seqs * cap_per_seq + 1)
            if self.spec is not None:
                num_blocks = self.spec.target_kv_share(num_blocks)
        if num_blocks < per_seq:
            need = (f"max_model_len={self.max_model_len}" if kv_window is None else
                    f"one sequence's sliding window of {kv_window} tokens plus a step's "
                    f"{self.max_num_batched_tokens} (max_num_batched_tokens), {per_seq} blocks")
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {bs} tokens ({num_blocks * bs} tokens), fewer than "
                f"{need}; raise num_kv_blocks (or gpu_memory_utilization) or lower max_model_len"
            )
        self.runner.allocate_kv_cache(num_blocks)
        if not config.enforce_eager:
            self.runner.capture_decode_graphs(min(config.max_num_seqs, 256))
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, window=kv_window)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                                   lora_slots, long_rope_after=mc.rope_long_after)
        if self.spec is not None:
            self.spec.bind(num_blocks)
        self.sampler = Sampler()
        self._async_scheduling = (
            self.device.type == "cuda" if config.async_scheduling is None else bool(config.async_scheduling)
        )
        self._inflight: Optional[_Inflight] = None  # a launched step whose sampled tokens are not processed
        self._pooled: list[tuple[Request, int]] = []  # embedding requests _launch found complete: (req, hidden row)
        self._structured: Optional[StructuredOutputs] = None  # built at the first structured request
        self._structured_lock = threading.Lock()  # (the server compiles constraints on another thread)
        self._bad_words_cache: collections.OrderedDict[tuple[str, ...], tuple[tuple[int, ...], ...]] = \
            collections.OrderedDict()
        self._bad_words_lock = threading.Lock()  # (the server tokenizes bad_words on another thread)
        self.groups: dict[str, list[Request]] = {}  # user request id -> its sequences (n of them)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._ids = itertools.count()
        # Random rows without a per-request seed draw from torch's default generators: seed them from
        # config.seed (as vLLM's workers do), so that running the same script again gives the same tokens.
        torch.manual_seed(config.seed)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done when the engine is collected
        or the process exits). The engine cannot step afterwards."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    @property
    def async_scheduling(self) -> bool:
        """Whether steps may overlap now: asked for (or CUDA), and no speculative decoder attached
        or one whose plain steps can overlap (adaptive, while it keeps speculation off). A decoder
        may be attached and detached at run time, as `pageflash bench spec` does."""
        return self._async_scheduling and (self.spec is None or self.spec.may_overlap_plain_steps)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    # -- requests -------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(text or None, token ids). Raises ValueError/TypeError for malformed prompts."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown & {"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"}:
                raise ValueError("multi_modal_data is not supported: pageflash runs text-only models")
            if "cache_salt" in unknown:
                if self.config.enable_prefix_caching:
                    raise ValueError("cache_salt is not supported: cached prompt blocks are shared by every "
                                     "request (enable_prefix_caching=False keeps requests from sharing them)")
                unknown.discard("cache_salt")  # nothing is shared without prefix caching: it holds already
            if unknown:
                raise ValueError(f"unknown prompt key(s) {sorted(unknown)}: a prompt dict takes 'prompt' or "
                                 f"'prompt_token_ids'")
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):  # (it becomes RequestOutput.prompt)
                    raise TypeError(f"a prompt dict's 'prompt' must be a str beside 'prompt_token_ids', got "
                                    f"{type(text).__name__}")
                return text, self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one token")
            check_text(prompt, "prompt")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights): pass prompt_token_ids")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)) or is_array(prompt):
            return None, self._check_ids(prompt)
        raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        """Token ids as a list of Python ints: a list / tuple of ints (numpy or torch integer scalars
        too) or a 1-D integer numpy array / torch tensor."""
        if is_array(ids):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        if not all(type(t) is int for t in ids):
            try:  # numpy / torch integer scalars have __index__ (numpy's bool does not; Python's is refused)
                if any(isinstance(t, bool) for t in ids):
                    raise TypeError
                ids = [operator.index(t) for t in ids]
            except TypeError:
                raise TypeError("prompt_token_ids must be a list of ints") from None
        if any(t < 0 or t >= self.vocab_size for t in ids):
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})")
        return list(ids)

    def validate_request(self, prompt_ids: list[int], params: Union[SamplingParams, PoolingParams],
                         compile_constraints: bool = True, strict_length: bool = True) -> None:  # fmt: skip
        """Raise ValueError for a request this engine cannot run: lengths and ids against its limits;
        with compile_constraints, also an invalid output constraint (compiled and cached, so that
        add_request copies it) or bad_words without a tokenizer. The server passes False: it compiles
        on its worker thread, and the engine thread tokenizes bad_words. An embedding request
        (PoolingParams) generates nothing: its prompt may fill max_model_len.
        strict_length: prompt + max_tokens beyond max_model_len is an error (the server's 400, as
        vLLM's); False (offline generate, as vLLM's LLM): the output stops at the context instead,
        finish_reason "length"."""
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("prompt is empty: give at least one token")
        k = params.truncate_prompt_tokens
        if k is not None and k > self.max_model_len:  # (vLLM's check: a truncation that cannot fit)
            raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({self.max_model_len}): "
                             f"give at most {self.max_model_len}, or -1 for the model's context")
        if isinstance(params, PoolingParams):
            if n > self.max_model_len:
                raise ValueError(f"prompt has {n} tokens, but max_model_len is {self.max_model_len}")
            if params.dimensions is not None and params.dimensions > self.model_config.hidden_size:
                raise ValueError(f"dimensions={params.dimensions} exceeds the model's hidden size "
                                 f"({self.model_config.hidden_size})")
            return
        if n >= self.max_model_len:
            # (the opening words are OpenAI's and vLLM's: clients look for "maximum context length")
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens (max_model_len), but the "
                f"prompt has {n} tokens: at most {self.max_model_len - 1} prompt tokens leave room for one "
                f"generated token"
            )
        allowed = params.allowed_token_ids
        if allowed is not None:
            bad = [t for t in allowed if t >= self.vocab_size]
            if bad:
                raise ValueError(f"allowed_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
            if params.min_tokens and set(allowed) <= params.all_stop_token_ids(sorted(self.eos_token_ids)):
                raise ValueError(f"allowed_token_ids holds only stop / EOS tokens, which min_tokens="
                                 f"{params.min_tokens} forbids for the first tokens: no token could be generated")
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
            if bad:
                raise ValueError(f"logit_bias has token id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        bad = sorted(t for t in params.stop_token_ids if t >= self.vocab_size)
        if bad:
            raise ValueError(f"stop_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        if compile_constraints and params.structured_outputs is not None:
            self.structured_outputs().matcher(params.structured_outputs)
        if compile_constraints and params.bad_words:
            self.bad_word_ids(params.bad_words)
        cap = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = asked = getattr(params, name)
            if k == -1:  # the whole vocabulary
                k = self.vocab_size
                asked = f"-1 (the whole vocabulary, {k})"
            if k is not None and k > self.vocab_size:
                raise ValueError(f"{name}={k} exceeds the vocabulary size ({self.vocab_size})")
            if k is not None and cap >= 0 and k > cap:
                raise ValueError(f"{name}={asked} is more than the {cap} logprobs allowed per token (the engine's "
                                 f"max_logprobs option; -1 allows the whole vocabulary)")
        if strict_length and params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens (max_model_len), but the "
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens}; lower "
                f"max_tokens to at most {self.max_model_len - n}"
            )

    def add_request(
        self,
        request_id: Optional[str],
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> str:
        """Validate and queue one request; returns its id. Raises ValueError/TypeError on bad input,
        leaving the engine and every other request untouched. params: a SamplingParams, or a
        PoolingParams for an embedding request (RequestOutput.embedding, no tokens generated).
        lora_request: the LoRA adapter to run it under (None: the base model); its folder is read
        here the first time (ValueError for a bad one)."""
        params = SamplingParams() if params is None else params
        pooling = None
        if isinstance(params, PoolingParams):  # the request runs as a one-token one that never samples
            pooling = params
            params = SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=pooling.truncate_prompt_tokens)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        adapter = self.get_lora(lora_request) if lora_request is not None else None
        text, ids = self.tokenize_prompt(prompt)
        ids = params.truncate_prompt(ids, self.max_model_len)
        # (compiled just below; the server checked max_tokens against the context before)
        self.validate_request(ids, pooling or params, compile_constraints=False, strict_length=False)
        if params.logprobs == -1 or params.prompt_logprobs == -1:  # -1: the whole vocabulary, counted here
            params = params.clone()
            params.logprobs = self.vocab_size if params.logprobs == -1 else params.logprobs
            params.prompt_logprobs = self.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured_outputs().matcher(params.structured_outputs)
        seeds = SeedStream(params.seed, self.device) if params.seed is not None else None
        req = Request(request_id, text, ids, params, arrival_time or time.monotonic(), seeds=seeds)
        req.pooling = pooling
        req.lora = adapter
        req.lora_request = lora_request
        req.grammar = grammar
        req.bad_words = self.bad_word_ids(params.bad_words)
        self._attach_detokenizer(req)
        self.groups[request_id] = [req]
        self.scheduler.add(req)
        self.prompt_tokens_total += len(ids)
        return request_id

    # -- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -------------------------------
    def get_lora(self, lora_request: LoRARequest) -> Any:
        """The adapter of lora_request, read from its folder unless cached (lora/manager.py);
        ValueError when LoRA is off or the adapter cannot serve this model."""
        if self.lora_cache is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True (CLI: --enable-lora)")
        return self.lora_cache.get(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (rather than at its first request); True once it is known."""
        self.get_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: requests already running under it finish under it; a later request
        with that id reads its folder again, as a new adapter (new slot, no prefix-cache hits on the
        old one's blocks). False if no adapter has that id."""
        if self.lora_cache is None:
            return False
        uid = self.lora_cache.known.get(lora_int_id, (None, None, None))[2]
        if uid is not None:
            self.scheduler.lora_slots.forget(uid)
        return self.lora_cache.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The int ids of the adapters this engine knows."""
        return self.lora_cache.ids() if self.lora_cache is not None else set()

    BAD_WORDS_CACHE_SIZE = 64  # tokenized bad_words lists kept (the server tokenizes them ahead, see below)

    def bad_word_ids(self, words: Optional[list[str]], tokenizer: Any = None) -> tuple[tuple[int, ...], ...]:
        """A request's bad_words as token sequences, as vLLM tokenizes them: each word (left-stripped)
        as written, and with a leading space where that gives another first token of the same length.
        Cached by the list: the server calls this on its tokenizer worker (tokenizer: that thread's
        own copy of this engine's tokenizer) before it adds the request, so that a long list (300k
        words take seconds) is not tokenized on the engine thread while every other stream waits."""
        if not words:
            return ()
        tok = self.tokenizer if tokenizer is None else tokenizer
        if tok is None:
            raise ValueError("bad_words need the model's tokenizer; this model has none (dummy weights)")
        key = tuple(words)
        with self._bad_words_lock:
            hit = self._bad_words_cache.get(key)
            if hit is not None:
                self._bad_words_cache.move_to_end(key)
                return hit
        seqs = _tokenize_bad_words(tok, words)
        with self._bad_words_lock:
            self._bad_words_cache[key] = seqs
            while len(self._bad_words_cache) > self.BAD_WORDS_CACHE_SIZE:
                self._bad_words_cache.popitem(last=False)
        return seqs

    def structured_outputs(self) -> StructuredOutputs:
        """The grammar compiler over this engine's tokenizer (built once, ~0.5 s); ValueError when
        structured outputs cannot be had here (no llguidance, no tokenizer)."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._structured

    def _attach_detokenizer(self, req: Request) -> None:
        if self.tokenizer is not None and req.params.detokenize:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, skip_special_tokens=req.params.skip_special_tokens
            )

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> None:
        """Stop requests and free their KV blocks now. Unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            for req in self.groups.pop(rid, []):
                if not req.is_finished:
                    req.finish_reason = "abort"
                    self._finish(req)

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's entries for blocks no request holds (benchmarks: every timed run
        then computes its prompts). Returns how many blocks were dropped."""
        n = self.kv.pool.reset_cache()
        if self.spec is not None and self.spec.draft_kv is not None:
            n += self.spec.draft_kv.pool.reset_cache()
        return n

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # -- the step ---------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One step. Returns a RequestOutput for every request that progressed (only the finished
        ones with final_only, which offline generation uses to skip building partial outputs).

        With async scheduling, step N+1 is scheduled and launched before step N's sampled tokens
        are read: its requests' newest input tokens are copied on the device from step N's samples.
        Step N's tokens are then processed (stops, text, outputs) while the device runs N+1, so the
        outputs returned are one step behind the launches. A request that stopped at step N had one
        more token computed in N+1, which is dropped; its KV writes land in blocks it owned.
        """
        spec = self.spec
        touched: list[str] = []
        prev = self._inflight
        # Speculative steps need every token on the host (drafts follow it): only steps known to
        # carry no drafts overlap.
        overlap = self._async_scheduling and (spec is None or spec.plain_step_ahead())
        if prev is not None and not (overlap and prev.may_overlap):
            touched += self._resolve(prev)
            prev = self._inflight = None
        if spec is not None:
            spec.propose()  # draft tokens -> req.spec_token_ids, which the scheduler counts
        sched = self.scheduler.schedule()
        if not sched:
            if prev is not None:
                self._inflight = None
                touched += self._resolve(prev)
            return self._outputs(touched, final_only)
        now = time.monotonic()
        for s in sched.seqs:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        extra = spec.execute_kwargs(sched) if spec is not None else {}
        if prev is not None:
            extra["prev_tokens"] = prev.tokens
        result = self.runner.execute(sched, [self.kv.block_ids(s.request.request_id) for s in sched.seqs], **extra)
        if result.prompt_rows is not None:
            touched += self._prompt_logprobs(sched, result)
        if prev is not None and any(s.request.grammar is not None for s in sched.seqs):
            # A grammar's mask for this step's sampling needs the previous step's token on the host:
            # read it now, while the device runs this step's forward (launched above).
            touched += self._resolve(prev)
            prev = None
        launched = self._launch(sched, result.logits, result.rows, result.greedy)
        if self._pooled:
            touched += self._finish_pooled(result.hidden)
        self._inflight = None
        if prev is not None:  # the device runs the step just launched meanwhile
            touched += self._resolve(prev)
        if launched is not None:
            if overlap and launched.may_overlap:
                self._inflight = launched
            else:
                touched += self._resolve(launched)
        if spec is not None:  # verify the drafts, roll back rejected KV, emit accepted tokens
            touched += spec.finish_step(sched, result)
        return self._outputs(touched, final_only)

    def _outputs(self, touched: list[str], final_only: bool) -> list[RequestOutput]:
        groups = [g for g in dict.fromkeys(touched) if g in self.groups]
        if final_only:
            groups = [g for g in groups if self._group_finished(g)]
        return [self._make_output(gid) for gid in groups]

    def _group_finished(self, group_id: str) -> bool:
        reqs = self.groups.get(group_id)
        return reqs is not None and reqs[0].forked and all(r.is_finished for r in reqs)

    def _launch(self, sched: SchedulerOutput, logits: torch.Tensor, rows: list[tuple[int, int]],
                greedy: Optional[torch.Tensor] = None) -> Optional[_Inflight]:
        """Advance computed counts and launch sampling where a step reached a request's end (no sync:
        the tokens are copied to the host asynchronously and read by _resolve). greedy: the argmax of
        every logits row, where the step computed it (decode graphs)."""
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for s, (start, count) in zip(sched.seqs, rows):
            req = s.request
            if s.num_spec_tokens:
                continue  # verified by SpecDecoder.finish_step
            req.num_computed_tokens += s.num_new_tokens
            if count == 0:  # a prefill chunk that does not reach the end yet
                self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
                continue
            if req.pooling is not None:  # an embedding: read off the hidden states, nothing sampled
                self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
                self._pooled.append((req, start))
                continue
            for r in self._fork_if_needed(req):
                sample_rows.append(start)
                sample_reqs.append(r)
        if not sample_reqs:
            return None
        # Only rows with penalties or min_tokens read their outputs: the others get an empty list
        # instead of a copy of their outputs (O(length) per row per step otherwise).
        # (a request that finished by the previous step's token samples once more, for nothing: no mask)
        guided = [r.grammar is not None and not r.is_finished for r in sample_reqs]
        masks = iter(self._structured.bitmasks([r.grammar for r, g in zip(sample_reqs, guided) if g])
                     if any(guided) else ())  # fmt: skip
        batch = SamplingBatch.build(
            [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids if r.params.reads_outputs() else (),
                         r.generator, next(masks) if g else None, r.bad_words) for r, g in zip(sample_reqs, guided)],
            vocab_size=self.vocab_size, device=self.device, eos_token_ids=sorted(self.eos_token_ids),
        )
        if sample_rows != list(range(logits.shape[0])):  # decode steps: every row samples, once
            logits = logits[torch.tensor(sample_rows, device=logits.device)]
            greedy = None
        out = self.sampler(logits, batch, greedy_ids=greedy)
        for i, r in enumerate(sample_reqs):
            r.num_pending += 1
            r.pending_row = i
        # The next step may overlap only if no request sampled here needs its newest token on the
        # host to build its next sampling row (penalties read the outputs; min_tokens their count).
        # A grammar's next mask needs it too, but only for the next sampling, not for the next
        # forward: step() reads the token after launching that forward.
        may_overlap = not any(r.params.reads_outputs(r.num_output_tokens) for r in sample_reqs)
        return _Inflight(sample_reqs, out, may_overlap)

    def _prompt_logprobs(self, sched: SchedulerOutput, result: Any) -> list[str]:
        """Append the prompt logprobs this step's rows scored (raw logits' log-softmax, as for
        generated tokens): per prompt token its own logprob and rank, and the top prompt_logprobs.
        Logits are computed PROMPT_LOGPROB_ROWS rows at a time from the rows' hidden states."""
        seqs = [(s.request, first, cnt) for s, (first, cnt) in zip(sched.seqs, result.prompt_rows) if cnt]
        if not seqs:
            return []
        h = result.prompt_hidden
        targets = torch.tensor([t for r, _, cnt in seqs for t in
                                r.prompt_token_ids[len(r.prompt_logprobs): len(r.prompt_logprobs) + cnt]],
                               device=h.device)  # fmt: skip
        k = max(r.params.prompt_logprobs for r, _, _ in seqs)
        own_l, ranks, top_v, top_i = [], [], [], []
        for a in range(0, h.shape[0], self.PROMPT_LOGPROB_ROWS):
            lp = torch.log_softmax(self.runner.model.compute_logits(h[a : a + self.PROMPT_LOGPROB_ROWS]).float(), -1)
            own = lp.gather(1, targets[a : a + lp.shape[0], None])
            own_l += own[:, 0].tolist()
            ranks += (lp >= own).sum(-1).tolist()  # tokens at least as likely (vLLM's rank)
            if k:
                top = torch.topk(lp, k, dim=-1)
                top_v += top.values.tolist()
                top_i += top.indices.tolist()
        tgt_l = targets.tolist()
        row = 0
        for r, _, cnt in seqs:
            for _ in range(cnt):
                entry = {tgt_l[row]: Logprob(own_l[row], ranks[row], self._decode_one(tgt_l[row]))}
                for j in range(r.params.prompt_logprobs):
                    entry.setdefault(top_i[row][j], Logprob(top_v[row][j], j + 1, self._decode_one(top_i[row][j])))
                r.prompt_logprobs.append(entry)
                row += 1
        return [r.group_id for r, _, _ in seqs]

    def _resolve(self, inf: _Inflight) -> list[str]:
        """Read a launched step's sampled tokens and apply them: append, stops, finish."""
        token_ids, lp = inf.fetch()
        touched: dict[str, None] = {}
        now = time.monotonic()
        for i, (req, tok) in enumerate(zip(inf.reqs, token_ids)):
            req.num_pending -= 1
            if req.is_finished:  # stopped (or aborted) while this step ran: its extra token is dropped
                continue
            rlp = None if lp is None or req.logprobs is None else (lp[0][i], lp[1][i], lp[2][i])
            self._append_token(req, tok, rlp, now)
            touched[req.group_id] = None
        return list(touched)

    def _finish_pooled(self, hidden: torch.Tensor) -> list[str]:
        """Embedding requests whose prompt this step completed: the final hidden state at the last
        prompt token (truncated to dimensions, normalized), then finished (blocks freed)."""
        pooled, self._pooled = self._pooled, []
        vecs = hidden[torch.tensor([row for _, row in pooled], device=hidden.device)].float()
        now = time.monotonic()
        out = []
        for (req, _), v in zip(pooled, vecs.cpu()):
            if req.pooling.dimensions is not None:
                v = v[: req.pooling.dimensions]
            if req.pooling.normalize:
                v = torch.nn.functional.normalize(v, dim=0)
            req.embedding = v.tolist()
            req.finish_reason = "stop"
            req.metrics.first_token_time = now
            self._finish_output(req, now)
            out.append(req.group_id)
        return out

    def _fork_if_needed(self, req: Request) -> list[Request]:
        """At the first sample of an n > 1 request: n - 1 siblings share its blocks (copy on write)."""
        if req.forked:
            return [req]
        req.forked = True
        family = [req]
        prev = req
        for j in range(1, req.params.n):
            # sibling j's seed is seed + j (vLLM's), its generators keyed by position as the parent's
            seeds = SeedStream(req.params.seed + j, self.device) if req.params.seed is not None else None
            child = Request(
                f"{req.group_id}#{j}", req.prompt, req.prompt_token_ids, req.params,
                req.metrics.arrival_time, index=j, group_id=req.group_id, seeds=seeds,
            )
            child.num_computed_tokens = req.num_computed_tokens
            child.forked = True
            child.prompt_logprobs = None  # the group's are the parent's
            child.bad_words = req.bad_words
            child.lora, child.lora_request = req.lora, req.lora_request
            if req.grammar is not None:  # nothing consumed yet: this is the first sample
                child.grammar = req.grammar.deep_copy()
            child.metrics.first_scheduled_time = req.metrics.first_scheduled_time
            self._attach_detokenizer(child)
            self.kv.fork(req.request_id, child.request_id, req.num_computed_tokens)
            self.scheduler.add_running(child, after=prev)
            self.groups[req.group_id].append(child)
            family.append(child)
            prev = child
        return family

    def _append_token(self, req: Request, tok: int, lp: Optional[tuple], now: float) -> None:
        if req.grammar is not None and not req.grammar.consume_token(tok):
            # Only when the step's masks left no token (allowed_token_ids or bad_words outside the
            # grammar) or the grammar hit one of llguidance's limits: the token is not appended.
            logger.warning("request %s: structured-outputs constraint failed at token %d (%s); aborted",
                           req.request_id, tok, req.grammar.get_error()[:300])
            req.finish_reason = "abort"
            self._finish_output(req, now)
            return
        req.token_ids.append(tok)
        self.generation_tokens_total += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if lp is not None:
            lps, ids, rank = lp
            entry = {ids[0]: Logprob(lps[0], rank, self._decode_one(ids[0]))}
            for j in range(1, req.params.logprobs + 1):
                entry.setdefault(ids[j], Logprob(lps[j], j, self._decode_one(ids[j])))
            req.logprobs.append(entry)
            req.cumulative_logprob += lps[0]
            req.text_offsets.append(len(req.output_text))
        self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
        self._check_stop(req, tok)
        if req.finish_reason is None and req.grammar is not None and req.grammar.is_stopped():
            req.finish_reason = "stop"  # the constrained text is complete: nothing may follow
        if req.finish_reason is not None:
            self._finish_output(req, now)

    def _finish_output(self, req: Request, now: float) -> None:
        """A request that just reached its finish_reason: final text, time, blocks freed."""
        if req.detokenizer is not None and not isinstance(req.stop_reason, str):
            # bytes held back for a character still incomplete: emit them (as U+FFFD, like a
            # plain decode); a stop string already cut the text where it matched
            req.detokenizer.flush()
            req.output_text = req.detokenizer.output_text
        req.metrics.finished_time = now
        self._finish(req)

    def _finish(self, req: Request) -> None:
        self.scheduler.finish(req)
        if self.spec is not None:
            self.spec.remove_request(req)

    def _decode_one(self, tok: int) -> Optional[str]:
        return self.tokenizer.decode([tok]) if self.tokenizer is not None else None

    def _check_stop(self, req: Request, tok: int) -> None:
        """Finish req after its new token tok if a stop condition holds (vLLM's rules): EOS and
        stop_token_ids end it once more than min_tokens tokens are out (the sampler masks them
        before), and their text is left out of the output unless include_stop_str_in_output;
        stop strings are looked for only past min_tokens as well."""
        p = req.params
        n_out = req.num_output_tokens
        past_min = n_out > p.min_tokens  # the sampler masks EOS and stop ids up to min_tokens
        stop_tok = None
        if past_min:
            if not p.ignore_eos and tok in self.eos_token_ids:
                stop_tok = "eos"
            elif tok in p.stop_token_ids:
                stop_tok = "id"
        if req.detokenizer is not None and (stop_tok is None or p.include_stop_str_in_output):
            delta = req.detokenizer.add_tokens([tok])
            req.output_text = req.detokenizer.output_text
            if p.stop and delta and past_min and stop_tok is None:
                hit = find_stop_string(req.output_text, len(delta), p.stop, p.include_stop_str_in_output)
                if hit is not None:
                    cut, stop = hit
                    req.output_text = req.output_text[:cut]
                    req.finish_reason, req.stop_reason = "stop", stop
                    return
        if stop_tok is not None:
            req.finish_reason = "stop"
            if stop_tok == "id":
                req.stop_reason = tok
            return
        if p.max_tokens is not None and n_out >= p.max_tokens:
            req.finish_reason = "length"
        elif len(req.token_ids) >= self.max_model_len:
            req.finish_reason = "length"

    def _make_output(self, group_id: str) -> RequestOutput:
        reqs = self.groups[group_id]
        outs = [
            CompletionOutput(
                index=r.index, text=r.output_text, token_ids=list(r.output_token_ids),
                cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                logprobs=list(r.logprobs) if r.logprobs is not None else None,
                text_offsets=[min(o, len(r.output_text)) for o in r.text_offsets] if r.text_offsets is not None else None,
                finish_reason=r.finish_reason, stop_reason=r.stop_reason, lora_request=r.lora_request,
            )
            for r in reqs
        ]
        head = reqs[0]
        finished = head.forked and all(r.is_finished for r in reqs)
        if finished:
            del self.groups[group_id]
        plp = list(head.prompt_logprobs) if head.prompt_logprobs is not None else None
        if head.pooling is not None:
            return RequestOutput(group_id, head.prompt, head.prompt_token_ids, [], finished, head.metrics,
                                 embedding=head.embedding, num_cached_tokens=head.num_cached_tokens,
                                 lora_request=head.lora_request)  # fmt: skip
        return RequestOutput(group_id, head.prompt, head.prompt_token_ids, outs, finished, head.metrics, plp,
                             num_cached_tokens=head.num_cached_tokens, lora_request=head.lora_request)  # fmt: skip

    # -- introspection ----------------------------------------------------------------------------
    def get_stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        s["prompt_tokens_total"] = self.prompt_tokens_total
        s["generation_tokens_total"] = self.generation_tokens_total
        if self.spec is not None:
            s["spec"] = self.spec.stats()
        return s


def _tokenize_bad_words(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """bad_words as token sequences (LLMEngine.bad_word_ids): each word left-stripped, and with a
    leading space where that gives another first token of the same length; empty ones dropped."""
    texts = [w.lstrip() for w in words]
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:  # (HF's batch call builds a Python dict per word: seconds for 300k words)
        plain = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        spaced = [e.ids for e in backend.encode_batch([" " + t for t in texts], add_special_tokens=False)]
    else:
        plain = tokenizer(texts, add_special_tokens=False)["input_ids"]
        spaced = tokenizer([" " + t for t in texts], add_special_tokens=False)["input_ids"]
    seqs: list[tuple[int, ...]] = []
    for a, b in zip(plain, spaced):
        seqs.append(tuple(a))
        if b and len(b) == len(a) and b[0] != a[0]:
            seqs.append(tuple(b))
    return tuple(s for s in dict.fromkeys(seqs) if s)


def check_host_memory(cfg: ModelConfig, dtype: torch.dtype, name: str, tp: int = 1,
                      meminfo: str = "/proc/meminfo") -> None:
    """On the CPU, refuse up front a model whose weights in dtype exceed the memory the host has free
    (MemAvailable): loading it would end in the kernel's OOM kill, with no message (e.g. the benchmarks'
    default llama-3-8b, 32 GB in float32). Hosts without /proc/meminfo are not checked."""
    try:
        with open(meminfo) as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return
    need = cfg.num_params() * torch.finfo(dtype).bits // 8 // max(1, tp)
    if need > avail:
        raise ValueError(f"{name}: its weights take about {need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')} "
                         f"on the CPU, more than the {avail / 2**30:.1f} GiB this machine has available; choose a "
                         f"smaller model (e.g. smollm2-135m) or a GPU")


def check_text(text: str, what: str) -> None:
    """ValueError naming `what` for text the tokenizer cannot take: a lone surrogate (from a JSON
    "\\ud800" or a bad decode) has no UTF-8 encoding, and HF's tokenizers refuse it with a TypeError
    that says nothing of where it came from."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: {e.reason} at character {e.start} "
                         f"({text[e.start:e.end]!a})") from None


def is_array(x: Any) -> bool:
    """A numpy array or torch tensor of at least one dimension (duck-typed: numpy need not be importable)."""
    return (hasattr(x, "tolist") and len(getattr(x, "shape", ())) >= 1
            and not isinstance(x, (str, bytes, list, tuple, dict)))  # fmt: skip
