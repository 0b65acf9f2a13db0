"""Sampler: each transformation against its definition, seeds, distributions, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pageflash.engine.sampler import (
    Sampler,
    argmax_rows,
    SamplingBatch,
    SamplingRow,
    SeedStream,
    apply_penalties_and_min_tokens,
    compute_probs,
    sample_rows_keyed,
)
from pageflash.sampling_params import SamplingParams

DEVICE = "cpu"


def rows_for(params: list[SamplingParams], outputs=None, prompts=None, gens=None):
    n = len(params)
    outputs = outputs or [[] for _ in range(n)]
    prompts = prompts or [[] for _ in range(n)]
    gens = gens or [None] * n
    return [SamplingRow(p, pr, o, g) for p, pr, o, g in zip(params, prompts, outputs, gens)]


def build(params, vocab, **kw):
    eos = kw.pop("eos", None)
    return SamplingBatch.build(rows_for(params, **kw), vocab, DEVICE, eos_token_ids=eos)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def chi2_sf_even_df(x: float, df: int) -> float:
    """Survival function of the chi-square distribution for an even df (closed form)."""
    assert df % 2 == 0
    half = x / 2
    term, total = 1.0, 1.0
    for i in range(1, df // 2):
        term *= half / i
        total += term
    return math.exp(-half) * total


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(7, 301) * 4).to(dtype)
    before = logits.clone()
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 7, 301))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None
    assert torch.equal(logits, before)  # the model's buffer is never modified


def test_precomputed_greedy_ids_are_used_only_where_they_are_the_answer():
    """greedy_ids (the decode graphs' in-graph argmax) serve all-greedy batches without processing
    and the greedy rows of mixed batches; penalties make the sampler take its own argmax."""
    torch.manual_seed(2)
    logits = torch.randn(3, 40) * 3
    marker = torch.tensor([5, 6, 7])  # not the argmax: shows which ids were used
    out = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 3, 40), greedy_ids=marker)
    assert out.token_ids is marker
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, build(mixed, 40), greedy_ids=marker)
    assert out.token_ids[0] == 5 and out.token_ids[2] == 7
    pen = [SamplingParams(temperature=0.0, repetition_penalty=1.5)] * 3
    out = Sampler()(logits, build(pen, 40, outputs=[[1], [2], [3]]), greedy_ids=marker)
    assert not torch.equal(out.token_ids, marker)
    with pytest.raises(ValueError, match="greedy_ids"):
        Sampler()(logits, build([SamplingParams(temperature=0.0)] * 3, 40), greedy_ids=marker[:2])


def test_greedy_rows_in_mixed_batch_ignore_sampling_knobs():
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    params = [
        SamplingParams(temperature=0.0, top_k=2, top_p=0.1, min_p=0.9),  # greedy: knobs inert
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1e-6),  # below 1e-5 counts as greedy
        SamplingParams(temperature=0.7, top_p=0.5, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(),
    ]
    gens = [None, None, None, gen(3), None, None]
    out = Sampler()(logits, build(params, 50, gens=gens))
    for i in (0, 2, 4):
        assert out.token_ids[i] == logits[i].argmax()
    probs = compute_probs(logits, build(params, 50, gens=gens))
    for i in (0, 2, 4):  # greedy rows' distribution is the point mass at the argmax
        assert probs[i, logits[i].argmax()] == 1.0 and probs[i].sum() == 1.0


# ---------------------------------------------------------------- filters vs definitions


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """float64 [V]: temperature, then min-p, top-k, top-p by their textbook definitions, in vLLM's
    order (min-p first: top-p's mass is over the tokens min-p kept)."""
    z = logits.double() / p.temperature
    keep = torch.ones_like(z, dtype=torch.bool)

    def renorm(mask):
        q = torch.softmax(z, -1) * mask
        return q / q.sum()

    if p.min_p > 0.0:
        q = renorm(keep)
        keep = keep & (q >= p.min_p * q.max())
    if p.top_k > 0:
        top = torch.zeros_like(keep)
        top[z.topk(min(p.top_k, z.numel())).indices] = True
        keep = keep & top
    if p.top_p < 1.0:
        q = renorm(keep)
        order = q.argsort(descending=True)
        cum = q[order].cumsum(0)
        n = int((cum < p.top_p).sum()) + 1  # smallest prefix whose mass reaches top_p
        keep = torch.zeros_like(keep)
        keep[order[:n]] = True
    return renorm(keep)


def test_min_p_filters_before_top_p() -> None:
    """vLLM's order: min-p keeps [0.5, 0.3] of [0.5, 0.3, 0.1, 0.1] (renormalized 0.625 / 0.375), then
    top-p 0.6 is reached by the first token alone (top-p first would keep two tokens)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    sp = SamplingParams(temperature=1.0, min_p=0.5, top_p=0.6)
    probs = compute_probs(logits, SamplingBatch.build([SamplingRow(sp, [0], [])], 4, "cpu"))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    sp = SamplingParams(temperature=1.0, min_p=0.5, top_p=0.7)  # 0.625 < 0.7: both min-p survivors
    probs = compute_probs(logits, SamplingBatch.build([SamplingRow(sp, [0], [])], 4, "cpu"))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


@pytest.mark.parametrize("case", range(6))
def test_filters_match_definitions(case):
    g = torch.Generator().manual_seed(100 + case)
    batch_size, vocab = 16, 97
    logits = torch.randn(batch_size, vocab, generator=g) * 2.5
    params = []
    for i in range(batch_size):
        u = torch.rand(5, generator=g).tolist()
        params.append(
            SamplingParams(
                temperature=0.3 + 1.7 * u[0],
                top_k=[-1, 0, 1, 5, 20, 200][int(u[1] * 6)],
                top_p=[1.0, 0.9, 0.5, 0.2, 0.05][int(u[2] * 5)] if case % 2 == 0 else 1.0,
                min_p=[0.0, 0.05, 0.3, 1.0][int(u[3] * 4)] if case < 4 else 0.0,
            )
        )
    probs = compute_probs(logits, build(params, vocab))
    assert probs.dtype == torch.float32 and probs.shape == (batch_size, vocab)
    for i, p in enumerate(params):
        ref = reference_probs(logits[i], p)
        assert torch.equal(probs[i] > 0, ref > 0), (i, p)
        torch.testing.assert_close(probs[i].double(), ref, atol=1e-5, rtol=1e-4)


def test_top_p_on_top_k_candidates_equals_full_sort():
    # every top-p row also has a small top-k: top-p runs on torch.topk's candidates, no full sort
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(12, 300, generator=g) * 2
    params = [
        SamplingParams(temperature=0.5 + 0.1 * i, top_k=[3, 40, 150][i % 3], top_p=[0.3, 0.8, 0.95][i % 3])
        for i in range(10)
    ] + [SamplingParams(min_p=0.1), SamplingParams(temperature=0)]
    batch = build(params, 300)
    assert batch.top_p_candidates == 150
    fast = compute_probs(logits, batch)
    batch.top_p_candidates = None  # force the full-sort path
    full = compute_probs(logits, batch)
    torch.testing.assert_close(fast, full)
    for i, p in enumerate(params[:-1]):
        assert torch.equal(fast[i] > 0, reference_probs(logits[i], p) > 0)
    assert build([SamplingParams(top_p=0.9), SamplingParams(top_k=5)], 300).top_p_candidates is None


def test_ties_at_the_cutoff_are_kept_on_every_path():
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0]] * 3)
    params = [SamplingParams(top_k=3), SamplingParams(top_k=3, top_p=0.99), SamplingParams(top_p=0.3)]
    batch = build(params, 6)
    probs = compute_probs(logits, batch)
    assert (probs[0] > 0).tolist() == [True] * 5 + [False]
    assert (probs[1] > 0).tolist() == [True] * 5 + [False]
    # top-p 0.3: the most likely token alone holds 0.55 of the mass
    assert (probs[2] > 0).tolist() == [True] + [False] * 5
    assert batch.top_p_candidates is None  # row 2 has top-p without top-k: full sort
    fast = build(params[:2], 6)
    assert fast.top_p_candidates == 3
    torch.testing.assert_close(compute_probs(logits[:2], fast), probs[:2])


def test_top_p_tiny_keeps_one_token_and_top_k_one_is_argmax():
    torch.manual_seed(2)
    logits = torch.randn(4, 40)
    params = [SamplingParams(top_p=1e-6), SamplingParams(top_k=1)] * 2
    probs = compute_probs(logits, build(params, 40))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal((probs > 0).sum(-1), torch.ones(4, dtype=torch.int64))
    out = Sampler()(logits, build(params, 40))
    assert torch.equal(out.token_ids, logits.argmax(-1))


# ---------------------------------------------------------------- penalties


def reference_penalized(logits, p: SamplingParams, prompt, output):
    x = logits.double().clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def test_penalties_match_reference():
    g = torch.Generator().manual_seed(7)
    vocab = 30
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, repetition_penalty=0.7),
        SamplingParams(temperature=0.0, presence_penalty=1.2),
        SamplingParams(temperature=0.0, frequency_penalty=-0.8),
        SamplingParams(
            temperature=0.0, presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.3
        ),
        SamplingParams(temperature=0.0),
    ]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 8, 0, 3, 12, 4)]
    outputs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 0, 9, 7, 10, 3)]
    logits = torch.randn(len(params), vocab, generator=g) * 3
    batch = build(params, vocab, prompts=prompts, outputs=outputs)
    got = apply_penalties_and_min_tokens(logits, batch)
    for i, p in enumerate(params):
        ref = reference_penalized(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(got[i].double(), ref, atol=1e-5, rtol=1e-5)
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, got.argmax(-1))


def test_extreme_repetition_penalty_keeps_probabilities_defined():
    """A repetition penalty near 0 sends the repeated tokens' positive logits past float32's range:
    they stay the likeliest (finite), and sampling picks among them instead of NaN's token 0."""
    vocab = 12
    logits = torch.full((2, vocab), -1.0)
    logits[:, 5], logits[:, 7] = 2.0, 1.0
    params = [SamplingParams(temperature=t, repetition_penalty=1e-38, seed=3) for t in (1.0, 1e-5)]
    batch = build(params, vocab, prompts=[[5, 7], [5, 7]], gens=[gen(1), gen(2)])
    probs = compute_probs(logits, batch)
    assert torch.isfinite(probs).all()
    assert probs[:, [5, 7]].sum(-1).min() > 0.99
    for _ in range(5):
        assert set(Sampler()(logits, batch).token_ids.tolist()) <= {5, 7}


def test_allowed_token_ids_restrict_greedy_and_sampled_rows():
    """allowed_token_ids: greedy takes the best allowed token, sampling draws only allowed ones in
    proportion to the model's probabilities; other rows in the batch are untouched; logprobs stay
    the model's raw ones."""
    vocab = 10
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 2
    allowed = [1, 4, 7]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed, logprobs=1),
              SamplingParams(temperature=1.0, allowed_token_ids=allowed, seed=5),
              SamplingParams(temperature=0.0)]
    batch = build(params, vocab, gens=[None, gen(5), None])
    assert batch.needs_logits_processing
    out = Sampler()(logits, batch)
    assert out.token_ids[0].item() == max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids[2].item() == logits[2].argmax().item()
    probs = compute_probs(logits, batch)
    want = torch.zeros(vocab)
    want[allowed] = torch.softmax(logits[1, allowed], -1)
    torch.testing.assert_close(probs[1], want)
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0, 0].item() == pytest.approx(raw[out.token_ids[0]].item(), abs=1e-5)
    counts = torch.zeros(vocab)
    for _ in range(300):
        counts[Sampler()(logits, batch).token_ids[1]] += 1
    assert counts[[t for t in range(vocab) if t not in allowed]].sum() == 0
    for bad, err in (([], ValueError), ([1, -2], ValueError), ([True], TypeError), ("1,2", TypeError)):
        with pytest.raises(err, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    assert SamplingParams(allowed_token_ids=(7, 1, 7)).allowed_token_ids == [1, 7]


def test_logit_bias_shifts_greedy_and_sampled_rows():
    """logit_bias: added to the logits before sampling (greedy takes argmax(logits + bias), sampling
    follows softmax((logits + bias) / T)); rows without one are untouched; logprobs stay raw; biases
    past the vocabulary of a smaller draft model are skipped, not an index error."""
    vocab = 10
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, vocab, generator=g) * 2
    bias = {3: 5.0, 7: -100.0, int(logits[0].argmax()): -4.0}
    params = [SamplingParams(temperature=0.0, logit_bias=bias, logprobs=1),
              SamplingParams(temperature=0.7, logit_bias={str(k): v for k, v in bias.items()}, seed=3),
              SamplingParams(temperature=0.0)]
    assert params[1].logit_bias == bias
    batch = build(params, vocab, gens=[None, gen(3), None])
    assert batch.needs_logits_processing and params[0].changes_logits()
    biased = logits.clone()
    for t, b in bias.items():
        biased[:2, t] += b
    out = Sampler()(logits, batch)
    assert out.token_ids[0].item() == biased[0].argmax().item()
    assert out.token_ids[2].item() == logits[2].argmax().item()
    probs = compute_probs(logits, batch)
    torch.testing.assert_close(probs[1], torch.softmax(biased[1] / 0.7, -1))
    assert probs[1, 7].item() < 1e-30  # -100 in effect bans
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0, 0].item() == pytest.approx(raw[out.token_ids[0]].item(), abs=1e-5)
    small = build([SamplingParams(temperature=0.0, logit_bias={12: 100.0, 2: 100.0})], vocab)
    assert small.logit_bias[0].nonzero().flatten().tolist() == [2]
    zero = build([SamplingParams(temperature=0.0, logit_bias={4: 0.0})], vocab)
    assert not zero.logit_bias.any()  # a zero bias changes nothing (its id is still checked by the engine)
    for bad, err, match in (({"x": 1}, ValueError, "token ids"), ({5: 100.5}, ValueError, r"\[-100, 100\]"),
                            ({" 5": 1}, ValueError, "token ids"), ({"+5": 1}, ValueError, "token ids"),
                            ({"1_0": 1}, ValueError, "token ids"), ({"\u0661": 1}, ValueError, "token ids"),
                            ({"5": 1, 5: 2}, ValueError, "twice"), ({"-": 1}, ValueError, "token ids"),
                            ({5: float("nan")}, ValueError, "NaN"), ({-1: 1.0}, ValueError, ">= 0"),
                            ({True: 1.0}, TypeError, "token ids"), ({5: "1"}, TypeError, "number"),
                            ([5], TypeError, "dict")):
        with pytest.raises(err, match=match):
            SamplingParams(logit_bias=bad)


