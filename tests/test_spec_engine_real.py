"""Speculative decoding on the real default model (SmolLM2-135M-Instruct, CPU): a short n-gram check.

Greedy output with n-gram speculation equals plain greedy output of the same engine (speculation
switched off) on held-out grounded prompts (the answer quotes the prompt, so drafts get accepted)
and a free chat prompt, in one batch; no KV block leaks; the bench's CPU smoke run on a tiny model.
"""

from __future__ import annotations

import json

import pytest

from pageflash import LLM, SamplingParams
from pageflash.spec.corpus import build_prompts, chat_prompt


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, num_kv_blocks=160, max_num_batched_tokens=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 5})


def test_real_model_ngram_greedy_equals_plain(llm):
    eng = llm.llm_engine
    tok = eng.tokenizer
    msgs = build_prompts("grounded", 2, text_tokens=120, count_tokens=lambda s: len(tok.encode(s)))
    msgs = [msgs[1], build_prompts("chat", 1)[0]]  # "Repeat ... exactly" and a free question
    prompts = [chat_prompt(tok, m) for m in msgs]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eng.spec.enabled = False
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    eng.spec.enabled = True
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    s = eng.get_stats()["spec"]["ngram"]
    assert s["num_accepted_tokens"] >= 10 and s["mean_emitted_per_step"] > 1.5, s
    assert sum(outs[0].metrics.spec_accepted) >= 10  # the repeat task copies its input
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_bench_spec_cpu_smoke(tmp_path):
    from hf_ref import make_random_hf_folder
    from pageflash.bench.spec import main

    cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama",
               architectures=["LlamaForCausalLM"], num_attention_heads=4, num_key_value_heads=2)
    folder = make_random_hf_folder(tmp_path / "m", cfg)
    out = tmp_path / "spec.json"
    rc = main(["--model", folder, "--max-model-len", "96", "--num-kv-blocks", "200", "--methods", "ngram",
               "ngram@3", "early_exit-tree", "medusa", "--batch-size", "1", "2", "--temperature", "0", "1", "--tasks",
               "grounded", "--num-prompts", "2", "--max-tokens", "8", "--text-tokens", "16",
               "--medusa-train-prompts", "4", "--medusa-train-tokens", "8", "--medusa-epochs", "1",
               "--num-iters", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["results"]) == 4 * 2 * 2
    ks = {r["method"]: r["spec_config"].get("num_speculative_tokens") for r in res["results"]}
    assert ks["ngram"] == 5 and ks["ngram@3"] == 3
    for r in res["results"]:
        assert r["spec_tok_s"] > 0 and r["baseline_tok_s"] > 0
        assert len(r["spec_tok_s_rounds"]) == len(r["baseline_tok_s_rounds"]) == 2
        assert r["spec_tok_s"] in r["spec_tok_s_rounds"] and r["baseline_tok_s"] in r["baseline_tok_s_rounds"]
        if r["temperature"] == 0.0:
            assert r["greedy_equal"] == f"{r['num_prompts']}/{r['num_prompts']}"
    assert res["medusa_training"]["val_top1_per_head"]


def test_bench_spec_method_names(capsys):
    import argparse

    from pageflash.bench.spec import main, parse_method, spec_config

    assert parse_method("ngram") == ("ngram", None, False)
    assert parse_method("ngram-tree@8+adaptive") == ("ngram-tree", 8, True)
    a = argparse.Namespace(k=5, ngram_width=3, tree="3,2,1", early_exit_layers=None)
    assert spec_config("ngram@10+adaptive", a, 30, None) == {"method": "ngram", "adaptive": True,
                                                             "num_speculative_tokens": 10}
    assert spec_config("ngram-tree@4", a, 30, None) == {"method": "ngram", "adaptive": False,
                                                        "num_speculative_tokens": 12, "tree": [3]}
    assert spec_config("early_exit@2", a, 30, None)["num_speculative_tokens"] == 2
    for bad in ("ngram@0", "ngram@x", "bogus", "ngram@"):
        assert main(["--methods", bad]) == 2
        assert "error:" in capsys.readouterr().err
