"""Sliding-window attention (Mistral v0.1, Qwen2/3 with use_sliding_window): the references against a
brute-force loop, every Triton kernel (Flash-Decoding, the paged kernel for chunks / trees / split
keys, the contiguous varlen prefill) against the references under the interpreter, the config's
per-layer windows as transformers reads them, and the engine's greedy tokens against HF past the
window."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import poison_outputs  # noqa: F401  (autouse: outputs start poisoned)
from test_kernels_paged import TOL, make_case, rel_err

from pageflash.config import ModelConfig
from pageflash.kernels.backend import TritonBackend
from pageflash.kernels.flash_attention import flash_attn_varlen_fwd, flash_attn_varlen_ref
from pageflash.kernels.flash_decoding import flash_decode, flash_decode_ref
from pageflash.kernels.paged_attention import paged_attention, paged_attention_ref
from pageflash.layers.attention import TorchBackend, gather_kv_ref, store_kv_ref


def tree_positions(meta) -> torch.Tensor:
    """Each new token's position: context + its depth in the tree (ancestors on its mask row - 1)."""
    pos, row = [], 0
    for n, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        ctx = s - n
        for j in range(n):
            pos.append(ctx + int(meta.tree_mask[row + j, :n].sum()) - 1 if meta.tree_mask is not None else ctx + j)
        row += n
    return torch.tensor(pos, dtype=torch.int64)