def test_penalties_only_build_what_is_used():
    b = build([SamplingParams(), SamplingParams(temperature=0)], 10, outputs=[[1], [2]])
    assert b.output_counts is None and b.repetition_mask is None and not b.needs_logits_processing
    b = build([SamplingParams(presence_penalty=1.0), SamplingParams()], 10, outputs=[[1, 1], [2]])
    assert b.repetition_mask is None
    assert b.output_counts[0, 1] == 2 and b.output_counts[1].sum() == 0  # row 1 does not pay


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_blocks_eos_and_stop_ids():
    vocab, eos = 12, 11
    logits = torch.zeros(5, vocab)
    logits[:, eos] = 50.0  # EOS would win by far
    logits[:, 3] = 40.0  # a stop token id, second
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),  # 2 outputs: blocked
        SamplingParams(temperature=0.9, min_tokens=3, stop_token_ids=[3], seed=1),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),  # reached: free
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=3),  # EOS blocked, 3 is no stop here
    ]
    outputs = [[0, 0]] * 5
    for _ in range(20):
        gens = [None, gen(torch.randint(0, 10**6, ()).item()), None, None, None]
        out = Sampler()(logits, build(params, vocab, outputs=outputs, gens=gens, eos=eos))
        t = out.token_ids.tolist()
        assert t[0] not in (eos, 3) and t[1] not in (eos, 3)
        assert t[2] == eos
        assert t[3] == eos  # ignore_eos: EOS is not a stop, so min_tokens leaves it alone
        assert t[4] == 3


