"""LoRA adapters: the engine's greedy output under PEFT adapters equals HF transformers + peft on the
same weights, for several adapters and the base model in one batch, with chunked prefill, preemption
and prefix caching, and equal to each request run alone; adapters wait for a free slot; prefix-cache
blocks never cross adapters; clear errors for what is not supported."""

import json
import os

import pytest
import torch

from hf_ref import (hf_fake_quantized, hf_greedy, hf_with_adapter, make_peft_adapter,
                    make_random_hf_folder)  # fmt: skip
from pageflash import LLM, SamplingParams
from pageflash.lora import LoRARequest
from test_engine_hf import CONFIGS

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _prompts(seed, lengths=(1, 6, 17, 30)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 211, (n,), generator=g).tolist() for n in lengths]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-bias"])
def model(request, tmp_path_factory):
    """A random model, two adapters (all seven projections at rank 8; q/v at rank 4 with rsLoRA and an
    alpha_pattern for v) and HF + peft references for each and for the base."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp(request.param)
    folder = make_random_hf_folder(tmp / "model", CONFIGS[request.param])
    a = make_peft_adapter(folder, tmp / "a", ALL, r=8, lora_alpha=16, seed=1)
    b = make_peft_adapter(folder, tmp / "b", ["q_proj", "v_proj"], r=4, lora_alpha=8, seed=2, std=0.2,
                          use_rslora=True, alpha_pattern={"v_proj": 4})
    refs = {None: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            "a": hf_with_adapter(folder, a), "b": hf_with_adapter(folder, b)}
    reqs = {None: None, "a": LoRARequest("a", 1, a), "b": LoRARequest("b", 2, b)}
    return folder, reqs, refs


def test_mixed_batch_matches_hf_peft(model):
    """Two adapters and the base in one batch (chunked prefill over blocks of 4), against HF + peft;
    the adapters do change the output; nothing leaks."""
    folder, reqs, refs = model
    prompts = _prompts(1)
    names = ["a", None, "b", "a", "b", None]
    prompts = prompts + prompts[:2]
    llm = LLM(folder, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_num_batched_tokens=24,
              max_model_len=96, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] for n in names])
    want = [hf_greedy(refs[n], p, NEW) for p, n in zip(prompts, names)]
    assert _tokens(outs) == want
    # vLLM's: each output names the adapter it ran under
    assert [o.lora_request for o in outs] == [reqs[n] for n in names]
    assert [o.outputs[0].lora_request for o in outs] == [reqs[n] for n in names]
    assert want[0] != hf_greedy(refs[None], prompts[0], NEW) and want[2] != hf_greedy(refs[None], prompts[2], NEW)
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    # each request alone: the same tokens
    for i in (0, 2, 5):
        alone = llm.generate({"prompt_token_ids": prompts[i]}, GREEDY, use_tqdm=False, lora_request=reqs[names[i]])
        assert alone[0].outputs[0].token_ids == want[i]


def test_preemption_and_one_slot_for_three_adapters(model, tmp_path):
    """One device slot for two adapters and the base, a pool small enough to preempt: requests wait for
    the slot (none fails) and every output equals HF + peft; the slot was loaded again and again."""
    folder, reqs, refs = model
    prompts = _prompts(2, (9, 14, 21, 26))
    names = ["a", "b", None, "b"]
    llm = LLM(folder, enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4, max_num_batched_tokens=16,
              max_model_len=48, num_kv_blocks=13)
    eng = llm.llm_engine
    loads = []
    run = eng.runner.load_loras
    eng.runner.load_loras = lambda ls: (loads.extend(a.name for _, a in ls), run(ls))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] for n in names])
    assert _tokens(outs) == [hf_greedy(refs[n], p, NEW) for p, n in zip(prompts, names)]
    assert eng.scheduler.num_preemptions > 0
    assert loads.count("a") >= 1 and loads.count("b") >= 1 and len(loads) >= 2
    assert eng.kv.num_free_blocks == 13
    assert eng.scheduler.lora_slots.refs == [0, 0]


def test_prefix_cache_never_crosses_adapters(model):
    """One prompt under a, then b, then the base, then a again: only the second run under a hits the
    cache, and every output equals its own reference (the KV of one adapter never serves another)."""
    folder, reqs, refs = model
    (p,) = _prompts(3, (26,))
    llm = LLM(folder, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_model_len=64,
              num_kv_blocks=64)
    eng = llm.llm_engine
    for name, hits in (("a", 0), ("b", 0), (None, 0), ("a", 24)):
        out = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=reqs[name])[0]
        assert out.num_cached_tokens == hits, name
        assert out.outputs[0].token_ids == hf_greedy(refs[name], p, NEW), name


def test_n_siblings_share_the_adapter(model):
    """n = 2 under an adapter: the sibling forked after the prompt holds the same slot (greedy: both
    equal HF + peft), and the slot's references are all released at the end."""
    folder, reqs, refs = model
    (p,) = _prompts(4, (11,))
    llm = LLM(folder, enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4, max_model_len=64,
              num_kv_blocks=64)
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False, lora_request=reqs["a"])[0]
    want = hf_greedy(refs["a"], p, 8)
    assert [c.token_ids for c in out.outputs] == [want, want]
    assert [c.lora_request for c in out.outputs] == [reqs["a"]] * 2  # forked samples keep it
    assert llm.llm_engine.scheduler.lora_slots.refs == [0, 0]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_base_with_adapter(tmp_path, method):
    """INT8 / FP8 weights + an adapter: the delta adds to the quantized base's output (HF over the
    dequantized weights + peft)."""
    folder = make_random_hf_folder(tmp_path / "m", CONFIGS["qwen2-bias"], std=0.3)
    a = make_peft_adapter(folder, tmp_path / "a", ALL, r=8, seed=5)
    ref = hf_with_adapter(folder, a, base=hf_fake_quantized(folder, method))
    prompts = _prompts(5, (3, 19))
    llm = LLM(folder, quantization=method, enable_lora=True, max_lora_rank=8, block_size=4, max_model_len=64,
              num_kv_blocks=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, a))
    assert _tokens(outs) == [hf_greedy(ref, p, NEW) for p in prompts]