def brute(q, kc, vc, meta, scale, window, positions, softcap=None):
    """One (query, head) at a time in float64: the keys a query sees are its context's and its own
    ancestors' (or causal predecessors') whose position is > its position - window. softcap: each
    score s becomes softcap * tanh(s / softcap)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    hq, hkv = q.shape[1], kc.shape[2]
    row = 0
    for i, (n, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        ctx = s - n
        kk = gather_kv_ref(kc, meta.block_tables[i], s).double()
        vv = gather_kv_ref(vc, meta.block_tables[i], s).double()
        for j in range(n):
            qp = int(positions[row + j])
            keys = []
            for key in range(s):
                if key < ctx:
                    kp, seen = key, True
                else:
                    t = key - ctx
                    kp = int(positions[row + t])
                    seen = bool(meta.tree_mask[row + j, t]) if meta.tree_mask is not None else t <= j
                if seen and kp > qp - window:
                    keys.append(key)
            for h in range(hq):
                g = h // (hq // hkv)
                sc = (kk[keys, g] @ q[row + j, h].double()) * scale
                if softcap is not None:
                    sc = torch.tanh(sc / softcap) * softcap
                out[row + j, h] = torch.softmax(sc, 0) @ vv[keys, g]
        row += n
    return out


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("window", [1, 3, 8, 21, 1000])
def test_reference_matches_brute_force(tree, window):
    specs = [(21, 6), (0, 5), (15, 7), (40, 1)]
    q, k, v, kc, vc, meta = make_case(specs, 4, 2, 16, 8, torch.float32, tree=tree, seed=window)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    pos = tree_positions(meta)
    ref = paged_attention_ref(q, kc, vc, meta, 0.25, window=window, positions=pos)
    assert rel_err(ref, brute(q, kc, vc, meta, 0.25, window, pos).float()) < 1e-5
    if window == 1000:  # longer than every sequence: full attention
        assert torch.equal(ref, paged_attention_ref(q, kc, vc, meta, 0.25))
    else:
        assert rel_err(ref, paged_attention_ref(q, kc, vc, meta, 0.25)) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("splits,strided,fused", [(1, True, False), (3, True, False), (3, False, False),
                                                  (7, True, True), (4, False, True)])
def test_flash_decode_window(window, splits, strided, fused, dtype):
    # lengths 1, block_size +- 1, a block boundary, longer than the window; some splits empty
    specs = [(0, 1), (14, 1), (15, 1), (16, 1), (52, 1), (90, 1)]
    q, k, v, kc, vc, meta = make_case(specs, 8, 2, 64, 16, dtype, seed=window + splits)
    ref = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, window=window)
    counters = torch.zeros(len(specs) * 2, dtype=torch.int32) if fused else None
    cfg = dict(BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=1, STRIDED=strided)
    out = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, num_splits=splits, config=cfg,
                       counters=counters, window=window)
    assert rel_err(out, ref) < TOL[dtype]
    assert counters is None or not counters.any()


def rotated_and_stored(q, k, v, kc, vc, meta):
    """A decode step's rotary tables (pos, cos, sin) and what rotary then the K/V store leave:
    (rope, rotated q, k_cache, v_cache), for the decode launch that does both itself."""
    from pageflash.kernels.rotary import apply_rotary_ref

    pos = meta.seq_lens.long() - 1
    ang = torch.outer(torch.arange(80, dtype=torch.float32), torch.rand(16, generator=torch.Generator().manual_seed(2)))
    cos, sin = ang.cos(), ang.sin()
    qr, kr = apply_rotary_ref(q, k, pos, cos, sin)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_ref(kr, v, kc_ref, vc_ref, meta.slot_mapping)
    return (pos, cos, sin), qr, kc_ref, vc_ref


@pytest.mark.parametrize("window,splits", [(3, 1), (20, 3), (33, 5)])
def test_flash_decode_window_with_rope_and_store(window, splits):
    """The decode launch that also rotates q / k and stores the new K/V: equal to rotary + store, then
    the windowed reference."""
    specs = [(0, 1), (30, 1), (47, 1), (64, 1)]
    q, k, v, kc, vc, meta = make_case(specs, 4, 2, 32, 16, torch.float32, seed=window)
    (pos, cos, sin), qr, kc_ref, vc_ref = rotated_and_stored(q, k, v, kc, vc, meta)
    ref = flash_decode_ref(qr, kc_ref, vc_ref, meta.block_tables, meta.seq_lens, 0.2, window=window)
    out = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2, num_splits=splits, rope=(pos, cos, sin),
                       k_new=k, v_new=v, slot_mapping=meta.slot_mapping, window=window)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert rel_err(out, ref) < TOL[torch.float32]


PAGED_CASES = {
    "chunked": [(33, 9), (16, 16), (5, 1), (47, 20), (0, 40)],
    "spec": [(30, 4), (1, 3), (64, 5), (100, 6)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 4, 9, 16, 30])
@pytest.mark.parametrize("case,tree,splits", [("chunked", False, 1), ("spec", False, 3), ("spec", True, 1),
                                              ("spec", True, 4)])
def test_paged_attention_window(case, tree, splits, window, dtype):
    q, k, v, kc, vc, meta = make_case(PAGED_CASES[case], 8, 2, 64, 8, dtype, tree=tree, seed=window)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    pos = tree_positions(meta)
    ref = paged_attention_ref(q, kc, vc, meta, 0.125, window=window, positions=pos)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=1)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask, config=cfg,
                          num_splits=splits, window=window, positions=pos)
    assert rel_err(out, ref) < TOL[dtype]


def test_paged_attention_window_tree_needs_positions():
    q, k, v, kc, vc, meta = make_case([(10, 3)], 4, 2, 16, 8, torch.float32, tree=True)
    with pytest.raises(ValueError, match="needs positions"):
        paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25,
                        meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask, window=4)
    with pytest.raises(ValueError, match="window must be a positive int"):
        flash_decode(q[:1], kc, vc, meta.block_tables, meta.seq_lens, 0.25, window=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 7, 16, 31, 64])
def test_varlen_prefill_window(window, dtype):
    g = torch.Generator().manual_seed(window)
    lens = [1, 15, 17, 40, 33]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, 32, generator=g).to(dtype) for h in (6, 2, 2))
    o, lse = flash_attn_varlen_fwd(q, k, v, cu, max(lens), True, 0.2, window=window)
    o_ref, lse_ref = flash_attn_varlen_ref(q, k, v, cu, True, 0.2, window=window)
    assert rel_err(o, o_ref) < TOL[dtype]
    assert torch.allclose(lse, lse_ref, atol=1e-3)
    with pytest.raises(ValueError, match="sliding window needs causal"):
        flash_attn_varlen_fwd(q, k, v, cu, max(lens), False, 0.2, window=window)


STEPS = {
    "decode": [(0, 1), (16, 1), (30, 1), (70, 1)],
    "fresh_prefill": [(0, 9), (0, 1), (0, 30)],
    "mixed": [(16, 1), (30, 1), (0, 40), (20, 18)],
    "chain_verify": [(290, 5), (40, 3)],
    "tree_verify": [(300, 4), (20, 3)],
}


@pytest.mark.parametrize("window", [5, 24])
@pytest.mark.parametrize("step", sorted(STEPS))
def test_backends_agree_with_a_window(step, window):
    """TritonBackend (interpreter) == TorchBackend for every kind of step, window on; the fused
    rope + store path included (decode)."""
    tree = step == "tree_verify"
    q, k, v, kc, vc, meta = make_case(STEPS[step], 4, 2, 32, 16, torch.float32, tree=tree, seed=window)
    pos = tree_positions(meta)
    kc2, vc2 = kc.clone(), vc.clone()
    ref = TorchBackend().forward(q, k, v, kc, vc, TorchBackend().plan(meta), 0.2, window=window, positions=pos)
    assert rel_err(ref, brute(q, kc, vc, meta, 0.2, window, pos).float()) < 1e-5
    be = TritonBackend(num_sms=4)
    be.mixed_decode_min = 0
    plan = be.plan(meta)
    out = be.forward(q, k, v, kc2, vc2, plan, 0.2, window=window, positions=pos)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("step", ["decode", "mixed", "tree_verify", "fresh_prefill"])
def test_backends_agree_with_a_window_over_a_quantized_cache(step):
    """The same with an int8 KV cache (codes and scales): every kernel's QUANT path with a window."""
    from test_kv_quant import _quantized

    q, k, v, kc, vc, meta = make_case(STEPS[step], 4, 2, 32, 16, torch.float32, tree=step == "tree_verify", seed=1)
    pos = tree_positions(meta)
    kq, vq, (ks, vs) = _quantized(kc, vc, torch.int8)
    c1 = [x.clone() for x in (kq, vq, ks, vs)]
    ref = TorchBackend().forward(q, k, v, c1[0], c1[1], TorchBackend().plan(meta), 0.2, kv_scales=(c1[2], c1[3]),
                                 window=7, positions=pos)
    full = TorchBackend().forward(q, k, v, kq.clone(), vq.clone(), TorchBackend().plan(meta), 0.2,
                                  kv_scales=(ks.clone(), vs.clone()), positions=pos)
    assert rel_err(ref, full) > 1e-3  # the window matters here
    be = TritonBackend(num_sms=4)
    be.mixed_decode_min = 0
    out = be.forward(q, k, v, kq, vq, be.plan(meta), 0.2, kv_scales=(ks, vs), window=7, positions=pos)
    assert torch.equal(kq, c1[0]) and torch.equal(ks, c1[2])
    assert rel_err(out, ref) < TOL[torch.float32]


