"""Tensor parallelism (engine/parallel.py) on the CPU: two ranks, two processes over gloo.

The sharding itself (ModelConfig.shard, the model's checkpoint slices) is checked without processes:
each rank's MLP / MoE block gives a partial sum and the ranks' sums add up to the whole model's. End
to end, an engine of two ranks gives HF transformers' greedy tokens (float32; chunked prefill,
preemption), for dense, GQA, MQA (replicated KV head), biased, q/k-norm (per head, and OLMo 2's over
the whole projections) and mixture-of-experts models, and with INT8 weights it equals HF over
weights quantized as the shards quantize them.
"""

import gc
import time

import pytest
import torch

from hf_ref import hf_greedy, make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.config import ModelConfig
from pageflash.model.loader import iter_weights, load_config, resolve_model
from test_engine_hf import CONFIGS

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_shard_config_sizes_and_errors():
    base = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    s = base.shard(2)
    assert (s.num_attention_heads, s.num_key_value_heads, s.intermediate_size, s.head_dim) == (4, 2, 48, 8)
    assert (s.hidden_size, s.vocab_size) == (64, 100)
    assert base.shard(1) is base
    rep = base.shard(8)  # 4 KV heads over 8 ranks: one each, every KV head on two ranks
    assert (rep.num_attention_heads, rep.num_key_value_heads) == (1, 1)
    with pytest.raises(ValueError, match=r"does not divide the model's num_attention_heads \(8\)"):
        base.shard(3)
    odd = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=3, head_dim=8)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\)"):
        odd.shard(2)
    moe = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=36, architecture="Qwen3MoeForCausalLM")
    m = moe.shard(4)  # every layer sparse: the dense intermediate size is unused and need not divide
    assert (m.moe_intermediate_size, m.num_experts, m.num_experts_per_tok) == (9, 4, 2)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(36\)"):
        moe.shard(8)


def _rank_models(folder: str, tp: int):
    """The whole model and each rank's shard, loaded from folder (float32, no process group)."""
    from pageflash.model.llama import LlamaForCausalLM

    src = resolve_model(folder)
    cfg = load_config(src)
    models = []
    for rank, size in [(0, 1)] + [(r, tp) for r in range(tp)]:
        m = LlamaForCausalLM(cfg.shard(size), max_positions=64, tp_rank=rank, tp_size=size)
        loaded = m.load_weights(iter_weights(src, cfg))
        assert loaded == {n for n, _ in m.named_parameters()}
        models.append(m.eval())
    return models[0], models[1:]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-moe", "mixtral"])
def test_rank_partial_sums_add_up_to_the_whole_layer(tmp_path, name):
    """Each rank's MLP (or MoE block with its shared expert) over the same input gives a partial sum;
    the ranks' sums equal the whole model's block. So do the o_proj products over each rank's heads."""
    folder = make_random_hf_folder(tmp_path, CONFIGS[name])
    full, shards = _rank_models(folder, 2)
    x = torch.randn(7, full.cfg.hidden_size)
    with torch.no_grad():
        for i, layer in enumerate(full.layers):
            parts = sum(s.layers[i].mlp(x) for s in shards)
            torch.testing.assert_close(parts, layer.mlp(x), rtol=1e-5, atol=1e-5)
            a = torch.randn(7, full.cfg.q_size)  # the attention output, heads in order
            q = shards[0].cfg.q_size
            o = sum(s.layers[i].self_attn.o_proj(a[:, r * q:(r + 1) * q]) for r, s in enumerate(shards))
            torch.testing.assert_close(o, layer.self_attn.o_proj(a), rtol=1e-5, atol=1e-5)
            # q/k/v rows: rank r holds heads [r H/2, (r+1) H/2) of q and of k and v
            fq, fk, fv = layer.self_attn.qkv_proj.split(layer.self_attn.qkv_proj(x))
            got = [s.layers[i].self_attn.qkv_proj.split(s.layers[i].self_attn.qkv_proj(x)) for s in shards]
            torch.testing.assert_close(torch.cat([g[0] for g in got], 1), fq)
            torch.testing.assert_close(torch.cat([g[1] for g in got], 1), fk)
            torch.testing.assert_close(torch.cat([g[2] for g in got], 1), fv)
        # replicated: the embedding table and the head
        for s in shards:
            assert torch.equal(s.head_weight, full.head_weight)


