"""Prefill CUDA graphs (engine/model_runner.py PrefillGraphs) on the GPU: one sequence's prefill step
replayed from a graph gives the tokens of the eager step, in float32 against HF transformers over
several architectures (MoE, sliding windows, softcapping, q/k norms, dynamic rope), in bf16 against the
same static-buffer path run eagerly, and under a LoRA adapter (its graph and the base twin)."""

import sys
from pathlib import Path

import pytest
import torch

from pageflash import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# lengths over buckets 16..512 (and past them: eager), one prompt twice (a prefix-cache hit)
LENGTHS = (2, 9, 16, 17, 100, 300, 700)


def _prompts(vocab: int, lengths=LENGTHS):
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return ps + [ps[4]]


def _alone(llm, prompts, lora=None, rounds=2):
    """Each prompt alone, `rounds` times (a bucket's graph is captured the second time it is seen):
    every round's tokens."""
    return [[llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
             for p in prompts] for _ in range(rounds)]


@pytest.mark.parametrize("name", ["llama-gqa", "mixtral", "mistral-window", "gemma2", "gemma3", "qwen3-qk-norm",
                                  "llama-dynamic"])
def test_prefill_graphs_match_hf_fp32(tmp_path, name):
    from hf_ref import hf_greedy, hf_reference, make_random_hf_folder
    from test_engine_hf import CONFIGS

    folder = make_random_hf_folder(tmp_path, CONFIGS[name])
    hf = hf_reference(folder)  # on the CPU, eager attention (hf_ref.hf_reference: Gemma 2's softcap)
    prompts = _prompts(200, (2, 9, 16, 17, 40, 90))
    llm = LLM(folder, dtype="float32", block_size=16, max_model_len=128, num_kv_blocks=64)
    pg = llm.llm_engine.runner.prefill_graphs
    assert pg is not None
    want = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    got = _alone(llm, prompts)  # the second round's prompts hit the prefix cache
    assert got == [want, want]
    assert pg.replays >= 6 and len(pg.graphs) >= 1
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.pool.num_blocks


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen3-0.6b"])
def test_prefill_graphs_equal_eager_steps_bf16(model):
    """The graphs against the same static-buffer forward run eagerly (the same kernels): equal tokens
    (prefix caching off: every round computes the same steps)."""
    kw = dict(load_format="dummy", max_model_len=1024, num_kv_blocks=512, enable_prefix_caching=False)
    eager = LLM(model, **kw)
    r = eager.llm_engine.runner
    r.enable_prefill_graphs(cuda_graphs=False)
    r.prefill_graphs.CAPTURE_AFTER = 1
    vocab = r.cfg.vocab_size
    want = _alone(eager, _prompts(vocab))
    assert r.prefill_graphs.replays >= 12
    del eager
    llm = LLM(model, **kw)
    got = _alone(llm, _prompts(vocab))
    assert got[1] == want[1]  # (round 0: the first sight of each bucket runs eagerly, over the varlen kernel)
    assert llm.llm_engine.runner.prefill_graphs.replays >= 6


def test_prefill_graphs_under_lora_fp32(tmp_path, monkeypatch):
    from pageflash.lora import LoRARequest
    from pageflash.lora.adapter import write_random_adapter

    kw = dict(load_format="dummy", dtype="float32", max_model_len=1024, num_kv_blocks=512, enable_lora=True,
              max_lora_rank=8)
    llm = LLM("smollm2-135m", **kw)
    path = write_random_adapter(str(tmp_path / "a"), llm.llm_engine.runner.cfg, 8, seed=2, std_b=0.3)
    lora = LoRARequest("a", 1, path)
    prompts = _prompts(llm.llm_engine.runner.cfg.vocab_size)
    got = {n: _alone(llm, prompts, lo) for n, lo in (("base", None), ("lora", lora))}
    assert {k[1] for k in llm.llm_engine.runner.prefill_graphs.graphs} == {False, True}
    del llm
    monkeypatch.setenv("PAGEFLASH_PREFILL_GRAPH_TOKENS", "0")
    ref = LLM("smollm2-135m", **kw)
    assert ref.llm_engine.runner.prefill_graphs is None
    for n, lo in (("base", None), ("lora", lora)):
        assert _alone(ref, prompts, lo) == got[n], n
    assert got["base"] != got["lora"]
