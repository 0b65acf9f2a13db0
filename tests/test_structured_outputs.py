"""Structured outputs (JSON schema, regex, choice, grammar) on the real default model: the parameters,
the sampler's mask, and the engine against a plain constrained-greedy reference over HF transformers."""

import json
import re

import numpy as np
import pytest
import torch

from pageflash import LLM, SamplingParams, StructuredOutputsParams
from pageflash.engine.sampler import Sampler, SamplingBatch, SamplingRow, unpack_bitmask
from pageflash.engine.structured import allowed_tokens

from hf_ref import hf_greedy_processed, hf_model_from_gguf

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, num_kv_blocks=160, max_num_seqs=16, dtype="float32")


def chat(llm, text):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def free_all(llm):
    kv = llm.llm_engine.kv
    return kv.num_free_blocks == kv.pool.num_blocks and not llm.llm_engine.has_unfinished_requests()


# ---------------------------------------------------------------------------------- parameters
@pytest.mark.parametrize("kwargs,err,match", [
    ({}, ValueError, "exactly one"),
    ({"json": PERSON, "regex": "a"}, ValueError, "exactly one"),
    ({"json": 5}, TypeError, "JSON schema"),
    ({"regex": ""}, TypeError, "regex"),
    ({"choice": []}, TypeError, "non-empty list"),
    ({"choice": ["a", 3]}, TypeError, "choice"),
    ({"grammar": 7}, TypeError, "grammar"),
    ({"json_object": "yes"}, TypeError, "json_object"),
])
def test_bad_structured_outputs_params(kwargs, err, match):
    with pytest.raises(err, match=match):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_from_a_dict():
    p = SamplingParams(structured_outputs={"choice": ("a", "b")})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.choice == ["a", "b"]
    assert p.structured_outputs.kind == "choice" and p.changes_logits()
    with pytest.raises(ValueError, match="regexp"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")


# ---------------------------------------------------------------------------------- sampler mask
def test_unpack_bitmask_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 1000):
        words = torch.randint(-(2**31), 2**31, (3, (vocab + 31) // 32 + 1), generator=g, dtype=torch.int64)
        words = words.to(torch.int32)
        got = unpack_bitmask(words, vocab)
        for i in range(3):
            assert torch.equal(got[i], torch.from_numpy(allowed_tokens(words[i].numpy(), vocab)))


def _bits(allowed: list[int], vocab: int) -> np.ndarray:
    bits = np.zeros((vocab + 31) // 32 * 32, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_sampler_draws_only_what_the_grammar_allows():
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    allowed = [[3, 7, 11], [0], list(range(40, 50)), None]
    rows = [SamplingRow(SamplingParams(temperature=t), [1], [], None, _bits(a, vocab) if a else None)
            for a, t in zip(allowed, (0.0, 1.0, 1.0, 0.0))]
    batch = SamplingBatch.build(rows, vocab, "cpu")
    for seed in range(20):
        out = Sampler()(logits, batch, torch.Generator().manual_seed(seed)).token_ids.tolist()
        assert out[0] == max(allowed[0], key=lambda t: logits[0, t].item())  # greedy: best allowed
        assert out[1] == 0 and out[2] in allowed[2]
        assert out[3] == logits[3].argmax().item()  # a row without a grammar is untouched


def test_min_tokens_yields_to_a_complete_grammar():
    """A grammar that allows only EOS next (its text is complete) is not also denied EOS by min_tokens:
    that would leave no token at all."""
    vocab, eos = 20, 2
    p = SamplingParams(temperature=0.0, min_tokens=5)
    only_eos = SamplingRow(p, [1], [4], None, _bits([eos], vocab))
    more = SamplingRow(p, [1], [4], None, _bits([eos, 9], vocab))
    batch = SamplingBatch.build([only_eos, more], vocab, "cpu", eos_token_ids=[eos])
    logits = torch.zeros(2, vocab)
    logits[:, eos] = 5.0
    assert Sampler()(logits, batch).token_ids.tolist() == [eos, 9]


# ---------------------------------------------------------------------------------- engine
@torch.no_grad()
def hf_constrained_greedy(model, structured, prompt_ids, so, max_new_tokens, eos_ids):
    """The reference: HF forward, every disallowed logit -inf, argmax, feed the matcher; until EOS,
    the matcher stops, or max_new_tokens."""
    m = structured.matcher(so)
    ids = list(prompt_ids)
    out = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        mask = torch.from_numpy(allowed_tokens(structured.bitmasks([m])[0], logits.shape[0]))
        tok = int(logits.masked_fill(~mask, float("-inf")).argmax())
        out.append(tok)
        ids.append(tok)
        assert m.consume_token(tok)
        if tok in eos_ids or m.is_stopped():
            break
    return out


def test_greedy_structured_outputs_equal_the_hf_reference(llm):
    eng = llm.llm_engine
    cases = [
        ("Give me a person as JSON with a name and an age.", StructuredOutputsParams(json=PERSON)),
        ("Is the review 'awful, broke in a day' positive or negative?",
         StructuredOutputsParams(choice=["positive", "negative", "neutral"])),
        ("Write a US phone number.", StructuredOutputsParams(regex=r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")),
        ("Say yes or no.", StructuredOutputsParams(grammar='start: ("yes" | "no") " because " /[a-z ]{1,20}/ "."')),
    ]
    prompts = [chat(llm, q) for q, _ in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so) for _, so in cases]
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model_from_gguf()
    for (q, so), p, o in zip(cases, prompts, outs):
        ref = hf_constrained_greedy(hf, eng.structured_outputs(), o.prompt_token_ids, so, 40, eng.eos_token_ids)
        assert o.outputs[0].token_ids == ref, (q, o.outputs[0].text)
    person = json.loads(outs[0].outputs[0].text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert outs[1].outputs[0].text in ("positive", "negative", "neutral")
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", outs[2].outputs[0].text)
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,20}\.", outs[3].outputs[0].text)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert free_all(llm)


def test_constrained_and_free_requests_share_a_batch(llm):
    """Sampled, n > 1, seeded: each output holds its constraint, the free request is what it is alone,
    and a seeded constrained request gives the same text alone and in the batch."""
    so = StructuredOutputsParams(json_object=True)
    free = SamplingParams(temperature=0.0, max_tokens=20)
    guided = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=60, structured_outputs=so)
    choice = SamplingParams(temperature=1.0, seed=3, max_tokens=8, structured_outputs={"choice": ["cat", "dog"]})
    prompts = [chat(llm, "Hello!"), chat(llm, "Describe a cat as JSON."), chat(llm, "Cat or dog?")]
    together = llm.generate(prompts, [free, guided, choice], use_tqdm=False)
    alone_free = llm.generate(prompts[0], free, use_tqdm=False)[0]
    alone_guided = llm.generate(prompts[1], guided, use_tqdm=False)[0]
    assert together[0].outputs[0].token_ids == alone_free.outputs[0].token_ids
    assert [c.text for c in together[1].outputs] == [c.text for c in alone_guided.outputs]
    for c in together[1].outputs:
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    assert together[2].outputs[0].text in ("cat", "dog")
    assert free_all(llm)


def test_invalid_constraints_are_refused_and_the_engine_goes_on(llm):
    eng = llm.llm_engine
    for so, match in [({"regex": "[a-z"}, "regex"), ({"grammar": "start: undefined_rule"}, "grammar"),
                      ({"json": "{oops"}, "json"), ({"json": {"type": "no-such-type"}}, "json")]:
        with pytest.raises(ValueError, match=match):
            eng.add_request(None, "hi", SamplingParams(structured_outputs=so))
    assert free_all(llm)
    out = llm.generate(chat(llm, "Pick one."), SamplingParams(temperature=0, max_tokens=5,
                                                              structured_outputs={"choice": ["a", "b"]}),
                       use_tqdm=False)[0]
    assert out.outputs[0].text in ("a", "b")


def test_async_scheduling_speculation_and_preemption_keep_the_constraint():
    """The same greedy constrained outputs with async scheduling, with n-gram speculation running for
    the free requests beside them, and with a KV pool small enough to preempt."""
    base = dict(max_model_len=256, max_num_seqs=8, dtype="float32")
    so = StructuredOutputsParams(json=PERSON)
    qs = ["A person as JSON, please.", "Invent a person. JSON only.", "Repeat: a b c a b c a b c a b c"]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json_object": True}),
              SamplingParams(temperature=0, max_tokens=40)]

    def run(preempts=False, **kw):
        llm = LLM(**{**base, **kw})
        outs = llm.generate([chat(llm, q) for q in qs], params, use_tqdm=False)
        assert free_all(llm)
        assert (llm.llm_engine.scheduler.num_preemptions > 0) == preempts
        return [o.outputs[0].token_ids for o in outs]

    ref = run(num_kv_blocks=160, async_scheduling=False)
    assert run(num_kv_blocks=160, async_scheduling=True) == ref
    assert run(num_kv_blocks=160, speculative_config={"method": "ngram", "num_speculative_tokens": 4}) == ref
    # 32 blocks of 4 tokens hold one sequence of max_model_len, not the three together; prompts are chunked
    assert run(preempts=True, max_model_len=128, num_kv_blocks=32, block_size=4, max_num_batched_tokens=32) == ref


def test_missing_llguidance_or_tokenizer_is_a_clear_error(monkeypatch):
    import sys

    from pageflash.engine.structured import StructuredOutputs, grammar_threads

    with pytest.raises(ValueError, match="tokenizer"):
        StructuredOutputs(None, 100, [2])
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails
    with pytest.raises(ValueError, match="pip install llguidance"):
        StructuredOutputs(None, 100, [2])
    monkeypatch.setenv("PAGEFLASH_GRAMMAR_THREADS", "3")
    assert grammar_threads() == 3
    for bad in ("0", "many"):
        monkeypatch.setenv("PAGEFLASH_GRAMMAR_THREADS", bad)
        with pytest.raises(ValueError, match="PAGEFLASH_GRAMMAR_THREADS"):
            grammar_threads()
    monkeypatch.delenv("PAGEFLASH_GRAMMAR_THREADS")
    assert 1 <= grammar_threads() <= 4


# ---------------------------------------------------------------------------------- bad_words
def got_prompt_ids(llm, prompt):
    return llm.get_tokenizer().encode(prompt)


def test_bad_word_masks_follow_the_outputs():
    vocab = 20
    p = SamplingParams(temperature=0.0, bad_words=["x"])  # the words themselves are tokenized by the engine
    rows = [SamplingRow(p, [1], [5, 6], None, bad_words=((3,), (6, 7), (5, 9, 8), (4, 2)))]
    batch = SamplingBatch.build(rows, vocab, "cpu")
    # 3 always; 7 follows 6 (the last output); 8 would need outputs ending 5, 9; 2 would need 4
    assert batch.banned_mask[0].nonzero().flatten().tolist() == [3, 7]


def hf_greedy_without(model, prompt_ids, seqs, max_new_tokens, eos_ids):
    """The reference: HF greedy after masking each bad sequence's last token where the output ends
    with the rest of it."""
    def mask(logits, out):
        for seq in seqs:
            if len(seq) == 1 or (len(out) >= len(seq) - 1 and tuple(out[len(out) - len(seq) + 1:]) == seq[:-1]):
                logits[seq[-1]] = float("-inf")

    return hf_greedy_processed(model, prompt_ids, mask, max_new_tokens, eos_ids)


def test_bad_words_never_come_out(llm):
    """Greedy with bad_words equals an HF greedy reference masked by the same rule, the words' token
    sequences do not occur, and n-gram speculation gives the same output."""
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    prompt = chat(llm, "Write a sentence about the sky and the sea.")
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    words = free.text.split()[:3]  # words greedy decoding does produce
    sp = SamplingParams(temperature=0, max_tokens=30, bad_words=words)
    got = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
    seqs = eng.bad_word_ids(words)
    out = got.token_ids
    for seq in seqs:  # no bad word's token sequence occurs in the output
        assert not any(tuple(out[i:i + len(seq)]) == seq for i in range(len(out) - len(seq) + 1)), (seq, got.text)
    assert got.token_ids != free.token_ids
    ref = hf_greedy_without(hf_model_from_gguf(), got_prompt_ids(llm, prompt), seqs, 30, eng.eos_token_ids)
    assert out == ref
    spec = LLM(max_model_len=256, num_kv_blocks=160, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert spec.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == out
    with pytest.raises(ValueError, match="non-blank"):
        SamplingParams(bad_words=[" "])
    assert free_all(llm)


# ---------------------------------------------------------------------------------- from an audit
def test_a_batch_compiles_a_constraint_once_and_bad_ones_leave_nothing_queued(llm):
    eng = llm.llm_engine
    so = StructuredOutputsParams(choice=[f"item{i}" for i in range(3000)])  # past llguidance's 2000 items a row
    sp = SamplingParams(temperature=0, max_tokens=8, structured_outputs=so)
    compiled = []
    orig = eng.structured_outputs()._new_matcher
    eng.structured_outputs()._new_matcher = lambda g: compiled.append(1) or orig(g)
    try:
        outs = llm.generate([chat(llm, "Pick an item."), chat(llm, "Another item.")], sp, use_tqdm=False)
    finally:
        del eng.structured_outputs()._new_matcher
    assert len(compiled) == 1  # one compile, then copies
    assert all(re.fullmatch(r"item\d+", o.outputs[0].text) and int(o.outputs[0].text[4:]) < 3000 for o in outs)
    bad = SamplingParams(structured_outputs={"regex": "[a-"})
    with pytest.raises(ValueError, match="prompt 2: structured_outputs regex"):
        llm.generate(["Hello", "World", "x"], [sp, sp, bad], use_tqdm=False)
    assert free_all(llm) and not eng.groups


def test_a_mask_that_leaves_no_token_aborts_without_a_token(llm):
    """allowed_token_ids outside the grammar: the request ends (abort) with no token that breaks it,
    and the requests beside it go on."""
    tok = llm.get_tokenizer()
    so = StructuredOutputsParams(choice=["yes", "no"])
    other = tok.encode(" maybe", add_special_tokens=False)
    outs = llm.generate([chat(llm, "Yes or no?"), chat(llm, "Hi")],
                        [SamplingParams(temperature=0, max_tokens=4, structured_outputs=so, allowed_token_ids=other),
                         SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)  # fmt: skip
    assert outs[0].outputs[0].finish_reason == "abort" and outs[0].outputs[0].token_ids == []
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4
    assert free_all(llm)


def test_the_cache_keeps_property_order_apart(llm):
    """Two schemas that differ only in property order are two constraints (the output follows the
    order): the cache must not hand one the other's matcher."""
    so = llm.llm_engine.structured_outputs()
    tok = llm.get_tokenizer()
    props_ab = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    s1 = {"type": "object", "properties": props_ab, "required": ["a", "b"], "additionalProperties": False}
    s2 = {**s1, "properties": dict(reversed(list(props_ab.items())))}
    so.matcher(StructuredOutputsParams(json=s1))
    m = so.matcher(StructuredOutputsParams(json=s2))
    assert m.consume_tokens(tok.encode('{"b": 1, "a": 2}', add_special_tokens=False))


def test_objects_take_only_their_properties_unless_asked(llm):
    """As vLLM's default (xgrammar) backend: an object schema that lists properties and says nothing
    of additionalProperties takes no others; disable_additional_properties=False keeps JSON Schema's
    rule. Nested objects too; an object without "properties" stays open."""
    so = llm.llm_engine.structured_outputs()
    tok = llm.get_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "o": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "free": {"type": "object"}}}

    def takes(text, **kw):
        m = so.matcher(StructuredOutputsParams(json=schema, **kw))
        return m.consume_tokens(tok.encode(text, add_special_tokens=False))

    assert takes('{"a": 1, "o": {"b": 2}, "free": {"x": 3}}')
    assert not takes('{"a": 1, "z": 2}') and not takes('{"o": {"b": 2, "z": 3}}')
    assert takes('{"a": 1, "z": 2}', disable_additional_properties=False)