def test_min_tokens_with_several_eos_ids():
    logits = torch.zeros(1, 8)
    logits[0, 5], logits[0, 6], logits[0, 1] = 9.0, 8.0, 7.0
    out = Sampler()(
        logits,
        build([SamplingParams(temperature=0, min_tokens=1)], 8, eos=[5, 6]),
    )
    assert out.token_ids.item() == 1


# ---------------------------------------------------------------- seeds


def test_seeded_row_is_independent_of_batch_composition():
    torch.manual_seed(3)
    vocab, steps = 64, 12
    target = SamplingParams(temperature=1.1, top_p=0.95, seed=1234)
    logits_seq = [torch.randn(vocab) for _ in range(steps)]

    def run(position: int, others: list[SamplingParams]) -> list[int]:
        g_target = gen(1234)
        g_others = [gen(p.seed) if p.seed is not None else None for p in others]
        tokens = []
        for s in range(steps):
            params = list(others)
            params.insert(position, target)
            gens = list(g_others)
            gens.insert(position, g_target)
            logits = torch.randn(len(params), vocab)
            logits[position] = logits_seq[s]
            out = Sampler()(logits, build(params, vocab, gens=gens))
            tokens.append(out.token_ids[position].item())
        return tokens

    alone = run(0, [])
    others = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=99, top_k=7),
        SamplingParams(temperature=2.0, min_p=0.1),
    ]
    assert run(0, others) == alone
    assert run(2, others) == alone
    assert run(4, others[:2] + others[3:] + [SamplingParams()] * 3) == alone
    # and the seed matters
    other_seed = []
    g = gen(4321)
    for s in range(steps):
        out = Sampler()(logits_seq[s][None], build([target], vocab, gens=[g]))
        other_seed.append(out.token_ids.item())
    assert other_seed != alone