def _prompts(n=(1, 5, 16, 17, 33)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 211, (k,), generator=g).tolist() for k in n]


def _generate(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def _close(llm) -> None:
    llm.shutdown()
    del llm
    gc.collect()


@pytest.mark.parametrize("name,async_scheduling", [("llama-gqa", False), ("llama-gqa", True),
                                                   ("llama-mqa-tied", False), ("qwen2-bias", True),
                                                   ("qwen3-qk-norm", False), ("qwen3-moe", True),
                                                   ("qwen2-moe", False), ("mistral-window", True),
                                                   ("gemma2", True), ("gemma3", False), ("phi3", False),
                                                   ("granite", True), ("phi3-longrope", True),
                                                   ("smollm3", False), ("smollm3-window-yarn", True),
                                                   ("olmo2", True), ("olmo2-mqa", False)])
def test_two_ranks_match_hf(tmp_path, name, async_scheduling):
    """Two ranks give HF's greedy tokens, with chunked prefill (a budget of 24 tokens, blocks of 4) in a
    pool small enough to preempt (a sliding window over every layer: blocks behind it given back); no KV block leaks; the workers stop at shutdown. With async
    scheduling, rank 0 broadcasts the in-flight step's sampled ids that the next step reads."""
    from transformers import AutoModelForCausalLM

    # (OLMo 2's whole-projection q / k norms: the sums of squares all-reduced; with one KV head, the
    # replicated head's k counted on both ranks)
    config = dict(CONFIGS["olmo2"], num_key_value_heads=1) if name == "olmo2-mqa" else CONFIGS[name]
    folder = make_random_hf_folder(tmp_path, config)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = _prompts()
    want = [hf_greedy(hf, p, 16) for p in prompts]
    # (a sliding window's sequences hold only their windows: a smaller pool to preempt)
    pool = dict(num_kv_blocks=8, max_num_batched_tokens=8) if ModelConfig.from_hf_dict(config).kv_window else \
        dict(num_kv_blocks=20, max_num_batched_tokens=24)
    llm = LLM(folder, block_size=4, max_model_len=64, tensor_parallel_size=2, async_scheduling=async_scheduling,
              **pool)
    eng = llm.llm_engine
    assert eng.runner.tp_size == 2 and eng.async_scheduling == async_scheduling
    assert eng.runner.model.cfg.num_attention_heads == hf.config.num_attention_heads // 2
    assert _generate(llm, prompts) == want
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.num_free_blocks == pool["num_kv_blocks"]
    procs = eng.runner._procs
    _close(llm)
    assert not any(p.is_alive() for p in procs)
    assert not torch.distributed.is_initialized()


SPEC_PROMPTS = [[5, 6, 7, 8, 9] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1], [11, 12, 13], [40] * 9]


@pytest.mark.parametrize("spec", [dict(method="ngram", num_speculative_tokens=3),
                                  dict(method="ngram", tree=[2], num_speculative_tokens=5),
                                  dict(method="early_exit", num_layers=1, tree=[2, 1]),
                                  # (the target itself as the draft: every draft is accepted)
                                  dict(method="draft_model", model="{target}", num_speculative_tokens=2)],
                         ids=["ngram", "ngram-tree", "early_exit-tree", "draft_model"])