def test_cpu_decode_path_window():
    """TorchBackend's CPU decode (SDPA over the gathered pages, the plan's masks) with a window, and a
    layer without one in the same step."""
    q, k, v, kc, vc, meta = make_case([(n - 1, 1) for n in (1, 15, 17, 40)], 4, 1, 16, 8, torch.float32)
    be = TorchBackend()
    plan = be.plan(meta)
    outs = {w: be.forward(q, k, v, kc, vc, plan, 0.25, window=w) for w in (None, 6, 100)}
    pos = meta.seq_lens.long() - 1
    assert rel_err(outs[6], brute(q, kc, vc, meta, 0.25, 6, pos).float()) < 1e-5
    assert rel_err(outs[None], brute(q, kc, vc, meta, 0.25, 10**6, pos).float()) < 1e-5
    assert torch.equal(outs[100], outs[None])


# ---------------------------------------------------------------------------------------------
# config: which layers slide, as transformers 5 reads each architecture
# ---------------------------------------------------------------------------------------------

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)


def test_config_sliding_layers():
    mistral = dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=32)
    c = ModelConfig.from_hf_dict(mistral)
    assert (c.sliding_window, c.sliding_layers) == (32, None) and c.layer_window(3) == 32
    assert ModelConfig.from_hf_dict(dict(mistral, sliding_window=None)).layer_window(0) is None
    qwen2 = dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], sliding_window=32)
    assert ModelConfig.from_hf_dict(qwen2).sliding_window is None  # use_sliding_window defaults to false
    on = dict(qwen2, use_sliding_window=True)
    assert ModelConfig.from_hf_dict(dict(on, max_window_layers=4)).sliding_window is None
    c = ModelConfig.from_hf_dict(dict(on, max_window_layers=1))
    assert c.sliding_layers == (1, 2, 3) and [c.layer_window(i) for i in range(4)] == [None, 32, 32, 32]
    assert ModelConfig.from_hf_dict(on).sliding_window is None  # max_window_layers defaults to 28
    c = ModelConfig.from_hf_dict(dict(on, layer_types=["sliding_attention", "full_attention"] * 2))
    assert c.sliding_layers == (0, 2)
    q2moe = dict(on, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], max_window_layers=3, **MOE)
    assert ModelConfig.from_hf_dict(q2moe).sliding_layers == (0, 2)  # even layers below max_window_layers
    q3moe = dict(on, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], max_window_layers=3,
                 layer_types=["full_attention"] * 4, **MOE)
    assert ModelConfig.from_hf_dict(q3moe).sliding_layers is None  # every layer (its modeling reads no types)
    # transformers' Mistral modeling reads no use_sliding_window, and MistralConfig's default is 4096;
    # Mixtral's is none; Llama ignores the key
    assert ModelConfig.from_hf_dict(dict(mistral, use_sliding_window=False)).sliding_window == 32
    assert ModelConfig.from_hf_dict({k: v for k, v in mistral.items() if k != "sliding_window"}).sliding_window == 4096
    mixtral = dict(mistral, model_type="mixtral", architectures=["MixtralForCausalLM"], **MOE)
    mixtral["num_local_experts"] = mixtral.pop("num_experts")
    assert ModelConfig.from_hf_dict({k: v for k, v in mixtral.items() if k != "sliding_window"}).sliding_window is None
    assert ModelConfig.from_hf_dict(mixtral).sliding_layers is None and ModelConfig.from_hf_dict(mixtral).sliding_window == 32
    llama = dict(BASE, model_type="llama", architectures=["LlamaForCausalLM"], sliding_window=32, use_sliding_window=True)
    assert ModelConfig.from_hf_dict(llama).sliding_window is None
    assert ModelConfig.from_hf_dict({k: v for k, v in on.items() if k != "sliding_window"} | {"max_window_layers": 1}
                                    ).sliding_window == 4096
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig.from_hf_dict(dict(mistral, sliding_window=-3))
    # to_hf_dict round trip
    for d in (mistral, dict(on, max_window_layers=1), dict(on, layer_types=["sliding_attention", "full_attention"] * 2)):
        c = ModelConfig.from_hf_dict(d)
        assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