def test_phi3_fused_targets_chat_and_embed(tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj as PEFT targets (one A shared by the parts); LLM.chat-style
    token prompts through generate, and LLM.embed under the adapter equals peft's last hidden state."""
    import torch.nn.functional as F

    from pageflash.sampling_params import PoolingParams

    folder = make_random_hf_folder(tmp_path / "m", CONFIGS["phi3"])
    a = make_peft_adapter(folder, tmp_path / "a", ["qkv_proj", "gate_up_proj", "o_proj", "down_proj"], r=4,
                          seed=6, std=0.15)
    ref = hf_with_adapter(folder, a)
    prompts = _prompts(6, (5, 12))
    llm = LLM(folder, enable_lora=True, max_lora_rank=4, block_size=4, max_model_len=64, num_kv_blocks=32)
    lora = LoRARequest("phi", 7, a)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)
    assert _tokens(outs) == [hf_greedy(ref, p, NEW) for p in prompts]
    emb = llm.embed([{"prompt_token_ids": prompts[1]}], PoolingParams(), use_tqdm=False, lora_request=lora)
    with torch.no_grad():
        h = ref(torch.tensor([prompts[1]]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert torch.allclose(torch.tensor(emb[0].outputs.embedding), F.normalize(h, dim=0), atol=1e-4)


def test_decode_graph_path_with_lora_kernels(model, monkeypatch):
    """The GPU path on the CPU: the LoRA Triton kernels (interpreter) inside the decode graphs' static
    buffers -- DecodeGraphs captured with a stand-in for CUDA graphs whose replay reruns the captured
    step over the same buffers --, the rows' slots padded to the bucket; greedy equals HF + peft for
    two adapters and the base in the same decode batches. (Real graphs: tests/gpu/test_lora_gpu.py.)"""
    from test_decode_graph_inputs import mock_decode_graphs

    mr = mock_decode_graphs(monkeypatch)
    monkeypatch.setenv("PAGEFLASH_LORA_FREE_GRAPHS", "2")  # twins without the LoRA kernels: buckets 1, 2
    folder, reqs, refs = model
    prompts = _prompts(8, (3, 9, 13))
    names = ["a", None, "b"]
    llm = LLM(folder, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_model_len=64,
              num_kv_blocks=64, attention_backend="triton", enforce_eager=True)
    r = llm.llm_engine.runner
    r.lora.kernels = True
    r.graphs = g = mr.DecodeGraphs(r, 4)  # buckets 1, 2, 4: three sequences padded to 4
    g.capture()
    assert sorted(g.full) == [1, 2, 4] and sorted(g.full_base) == [1, 2]
    steps = []
    run, select = g.run, g.select
    monkeypatch.setattr(g, "run", lambda *a, **k: (steps.append(len(a[0].seqs)), run(*a, **k))[1])
    picked = []
    monkeypatch.setattr(g, "select", lambda *a: (picked.append(select(*a)), picked[-1])[1])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] for n in names])
    assert _tokens(outs) == [hf_greedy(refs[n], p, NEW) for p, n in zip(prompts, names)]
    assert steps.count(3) >= NEW - 2  # mixed decode steps went through the graph path
    assert picked and all(c is g.full[4] for c in picked)
    # base requests only: the twins (buckets 1, 2); an adapter row among them: the LoRA graphs again
    for batch, want in (([None, None], g.full_base[2]), ([None], g.full_base[1]), (["b", None], g.full[2])):
        picked.clear()
        ps = prompts[: len(batch)]
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False,
                            lora_request=[reqs[n] for n in batch])
        assert _tokens(outs) == [hf_greedy(refs[n], p, NEW) for p, n in zip(ps, batch)]
        assert len(picked) >= NEW - 2 and all(c is want for c in picked), batch