def test_two_ranks_with_speculation_equal_plain_greedy(tmp_path, spec):
    """Speculative decoding over two ranks: verify steps (chains; token trees, whose accepted nodes'
    KV is compacted on every rank), early-exit drafts (the ranks' first layer only) and a draft model
    (rank 0 alone) give the one-rank engine's plain greedy tokens, with drafts accepted; no leaks."""
    folder = make_random_hf_folder(tmp_path / "t", CONFIGS["llama-gqa"])
    spec = {k: (v.format(target=folder) if isinstance(v, str) else v) for k, v in spec.items()}
    kw = dict(block_size=4, max_num_batched_tokens=32, max_model_len=96, num_kv_blocks=120)
    want = _generate(LLM(folder, **kw), SPEC_PROMPTS, GREEDY)
    llm = LLM(folder, tensor_parallel_size=2, speculative_config=spec, **kw)
    eng = llm.llm_engine
    assert _generate(llm, SPEC_PROMPTS, GREEDY) == want
    assert eng.get_stats()["spec"][spec["method"]]["num_accepted_tokens"] > 0
    assert eng.kv.num_free_blocks == 120
    _close(llm)


def test_two_ranks_early_exit_with_parallel_sampling(tmp_path):
    """n = 2 siblings share the prompt's partial last block; the early-exit drafter's allocation is the
    first write into it, and the copy it records must reach every rank (it once reached rank 0 only:
    one sibling of each pair then read stale KV on the other rank)."""
    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    prompts = _prompts((9, 7))
    params = SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(block_size=4, max_model_len=64, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in LLM(folder, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    llm = LLM(folder, tensor_parallel_size=2, speculative_config=dict(method="early_exit", num_layers=1,
                                                                      num_speculative_tokens=3), **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w[:12]] * 2 for w in want]
    assert llm.llm_engine.kv.num_free_blocks == 64
    _close(llm)


def _fake_quantized_tp_hf(folder: str, tp: int):
    """HF's model over the weights as `tp` INT8 ranks hold them: every projection quantized per row, the
    row-parallel ones (o_proj, down_proj, the experts' down) per row of each rank's column slice."""
    from transformers import AutoModelForCausalLM

    from pageflash.kernels.w8_linear import dequantize_int8, quantize_int8

    def fake(w):
        q, sc = quantize_int8(w.reshape(-1, w.shape[-1]))
        return dequantize_int8(q, sc, torch.float32).view(w.shape)

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.model.layers.named_parameters():
            if p.dim() < 2 or name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                continue
            if "o_proj" in name or "down_proj" in name:
                p.copy_(torch.cat([fake(c.contiguous()) for c in p.chunk(tp, dim=-1)], dim=-1))
            else:
                p.copy_(fake(p))
    return hf


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-moe"])
def test_two_int8_ranks_match_hf_on_their_quantization(tmp_path, name):
    """quantization="int8" under two ranks: each rank quantizes its own slices (row-parallel matrices
    then have a scale per row of each half); greedy equals HF over those dequantized weights."""
    folder = make_random_hf_folder(tmp_path, CONFIGS[name], std=0.3)
    prompts = _prompts((1, 7, 16, 33))
    llm = LLM(folder, max_model_len=64, num_kv_blocks=64, quantization="int8", tensor_parallel_size=2)
    got = _generate(llm, prompts)
    _close(llm)
    hf_q = _fake_quantized_tp_hf(folder, 2)
    assert got == [hf_greedy(hf_q, p, 16) for p in prompts]


def test_tensor_parallel_errors_name_the_problem(tmp_path):
    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(folder, tensor_parallel_size=0)
    # 8 heads over 3 ranks: refused before any process starts; nothing is left behind
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's num_attention_heads"):
        LLM(folder, tensor_parallel_size=3, max_model_len=64, num_kv_blocks=16)
    assert not torch.distributed.is_initialized()
    # a prompt that is too long is refused; the ranks go on serving the next requests
    llm = LLM(folder, max_model_len=32, num_kv_blocks=16, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1] * 40}], GREEDY, use_tqdm=False)
    out = _generate(llm, _prompts((3, 9)))
    assert [len(t) for t in out] == [16, 16]
    # a second engine in the same process while the first holds the process group
    with pytest.raises(ValueError, match="one tensor-parallel engine per process"):
        LLM(folder, max_model_len=32, num_kv_blocks=16, tensor_parallel_size=2)
    _close(llm)