ARCHS = {"mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
         "llama": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM"}
TYPES = ["full_attention", "sliding_attention"] * 2


@pytest.mark.parametrize("d", [
    dict(model_type="mistral"), dict(model_type="mistral", sliding_window=16, use_sliding_window=False),
    dict(model_type="mistral", sliding_window=None),
    dict(model_type="mixtral", sliding_window=16, num_local_experts=4, num_experts_per_tok=2),
    dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    dict(model_type="qwen2", use_sliding_window=True, max_window_layers=2),
    dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0),
    dict(model_type="qwen2", sliding_window=16, max_window_layers=0),
    dict(model_type="qwen3", use_sliding_window=True, sliding_window=16, layer_types=TYPES),
    dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=16, max_window_layers=3, **MOE),
    dict(model_type="qwen2_moe", use_sliding_window=True, sliding_window=16, layer_types=TYPES, **MOE),
    dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=16, max_window_layers=1, **MOE),
    dict(model_type="qwen3_moe", use_sliding_window=True, **MOE),
    dict(model_type="llama", sliding_window=16, use_sliding_window=True),
    dict(model_type="phi3", sliding_window=16), dict(model_type="phi3"),
], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items() if k in ("model_type", "sliding_window",
                                                                   "use_sliding_window", "max_window_layers")))
def test_config_windows_match_transformers(d):
    """Each layer's window as transformers' config object gives it to the layer (Mistral, Mixtral and
    Qwen3-MoE: the config's sliding_window in every layer; Qwen2/3 and Qwen2-MoE: by layer_types;
    Llama: never)."""
    from transformers import AutoConfig

    d = dict(BASE, architectures=[ARCHS[d["model_type"]]], **d)
    c = AutoConfig.for_model(**d)
    n = c.num_hidden_layers
    if d["model_type"] == "llama":
        want = [None] * n
    elif d["model_type"] in ("mistral", "mixtral", "qwen3_moe", "phi3"):
        want = [c.sliding_window or None] * n
    else:
        want = [(c.sliding_window or None) if c.layer_types[i] == "sliding_attention" else None for i in range(n)]
    cfg = ModelConfig.from_hf_dict(d)
    assert [cfg.layer_window(i) for i in range(n)] == want