def test_one_row_steps_add_the_delta_in_the_gemv(model, monkeypatch):
    """Steps of one token add each projection's delta inside the GEMV's launch (LoRASlots.fused_gemv;
    the interpreter, with a fixed tile): every targeted projection of a decode step at batch 1 takes
    it, gate/up with the activation in its epilogue, and greedy output equals HF + peft, one request
    at a time under each adapter and the base model (slot 0: the GEMV adds nothing). Steps of more
    rows keep the shrink and expand kernels."""
    from pageflash.lora.layers import LoRASlots

    folder, reqs, refs = model
    llm = LLM(folder, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, max_model_len=64,
              num_kv_blocks=64, attention_backend="triton", enforce_eager=True)
    r = llm.llm_engine.runner
    r.lora.kernels = True
    r.lora.gemv_tile = (8, 4, 32, 2, 4)
    calls = []  # (rows, act, fused) of each projection of a step with adapter rows
    real = LoRASlots.fused_gemv

    def fused_gemv(self, x, w, act=None):
        y = real(self, x, w, act)
        calls.append((x.shape[0], act is not None, y is not None))
        return y

    monkeypatch.setattr(LoRASlots, "fused_gemv", fused_gemv)
    prompts = _prompts(12, (3, 11))
    for name in ("a", "b", None):
        calls.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], GREEDY, use_tqdm=False,
                            lora_request=reqs[name])
        assert _tokens(outs) == [hf_greedy(refs[name], prompts[0], NEW)], name
        one = [c for c in calls if c[0] == 1]
        if name is None:  # (steps without adapter rows skip LoRA: nothing fused)
            assert not any(c[2] for c in calls)
            continue
        layers = len({i for i, _, _ in r.model.lora_targets})
        # NEW - 1 decode steps, each: q/k/v, o, down plain and gate/up with the activation, per layer
        assert len(one) == 4 * layers * (NEW - 1) and all(c[2] for c in one)
        assert sum(1 for c in one if c[1]) == layers * (NEW - 1)
        assert not any(c[2] for c in calls if c[0] > 1)  # the prefill: shrink and expand
    # two requests in one batch: nothing fused, the same tokens as each alone
    calls.clear()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[reqs["a"], reqs["b"]])
    assert _tokens(outs) == [hf_greedy(refs[n], p, NEW) for p, n in zip(prompts, "ab")]
    assert calls and not any(c[2] for c in calls if c[0] > 1)
    for mod in (m for _, _, m in r.model.lora_targets):
        assert not mod.lora.gemv_counters.any()  # reset by each chunk's last arrival


# ---- vLLM's signatures ---------------------------------------------------------------------------