def test_real_model_on_three_ranks_serves_openai_clients():
    """The embedded SmolLM2-135M (9 heads, 3 KV heads: three ranks) behind the OpenAI-compatible server:
    a completion, a streamed chat and concurrent requests give the one-rank engine's greedy text."""
    import threading

    import openai

    from pageflash.engine.async_engine import AsyncLLMEngine
    from pageflash.server.app import build_app
    from test_server import CHAT, LOAD_PROMPTS, MODEL, PROMPT, serve

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one = LLM(MODEL, max_model_len=256, num_kv_blocks=96)
    want = one.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    want_chat = one.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0].text
    want_load = [o.outputs[0].text for o in one.generate(LOAD_PROMPTS, greedy, use_tqdm=False)]
    del one
    llm = LLM(MODEL, max_model_len=256, num_kv_blocks=96, tensor_parallel_size=3)
    aeng = AsyncLLMEngine(llm.llm_engine)
    try:
        with serve(build_app(aeng, MODEL)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
            kw = dict(model=MODEL, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
            assert client.completions.create(prompt=PROMPT, **kw).choices[0].text == want
            stream = client.chat.completions.create(messages=CHAT, stream=True, **kw)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat
            got = [None] * len(LOAD_PROMPTS)

            def one_request(i):
                got[i] = client.completions.create(prompt=LOAD_PROMPTS[i], **kw).choices[0].text

            threads = [threading.Thread(target=one_request, args=(i,)) for i in range(len(LOAD_PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert got == want_load
            assert llm.llm_engine.kv.num_free_blocks == 96
    finally:
        aeng.shutdown()
        _close(llm)


def test_compact_schedule_gives_the_runner_the_same_step():
    """A step as the workers receive it (compact_schedule, pickled) gives ModelRunner.prepare and the
    prompt-logprob rows exactly what the SchedulerOutput gives: a prefill chunk asking prompt
    logprobs, a finished prompt's last chunk, decodes (one with its token pending on the device), draft
    tokens, block copies."""
    import pickle
    from types import SimpleNamespace

    from pageflash.engine.model_runner import ModelRunner
    from pageflash.engine.parallel import compact_schedule
    from pageflash.engine.scheduler import ScheduledSeq, SchedulerOutput
    from pageflash.engine.sequence import Request

    def req(i, n_prompt, computed, outputs=(), **params):
        r = Request(f"r{i}", None, list(range(100 * i, 100 * i + n_prompt)), SamplingParams(**params), 0.0)
        r.token_ids += list(outputs)
        r.num_computed_tokens = computed
        return r

    chunk = req(0, 30, 8, prompt_logprobs=2)  # a prefill chunk of 10 that scores prompt tokens
    last = req(1, 13, 9)  # the prompt's last 4 tokens: samples
    dec = req(2, 5, 6, outputs=[7, 8])  # a decode
    pend = req(3, 5, 7, outputs=[9, 10])  # a decode whose newest token is still on the device
    pend.num_pending, pend.pending_row = 1, 3
    spec = req(4, 6, 7, outputs=[4, 5])  # a decode with 2 draft tokens to verify
    spec.spec_token_ids = [11, 12]
    sched = SchedulerOutput([ScheduledSeq(chunk, 10, 0), ScheduledSeq(last, 4, 0), ScheduledSeq(dec, 1, 0),
                             ScheduledSeq(pend, 1, 0), ScheduledSeq(spec, 3, 2)], block_copies=[(3, 9)])
    tables = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14], [15, 16], [17, 18, 19]]
    compact = pickle.loads(pickle.dumps(compact_schedule(sched)))
    assert [s.samples for s in compact.seqs] == [s.samples for s in sched.seqs] == [False, True, True, True, True]
    assert compact.block_copies == [(3, 9)] and compact.is_decode == sched.is_decode
    runner = SimpleNamespace(block_size=4)
    assert ModelRunner.prepare(runner, compact, tables, []) == ModelRunner.prepare(runner, sched, tables, [])
    fixes_a, fixes_b = [], []
    ModelRunner.prepare(runner, compact, tables, fixes_a)
    ModelRunner.prepare(runner, sched, tables, fixes_b)
    assert fixes_a == fixes_b == [(len(range(10)) + 4 + 1, 3)]
    assert ModelRunner._prompt_logprob_rows(compact) == ModelRunner._prompt_logprob_rows(sched)
    assert ModelRunner._prompt_logprob_rows(sched)[1] is not None
    # (LongRoPE's table rows follow each request's length: ModelRunner.rope_rows)
    assert [s.request.num_tokens for s in compact.seqs] == [s.request.num_tokens for s in sched.seqs]
    # what the decode graphs read: the token at num_computed_tokens, and the history's length
    for a, b in zip(compact.seqs[2:4], sched.seqs[2:4]):
        ra, rb = a.request, b.request
        assert len(ra.token_ids) == len(rb.token_ids)
        p = rb.num_computed_tokens
        if p < len(rb.token_ids):
            assert ra.token_ids[p] == rb.token_ids[p]
        with pytest.raises(IndexError, match="outside the step's window"):
            ra.token_ids[0]


def test_two_ranks_sampling_forks_embeddings_and_prompt_logprobs_equal_one_rank(tmp_path):
    """What rank 0 alone does on the step's results is unchanged by the split: seeded sampling with
    n = 2 (the siblings fork the prompt's blocks, the shared partial block copied on first write on
    every rank), embeddings (final hidden states) and prompt logprobs equal the one-rank engine's."""
    from pageflash import PoolingParams

    folder = make_random_hf_folder(tmp_path, CONFIGS["qwen3-qk-norm"])
    prompts = _prompts((6, 19))
    sampled = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
    lp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)

    def run(tp):
        llm = LLM(folder, block_size=4, max_model_len=64, num_kv_blocks=64, tensor_parallel_size=tp)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False)
        toks = [[c.token_ids for c in o.outputs] for o in outs]
        emb = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in prompts],
                                                       PoolingParams(normalize=False), use_tqdm=False)]
        plp = llm.generate([{"prompt_token_ids": prompts[1]}], lp, use_tqdm=False)[0].prompt_logprobs
        free = llm.llm_engine.kv.num_free_blocks
        if tp > 1:
            _close(llm)
        return toks, emb, plp, free

    one, two = run(1), run(2)
    assert two[0] == one[0] and all(a != b for a, b in two[0])  # two different samples per prompt
    for a, b in zip(two[1], one[1]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)
    assert len(two[2]) == len(one[2]) == len(prompts[1])
    for a, b in zip(two[2][1:], one[2][1:]):
        assert a.keys() == b.keys()
        for tok in a:
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
    assert two[3] == one[3] == 64


