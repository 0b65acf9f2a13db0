"""Ceilings of the machine and the cost model of a decoder step, for the latency/throughput benchmarks.

Measured ceilings:
- ``copy_bandwidth_gbps``: a large copy, bytes read + written per second (GB/s = 1e9 B/s), median of
  several. CUDA: device-to-device ``dst.copy_(src)`` timed with CUDA events. CPU: a host ``memcpy``
  (``Tensor.copy_``) timed with ``time.perf_counter``, so the CPU path reports something too.
- ``gemm_tflops``: square GEMM, 2*n^3 FLOPs over the median time (CUDA: bf16 8192^3 with events; CPU:
  fp32 1024^3, a sanity figure only).

Cost model (a Llama-family decoder, ``ModelConfig``):
- matmul parameters = every weight a token's forward reads except the embedding table, i.e.
  ``num_params(include_embedding=False)`` (attention, MLP, norms, an untied lm_head) plus, for tied
  embeddings, the table once more because it is read as the LM head.
- bytes per decode step (batch B, contexts L_i) = matmul parameters * weight bytes
  + 2 (K and V) * layers * kv_heads * head_dim * kv bytes * sum_i L_i. L_i counts the keys token i
  attends to (its own included) -- in a sliding-window layer at most its window, so the sum runs over
  layers, min(L_i, window). Not counted (each < 0.1% at batch 1): the embedding rows gathered,
  the one K/V slot written per sequence, activations and logits.
- Mixtures of experts: a step of T tokens reads the experts its tokens pick. Bytes count the expected
  distinct experts per MoE layer if tokens pick uniformly, E (1 - (1 - k/E)^T) (``ModelConfig.
  experts_per_step``: k at batch 1, nearly all E at batch 64 for 128 experts top 8); FLOPs count the
  k experts each token runs (the "active" parameters).
- FLOPs per token at context L = 2 * matmul parameters + 4 * layers * q_heads * head_dim * L
  (QK^T and PV, 2 FLOPs per multiply-add each). A causal prompt of n tokens costs
  sum_{p < n} flops_per_token(p + 1).

No import-time side effects; nothing here touches CUDA until a measure_* function is called.
"""

from __future__ import annotations

import statistics
import time
from typing import Iterable, Optional, Union

import torch

from pageflash.config import ModelConfig

GB = 1e9


# ---- measured ceilings ---------------------------------------------------------------------------


def _is_cuda(device: Union[str, torch.device]) -> bool:
    return torch.device(device).type == "cuda"


