"""LoRA on CUDA: the shrink / expand kernels against their references at model sizes, and the engine's
decode CUDA graphs (with async scheduling) giving the tokens of eager steps with several adapters and
the base model in one batch -- float32 equal to HF + peft too; one slot shared by two adapters (slot
reloads queued behind steps in flight); bf16 on SmolLM2's shapes with random adapters written by lora.adapter.write_random_adapter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_ref import hf_greedy, hf_with_adapter, make_peft_adapter, make_random_hf_folder  # noqa: E402
from near_ties import assert_parts_only_at_near_ties  # noqa: E402
from test_engine_hf import CONFIGS  # noqa: E402

from pageflash import LLM, SamplingParams  # noqa: E402
from pageflash.kernels.lora_expand import lora_expand, lora_expand_ref  # noqa: E402
from pageflash.kernels.lora_shrink import lora_shrink, lora_shrink_ref  # noqa: E402
from pageflash.lora import LoRARequest  # noqa: E402
from pageflash.lora.adapter import write_random_adapter  # noqa: E402
from pageflash.lora.layers import group_by_slot  # noqa: E402

DEV = torch.device("cuda")
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW = 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,k,rank,slices", [(1, 4096, 16, [4096, 1024, 1024]), (8, 4096, 16, [14336, 14336]),
                                             (300, 2048, 8, [2048]), (2000, 14336, 32, [4096])])
def test_kernels_match_reference(poison_outputs, dtype, t, k, rank, slices):
    g = torch.Generator(DEV).manual_seed(t + k)
    s = 5
    x = torch.randn(t, k, device=DEV, generator=g).to(dtype)
    a = (torch.randn(s, len(slices) * rank, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(s, sum(slices), rank, device=DEV, generator=g).to(dtype)
    a[0], b[0] = 0, 0
    scale = torch.rand(s, len(slices), device=DEV, generator=g) + 0.5
    slots = torch.randint(0, s, (t,), device=DEV, generator=g, dtype=torch.int32)
    groups = group_by_slot(slots, s)
    p = lora_shrink(x, a, scale, *groups)
    ref_p = lora_shrink_ref(x, a, scale, *groups)
    has = slots > 0
    tol = TOL[dtype]
    assert torch.allclose(p.sum(0)[has], ref_p[0][has], rtol=tol, atol=tol)
    base = torch.randn(t, sum(slices), device=DEV, generator=g).to(dtype)
    out = lora_expand(p, b, *groups, base.clone(), slices)
    ref = lora_expand_ref(ref_p, b, *groups, base.clone(), slices)
    assert torch.equal(out[~has], base[~has])
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * rank ** 0.5)


@pytest.mark.parametrize("silu,slices", [(False, [4096, 1024, 1024]), (True, [14336, 14336]), (False, [4096])])
def test_gemv_with_lora_in_graphs(silu, slices):
    """The batch-1 GEMV with the LoRA delta in its launch (kernels/gemv.py ``lora=``) at llama-3-8b
    sizes in bf16, eagerly and replayed in a CUDA graph 50 times while the token's slot changes (0: no
    adapter; the chunks' counters must reset themselves every launch): equal to the GEMV followed
    by the shrink / expand references."""
    from pageflash.kernels.activation import silu_and_mul
    from pageflash.kernels.gemv import GemvLoRA, gemv, gemv_lora_scratch
    from pageflash.kernels.skinny_gemm import gemv_tile

    dtype, rank, s, k = torch.bfloat16, 16, 4, 4096 if len(slices) != 1 else 14336
    g = torch.Generator(DEV).manual_seed(len(slices))
    n = sum(slices)
    x = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    a = (torch.randn(s, len(slices) * rank, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    b = (torch.randn(s, n, rank, device=DEV, generator=g) * 0.5).to(dtype)
    a[0], b[0] = 0, 0
    scale = torch.rand(s, len(slices), device=DEV, generator=g) + 0.5
    slot = torch.zeros(1, dtype=torch.int32, device=DEV)
    lo = GemvLoRA(a, b, scale, slot, *gemv_lora_scratch(n, len(slices), rank, silu, dtype, DEV), tuple(slices))
    r, bk, stages, warps = gemv_tile(DEV)
    cfg = (2 * 2 * r if silu else 2 * r, r, bk, stages, warps)

    def ref(sl):
        groups = group_by_slot(torch.tensor([sl], dtype=torch.int32, device=DEV), s)
        y = lora_expand_ref(lora_shrink_ref(x, a, scale, *groups), b, *groups, gemv(x, w, *cfg), slices)
        return silu_and_mul(y) if silu else y

    refs = [ref(sl) for sl in range(s)]
    out = torch.empty_like(refs[0])
    run = lambda: gemv(x, w, *cfg, out=out, silu_mul=silu, lora=lo)  # noqa: E731
    for sl in (1, 0, 3):
        slot.fill_(sl)
        run()
        assert torch.allclose(out.float(), refs[sl].float(), rtol=2e-2, atol=2e-2), (sl, (out - refs[sl]).abs().max())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for i in range(50):
        sl = (i * 7) % s
        slot.fill_(sl)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out.float(), refs[sl].float(), rtol=2e-2, atol=2e-2), (i, sl)
    assert not lo.counters.any()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_gpu")
    folder = make_random_hf_folder(tmp / "model", CONFIGS["llama-gqa"])
    paths = {"a": make_peft_adapter(folder, tmp / "a", ALL, r=8, seed=1),
             "b": make_peft_adapter(folder, tmp / "b", ["q_proj", "v_proj"], r=4, seed=2, std=0.2, use_rslora=True)}
    return folder, paths


def _run(folder, loras, names, **kw):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 6, 17, 30, 9, 3)]
    llm = LLM(folder, dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=128, num_kv_blocks=64, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=NEW,
                        ignore_eos=True), use_tqdm=False, lora_request=[loras[n] for n in names])  # fmt: skip
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    return [o.outputs[0].token_ids for o in outs], prompts, llm


@pytest.mark.parametrize("max_loras", [2, 1])
def test_graphs_equal_eager_and_hf_fp32(tiny, max_loras):
    """Two adapters and the base in one batch (max_loras=1: one slot shared, reloaded while steps are in
    flight): decode graphs + async scheduling == eager synchronous steps == HF + peft on the CPU."""
    folder, paths = tiny
    loras = {None: None, "a": LoRARequest("a", 1, paths["a"]), "b": LoRARequest("b", 2, paths["b"])}
    names = ["a", None, "b", "a", "b", None]
    eager, prompts, _ = _run(folder, loras, names, max_loras=max_loras, enforce_eager=True, async_scheduling=False)
    graphs, _, llm = _run(folder, loras, names, max_loras=max_loras)
    assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.async_scheduling
    assert graphs == eager
    refs = {n: hf_with_adapter(folder, paths[n]) for n in ("a", "b")}
    from transformers import AutoModelForCausalLM

    refs[None] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert graphs == [hf_greedy(refs[n], p, NEW) for p, n in zip(prompts, names)]


def test_graphs_equal_eager_bf16_smollm2(tmp_path):
    """bf16 on SmolLM2's shapes (dummy weights), two adapters of ranks 16 and 8 and the base: graphs and
    eager steps give the same tokens up to bf16 near-ties (the decode graphs are planned for the longest
    context, eager steps for the step's: their attention splits, so their roundings, differ -- the
    base model's qwen3-0.6b parts from eager the same way, tests/gpu/test_engine_gpu.py): where a row
    parts, both tokens are within 0.15 nats of each other in the eager run's logprobs; the base rows
    are those of a run without adapters, and the adapters change the others."""
    from pageflash.model.loader import load_config, resolve_model

    cfg = load_config(resolve_model("smollm2-135m", "dummy"))
    loras = {None: None, "a": LoRARequest("a", 1, write_random_adapter(str(tmp_path / "a"), cfg, 16, 1)),
             "b": LoRARequest("b", 2, write_random_adapter(str(tmp_path / "b"), cfg, 8, 2))}
    names = ["a", "b", None, "b", "a", None, "a", "b"]
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 64, 100, 1, 250, 16))]

    def run(names, **kw):
        llm = LLM("smollm2-135m", load_format="dummy", max_model_len=512, num_kv_blocks=512, enable_lora=True,
                  max_loras=2, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=NEW,
                            ignore_eos=True, logprobs=5), use_tqdm=False, lora_request=[loras[n] for n in names])  # fmt: skip
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs], llm

    eager, lps, _ = run(names, enforce_eager=True)
    graphs, _, llm = run(names)
    assert llm.llm_engine.runner.graphs is not None
    assert_parts_only_at_near_ties(graphs, eager, lps, max_parted=2, labels=names)
    plain, _, _ = run([None] * len(names), enforce_eager=True)
    assert all(plain[i] == eager[i] for i, n in enumerate(names) if n is None)
    assert sum(plain[i] != eager[i] for i, n in enumerate(names) if n is not None) >= 4