def test_a_script_without_a_main_guard_gets_a_clear_error(tmp_path):
    """Workers are spawned: they import the main module, which (unguarded) would start an engine of its
    own. The worker dies starting up and the engine says why at once, instead of waiting out the
    rendezvous timeout."""
    import subprocess
    import sys
    import time

    folder = make_random_hf_folder(tmp_path / "model", CONFIGS["llama-gqa"])
    script = tmp_path / "unguarded.py"
    script.write_text(f"from pageflash import LLM\nLLM({folder!r}, max_model_len=32, num_kv_blocks=16, "
                      f"tensor_parallel_size=2)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PAGEFLASH_TP_TIMEOUT": "600"})
    assert r.returncode != 0
    assert "exited with code" in r.stderr and 'if __name__ == "__main__":' in r.stderr
    assert time.monotonic() - t0 < 240


def test_a_failed_step_stops_the_ranks_instead_of_running_them_out_of_step(tmp_path):
    """A step that raises on rank 0 leaves the workers inside its all-reduces: later steps would pair
    their collectives one step off and give wrong tokens. The engine stops the workers and refuses
    further steps with the reason; after shutdown() a step says the engine was shut down."""
    import time

    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    llm = LLM(folder, max_model_len=64, num_kv_blocks=32, tensor_parallel_size=2)
    runner = llm.llm_engine.runner
    real, calls = runner.local.execute, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure on rank 0")
        return real(*a, **kw)

    runner.local.execute = flaky
    with pytest.raises(RuntimeError, match="injected failure"):
        _generate(llm, _prompts((5,)))
    with pytest.raises(RuntimeError, match="out of step since a failed step .*injected failure"):
        _generate(llm, _prompts((1,)))
    t0 = time.monotonic()
    procs = runner._procs
    llm.shutdown()
    assert time.monotonic() - t0 < 10 and not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        _generate(llm, _prompts((1,)))
    del llm
    gc.collect()
    assert not torch.distributed.is_initialized()


