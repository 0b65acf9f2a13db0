"""The static-buffer path of PrefillGraphs (what the CUDA graphs of one sequence's prefill step replay),
run eagerly on the CPU with the Triton kernels under the interpreter: padding to a power-of-two
bucket, the causal paged attention over cached context (prefix-cache hits, the last chunk of a chunked
prompt), the logits row, LoRA's twin graphs. Greedy output through it equals the torch backend's; the
graphs themselves are checked on the GPU (tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from hf_ref import make_random_hf_folder
from pageflash import LLM, SamplingParams

V = 97
CFG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(block_size=4, max_model_len=96, max_num_batched_tokens=40, num_kv_blocks=120, dtype="float32")
# 2..40 tokens: buckets 16 / 32 / 64 (a 3-token prompt runs 13 padding rows), one prompt of 50 in two
# chunks (its second chunk attends to the first's cached blocks), one twice (a prefix-cache hit)
PROMPTS = [[5, 6], [11, 12, 13], [3, 1, 4, 1, 5, 9, 2, 6] * 2, [40] * 17, [(7 * i) % V for i in range(33)],
           [(3 * i + 1) % V for i in range(50)], [(3 * i + 1) % V for i in range(50)]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_random_hf_folder(tmp_path_factory.mktemp("model"), CFG, seed=0)


def _alone(llm, prompts, lora=None):
    """Each prompt in its own generate call (so that its prefill is the step's only sequence)."""
    return [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
            for p in prompts]


def test_prefill_graph_path_greedy_equals_torch_backend(folder):
    ref = _alone(LLM(folder, attention_backend="torch", **ENGINE), PROMPTS)
    llm = LLM(folder, attention_backend="triton", **ENGINE)
    r = llm.llm_engine.runner
    r.enable_prefill_graphs(64, cuda_graphs=False)
    pg = r.prefill_graphs
    assert pg.buckets == [16, 32, 64]
    pg.CAPTURE_AFTER = 1  # every eligible step through the static buffers
    calls = []  # (tokens, cached tokens before them) of the steps the graphs ran
    run = pg.run

    def spy(sched, ids, *a):
        res = run(sched, ids, *a)
        if res is not None:
            calls.append((len(ids), sched.seqs[0].request.num_computed_tokens))
        return res

    pg.run = spy
    assert _alone(llm, PROMPTS) == ref
    assert pg.replays == len(calls) == len(PROMPTS) + 1
    assert (40, 0) in calls and (10, 40) in calls  # the chunked prompt's two chunks
    assert calls[-1][1] > 0 and calls[-1][0] < 50  # the repeated prompt hit the prefix cache
    assert sorted(k[0] for k in pg.graphs) == [16, 32, 64]
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_prefill_graph_inputs_and_padding(folder):
    """What a step leaves in the static buffers: its tokens, then padding rows that store nothing
    (slot -1); the query starts and length of one sequence; its block table; the logits row."""
    llm = LLM(folder, attention_backend="triton", **ENGINE)
    r = llm.llm_engine.runner
    r.enable_prefill_graphs(32, cuda_graphs=False)
    pg = r.prefill_graphs
    pg.CAPTURE_AFTER = 1
    seen = {}
    fwd_of = pg._forward

    def spy(t, lora):
        fwd = fwd_of(t, lora)

        def wrapped():
            seen.update(t=t, ids=pg.input_ids[:t].clone(), slots=pg.slots[:t].clone(), qsl=pg.qsl.clone(),
                        lens=pg.seq_lens.clone(), row=int(pg.logit_row), bt=pg.block_tables[0, :3].clone())
            return fwd()
        return wrapped

    pg._forward = spy
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert seen["t"] == 16
    assert seen["ids"][:11].tolist() == prompt
    assert seen["slots"][11:].tolist() == [-1] * 5 and (seen["slots"][:11] >= 0).all()
    assert seen["qsl"].tolist() == [0, 11] and seen["lens"].tolist() == [11] and seen["row"] == 10
    # steps of one token (decode) and of more tokens than the largest bucket stay on their own paths
    before = pg.replays
    llm.generate({"prompt_token_ids": list(range(1, 40))}, GREEDY, use_tqdm=False)
    assert pg.replays == before


def test_prefill_graphs_under_lora_equal_eager(folder, tmp_path):
    """With LoRA on, a bucket's graph runs the LoRA kernels for a request under an adapter and its twin
    without them for a base request; the outputs equal the eager path's."""
    from pageflash.lora import LoRARequest
    from pageflash.lora.adapter import write_random_adapter

    kw = dict(ENGINE, attention_backend="triton", enable_lora=True, max_loras=1, max_lora_rank=8)
    eager = LLM(folder, **kw)
    path = write_random_adapter(str(tmp_path / "a"), eager.llm_engine.runner.cfg, 8, seed=3, std_b=0.3)
    lora = LoRARequest("a", 1, path)
    prompts = PROMPTS[:3]
    want = {name: _alone(eager, prompts, lo) for name, lo in (("base", None), ("lora", lora))}
    assert want["base"] != want["lora"]
    llm = LLM(folder, **kw)
    r = llm.llm_engine.runner
    r.enable_prefill_graphs(32, cuda_graphs=False)
    r.prefill_graphs.CAPTURE_AFTER = 1
    for name, lo in (("base", None), ("lora", lora)):
        assert _alone(llm, prompts, lo) == want[name], name
    assert {k[1] for k in r.prefill_graphs.graphs} == {False, True}


def test_prefill_graphs_off(folder, monkeypatch):
    monkeypatch.setenv("PAGEFLASH_PREFILL_GRAPH_TOKENS", "0")
    llm = LLM(folder, attention_backend="triton", **ENGINE)
    r = llm.llm_engine.runner
    r.enable_prefill_graphs(cuda_graphs=False)
    assert r.prefill_graphs is None
    torch.manual_seed(0)
    r.enable_prefill_graphs(8, cuda_graphs=False)  # below the smallest bucket
    assert r.prefill_graphs is None
