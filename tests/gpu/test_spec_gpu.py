"""Speculative verification on CUDA: same answers as on the CPU, seeded requests reproducible,
sampling still lossless (the CPU suite's toy models and chi-square harness, on the GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_spec_verify as cpu  # noqa: E402  (the CPU suite's helpers)

from pageflash.spec.tree import DraftTree, ExpansionConfig, build_trees, chain  # noqa: E402
from pageflash.spec.verify import verify_chains, verify_trees  # noqa: E402

DEV = torch.device("cuda")


def test_greedy_matches_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(40, 50, generator=g) * 4, -1)
    amax = p.argmax(-1)
    drafts = [amax[0:3].tolist(), [1, 2], amax[6:13].tolist(), []]
    # rows: 4 + 3 + 8 + 1 = 16
    flat = p[:16]
    assert verify_chains(drafts, flat.to(DEV), greedy=True).to_lists() == verify_chains(drafts, flat, greedy=True).to_lists()
    trees = [DraftTree([int(amax[0]), 3, int(amax[1])], [-1, -1, 0]), chain([int(amax[4])])]
    flat = p[:6]
    assert verify_trees(trees, flat.to(DEV), greedy=True) == verify_trees(trees, flat, greedy=True)


def test_seeded_requests_are_reproducible_on_cuda() -> None:
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(9, 64, device=DEV), -1)
    q = torch.softmax(torch.randn(3, 64, device=DEV), -1)
    outs = []
    for extra in ([], [[5, 6, 7]]):
        rows = torch.cat([p[4:8]] + ([p[:4]] if extra else []))
        gens = [torch.Generator(DEV).manual_seed(7)] + [None] * len(extra)
        outs.append(verify_chains([[1, 2, 3], *extra], rows, [q] + [None] * len(extra), generators=gens).to_lists()[0])
    assert outs[0] == outs[1]


def test_chain_and_tree_lossless_on_cuda() -> None:
    target, draft = cpu.ToyLM(cpu.V, 4, seed=1), cpu.ToyLM(cpu.V, 4, seed=2)
    target.table, draft.table = target.table.to(DEV), draft.table.to(DEV)
    g = torch.Generator(DEV).manual_seed(0)
    n = cpu.N
    ctx = np.zeros((n, 0), dtype=np.int64)
    qs, ps = [], [target.probs(ctx)]
    for _ in range(3):
        q = draft.probs(ctx)
        x = torch.multinomial(q, 1, generator=g).squeeze(1).cpu().numpy()
        qs.append(q)
        ctx = np.concatenate([ctx, x[:, None]], 1)
        ps.append(target.probs(ctx))
    p_flat = torch.stack(ps, 1).reshape(n * 4, cpu.V)
    emitted = verify_chains(ctx.tolist(), p_flat, list(torch.stack(qs, 1).unbind(0)), generator=g).to_lists()
    ref_t = cpu.ToyLM(cpu.V, 4, seed=1)  # CPU copy for the completion draws and the expected table
    gc = torch.Generator().manual_seed(1)
    assert cpu.chi2_pvalue(cpu.first_two(emitted, ref_t, gc), cpu.joint_first_two(ref_t)) > cpu.ALPHA

    trees = build_trees(lambda _r, p: draft.probs_of_paths(p), cpu.NT, ExpansionConfig([3, 2]), sample=True, generator=g)
    emitted = cpu._verify_trees_on(target, trees, g)
    assert cpu.chi2_pvalue(cpu.first_two(emitted, ref_t, gc), cpu.joint_first_two(ref_t)) > cpu.ALPHA


def test_spec_step_graphs_equal_eager_and_plain() -> None:
    """Verify / draft steps replayed from CUDA graphs give plain greedy's tokens (float32, dummy
    smollm2 config): n-gram chain, n-gram tree, early-exit tree."""
    from pageflash import LLM, SamplingParams

    prompts = [[(7 * i + j) % 50 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 64, 100))]
    prompts += [[5, 6, 7, 8, 9] * 8]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(load_format="dummy", max_model_len=512, num_kv_blocks=512, dtype="float32")

    def run(**extra):
        llm = LLM("smollm2-135m", **kw, **extra)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    plain, _ = run(enforce_eager=True)
    for spec in (dict(method="ngram", num_speculative_tokens=4), dict(method="ngram", tree=[2], num_speculative_tokens=6),
                 dict(method="early_exit", num_layers=8, tree=[2, 1, 1])):
        got, llm = run(speculative_config=spec)
        sg = llm.llm_engine.runner.step_graphs
        assert sg is not None and sg.replays > 0 and sg.graphs, spec
        assert got == plain, spec
        eng = llm.llm_engine
        assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def test_seeded_sampling_under_ngram_speculation_equals_plain_decoding() -> None:
    """A seeded request's generator is keyed by output position on the GPU too: under n-gram
    speculation (chain, tree, adaptive; verify steps from CUDA graphs) its sampled tokens are plain
    decoding's, beside unseeded requests (float32, dummy smollm2 config; top-k 2 at low temperatures,
    so that drafts are accepted)."""
    from pageflash import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9] * 8, [(7 * j) % 50 + 3 for j in range(33)]]
    seeded = [SamplingParams(temperature=0.3, top_k=2, seed=11, max_tokens=32, ignore_eos=True),
              SamplingParams(n=2, temperature=0.5, top_k=2, seed=3, max_tokens=32, ignore_eos=True)]
    free = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    kw = dict(load_format="dummy", max_model_len=512, num_kv_blocks=512, dtype="float32")

    def toks(outs):
        return [[c.token_ids for c in o.outputs] for o in outs]

    plain = toks(LLM("smollm2-135m", **kw).generate([{"prompt_token_ids": p} for p in prompts], seeded,
                                                     use_tqdm=False))
    for spec in (dict(method="ngram", num_speculative_tokens=4), dict(method="ngram", tree=[2], num_speculative_tokens=6),
                 dict(method="ngram", num_speculative_tokens=4, adaptive=True)):
        llm = LLM("smollm2-135m", speculative_config=spec, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in [prompts[1], prompts[0], prompts[0], prompts[1]]],
                            [free, seeded[0], free, seeded[1]], use_tqdm=False)
        assert toks([outs[1], outs[3]]) == plain, spec
        assert llm.llm_engine.get_stats()["spec"]["ngram"]["num_accepted_tokens"] > 0, spec