# ---------------------------------------------------------------------------------------------
# engine: greedy tokens equal HF's past the window
# ---------------------------------------------------------------------------------------------

ENGINE_CONFIGS = {
    "mistral-w8": dict(BASE, model_type="mistral", architectures=["MistralForCausalLM"], num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=96,
                       vocab_size=211, sliding_window=8),
    # layers 1 and 2 of 3 slide, layer 0 attends to everything
    "qwen2-mixed-w11": dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_hidden_layers=3,
                            hidden_size=64, intermediate_size=96, vocab_size=211, sliding_window=11,
                            use_sliding_window=True, max_window_layers=1),
}


@pytest.mark.parametrize("name", sorted(ENGINE_CONFIGS))
def test_engine_matches_hf_past_the_window(tmp_path, name):
    from transformers import AutoModelForCausalLM

    from hf_ref import hf_greedy, make_random_hf_folder
    from pageflash import LLM, SamplingParams

    folder = make_random_hf_folder(tmp_path, ENGINE_CONFIGS[name])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 6, 17, 40)]
    # block size 4, a small token budget (chunked prefill across the window's edge), few blocks
    # (preemption), prefix hits (two prompts share 24 tokens)
    prompts.append(prompts[3][:24] + [5, 6, 7])
    llm = LLM(folder, block_size=4, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=40)
    assert llm.llm_engine.max_model_len == 128  # no longer capped at the window
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 24), f"prompt of {len(p)}"
    eng = llm.llm_engine
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_kv_pool_smaller_than_the_context(tmp_path):
    """Every layer slides: a sequence holds only its window (+ a step) of KV, so a pool far smaller
    than max_model_len serves long sequences -- and concurrent ones -- with HF's tokens, without a
    preemption, and nothing leaks. A model with a full-attention layer still needs the whole context."""
    from transformers import AutoModelForCausalLM

    from hf_ref import hf_greedy, make_random_hf_folder
    from pageflash import LLM, SamplingParams

    folder = make_random_hf_folder(tmp_path / "m", ENGINE_CONFIGS["mistral-w8"])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (30, 3, 19)]
    # per sequence: window 8 + a step of 8 tokens = 4 blocks of 4, + 2 partial: 6 blocks; 3 sequences
    llm = LLM(folder, block_size=4, max_num_batched_tokens=8, max_model_len=128, num_kv_blocks=18)
    eng = llm.llm_engine
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):  # 100 tokens of context: 25 blocks each, 75 in all, in a pool of 18
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 70), f"prompt of {len(p)}"
    assert eng.scheduler.num_preemptions == 0
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    # parallel sampling: the siblings fork a table whose head was given back
    (o,) = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(n=2, temperature=0.0, max_tokens=40,
                                                                            ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in o.outputs] == [hf_greedy(hf, prompts[0], 40)] * 2
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    with pytest.raises(ValueError, match="sliding window of 8 tokens plus a step's 8"):
        LLM(folder, block_size=4, max_num_batched_tokens=8, max_model_len=128, num_kv_blocks=5)
    mixed = make_random_hf_folder(tmp_path / "q", ENGINE_CONFIGS["qwen2-mixed-w11"])
    with pytest.raises(ValueError, match="fewer than max_model_len=128"):
        LLM(mixed, block_size=4, max_num_batched_tokens=8, max_model_len=128, num_kv_blocks=18)