def test_shutdown_drops_rank_zeros_graphs_before_leaving_the_group(monkeypatch):
    """NCCL's teardown can block while a CUDA graph holding its collectives is alive (two H100s: rank 0
    hung at exit in destroy_process_group), and it is collective: _shutdown releases rank 0's graphs
    first, tells the workers to stop, starts leaving the group while they leave too, then waits for
    them and (at most _LEAVE_WAIT_S) for its own leave."""
    from pageflash.engine import parallel

    calls = []

    class Runner:
        def release_graphs(self):
            calls.append("release")

    class Conn:
        def send(self, msg):
            calls.append(("send", msg))

        def close(self):
            calls.append("close")

    class Proc:
        def join(self, timeout=None):
            calls.append("join")

        def is_alive(self):
            return False

    monkeypatch.setattr(parallel, "_start_leave", lambda: calls.append("leave") or "thread")
    monkeypatch.setattr(parallel, "_finish_leave", lambda t: calls.append(("left", t)))
    local = [Runner()]
    parallel._shutdown([Conn()], [Proc()], local)
    assert calls == ["release", ("send", None), "leave", "join", "close", ("left", "thread")] and local == []


def test_leaving_a_group_that_blocks_gives_up_with_a_warning(monkeypatch, caplog):
    """A destroy_process_group that never returns costs `wait` seconds and a warning, not a hung process."""
    import threading

    import torch.distributed as dist

    from pageflash.engine import parallel

    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(30))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    with caplog.at_level("WARNING", logger=parallel.logger.name):
        t0 = time.perf_counter()
        parallel._leave_group(wait=0.2)
        assert time.perf_counter() - t0 < 5
    release.set()
    assert "leaving the process group did not finish in 0 s (pageflash-tp-teardown-rank1)" in caplog.text


def test_release_graphs_destroys_every_captured_graph():
    """NCCL's communicator teardown waits for every graph that captured one of its collectives to be
    destroyed: release_graphs resets each graph it captured, whoever else still holds one."""
    from types import SimpleNamespace

    from pageflash.engine.model_runner import ModelRunner

    class Graph:
        resets = 0

        def reset(self):
            self.resets += 1

    kept = [Graph(), Graph()]  # (as if a step's closure still held them)
    runner = SimpleNamespace(graphs=object(), step_graphs=object(), graph_pool=object(), captured=list(kept),
                             device=torch.device("cpu"))
    ModelRunner.release_graphs(runner)
    assert [g.resets for g in kept] == [1, 1]
    assert runner.captured == [] and runner.graphs is None and runner.step_graphs is None and runner.graph_pool is None
    ModelRunner.release_graphs(runner)  # idempotent
    assert [g.resets for g in kept] == [1, 1]


def test_leave_mode_names_a_bad_value(monkeypatch):
    from pageflash.engine import parallel

    monkeypatch.setenv("PAGEFLASH_TP_LEAVE", "kill")
    with pytest.raises(ValueError, match="PAGEFLASH_TP_LEAVE must be 'destroy' or 'abort', got 'kill'"):
        parallel._leave_mode()
    monkeypatch.setenv("PAGEFLASH_TP_LEAVE", "abort")
    assert parallel._leave_mode() == "abort"