def test_beam_search_takes_lora_request_in_vllms_place(small):
    """LLM.beam_search(prompts, params, lora_request, use_tqdm) in vLLM's order (a vLLM script passing
    the adapter positionally ran the base model, with a progress bar), and, as vLLM's, a list of one
    adapter per prompt."""
    from pageflash.beam_search import BeamSearchParams

    _, _, good, llm = small
    lora = LoRARequest("good", 1, good)
    prompts = [{"prompt_token_ids": p} for p in _prompts(11, (5, 9))]
    bp = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)

    def beams(outs):
        return [[s.tokens for s in o.sequences] for o in outs]

    base = beams(llm.beam_search(prompts, bp))
    under = beams(llm.beam_search(prompts, bp, lora_request=lora))
    assert under[0] != base[0] and under[1] != base[1]
    assert beams(llm.beam_search(prompts, bp, lora)) == under
    assert beams(llm.beam_search(prompts, bp, [lora, None])) == [under[0], base[1]]
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        llm.beam_search(prompts, bp, [lora])
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.pool.num_blocks


def test_chat_takes_lora_request_fourth(tmp_path):
    """LLM.chat(messages, sampling_params, use_tqdm, lora_request, chat_template,
    chat_template_content_format, add_generation_prompt, ...) in vLLM's order (the adapter passed
    fourth was once taken as add_generation_prompt: the base model ran); more positional arguments
    than vLLM's are refused."""
    from pageflash.model.loader import load_tokenizer, resolve_model

    folder = make_random_hf_folder(tmp_path / "m", dict(CONFIGS["llama-gqa"], vocab_size=49152))
    load_tokenizer(resolve_model("smollm2-135m", "auto")).save_pretrained(folder)
    lora = LoRARequest("a", 1, make_peft_adapter(folder, tmp_path / "a", ALL, r=4, seed=3, std=0.2))
    llm = LLM(folder, enable_lora=True, max_lora_rank=4, max_model_len=128, num_kv_blocks=64)
    chat = [{"role": "user", "content": "Name a color."}]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.chat(chat, sp, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids
    assert want != llm.chat(chat, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.chat(chat, sp, False, lora)[0].outputs[0].token_ids == want
    assert llm.chat(chat, sp, False, lora, None)[0].outputs[0].token_ids == want
    assert llm.chat(chat, sp, False, lora, None, "auto", True)[0].outputs[0].token_ids == want
    with pytest.raises(TypeError):
        llm.chat(chat, sp, False, lora, None, "auto", True, False, None, None, None, "one too many")


# ---- errors ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    folder = make_random_hf_folder(tmp / "model", CONFIGS["llama-gqa"])
    good = make_peft_adapter(folder, tmp / "good", ["q_proj", "v_proj"], r=4)
    llm = LLM(folder, enable_lora=True, max_loras=2, max_lora_rank=4, block_size=4, max_model_len=64,
              num_kv_blocks=32)
    return tmp, folder, good, llm


def _edit(src, dst, config=None, tensors=None):
    """A copy of adapter src at dst with its config updated and/or its tensors replaced."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "adapter_config.json")) as f:
        cfg = json.load(f)
    cfg.update(config or {})
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    t = load_file(os.path.join(src, "adapter_model.safetensors"))
    save_file(tensors(t) if tensors else t, os.path.join(dst, "adapter_model.safetensors"))
    return str(dst)


def test_bad_adapters_raise_by_name_and_nothing_else_breaks(small):
    tmp, folder, good, llm = small
    eng = llm.llm_engine
    (p,) = _prompts(7, (9,))
    a0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    bad = {
        "rank 8, above max_lora_rank=4": make_peft_adapter(folder, tmp / "r8", ["q_proj"], r=8),
        "targets embed_tokens": make_peft_adapter(folder, tmp / "emb", ["embed_tokens", "q_proj"], r=4),
        "targets lm_head": make_peft_adapter(folder, tmp / "head", ["lm_head"], r=4),
        "modules_to_save": _edit(good, tmp / "mts", {"modules_to_save": ["lm_head"]}),
        "bias='all'": _edit(good, tmp / "bias", {"bias": "all"}),
        "use_dora": _edit(good, tmp / "dora", {"use_dora": True}),
        "does not exist": str(tmp / "missing"),
        "no adapter_config.json": str(tmp / "model"),
        "cannot read its weights": _edit(good, tmp / "corrupt"),
        "do not fit the base model": _edit(good, tmp / "shape", tensors=lambda t: {
            k: (v[:, :32].contiguous() if k == a0 else v) for k, v in t.items()}),
        "mixture-of-experts": _edit(good, tmp / "moe", tensors=lambda t: {
            k.replace("self_attn.q_proj", "mlp.experts.0.gate_proj"): v for k, v in t.items()}),
        "part of a mixture-of-experts block": _edit(good, tmp / "moe_fused", tensors=lambda t: {  # (PEFT on
            k.replace("self_attn.q_proj", "mlp.experts"): v for k, v in t.items()}),  # fused experts' tensors)
        r"alpha_pattern\['v_proj'\] must be a number": _edit(good, tmp / "alpha", {"alpha_pattern": {"v_proj": "8"}}),
    }
    with open(os.path.join(bad["cannot read its weights"], "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    running = eng.add_request("ok", {"prompt_token_ids": p}, GREEDY, lora_request=LoRARequest("good", 1, good))
    eng.step()
    for i, (msg, path) in enumerate(bad.items()):
        with pytest.raises(ValueError, match=msg):
            eng.add_request(f"bad{i}", {"prompt_token_ids": p}, GREEDY, lora_request=LoRARequest(f"x{i}", 10 + i, path))
        with pytest.raises(ValueError, match=msg):  # offline: nothing is queued
            llm.generate([{"prompt_token_ids": p}] * 2, GREEDY, use_tqdm=False,
                         lora_request=[None, LoRARequest(f"x{i}", 10 + i, path)])
    with pytest.raises(ValueError, match="already used by adapter 'good'"):
        eng.add_request("dup", {"prompt_token_ids": p}, GREEDY, lora_request=LoRARequest("other", 1, bad["bias='all'"]))
    while eng.has_unfinished_requests():  # the request that was running goes on, to its end
        outs = eng.step()
    assert outs[0].request_id == running and len(outs[0].outputs[0].token_ids) == NEW
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_lora_options_refused_by_name(small, tmp_path):
    tmp, folder, good, llm = small
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, good)
    plain = LLM(folder, block_size=4, max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, good))
    with pytest.raises(ValueError, match="enable_lora with tensor_parallel_size=2"):
        LLM(folder, enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="enable_lora with speculative_config"):
        LLM(folder, enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        LLM(folder, enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="max_cpu_loras=1 must be at least max_loras=2"):
        LLM(folder, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        llm.generate([[1, 2], [3]], GREEDY, use_tqdm=False, lora_request=[None])


def test_bin_weights_and_fan_in_fan_out(small):
    """adapter_model.bin (torch.save) reads as the safetensors file does; fan_in_fan_out=True changes
    nothing for Linear targets (PEFT turns it off for them)."""
    from safetensors.torch import load_file

    tmp, folder, good, llm = small
    b = tmp / "bin"
    b.mkdir()
    with open(os.path.join(good, "adapter_config.json")) as f:
        cfg = dict(json.load(f), fan_in_fan_out=True)
    (b / "adapter_config.json").write_text(json.dumps(cfg))
    torch.save(load_file(os.path.join(good, "adapter_model.safetensors")), b / "adapter_model.bin")
    (p,) = _prompts(9, (7,))
    outs = llm.generate([{"prompt_token_ids": p}] * 2, GREEDY, use_tqdm=False,
                        lora_request=[LoRARequest("good", 1, good), LoRARequest("bin", 20, str(b))])
    base = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids != base.outputs[0].token_ids


def test_cli_generate_with_lora(small, tmp_path):
    """`pageflash generate --input ... --lora PATH`: the offline engine's tokens under that adapter."""
    from pageflash.cli import main

    _, folder, good, llm = small
    prompts = _prompts(10, (4, 11))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    rc = main(["generate", "--model", folder, "--input", str(tmp_path / "in.jsonl"), "--output",
               str(tmp_path / "out.jsonl"), "--lora", good, "--max-lora-rank", "4", "--temperature", "0",
               "--ignore-eos", "--max-tokens", str(NEW), "--block-size", "4", "--num-kv-blocks", "32",
               "--max-model-len", "64"])
    assert rc == 0
    got = [json.loads(line)["outputs"][0]["token_ids"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("good", 1, good))
    assert got == _tokens(ref)


def test_add_remove_list_loras(small):
    """vLLM's add_lora / list_loras / remove_lora: a removed adapter read again is a new one (its own
    prefix-cache chain)."""
    tmp, folder, good, llm = small
    eng = llm.llm_engine
    req = LoRARequest("good", 1, good)
    assert eng.add_lora(req) and 1 in eng.list_loras()
    uid = eng.get_lora(req).uid
    assert eng.remove_lora(1) and 1 not in eng.list_loras() and not eng.remove_lora(1)
    assert eng.get_lora(req).uid != uid


# ---- host bookkeeping --------------------------------------------------------------------------


def test_adapters_are_read_once_while_requests_hold_them(small, tmp_path, monkeypatch):
    """max_cpu_loras=1 with two adapters interleaved over six prompts: each folder is read once (it was
    read again for nearly every prompt, at generate's check and at its add_request, each request then
    holding its own copy), and the outputs are each adapter's; with no request left, one dropped from
    the cache is read again at its next use."""
    import pageflash.lora.manager as manager

    tmp, folder, good, _ = small
    other = make_peft_adapter(folder, tmp_path / "o", ["v_proj"], r=2, seed=8, std=0.3)
    reads = []
    load = manager.load_adapter
    monkeypatch.setattr(manager, "load_adapter", lambda req, *a: (reads.append(req.lora_name), load(req, *a))[1])
    llm = LLM(folder, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=4, block_size=4,
              max_model_len=64, num_kv_blocks=64)
    loras = [LoRARequest("good", 1, good), LoRARequest("other", 2, other)] * 3
    (p,) = _prompts(12, (6,))
    outs = llm.generate([{"prompt_token_ids": p}] * 6, GREEDY, use_tqdm=False, lora_request=loras)
    assert sorted(reads) == ["good", "other"]
    assert _tokens(outs)[0::2] == [_tokens(outs)[0]] * 3 and _tokens(outs)[1::2] == [_tokens(outs)[1]] * 3
    assert _tokens(outs)[0] != _tokens(outs)[1]
    llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False, lora_request=loras[0])
    assert sorted(reads) == ["good", "good", "other"]


def test_adapter_slots_lru_among_idle_slots():
    """Two slots: a loaded adapter is reused without a copy; a third adapter takes the least recently
    released idle slot; none is free while both are held."""
    from types import SimpleNamespace as A

    from pageflash.lora.manager import AdapterSlots

    s = AdapterSlots(2)
    a, b, c = A(uid=1), A(uid=2), A(uid=3)
    assert s.acquire(a) == (1, True) and s.acquire(b) == (2, True) and s.acquire(a) == (1, False)
    assert not s.can_acquire(c)
    s.release(1)
    assert not s.can_acquire(c)  # a is still held once
    s.release(2)
    s.release(1)  # released last: b's slot is the least recently released
    assert s.can_acquire(c) and s.acquire(c) == (2, True)
    assert s.loaded == {1: 1, 3: 2} and s.acquire(b) == (1, True)  # a's slot idle: evicted for b
    s.release(1)
    s.forget(2)  # b removed from the engine while idle: its slot is empty again
    assert s.loaded == {3: 2} and s.acquire(a) == (1, True)


def test_prefix_hash_chain_is_salted_by_adapter():
    from pageflash.engine.kv_cache import KVCacheManager

    kv = KVCacheManager(16, 4)
    toks = list(range(13))
    assert kv.allocate("x", 0, 13, salt=("lora", 1))
    kv.cache_full_blocks("x", toks, 13)
    assert kv.find_cached_prefix(toks, ("lora", 1)) == kv.block_ids("x")[:3]
    assert kv.find_cached_prefix(toks) == [] and kv.find_cached_prefix(toks, ("lora", 2)) == []


def test_prefix_salt_joins_adapter_and_longrope():
    """A LongRoPE model serving adapters: a request's chain is (adapter, long), so neither an adapter
    nor the short / long rotation ever shares blocks with another."""
    from types import SimpleNamespace

    from pageflash.engine.kv_cache import KVCacheManager
    from pageflash.engine.scheduler import Scheduler
    from pageflash.engine.sequence import Request
    from pageflash.sampling_params import SamplingParams

    def req(n, uid=None):
        r = Request(f"r{n}{uid}", None, list(range(n)), SamplingParams(max_tokens=4), 0.0)
        r.lora = None if uid is None else SimpleNamespace(uid=uid)
        return r

    plain = Scheduler(KVCacheManager(64, 4), 8, 64, 64)
    assert plain._salt(req(10)) is None
    assert plain._salt(req(10, uid=3)) == (("lora", 3), None)
    longrope = Scheduler(KVCacheManager(64, 4), 8, 64, 64, long_rope_after=12)
    salts = {longrope._salt(req(n, uid)) for n in (10, 20) for uid in (None, 3, 4)}
    assert len(salts) == 6 and (None, False) in salts and (("lora", 4), True) in salts