def _cuda_median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cpu_median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_copy_bandwidth(
    device: Union[str, torch.device] = "cuda",
    nbytes: Optional[int] = None,
    iters: int = 20,
    warmup: int = 3,
) -> float:
    """Copy bandwidth in GB/s, counting bytes read + written (2 * nbytes per copy); median of `iters`.

    nbytes: size of the source buffer (default 1 GiB on CUDA, 256 MiB on CPU: far past the caches).
    On CUDA, an out-of-memory halves the size down to 128 MiB (the engine may hold most of the GPU),
    and the cached blocks are released afterwards so the engine's memory accounting is unchanged.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        size = nbytes or (1 << 30)
        while True:
            try:
                src = torch.empty(size // 2, dtype=torch.bfloat16, device=dev).uniform_()
                dst = torch.empty_like(src)
                break
            except torch.cuda.OutOfMemoryError:
                if size <= (128 << 20):
                    raise
                size //= 2
        try:
            with torch.cuda.device(dev):
                ms = _cuda_median_ms(lambda: dst.copy_(src), iters, warmup)
        finally:
            del src, dst
            torch.cuda.empty_cache()
        return 2 * size / (ms * 1e-3) / GB
    size = nbytes or (256 << 20)
    src = torch.rand(size // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = _cpu_median_ms(lambda: dst.copy_(src), max(3, iters // 4), max(1, warmup // 3))
    return 2 * size / (ms * 1e-3) / GB


def measure_gemm_tflops(
    device: Union[str, torch.device] = "cuda",
    n: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    iters: int = 20,
    warmup: int = 3,
) -> float:
    """Square GEMM throughput in TFLOP/s (2*n^3 FLOPs per matmul), median time of `iters`.

    Defaults: CUDA bf16 n=8192 (the figure WORKLOADS.md quotes, ~680 on an H100); CPU fp32 n=1024.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        n = n or 8192
        dtype = dtype or torch.bfloat16
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        c = torch.empty(n, n, device=dev, dtype=dtype)
        try:
            with torch.cuda.device(dev):
                ms = _cuda_median_ms(lambda: torch.matmul(a, b, out=c), iters, warmup)
        finally:
            del a, b, c
            torch.cuda.empty_cache()
    else:
        n = n or 1024
        dtype = dtype or torch.float32
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        c = torch.empty(n, n, dtype=dtype)
        ms = _cpu_median_ms(lambda: torch.matmul(a, b, out=c), max(3, iters // 4), 1)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def device_name(device: Union[str, torch.device]) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---- cost model -----------------------------------------------------------------------------------


def matmul_params(cfg: ModelConfig, experts_read: Optional[float] = None) -> int:
    """Parameters read per token except the embedding gather: layers, final norm, LM head (tied or not).
    experts_read: routed experts counted per MoE layer (None: all; dense models have none)."""
    n = cfg.num_params(include_embedding=False, experts_read=experts_read)
    if cfg.tie_word_embeddings:  # num_params leaves the tied table out; it is read as the LM head
        n += cfg.vocab_size * cfg.hidden_size
    return n


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one step reads as the model holds them (quantized codes and their scales
    included): the decoder layers' parameters and buffers, the final norm and the LM head (the
    embedding table only as the tied head). For a 16-bit model, matmul_params * 2."""
    n = sum(t.nbytes for t in model.layers.parameters()) + sum(t.nbytes for t in model.layers.buffers())
    return n + model.norm.weight.nbytes + model.head_weight.nbytes


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward multiplies by: matmul_params with k experts per MoE layer."""
    return matmul_params(cfg, experts_read=cfg.num_experts_per_tok if cfg.num_experts else None)


def weight_bytes(cfg: ModelConfig, weight_bytes_per_param: float, num_tokens: Optional[int] = None) -> int:
    """Bytes of weights one forward step of num_tokens tokens reads: matmul_params * bytes per parameter
    (any step size for a dense model; a mixture of experts counts the experts num_tokens tokens are
    expected to pick, or all of them when num_tokens is None)."""
    experts = cfg.experts_per_step(num_tokens) if cfg.num_experts and num_tokens is not None else None
    return round(matmul_params(cfg, experts) * weight_bytes_per_param)


def layer_keys(cfg: ModelConfig, context_len: int) -> int:
    """Keys a token at context context_len reads summed over the layers: context_len in each layer
    that attends to everything, at most the window in each sliding-window layer."""
    return sum(context_len if (w := cfg.layer_window(i)) is None else min(context_len, w)
               for i in range(cfg.num_hidden_layers))


def _layer_keys_causal(cfg: ModelConfig, t: int) -> int:
    """sum_{p=1..t} layer_keys(cfg, p): the keys a causal sequence of t tokens reads, over the layers."""
    total = 0
    for i in range(cfg.num_hidden_layers):
        w = cfg.layer_window(i)
        total += t * (t + 1) // 2 if w is None or w >= t else w * (w + 1) // 2 + (t - w) * w
    return total


def kv_bytes_per_token(cfg: ModelConfig, kv_bytes_per_elem: float) -> int:
    """K and V bytes of one cached token across all layers (kv_bytes_per_elem: a quantized cache's
    code size plus its per-row scale's share, e.g. 1 + 4 / head_dim)."""
    return round(2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_bytes_per_elem)


def decode_step_bytes(
    cfg: ModelConfig,
    context_lens: Union[int, Iterable[int]],
    weight_bytes_per_param: float,
    kv_bytes_per_elem: Optional[float] = None,
    batch_size: Optional[int] = None,
) -> int:
    """Bytes one decode step reads: weights (once; a mixture of experts' expected share for this many
    sequences) + the K/V of every sequence's context.

    context_lens: one int per sequence (keys each new token attends to, itself included), or a single
    int L together with batch_size B (B sequences of context L).
    """
    if kv_bytes_per_elem is None:
        kv_bytes_per_elem = weight_bytes_per_param
    if isinstance(context_lens, int):
        num_seqs = 1 if batch_size is None else batch_size
        keys = layer_keys(cfg, context_lens) * num_seqs
    else:
        if batch_size is not None:
            raise ValueError("batch_size is only for a single int context length")
        lens = list(context_lens)
        num_seqs, keys = len(lens), sum(layer_keys(cfg, n) for n in lens)
    per_layer_key = kv_bytes_per_token(cfg, kv_bytes_per_elem) / cfg.num_hidden_layers
    return weight_bytes(cfg, weight_bytes_per_param, num_seqs) + round(per_layer_key * keys)


def flops_per_token(cfg: ModelConfig, context_len: float) -> float:
    """Forward FLOPs of one token attending to context_len keys (a sliding-window layer: at most its
    window): 2 * matmul params + attention."""
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * layer_keys(cfg, round(context_len))
    return 2 * active_params(cfg) + attn


def decode_step_flops(cfg: ModelConfig, context_lens: Iterable[int]) -> float:
    """Forward FLOPs of one decode step: one token per sequence, sequence i attending to context_lens[i] keys."""
    lens = list(context_lens)
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * sum(layer_keys(cfg, n) for n in lens)
    return 2.0 * active_params(cfg) * len(lens) + attn


def sequence_flops(cfg: ModelConfig, num_prompt_tokens: int, num_output_tokens: int) -> float:
    """Forward FLOPs to run one request end to end: the prompt and every generated token but the last
    are fed through the model (T = n + m - 1 tokens, token at position p attends to p + 1 keys)."""
    t = num_prompt_tokens + max(num_output_tokens, 1) - 1
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * _layer_keys_causal(cfg, t)
    return 2.0 * active_params(cfg) * t + attn
