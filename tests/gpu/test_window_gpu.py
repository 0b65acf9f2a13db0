"""Sliding-window attention on the GPU: every Triton kernel with a window against the PyTorch
reference at full size in bf16, and the engine (Triton backend, CUDA graphs, speculative verify
graphs, blocks given back behind the window) against the reference backend in float32."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pageflash import LLM, SamplingParams
from pageflash.kernels.backend import TritonBackend
from pageflash.kernels.flash_attention import flash_attn_varlen_fwd, flash_attn_varlen_ref
from pageflash.kernels.paged_attention import paged_attention, paged_attention_ref
from pageflash.layers.attention import TorchBackend
from pageflash.model.registry import NAMED_CONFIGS
from test_kernels_gpu import DEV, TOL, make_case, rel_err, rnd

# kernel outputs start poisoned (not the engine test's: the fixture's torch.empty would escape the
# engine's torch.device context)
poisoned = pytest.mark.usefixtures("poison_outputs")


def positions(meta) -> torch.Tensor:
    """Context + depth of each new token (a tree's: its ancestors on its mask row - 1)."""
    out, row = [], 0
    for n, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        for j in range(n):
            depth = int(meta.tree_mask[row + j, :n].sum()) - 1 if meta.tree_mask is not None else j
            out.append(s - n + depth)
        row += n
    return torch.tensor(out, dtype=torch.int64, device=DEV)


@poisoned
@pytest.mark.parametrize("window", [1000, 4096])
@pytest.mark.parametrize("b,L", [(1, 32768), (16, 8192), (64, 2048), (256, 1024), (7, 17)])
def test_decode_window(b, L, window):
    lens = [L] + [random.Random(i).randint(1, L) for i in range(b - 1)]
    q, k, v, kc, vc, meta = make_case([(n - 1, 1) for n in lens], 32, 8, 128, 16, seed=b)
    kc2, vc2 = kc.clone(), vc.clone()
    ref = TorchBackend().forward(q, k, v, kc, vc, meta, 0.09, window=window)
    be = TritonBackend()
    plan = be.plan(meta)
    out = be.forward(q, k, v, kc2, vc2, plan, 0.09, window=window)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    # the fused rotary + store launch with a window, against rotary, then the reference
    from pageflash.kernels.rotary import apply_rotary_ref

    ang = torch.rand(L + 1, 64, device=DEV) * 6.0
    cos, sin = ang.cos(), ang.sin()
    pos = meta.seq_lens.long() - 1
    qr, kr = apply_rotary_ref(q, k, pos, cos, sin)
    kc3, vc3 = kc.clone(), vc.clone()
    ref_r = TorchBackend().forward(qr, kr, v, kc3, vc3, meta, 0.09, window=window)
    kc4, vc4 = kc.clone(), vc.clone()
    out_r = be.forward(q.clone(), k.clone(), v, kc4, vc4, plan, 0.09, rope=(pos, cos, sin), window=window)
    assert torch.equal(kc4, kc3) and torch.equal(vc4, vc3)
    assert rel_err(out_r, ref_r) < TOL[torch.bfloat16]


PAGED = {
    "chunked": [(5000, 512), (1000, 37), (16, 16), (3, 1), (0, 700)],
    "spec": [(6000, 5), (17, 8), (64, 1), (900, 4)],
}


@poisoned
@pytest.mark.parametrize("window", [100, 1024])
@pytest.mark.parametrize("case,tree,splits", [("chunked", False, 1), ("spec", False, 1), ("spec", False, 16),
                                              ("spec", True, 1), ("spec", True, 16)])
def test_paged_window(case, tree, splits, window):
    q, k, v, kc, vc, meta = make_case(PAGED[case], 32, 8, 128, 16, tree=tree, seed=window)
    store_kv = TorchBackend().forward  # store the new K/V (and compute the reference)
    pos = positions(meta)
    ref = store_kv(q, k, v, kc, vc, meta, 0.09, window=window, positions=pos)
    ref2 = paged_attention_ref(q, kc, vc, meta, 0.09, window=window, positions=pos)
    assert torch.equal(ref, ref2)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.09,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask, num_splits=splits,
                          window=window, positions=pos)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@poisoned
@pytest.mark.parametrize("window", [64, 1000, 4096])
def test_varlen_prefill_window(window):
    lens = [4096, 1000, 17, 2500]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v = rnd(sum(lens), 32, 128), rnd(sum(lens), 8, 128), rnd(sum(lens), 8, 128)
    o, lse = flash_attn_varlen_fwd(q, k, v, cu, max(lens), True, 0.09, window=window)
    o_ref, lse_ref = flash_attn_varlen_ref(q, k, v, cu, True, 0.09, window=window)
    assert rel_err(o, o_ref) < TOL[torch.bfloat16]
    assert torch.allclose(lse, lse_ref, atol=2e-2)


# --------------------------------------------------------------------------------------------- engine

PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 100, 250, 1, 180))]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """smollm2-135m's shapes as a Mistral whose every layer attends to the last 64 tokens (dummy weights)."""
    d = tmp_path_factory.mktemp("mistral-w64")
    cfg = dict(NAMED_CONFIGS["smollm2-135m"], architectures=["MistralForCausalLM"], model_type="mistral",
               sliding_window=64, head_dim=64)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _run(folder, **kw):
    kw = dict(dict(load_format="dummy", max_model_len=512, num_kv_blocks=512, dtype="float32"), **kw)
    llm = LLM(folder, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    eng = llm.llm_engine
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    return [o.outputs[0].token_ids for o in outs], llm


def test_engine_window_triton_graphs_equal_torch_fp32(folder):
    ref, _ = _run(folder, attention_backend="torch", enforce_eager=True)
    tri, llm = _run(folder)  # Triton, decode graphs, async scheduling
    assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.kv.window == 64
    assert tri == ref
    # a pool of 40 blocks of 16 for 6 sequences of up to 298 tokens: only the windows are held
    small, llm = _run(folder, num_kv_blocks=40, max_num_batched_tokens=128)
    assert small == ref and llm.llm_engine.scheduler.num_preemptions == 0
    # n-gram speculation through the verify graphs
    spec, llm = _run(folder, speculative_config=dict(method="ngram", num_speculative_tokens=4))
    assert spec == ref
    tree, llm = _run(folder, speculative_config=dict(method="ngram", tree=[2], num_speculative_tokens=6))
    assert tree == ref
