"""The engine on CUDA: Triton backend vs the PyTorch reference backend, CUDA graphs vs eager."""

import pytest
import torch

from pageflash import LLM, SamplingParams

PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 64, 100, 1, 250, 16))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(model="smollm2-135m", params=GREEDY, **kw):
    llm = LLM(model, load_format="dummy", max_model_len=512, num_kv_blocks=512, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


# qwen3-0.6b: per-head q/k RMSNorm before the fused rope + store launch, head_dim 128 != hidden / heads
MODELS = ["smollm2-135m", "qwen3-0.6b"]


@pytest.mark.parametrize("model", MODELS)
def test_triton_equals_torch_backend_fp32(model):
    ref, _ = run(model, dtype="float32", attention_backend="torch", enforce_eager=True)
    tri, llm = run(model, dtype="float32", attention_backend="triton", enforce_eager=True)
    assert llm.llm_engine.runner.backend.name == "triton"
    assert tri == ref


# bf16 for smollm2. qwen3-0.6b in float32: in bf16 its graphs and eager steps part at one near-tie token
# (prompt 4, position 17) with and without the fused q/k norm alike (scripts/qwen3_graph_probe.py, run 27)
@pytest.mark.parametrize("model,dtype", [("smollm2-135m", "bfloat16"), ("qwen3-0.6b", "float32")])
def test_cuda_graphs_equal_eager_bf16(model, dtype):
    eager, _ = run(model, dtype=dtype, enforce_eager=True)
    graphs, llm = run(model, dtype=dtype)
    assert llm.llm_engine.runner.graphs is not None
    assert graphs == eager


def test_qwen3_fused_qk_norm_equals_two_norms_fp32(monkeypatch):
    """The in-place q/k norm kernel gives the tokens of the reference path (two copies, two norms)."""
    import pageflash.model.llama as llama

    fused, _ = run("qwen3-0.6b", dtype="float32")
    monkeypatch.setattr(llama, "_fused_qk_norm", lambda qkv, w: None)
    plain, _ = run("qwen3-0.6b", dtype="float32")
    assert fused == plain


def test_logit_bias_through_graphs_and_async_fp32():
    """logit_bias rows beside plain ones: the decode graphs with async scheduling give the tokens of
    eager synchronous steps, and the biased rows differ from the plain run."""
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             logit_bias={(13 * i) % 900 + 3: 8.0, (5 * i) % 900 + 7: -100.0} if i % 2 else None)
              for i in range(len(PROMPTS))]  # fmt: skip
    eager, _ = run(params=params, dtype="float32", enforce_eager=True, async_scheduling=False)
    fast, llm = run(params=params, dtype="float32")
    assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.async_scheduling
    assert fast == eager
    plain, _ = run(dtype="float32")
    assert all(fast[i] != plain[i] for i in range(1, len(PROMPTS), 2))
    assert all(fast[i] == plain[i] for i in range(0, len(PROMPTS), 2))


def test_llama3_8b_dummy_runs_bf16():
    llm = LLM("llama-3-8b", load_format="dummy", max_model_len=1024, gpu_memory_utilization=0.85)
    out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]],
                       SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=1), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    eng = llm.llm_engine
    assert eng.dtype == torch.bfloat16 and eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_parallel_sampling_and_preemption_on_cuda():
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=256, num_kv_blocks=24, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p[:40]} for p in PROMPTS[:4]],
                        SamplingParams(n=2, temperature=1.0, max_tokens=40, ignore_eos=True, seed=3), use_tqdm=False)
    assert all(len(c.token_ids) == 40 for o in outs for c in o.outputs)
    assert llm.llm_engine.kv.num_free_blocks == 24


