"""pageflash bench latency / throughput on the CPU (tiny sizes) and the roofline cost model by hand."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import warnings

import pytest
import torch

from pageflash.bench import roofline
from pageflash.bench.latency import llm_kwargs, resolve_load_format
from pageflash.bench.latency import main as latency_main
from pageflash.bench.throughput import load_dataset, w_offline_requests
from pageflash.bench.throughput import main as throughput_main
from pageflash.config import ModelConfig
from pageflash.model.registry import NAMED_CONFIGS

TINY_ENGINE = ["--model", "smollm2-135m", "--max-model-len", "64", "--max-num-seqs", "4", "--num-kv-blocks", "16",
               "--disable-tqdm"]


def tiny_cfg(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=tied)


# ---- roofline by hand ------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_roofline_bytes_and_flops_by_hand(tied):
    cfg = tiny_cfg(tied)
    # per layer: qkv 8*(8+4+4)=128, o 8*8=64, gate/up/down 3*8*16=384, two norms 16 -> 592
    # 2 layers + final norm 8 = 1192; LM head 32*8 = 256 (untied: its own matrix; tied: the table, counted once)
    assert roofline.matmul_params(cfg) == 2 * 592 + 8 + 256 == 1448
    assert roofline.weight_bytes(cfg, 2) == 2896
    # K and V, 2 layers, 1 KV head, head_dim 4, bf16: 2*2*1*4*2
    assert roofline.kv_bytes_per_token(cfg, 2) == 32
    assert roofline.decode_step_bytes(cfg, 10, 2, batch_size=3) == 2896 + 32 * 30
    assert roofline.decode_step_bytes(cfg, [1, 2, 3], 2) == 2896 + 32 * 6
    assert roofline.decode_step_bytes(cfg, [5], 2, kv_bytes_per_elem=1) == 2896 + 16 * 5  # an fp8 cache
    # attention: 4 * layers * q heads * head_dim * L = 64 L
    assert roofline.flops_per_token(cfg, 5) == 2 * 1448 + 64 * 5
    # prompt 3 + 2 generated: 4 tokens fed, attending to 1, 2, 3, 4 keys
    assert roofline.sequence_flops(cfg, 3, 2) == sum(roofline.flops_per_token(cfg, p + 1) for p in range(4))
    assert roofline.sequence_flops(cfg, 3, 2) == 4 * 2896 + 64 * 10
    assert roofline.decode_step_flops(cfg, [3, 4]) == roofline.flops_per_token(cfg, 3) + roofline.flops_per_token(cfg, 4)


def test_roofline_sliding_window_by_hand():
    """A sliding-window layer reads at most its window of keys: layer 1 of 2 slides with window 4."""
    import dataclasses

    cfg = dataclasses.replace(tiny_cfg(False), sliding_window=4, sliding_layers=(1,))
    assert roofline.layer_keys(cfg, 10) == 10 + 4 and roofline.layer_keys(cfg, 3) == 6
    # per layer and key: K and V, 1 KV head, head_dim 4, bf16 = 16 bytes
    assert roofline.decode_step_bytes(cfg, [10, 3], 2) == 2896 + 16 * (14 + 6)
    assert roofline.flops_per_token(cfg, 10) == 2 * 1448 + 32 * 14
    # 9 tokens fed: every layer-key count of p = 1..9 summed
    assert roofline.sequence_flops(cfg, 7, 3) == sum(roofline.flops_per_token(cfg, p + 1) for p in range(9))
    every = dataclasses.replace(cfg, sliding_layers=None)
    assert roofline.layer_keys(every, 10) == 8
    assert roofline.sequence_flops(every, 7, 3) == sum(roofline.flops_per_token(every, p + 1) for p in range(9))


def test_roofline_named_configs():
    for name, d in NAMED_CONFIGS.items():
        cfg = ModelConfig.from_hf_dict(d)
        emb = cfg.vocab_size * cfg.hidden_size
        # all parameters but the embedding gather; a tied table is read once, as the LM head
        assert roofline.matmul_params(cfg) == cfg.num_params(include_embedding=True) - (0 if cfg.tie_word_embeddings else emb), name
    llama = ModelConfig.from_hf_dict(NAMED_CONFIGS["llama-3-8b"])
    assert 15.0e9 < roofline.weight_bytes(llama, 2) < 15.02e9  # 7.505B non-embedding parameters in bf16
    assert 15e9 < roofline.flops_per_token(llama, 800) < 16e9  # WORKLOADS.md: about 16 GFLOP per token


def test_measured_ceilings_cpu():
    bw = roofline.measure_copy_bandwidth("cpu", nbytes=8 << 20, iters=4)
    tf = roofline.measure_gemm_tflops("cpu", n=128, iters=4)
    assert math.isfinite(bw) and bw > 0.01
    assert math.isfinite(tf) and tf > 0


# ---- helpers -------------------------------------------------------------------------------------------


def test_w_offline_requests_deterministic_and_in_range():
    a = w_offline_requests()
    assert a == w_offline_requests()
    assert len(a) == 256 and all(m == 512 for _, m in a)
    lens = [len(ids) for ids, _ in a]
    assert min(lens) >= 100 and max(lens) <= 1024 and len(set(lens)) > 100
    assert all(0 <= t < 10000 for ids, _ in a for t in ids)
    assert w_offline_requests(seed=1) != a
    fixed = w_offline_requests(num_prompts=3, input_len=7, output_len=2)
    assert [len(ids) for ids, _ in fixed] == [7, 7, 7]


def test_load_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt_token_ids": [1, 2, 3], "output_len": 5}\n\n{"prompt": "hi"}\n"bare"\n')
    rows = load_dataset(str(p), 7, None)
    assert rows == [({"prompt_token_ids": [1, 2, 3]}, 5), ("hi", 7), ("bare", 7)]
    assert len(load_dataset(str(p), 7, 2)) == 2
    (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_dataset(str(tmp_path / "bad.jsonl"), 7, None)


def test_llm_kwargs_default_load_format_and_unknown_flags():
    from pageflash.llm import LLM

    assert resolve_load_format("llama-3-8b", None) == "dummy"
    assert resolve_load_format("/some/folder", None) == "auto"
    assert resolve_load_format("smollm2-135m", "auto") == "auto"
    ns = argparse.Namespace(model="llama-3-8b", load_format=None, dtype="auto", max_model_len=None,
                            enforce_eager=True, seed=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        kw = llm_kwargs(ns)
    assert kw["load_format"] == "dummy" and "max_model_len" not in kw  # unset flags keep LLM's defaults
    if "enforce_eager" in inspect.signature(LLM.__init__).parameters:
        assert kw["enforce_eager"] is True
    else:
        assert "enforce_eager" not in kw and any("enforce_eager" in str(x.message) for x in w)


def test_bad_flags_exit_2(capsys):
    assert latency_main(["--output-len", "0"]) == 2
    assert throughput_main(["--num-prompts", "0"]) == 2
    assert "must be at least 1" in capsys.readouterr().err


# ---- the benchmarks end to end --------------------------------------------------------------------------


def test_latency_smoke(tmp_path, capsys):
    out = tmp_path / "lat.json"
    argv = ["--input-len", "8", "--output-len", "3", "--batch-size", "1", "2", "--num-iters-warmup", "0",
            "--num-iters", "1", "--copy-bandwidth", "100", "--gemm-tflops", "2", "--json", str(out), *TINY_ENGINE]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(tmp_path / "lat.png")]
    except ImportError:
        pass
    assert latency_main(argv) == 0
    text = capsys.readouterr().out
    assert "% roofline" in text and "smollm2-135m" in text
    d = json.loads(out.read_text())
    assert d["model"] == "smollm2-135m" and d["load_format"] == "dummy" and d["device"] == "cpu"
    assert d["dtype"] == "float32" and d["copy_bandwidth_gbps"] == 100 and d["copy_bandwidth_source"] == "given"
    cs = d["cold_start"]
    assert cs["engine_init_s"] > 0 and cs["first_token_s"] > 0
    assert cs["total_s"] == pytest.approx(cs["engine_init_s"] + cs["first_token_s"])
    assert cs["first_iteration_s"] >= cs["first_token_s"]
    cfg = ModelConfig.from_hf_dict(NAMED_CONFIGS["smollm2-135m"])
    w, kv = roofline.weight_bytes(cfg, 4), roofline.kv_bytes_per_token(cfg, 4)
    assert d["weight_bytes"] == w and d["kv_bytes_per_token"] == kv
    assert [r["batch_size"] for r in d["results"]] == [1, 2]
    for r in d["results"]:
        b = r["batch_size"]
        (it,) = r["iterations"]
        # 3 tokens: the first comes from the prefill step, then 2 pure decode steps of b tokens each
        assert it["decode_steps"] == 2 and it["decode_tokens"] == 2 * b
        assert it["decode_seqs_mean"] == r["decode_seqs_mean"] == b
        # those steps feed positions 8 and 9: contexts of 9 and 10 keys
        assert r["bytes_per_step_mean"] == pytest.approx(w + kv * 9.5 * b)
        assert r["ttft_ms"] > 0 and r["ttft_ms_max"] >= r["ttft_ms"]
        assert r["step_ms_median"] > 0 and r["step_ms_p99"] >= r["step_ms_median"]
        assert r["decode_tok_s_total"] == pytest.approx(2 * b / (r["step_ms_mean"] * 2 / 1e3))
        assert 0 < r["decode_tok_s_per_seq"] <= r["decode_tok_s_total"] * 1.0001
        assert r["achieved_gbps"] == pytest.approx(r["bytes_per_step_mean"] / (r["step_ms_mean"] / 1e3) / 1e9)
        assert r["roofline_pct"] == pytest.approx(r["achieved_gbps"])  # of 100 GB/s
        assert r["roofline_tok_s_total"] == pytest.approx(100e9 / r["bytes_per_step_mean"] * b)
        assert r["latency_s_avg"] * 1e3 > r["ttft_ms"]
        step_flops = roofline.decode_step_flops(cfg, [9] * b) + roofline.decode_step_flops(cfg, [10] * b)
        assert r["achieved_tflops"] == pytest.approx(step_flops / (2 * r["step_ms_mean"] / 1e3) / 1e12)
        assert r["compute_pct"] == pytest.approx(100 * r["achieved_tflops"] / 2)
    assert d["env"]["command"].startswith("pageflash bench latency --input-len 8")
    if "--plot" in argv:
        assert (tmp_path / "lat.png").stat().st_size > 1000


def test_latency_notes_decode_steps_smaller_than_the_batch(tmp_path, capsys):
    """One prompt's worth of tokens a step: each request is prefilled alone, and the first finish before
    the last start, so the pure decode steps (every request has its first token) hold fewer than the
    batch. The figure says so rather than passing them off as batch-4 steps."""
    out = tmp_path / "lat.json"
    argv = ["--input-len", "8", "--output-len", "4", "--batch-size", "4", "--num-iters-warmup", "0",
            "--num-iters", "1", "--copy-bandwidth", "100", "--gemm-tflops", "2", "--json", str(out),
            "--max-num-batched-tokens", "8", "--no-async-scheduling", *TINY_ENGINE]
    assert latency_main(argv) == 0
    text = capsys.readouterr().out
    (r,) = json.loads(out.read_text())["results"]
    (it,) = r["iterations"]
    assert it["decode_steps"] >= 1 and 1 <= r["decode_seqs_mean"] < 4
    assert it["decode_tokens"] == pytest.approx(r["decode_seqs_mean"] * it["decode_steps"])
    assert f"note: batch 4: its decode steps held {r['decode_seqs_mean']:.1f} sequences on average, not 4" in text


def test_throughput_smoke(tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["--input-len", "8", "--output-len", "4", "--num-prompts", "3", "--no-warmup", "--gemm-tflops", "2",
            "--json", str(out), *TINY_ENGINE]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(tmp_path / "tp.png")]
    except ImportError:
        pass
    assert throughput_main(argv) == 0
    assert "out tok/s" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["benchmark"] == "throughput" and d["num_prompts"] == 3
    assert d["prompt_tokens"] == 24 and d["output_tokens"] == 12
    assert d["output_tok_s"] == pytest.approx(12 / d["wall_s"])
    assert d["total_tok_s"] == pytest.approx(36 / d["wall_s"])
    assert d["requests_per_s"] == pytest.approx(3 / d["wall_s"])
    cfg = ModelConfig.from_hf_dict(NAMED_CONFIGS["smollm2-135m"])
    assert d["run_flops"] == pytest.approx(3 * roofline.sequence_flops(cfg, 8, 4))
    assert d["achieved_tflops"] == pytest.approx(d["run_flops"] / d["wall_s"] / 1e12)
    assert d["gemm_tflops"] == 2 and d["gemm_tflops_source"] == "given"
    assert d["compute_ceiling_pct"] == pytest.approx(100 * d["achieved_tflops"] / 2)
    assert d["ceiling_output_tok_s"] == pytest.approx(12 * 2e12 / d["run_flops"])
    assert 0 < d["ttft_ms_mean"] <= d["wall_s"] * 1e3
    assert d["engine_stats"]["generation_tokens_total"] == 12
    if "--plot" in argv:
        assert (tmp_path / "tp.png").stat().st_size > 1000


@pytest.mark.parametrize("bench", ["latency", "throughput"])
def test_lora_rank_runs_requests_under_random_adapters(tmp_path, capsys, bench):
    """--lora-rank R --num-loras K: K random rank-R adapters, requests under them in turn (the table's
    dtype reads float32/lora4x2); a bad rank exits 2 naming the flag."""
    out = tmp_path / "b.json"
    common = ["--input-len", "8", "--output-len", "3", "--lora-rank", "4", "--num-loras", "2", "--json", str(out),
              *TINY_ENGINE]
    if bench == "latency":
        argv = ["--batch-size", "2", "--num-iters-warmup", "0", "--num-iters", "1", "--copy-bandwidth", "100", *common]
        assert latency_main(argv) == 0
    else:
        assert throughput_main(["--num-prompts", "3", "--no-warmup", *common]) == 0
    assert "float32/lora4x2" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["lora"] == {"enabled": True, "rank": 4, "adapters": 2}
    assert d["engine_kwargs"]["enable_lora"] and d["engine_kwargs"]["max_lora_rank"] == 4
    assert d["engine_kwargs"]["max_loras"] == 2
    main = latency_main if bench == "latency" else throughput_main
    assert main(["--lora-rank", "0", *TINY_ENGINE]) == 2
    assert "--lora-rank" in capsys.readouterr().err


def test_write_random_adapter_is_read_by_the_engine(tmp_path):
    """lora.adapter.write_random_adapter's folder (the benchmarks' adapters) loads for its config and moves
    the outputs."""
    from pageflash import LLM, SamplingParams
    from pageflash.lora import LoRARequest
    from pageflash.lora.adapter import load_adapter, write_random_adapter

    cfg = ModelConfig.from_hf_dict(NAMED_CONFIGS["smollm2-135m"])
    path = write_random_adapter(str(tmp_path / "a"), cfg, 4, seed=1)
    ad = load_adapter(LoRARequest("a", 1, path), cfg, 4)
    assert ad.rank == 4 and len(ad.weights) == 4 * cfg.num_hidden_layers
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=64, num_kv_blocks=16, enable_lora=True,
              max_lora_rank=4)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    p = {"prompt_token_ids": list(range(3, 19))}
    base = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    under = llm.generate([p], sp, use_tqdm=False, lora_request=LoRARequest("a", 1, path))[0].outputs[0].token_ids
    assert base != under


def test_throughput_dataset_and_model_folder(tmp_path):
    """A HF folder holding only config.json (random weights of its shape) and requests from a JSONL file."""
    cfg = tiny_cfg(False).to_hf_dict()
    cfg["max_position_embeddings"] = 64
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    ds = tmp_path / "d.jsonl"
    ds.write_text("\n".join(json.dumps({"prompt_token_ids": list(range(1, 1 + n)), "output_len": m})
                            for n, m in [(5, 2), (9, 3), (4, 1)]))
    out = tmp_path / "tp.json"
    argv = ["--model", str(tmp_path / "m"), "--load-format", "dummy", "--dataset", str(ds), "--num-prompts", "2",
            "--json", str(out), "--disable-tqdm"]
    assert throughput_main(argv) == 0
    d = json.loads(out.read_text())
    assert d["num_prompts"] == 2 and d["prompt_tokens"] == 14 and d["output_tokens"] == 5
    assert d["compute_ceiling_pct"] is None  # CPU and no --gemm-tflops: no ceiling
    assert d["run_flops"] == roofline.sequence_flops(tiny_cfg(False), 5, 2) + roofline.sequence_flops(tiny_cfg(False), 9, 3)


@pytest.mark.parametrize("churn", [False, True])
def test_engine_block_tables(churn):
    """The decode bench's engine layouts: each sequence holds ceil(L / 16) distinct blocks of the pool,
    no block is shared, prompts take their blocks at once and decode adds the rest step by step."""
    from pageflash.bench.kernels import engine_block_tables

    b, L = 4, 1000
    pool = 2 * b * 63
    bt = engine_block_tables(b, L, pool, churn, device="cpu")
    assert bt.shape == (b, 63) and bt.dtype == torch.int32
    ids = bt.flatten().tolist()
    assert len(set(ids)) == len(ids) and 0 <= min(ids) and max(ids) < pool
    if not churn:
        # a fresh pool: each prompt's 47 blocks in order, the 48th (the end of its 4-block run) kept
        # free for its growth; decode then takes whole runs of 4 consecutive blocks per sequence
        assert bt[0, :48].tolist() == list(range(48)) and bt[1, 0] == 48
        for row in bt.tolist():
            for i in range(48, 60, 4):
                assert row[i:i + 4] == list(range(row[i], row[i] + 4))
        # without the allocator's locality (the plain LRU queue), decode blocks take turns
        lru = engine_block_tables(b, L, pool, churn, device="cpu", locality_tokens=0)
        assert lru[0, :40].tolist() == list(range(40)) and lru[1, -1] - lru[0, -1] == 1
    with pytest.raises(ValueError, match="too small"):
        engine_block_tables(b, L, 3 * 63, churn, device="cpu")
