"""Speculative sampling through the whole engine keeps the target's output distribution.

A tiny random Llama with a 16-token vocabulary (weights drawn wide, so that its next-token
distributions are neither flat nor one-hot) and, as the draft, the same random draw with every
weight matrix scaled by 0.75: a different distribution that agrees often (~70% of drafts accepted),
so accepted runs, bonus tokens and rejections all occur many times.
Many requests with the same prompt and seeds 0..N-1 sample 4 tokens each, with speculation; the
joint distribution of those 4 tokens must equal the target's exact one, computed by enumerating
every 3-token prefix with HF transformers (temperature and top-k applied as the engine does).

Each run is a Pearson chi-square goodness-of-fit test (cells with expected count < 5 pooled) at a
false-alarm rate of ALPHA = 1e-3 per test; everything is seeded, so a test either always passes or
always fails. The draft's tokens (draft_model) are sampled from its own distribution and verified
by rejection sampling against q, the n-gram drafts are deterministic (one-hot q), the tree configs
exercise multi-branch verification with children drawn without replacement. The steps see 1 to 3
draft tokens (max_tokens caps the depth near the end), so accepted drafts, the residual after a
rejection and the bonus token are all exercised; the test of the harness's power at the end shows
that a draft whose q is misreported (tokens drawn from the draft but claimed to come from a flat
q) is caught.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_ref import make_random_hf_folder
from test_spec_verify import chi2_pvalue
from pageflash import LLM, SamplingParams

ALPHA = 1e-3
V = 16
NEW = 4
N = 2500
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
CFG = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=64,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = make_random_hf_folder(tmp_path_factory.mktemp("target"), CFG, seed=0, std=0.4)
    draft = make_random_hf_folder(tmp_path_factory.mktemp("draft"), CFG, seed=0, std=0.3)
    return target, draft


def exact_joint(folder: str, temperature: float, top_k: int) -> torch.Tensor:
    """P(t1..t4 | PROMPT) under the target: float64 [V] * NEW."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    joint = torch.ones(1, dtype=torch.float64)
    for d in range(NEW):
        ctx = list(itertools.product(range(V), repeat=d))
        ids = torch.tensor([PROMPT + list(c) for c in ctx])
        with torch.no_grad():
            logits = hf(ids).logits[:, -1].double() / temperature
        if 0 < top_k < V:
            kth = logits.topk(top_k, -1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        joint = (joint[:, None] * torch.softmax(logits, -1)).reshape(-1)
    return joint.reshape([V] * NEW)


def sample_counts(llm: LLM, params: dict) -> torch.Tensor:
    torch.manual_seed(0)  # seeded requests draw from their own generators; this fixes the rest
    sps = [SamplingParams(max_tokens=NEW, ignore_eos=True, seed=i, **params) for i in range(N)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, sps, use_tqdm=False)
    counts = torch.zeros([V] * NEW, dtype=torch.float64)
    for o in outs:
        counts[tuple(o.outputs[0].token_ids)] += 1
    return counts


CASES = {
    "draft_model-chain": (dict(method="draft_model", num_speculative_tokens=3), dict(temperature=1.0)),
    "draft_model-tree": (dict(method="draft_model", tree=[2, 2, 1]), dict(temperature=0.8, top_k=8)),
    "ngram-chain": (dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1), dict(temperature=1.0)),
    "ngram-tree": (dict(method="ngram", tree=[3], num_speculative_tokens=6), dict(temperature=1.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_output_distribution_equals_target(models, case):
    target, draft = models
    spec, params = CASES[case]
    if spec["method"] == "draft_model":
        spec = dict(spec, model=draft)
    llm = LLM(target, block_size=4, max_model_len=32, num_kv_blocks=2048, max_num_seqs=256, speculative_config=spec)
    counts = sample_counts(llm, params)
    eng = llm.llm_engine
    stats = eng.get_stats()["spec"][spec["method"]]
    assert stats["num_steps"] > N // 5 and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    p = exact_joint(target, params["temperature"], params.get("top_k", -1))
    assert chi2_pvalue(counts, p) > ALPHA, stats


def test_harness_catches_misreported_draft_probs(models, monkeypatch):
    """Power: drafts drawn from the draft model but reported as drawn from a flat q are accepted
    with min(1, p / q) for the wrong q, which biases the output; the same test must reject it."""
    from pageflash.spec import draft as draft_mod

    target, draft = models
    real = draft_mod.ModelDraftProposer.propose

    def lying(self, requests):
        trees = real(self, requests)
        return [t if t is None or t.draft_probs is None else
                type(t)(t.tokens, t.parents, torch.full_like(t.draft_probs, 1.0 / V)) for t in trees]

    monkeypatch.setattr(draft_mod.ModelDraftProposer, "propose", lying)
    llm = LLM(target, block_size=4, max_model_len=32, num_kv_blocks=2048, max_num_seqs=256,
              speculative_config=dict(method="draft_model", model=draft, num_speculative_tokens=3))
    counts = sample_counts(llm, dict(temperature=1.0))
    assert chi2_pvalue(counts, exact_joint(target, 1.0, -1)) < ALPHA
