"""Tensor parallelism on CUDA: the engine's greedy tokens equal HF transformers' (float32; HF on the CPU).

- Two ranks on one GPU (PAGEFLASH_TP_ONE_DEVICE=1: gloo, eager steps): the worker processes on CUDA
  and the Triton kernels at the shards' shapes (heads, KV heads, MLP and expert slices); any GPU.
- Two GPUs (NCCL): the same through the decode graphs, which capture the all-reduces; graphs equal
  eager steps; INT8 ranks equal HF over the weights as the shards quantize them.
- Speculative decoding (n-gram trees, early-exit trees, a draft model on rank 0) over two ranks gives
  one rank's plain greedy tokens, on one GPU and on two. Skipped (named in
  -ra's summary) on a machine with fewer GPUs; scripts/gpu_tp.sh runs them on the 2-GPU machine."""

import sys
from pathlib import Path

import pytest
import torch

from pageflash import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_tensor_parallel import _close, _generate as _run, _prompts  # noqa: E402

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs 2 GPUs")

PROMPT_LENS = (1, 5, 16, 17, 33, 40, 3)


def _hf_check(tmp_path, name: str, one_device: bool) -> None:
    """Two ranks' greedy tokens equal HF's (float32, async scheduling on: the default on CUDA): on one
    GPU over gloo with eager steps, or on two over NCCL through the decode graphs."""
    from transformers import AutoModelForCausalLM

    from hf_ref import hf_greedy, make_random_hf_folder
    from test_engine_hf import CONFIGS

    folder = make_random_hf_folder(tmp_path, CONFIGS[name])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = _prompts(PROMPT_LENS)
    llm = LLM(folder, dtype="float32", block_size=16, max_num_batched_tokens=32, max_model_len=128,
              num_kv_blocks=64, tensor_parallel_size=2)
    eng = llm.llm_engine
    assert eng.runner.backend.name == "triton" and eng.async_scheduling
    assert eng.runner.comm_backend == ("gloo" if one_device else "nccl")
    assert (eng.runner.graphs is None) == one_device
    got = _run(llm, prompts)
    assert eng.kv.num_free_blocks == 64
    _close(llm)
    assert got == [hf_greedy(hf, p, 16) for p in prompts]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-qk-norm", "qwen3-moe", "qwen2-moe", "mistral-window", "olmo2"])
def test_two_ranks_on_one_gpu_match_hf_fp32(tmp_path, name, monkeypatch):
    monkeypatch.setenv("PAGEFLASH_TP_ONE_DEVICE", "1")
    _hf_check(tmp_path, name, one_device=True)


def test_two_int8_ranks_on_one_gpu_match_hf_on_their_quantization(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFLASH_TP_ONE_DEVICE", "1")
    _int8_check(tmp_path)


@two_gpus
@pytest.mark.parametrize("name", ["llama-gqa", "llama-mqa-tied", "qwen3-moe", "qwen2-moe", "olmo2"])
def test_two_gpus_match_hf_fp32(tmp_path, name):
    _hf_check(tmp_path, name, one_device=False)


@two_gpus
def test_two_gpus_graphs_equal_eager():
    kw = dict(model="qwen3-0.6b", load_format="dummy", dtype="float32", max_model_len=512, num_kv_blocks=256,
              tensor_parallel_size=2)
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 64, 100, 1, 250, 16))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(enforce_eager=True, **kw)
    eager = _run(llm, prompts, params)
    _close(llm)
    llm = LLM(**kw)
    graphs = _run(llm, prompts, params)
    _close(llm)
    assert graphs == eager


@two_gpus
@pytest.mark.parametrize("eager", [True, False])
def test_two_gpus_shut_down_within_the_teardown_bound(eager, capsys):
    """LLM.shutdown() of a two-GPU engine returns before any rank waits out the teardown bound
    (parallel._LEAVE_WAIT_S), with or without decode graphs: the ranks leave at the same time (NCCL's
    teardown is collective) and drop every captured graph first (pytorch/pytorch#115388). Run 48:
    0.9 s eager, 1.4 s with graphs; it took 11.2-11.3 s when rank 0 left after the workers."""
    import time

    from pageflash.engine import parallel

    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="float32", max_model_len=256, num_kv_blocks=64,
              tensor_parallel_size=2, enforce_eager=eager)
    _run(llm, [[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    llm.shutdown()
    took = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nTP=2 shutdown, {'eager' if eager else 'decode graphs'}: {took:.1f} s")
    assert took < parallel._LEAVE_WAIT_S


@two_gpus
def test_two_int8_gpus_match_hf_on_their_quantization(tmp_path):
    _int8_check(tmp_path)


def _int8_check(tmp_path):
    from hf_ref import hf_greedy, make_random_hf_folder
    from test_engine_hf import CONFIGS
    from test_tensor_parallel import _fake_quantized_tp_hf

    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"], std=0.3)
    prompts = _prompts(PROMPT_LENS)
    llm = LLM(folder, dtype="float32", max_model_len=64, num_kv_blocks=64, quantization="int8",
              tensor_parallel_size=2)
    got = _run(llm, prompts)
    _close(llm)
    hf_q = _fake_quantized_tp_hf(folder, 2)
    assert got == [hf_greedy(hf_q, p, 16) for p in prompts]


SPECS = [dict(method="ngram", tree=[2], num_speculative_tokens=5), dict(method="early_exit", num_layers=1, tree=[2, 1]),
         dict(method="draft_model", model="{target}", num_speculative_tokens=3)]
SPEC_IDS = ["ngram-tree", "early_exit-tree", "draft_model"]


def _spec_check(tmp_path, spec: dict) -> None:
    """Speculative decoding over two ranks gives one rank's plain greedy tokens (float32), drafts
    accepted, no block leaks."""
    import gc

    from hf_ref import make_random_hf_folder
    from test_engine_hf import CONFIGS
    from test_tensor_parallel import SPEC_PROMPTS

    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    spec = {k: (v.format(target=folder) if isinstance(v, str) else v) for k, v in spec.items()}
    kw = dict(dtype="float32", block_size=16, max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=64)
    plain = LLM(folder, **kw)
    want = _run(plain, SPEC_PROMPTS)
    del plain
    gc.collect()
    llm = LLM(folder, tensor_parallel_size=2, speculative_config=spec, **kw)
    eng = llm.llm_engine
    got = _run(llm, SPEC_PROMPTS)
    accepted = eng.get_stats()["spec"][spec["method"]]["num_accepted_tokens"]
    free = eng.kv.num_free_blocks
    _close(llm)
    assert got == want and accepted > 0 and free == 64


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_speculation_on_two_ranks_on_one_gpu(tmp_path, spec, monkeypatch):
    monkeypatch.setenv("PAGEFLASH_TP_ONE_DEVICE", "1")
    _spec_check(tmp_path, spec)


@two_gpus
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_speculation_on_two_gpus(tmp_path, spec):
    _spec_check(tmp_path, spec)