def test_seed_stream_keys_and_keyed_draws_equal_the_samplers():
    """SeedStream.at(pos, salt): the same key gives the same generator state, another position or
    salt another; sample_rows_keyed draws a row exactly as the sampler draws a seeded row with that
    generator (the speculative verification of a seeded request relies on it)."""
    st = SeedStream(1234, DEVICE)
    draw = lambda g: torch.rand(4, generator=g)  # noqa: E731
    assert torch.equal(draw(st.at(5)), draw(SeedStream(1234, DEVICE).at(5)))
    keys = [(5, 0), (6, 0), (5, SeedStream.DRAFT), (5, SeedStream.VERIFY)]
    draws = [draw(st.at(p, s)) for p, s in keys]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1:])
    assert not torch.equal(draw(SeedStream(1235, DEVICE).at(5)), draws[0])
    SeedStream(-3, DEVICE).at(0)  # (seeds as SamplingParams takes them: negative, up to 2**64 - 1)
    SeedStream(2**64 - 1, DEVICE).at(2**40)
    torch.manual_seed(0)
    vocab = 50
    params = SamplingParams(temperature=0.9, top_k=20, seed=7)
    for pos in range(20):
        logits = torch.randn(1, vocab)
        batch = build([params], vocab, gens=[st.at(pos)])
        want = Sampler()(logits, batch).token_ids
        probs = compute_probs(logits, batch)
        assert torch.equal(sample_rows_keyed(probs, [st.at(pos)]), want)


