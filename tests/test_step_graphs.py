"""The static-buffer path of StepGraphs (what the CUDA graphs of speculative verify and draft steps
replay), run eagerly on the CPU with the Triton kernels under the interpreter: packing, padding to
(sequence bucket x max query length), the causal / tree mask buffer, row mapping and hidden states.
Greedy speculative output through it equals plain greedy; the graphs themselves are checked on the
GPU (tests/gpu/test_spec_gpu.py)."""

from __future__ import annotations

import pytest

from hf_ref import make_random_hf_folder
from pageflash import LLM, SamplingParams

V = 97
CFG = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
ENGINE = dict(block_size=4, max_model_len=96, max_num_batched_tokens=32, num_kv_blocks=200, dtype="float32",
              attention_backend="triton")
PROMPTS = [[5, 6, 7, 8, 9] * 3, [3, 1, 4, 1, 5, 9, 2, 6] * 2 + [3, 1], [11, 12, 13], [40] * 9, [7]]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    target = make_random_hf_folder(tmp_path_factory.mktemp("target"), CFG, seed=0)
    draft = make_random_hf_folder(tmp_path_factory.mktemp("draft"), dict(CFG, num_hidden_layers=1), seed=1)
    plain = LLM(target, **dict(ENGINE, attention_backend="torch"))
    ref = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                           use_tqdm=False)]
    return dict(target=target, draft=draft, ref=ref)


@pytest.mark.parametrize("spec", [
    dict(method="ngram", num_speculative_tokens=3),
    dict(method="ngram", tree=[2], num_speculative_tokens=5),
    dict(method="early_exit", num_layers=1, tree=[2, 1]),
    dict(method="draft_model", model="{draft}", num_speculative_tokens=2),
], ids=["ngram", "ngram-tree", "early_exit-tree", "draft_model"])
def test_step_graph_path_greedy_equals_plain(env, spec):
    spec = {k: (v.format(**env) if isinstance(v, str) else v) for k, v in spec.items()}
    llm = LLM(env["target"], speculative_config=spec, **ENGINE)
    eng = llm.llm_engine
    runners = [eng.runner] + ([eng.spec.draft_runner] if eng.spec.draft_runner is not None else [])
    for r in runners:
        r.enable_step_graphs(8, cuda_graphs=False)  # buckets 1, 2, 4, 8: 5 sequences run padded to 8
    eng.runner.step_graphs.add_query_size(1 + eng.spec.max_draft_nodes)
    eng.runner.step_graphs.capture_all(1 + eng.spec.max_draft_nodes)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == env["ref"]
    assert all(r.step_graphs.replays > 0 for r in runners)
    assert any(s > 1 for s, _, _ in eng.runner.step_graphs.graphs)  # a padded multi-sequence verify ran
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_packed_input_copies_equal_one_copy_per_input(env):
    """The verify graphs' inputs are filled by two copies of packed host images; they must leave what a
    graph of the step's key reads exactly as one copy per input does (buffers poisoned before each)."""
    import random

    import torch

    llm = LLM(env["target"], **ENGINE)
    r = llm.llm_engine.runner
    r.enable_step_graphs(8, cuda_graphs=False)
    sg = r.step_graphs
    rng = random.Random(0)
    for trial in range(30):
        s = rng.randint(1, 8)
        b = next(x for x in sg.buckets if x >= s)
        q = rng.choice([1, 2, 4, 8])
        qlens = [rng.randint(1, q) for _ in range(s)]
        n, t = sum(qlens), b * q
        ids = [rng.randrange(V) for _ in range(n)]
        pos = [rng.randrange(90) for _ in range(n)]
        slots = [rng.randrange(800) for _ in range(n)]
        seq_lens = [rng.randint(1, 90) for _ in range(s)]
        tables = [[rng.randrange(200) for _ in range(rng.randint(1, sg.max_blocks))] for _ in range(s)]
        got = {}
        for packed in (True, False):
            sg._i64.fill_(7)
            sg._i32.fill_(7)
            fill = sg._copy_packed if packed else sg._copy_each
            qsl = fill(ids, pos, slots, qlens, seq_lens, tables, b, t)
            got[packed] = ([x.clone() for x in (sg.input_ids[:t], sg.positions[:t], sg.slots[:t], sg.qsl[: b + 1],
                                                 sg.seq_lens[:b], sg.block_tables[:b])], qsl.copy())
        for x, y in zip(got[True][0], got[False][0]):
            assert torch.equal(x, y), trial
        assert (got[True][1] == got[False][1]).all()