def test_async_scheduling_equals_sync_fp32_graphs():
    """Async scheduling (default on CUDA) feeds each decode graph the tokens sampled by the step
    still in flight; the outputs must equal synchronous stepping (float32: batch composition, which
    differs by the dropped extra steps, must not change a row's result beyond rounding)."""
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True, logprobs=2 if i % 4 == 1 else None)
              if i % 2 else SamplingParams(temperature=1.0, seed=i, max_tokens=30, stop_token_ids=[5, 6, 7, 8, 9])
              for i in range(len(PROMPTS))]
    outs = {}
    for mode in (None, False):
        llm = LLM("smollm2-135m", load_format="dummy", max_model_len=512, num_kv_blocks=512, dtype="float32",
                  async_scheduling=mode)
        assert llm.llm_engine.async_scheduling == (mode is None) and llm.llm_engine.runner.graphs is not None
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        outs[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in res]
        eng = llm.llm_engine
        assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    assert [o[:2] for o in outs[None]] == [o[:2] for o in outs[False]]
    for (_, _, a), (_, _, b) in zip(outs[None], outs[False]):
        assert (a is None) == (b is None)
        for da, db in zip(a or [], b or []):  # same tokens; logprobs equal up to float32 rounding
            assert da.keys() == db.keys()
            assert all(abs(da[t].logprob - db[t].logprob) < 1e-4 and da[t].rank == db[t].rank for t in da)


@pytest.mark.parametrize("mode", ["bulk", "line", "load"])
def test_weight_prefetch_leaves_decode_graphs_bitwise(monkeypatch, mode):
    """Decode graphs captured with the L2 weight prefetcher (side-stream branches) give the same
    logits, bit for bit, as graphs captured without it, at every prefetching bucket."""
    from pageflash.engine.model_runner import DecodeGraphs

    if mode == "bulk" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk prefetch instruction needs sm_90")
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=512, num_kv_blocks=512, dtype="bfloat16")
    r = llm.llm_engine.runner
    graphs = {}
    for name, spec in (("off", "0"), ("on", "qkv=64,o=64,gate_up=1,down=1,lm_head=8")):
        monkeypatch.setenv("PAGEFLASH_L2_PREFETCH", spec)
        monkeypatch.setenv("PAGEFLASH_L2_PREFETCH_MODE", mode)
        monkeypatch.setenv("PAGEFLASH_L2_PREFETCH_MAX_BATCH", "8")
        g = graphs[name] = DecodeGraphs(r, 8)
        g.capture()
    for b in (1, 2, 4, 8):
        for g in graphs.values():
            g.input_ids[:b] = torch.arange(b) * 31 + 5
            pos = torch.arange(b) + 3
            g.positions[:b] = pos
            g.seq_lens[:b] = (pos + 1).to(torch.int32)
            g.block_tables[:b, 0] = torch.arange(b, dtype=torch.int32) + 1
            g.slots[:b] = (torch.arange(b) + 1) * r.block_size + pos
        outs = {}
        for name, g in graphs.items():
            g.full[b].graph.replay()
            outs[name] = g.full[b].logits.clone()
        assert torch.isfinite(outs["off"]).all()
        assert torch.equal(outs["on"], outs["off"]), b


def test_embeddings_with_graphs_async_and_cached_prefixes_fp32():
    """Embedding requests beside generation on CUDA (decode graphs, async scheduling): the same vectors
    as eager synchronous steps, also when the prompt's blocks come from the prefix cache (a one-token
    tail: a decode-shaped step, which must not take the decode graphs)."""
    from pageflash import PoolingParams

    def vecs(**kw):
        llm = LLM("qwen3-0.6b", load_format="dummy", max_model_len=512, num_kv_blocks=512, dtype="float32", **kw)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        gen = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        first = llm.embed(prompts, use_tqdm=False)
        mixed = llm.generate(prompts + prompts, [gen] * len(PROMPTS) + [PoolingParams()] * len(PROMPTS), use_tqdm=False)
        eng = llm.llm_engine
        assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
        return ([o.outputs.embedding for o in first], [o.embedding for o in mixed[len(PROMPTS):]],
                [o.outputs[0].token_ids for o in mixed[:len(PROMPTS)]])

    e1, e2, toks = vecs(enforce_eager=True, async_scheduling=False)
    g1, g2, gtoks = vecs()
    for a, b in zip(e1 + e2 + g2, g1 * 3):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    assert gtoks == toks