def test_compute_probs_rows_with_same_params_are_identical_and_expand():
    torch.manual_seed(4)
    vocab = 40
    params = [SamplingParams(temperature=0.7, top_k=9, frequency_penalty=0.5, min_tokens=3),
              SamplingParams(temperature=0.0, presence_penalty=1.0)]
    batch = build(params, vocab, outputs=[[1, 2], [3]], eos=0)
    drafts = [[5, 6], [7]]
    expanded = batch.expand([3, 2], drafts)
    explicit = build(
        [params[0]] * 3 + [params[1]] * 2,
        vocab,
        outputs=[[1, 2], [1, 2, 5], [1, 2, 5, 6], [3], [3, 7]],
        eos=0,
    )
    logits = torch.randn(5, vocab)
    torch.testing.assert_close(compute_probs(logits, expanded), compute_probs(logits, explicit))
    # min_tokens=3 blocks EOS (id 0) for the first two positions only
    probs = compute_probs(logits, expanded)
    assert probs[0, 0] == 0 and probs[1, 0] == 0 and probs[2, 0] > 0
    plain = batch.expand([3, 2])
    assert [len(r.output_token_ids) for r in plain.rows] == [2, 2, 2, 1, 1]
    with pytest.raises(ValueError, match="counts"):
        batch.expand([1])


# ---------------------------------------------------------------- distributions

# Each test below compares counts with the expected probabilities by a chi-square test and
# fails when the p-value is below ALPHA: for a correct sampler and a fresh random seed that is a
# false alarm with probability 1e-6. The seeds are fixed, so the tests are deterministic.
ALPHA = 1e-6


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    n = counts.sum().item()
    expected = probs.double() * n
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    stat = (((counts[support].double() - expected[support]) ** 2) / expected[support]).sum().item()
    df = int(support.sum()) - 1
    if df % 2:  # the closed form needs an even df; one more df only makes the test laxer
        df += 1
    p_value = chi2_sf_even_df(stat, df)
    assert p_value > ALPHA, f"chi2={stat:.1f} df={df} p={p_value:.2e}"


def test_unseeded_samples_follow_softmax_over_temperature():
    torch.manual_seed(5)
    vocab, n, temp = 7, 50_000, 0.8
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 1.5])
    out = Sampler()(logits.expand(n, vocab), build([SamplingParams(temperature=temp)] * n, vocab))
    counts = torch.bincount(out.token_ids, minlength=vocab)
    assert_matches(counts, torch.softmax(logits.double() / temp, -1))