def test_long_prefix_hit_in_a_window_sized_pool(tmp_path):
    """A prompt whose cached prefix is as long as the whole (window-sized) pool is admitted: the hits
    behind its window are not taken (the engine used to wait for free blocks that could never be);
    its tokens are HF's, and a beam search over such a pool finishes too."""
    from transformers import AutoModelForCausalLM

    from hf_ref import hf_greedy, make_random_hf_folder
    from pageflash import LLM, SamplingParams
    from pageflash.beam_search import BeamSearchParams

    folder = make_random_hf_folder(tmp_path / "m", ENGINE_CONFIGS["mistral-w8"])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    p = torch.randint(0, 211, (72,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(folder, block_size=4, max_num_batched_tokens=8, max_model_len=128, num_kv_blocks=18)
    eng = llm.llm_engine
    llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                 use_tqdm=False)
    p2 = p + [1, 2, 3, 4, 5]
    assert len(eng.kv.find_cached_prefix(p2)) == 18  # every block of the pool holds a hit
    eng.add_request("r", {"prompt_token_ids": p2}, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    out = None
    for _ in range(200):
        for o in eng.step():
            if o.finished:
                out = o
        if out is not None:
            break
    assert out is not None, "the request was never admitted"
    assert out.outputs[0].token_ids == hf_greedy(hf, p2, 6)
    assert eng.kv.num_free_blocks == 18
    beams = llm.beam_search([{"prompt_token_ids": p[:40]}], BeamSearchParams(beam_width=2, max_tokens=24))
    assert len(beams[0].sequences) == 2 and eng.kv.num_free_blocks == 18


SPEC_CFG = dict(ENGINE_CONFIGS["mistral-w8"], vocab_size=97, sliding_window=6)
SPEC_PROMPTS = [[5, 6, 7, 8, 9] * 4, [3, 1, 4, 1, 5, 9, 2, 6] * 2 + [3, 1], [11, 12, 13], [40] * 9]


def static_verify_steps(eng) -> None:
    """Run the engine's verify steps along the static-buffer path their CUDA graphs replay (on the
    CPU: without graphs), every draft size captured up front."""
    eng.runner.enable_step_graphs(8, cuda_graphs=False)
    eng.runner.step_graphs.add_query_size(1 + eng.spec.max_draft_nodes)
    eng.runner.step_graphs.capture_all(1 + eng.spec.max_draft_nodes)


@pytest.fixture(scope="module")
def spec_env(tmp_path_factory):
    from hf_ref import make_random_hf_folder
    from pageflash import LLM, SamplingParams

    folder = make_random_hf_folder(tmp_path_factory.mktemp("mistral"), SPEC_CFG, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng = dict(block_size=4, max_model_len=96, max_num_batched_tokens=32, num_kv_blocks=200, dtype="float32")
    plain = LLM(folder, attention_backend="torch", **eng)
    ref = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in SPEC_PROMPTS], greedy,
                                                           use_tqdm=False)]
    return dict(folder=folder, greedy=greedy, eng=eng, ref=ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", [None, dict(method="ngram", num_speculative_tokens=3),
                                  dict(method="ngram", tree=[2], num_speculative_tokens=5),
                                  dict(method="early_exit", num_layers=1, tree=[2, 1]),
                                  # the target as its own draft: the draft's pool gives back blocks too
                                  dict(method="draft_model", model="{folder}", num_speculative_tokens=2)],
                         ids=["plain", "ngram", "ngram-tree", "early_exit-tree", "draft_model"])
def test_speculation_with_a_window_equals_plain(spec_env, spec, backend):
    """Verify steps (chains and token trees, whose keys sit at their depth) over a sliding window give
    plain greedy's tokens: the reference backend, and the Triton kernels (interpreter) through the
    static-buffer path the verify graphs replay."""
    from pageflash import LLM

    if spec is not None:
        spec = {k: (v.format(folder=spec_env["folder"]) if isinstance(v, str) else v) for k, v in spec.items()}
    llm = LLM(spec_env["folder"], attention_backend=backend, speculative_config=spec, **spec_env["eng"])
    eng = llm.llm_engine
    if spec is not None and backend == "triton":
        static_verify_steps(eng)
    outs = llm.generate([{"prompt_token_ids": p} for p in SPEC_PROMPTS], spec_env["greedy"], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == spec_env["ref"]
    if spec is not None:
        assert eng.get_stats()["spec"][spec["method"]]["num_accepted_tokens"] > 0
        if backend == "triton":
            assert eng.runner.step_graphs.replays > 0
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    if spec is not None and spec["method"] == "draft_model":
        assert eng.spec.draft_kv.window == 6
        assert eng.spec.draft_kv.num_free_blocks == eng.spec.draft_kv.pool.num_blocks