def test_seeded_samples_follow_the_filtered_distribution():
    torch.manual_seed(6)
    vocab, n = 9, 20_000
    logits = torch.randn(vocab) * 1.5
    params = SamplingParams(temperature=1.3, top_k=6, min_p=0.05, seed=11)
    g = gen(11)  # one request's generator, drawn from n times in a row
    out = Sampler()(logits.expand(n, vocab), build([params] * n, vocab, gens=[g] * n))
    counts = torch.bincount(out.token_ids, minlength=vocab)
    expected = compute_probs(logits[None], build([params], vocab))[0]
    torch.testing.assert_close(expected.double(), reference_probs(logits, params))
    assert_matches(counts, expected)


def test_chi_square_detects_a_wrong_distribution():
    # the check has power: samples of T=1 are rejected against T=0.8's distribution
    torch.manual_seed(5)
    vocab, n = 7, 50_000
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0, 1.5])
    out = Sampler()(logits.expand(n, vocab), build([SamplingParams()] * n, vocab))
    counts = torch.bincount(out.token_ids, minlength=vocab)
    with pytest.raises(AssertionError, match="chi2"):
        assert_matches(counts, torch.softmax(logits.double() / 0.8, -1))


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_ranks_are_right():
    torch.manual_seed(8)
    vocab = 50
    logits = (torch.randn(5, vocab) * 2).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=2.0),
        SamplingParams(temperature=1.5, logprobs=5, presence_penalty=1.0),
        SamplingParams(temperature=0.5, logprobs=2, top_k=10),
        SamplingParams(temperature=3.0),  # asks none; still gets columns, ignores them
        SamplingParams(temperature=0.0, logprobs=1),
    ]
    batch = build(params, vocab, prompts=[[1, 2]] * 5, outputs=[[3, 4]] * 5)
    out = Sampler()(logits, batch)
    ref = torch.log_softmax(logits.float(), -1)
    assert out.logprobs.shape == (5, 6) and out.logprob_token_ids.shape == (5, 6)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], ref.gather(1, out.token_ids[:, None])[:, 0])
    top = ref.topk(5, -1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    for i in range(5):
        sampled = ref[i, out.token_ids[i]]
        assert out.sampled_ranks[i].item() == int((ref[i] >= sampled).sum())


def test_a_tied_sampled_token_ranks_as_vllm_counts_it():
    """vLLM's rank of the sampled token is the number of tokens at least as likely: a token tied with
    two others at the top ranks 3, one tied with nothing ranks by the tokens above it plus 1."""
    logits = torch.tensor([[5.0, 5.0, 1.0, 5.0, 0.0], [3.0, 2.0, 2.0, 9.0, 0.0]])
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=0.0, logprobs=1)]
    out = Sampler()(logits, build(params, 5))
    assert out.token_ids[1].item() == 3 and out.sampled_ranks.tolist() == [3, 1]


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = torch.randn(3, 20)
    out = Sampler()(logits, build([SamplingParams(logprobs=0)] * 3, 20))
    assert out.logprobs.shape == (3, 1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)


# ---------------------------------------------------------------- shapes


def test_rejects_wrong_logits_shape_and_handles_empty_batch():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.randn(2, 9), build([SamplingParams()] * 2, 10))
    out = Sampler()(torch.randn(0, 10), build([], 10))
    assert out.token_ids.shape == (0,)


@pytest.mark.parametrize("v", [64, 1024, 4144])
def test_argmax_rows_two_pass_equals_argmax(v):
    """The chunked argmax returns argmax's index: random rows, rows with ties (the first occurrence
    wins, also across chunk borders), NaN and -inf rows, and vocabularies no chunk count divides."""
    g = torch.Generator().manual_seed(v)
    rows = [torch.randn(v, generator=g) for _ in range(8)]
    tie = torch.zeros(v)
    tie[[v // 3, v // 2, v - 1]] = 5.0  # first maximum inside one chunk, more in later chunks
    rows.append(tie)
    rows.append(torch.full((v,), 2.0))  # all equal: index 0
    rows.append(torch.full((v,), float("-inf")))
    nan = torch.randn(v, generator=g)
    nan[v // 2] = float("nan")
    rows.append(nan)
    q = torch.randint(0, 4, (v,), generator=g).float()  # many ties everywhere
    rows.append(q)
    x = torch.stack(rows)
    for two_pass in (True, False, None):
        assert torch.equal(argmax_rows(x, two_pass=two_pass), x.argmax(-1)), (two_pass, v)
    assert torch.equal(argmax_rows(x[:, : v - 1], two_pass=True), x[:, : v - 1].argmax(-1))  # odd length: one pass
