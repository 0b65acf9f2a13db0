"""The engine's API on the real default model: sampling options, n > 1, stops, logprobs, bad inputs."""

import math

import pytest
import torch

from pageflash import LLM, SamplingParams
from pageflash.sampling_params import PoolingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=256, num_kv_blocks=128, max_num_seqs=16)


def free_all(llm):
    kv = llm.llm_engine.kv
    return kv.num_free_blocks == kv.pool.num_blocks and not llm.llm_engine.has_unfinished_requests()


def test_seeded_sampling_same_alone_and_in_batch(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)
    batch = llm.generate(["Hello there", "Once upon a time", "A list of fruits:"], [other, sp, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["x y z", "Once upon a time"], [other, sp], use_tqdm=False)
    assert again[1].outputs[0].token_ids == alone
    assert free_all(llm)


def test_parallel_sampling_shares_prompt_blocks(llm):
    eng = llm.llm_engine
    sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # partial last block: copy on write
    rid = eng.add_request(None, prompt, sp)
    used = []
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            final = o
        used.append(eng.kv.pool.num_blocks - eng.kv.num_free_blocks)
    assert final.finished and final.request_id == rid
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    n_prompt = len(final.prompt_token_ids)
    assert n_prompt % 16  # the last prompt block is partial and shared: each sibling copies it on write
    # the full prompt blocks are shared by all 4; each sibling owns only the blocks from the partial one on
    shared = n_prompt // 16
    private = math.ceil((n_prompt + 10 - 1) / 16) - shared  # the 10th token's KV is never computed
    assert max(used) == shared + 4 * private
    assert max(used) < 4 * math.ceil(n_prompt / 16)
    assert free_all(llm)


def test_stop_strings_and_stop_tokens(llm):
    tok = llm.get_tokenizer()
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert " 6" in base.text
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[" 6"]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == " 6"
    assert c.text == base.text[: base.text.index(" 6")]
    inc = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[" 6"],
                                                     include_stop_str_in_output=True), use_tqdm=False)[0]
    assert inc.outputs[0].text == base.text[: base.text.index(" 6") + 2]
    stop_id = base.token_ids[2]
    st = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]),
                      use_tqdm=False)[0].outputs[0]
    assert st.finish_reason == "stop" and st.stop_reason == stop_id and st.token_ids[-1] == stop_id
    assert len(st.token_ids) <= 3
    # as vLLM: the stop token's text is left out of the output unless include_stop_str_in_output
    assert st.text == tok.decode(st.token_ids[:-1])
    st_inc = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id],
                                                        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert st_inc.text == tok.decode(st_inc.token_ids) and st_inc.token_ids == st.token_ids


def test_stop_strings_wait_for_min_tokens(llm):
    """vLLM's rule: a stop string is looked for only once more than min_tokens tokens are out."""
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    first = base.text.index(" 5")  # the first number generated
    assert first < 2
    sp = SamplingParams(temperature=0, max_tokens=12, stop=[","], min_tokens=4, ignore_eos=True)
    out = llm.generate("1, 2, 3, 4,", sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) > 4
    assert out.token_ids == base.token_ids[: len(out.token_ids)]
    early = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[","]),
                         use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) < len(out.token_ids)


def test_eos_text_left_out_unless_asked(llm):
    msgs = [{"role": "user", "content": "Say hi."}]
    sp = SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False)
    c = llm.chat(msgs, sp, use_tqdm=False)[0].outputs[0]
    eos = llm.get_tokenizer().eos_token
    assert c.finish_reason == "stop" and c.stop_reason is None and not c.text.endswith(eos)
    sp_inc = SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False, include_stop_str_in_output=True)
    assert llm.chat(msgs, sp_inc, use_tqdm=False)[0].outputs[0].text == c.text + eos


def test_eos_min_tokens_and_length(llm):
    tok = llm.get_tokenizer()
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200),
                    use_tqdm=False)[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == tok.eos_token_id
    n = len(chat.token_ids)
    longer = llm.chat([{"role": "user", "content": "Say hi."}],
                      SamplingParams(temperature=0, max_tokens=200, min_tokens=n + 3), use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 3
    assert tok.eos_token_id not in longer.token_ids[: n + 3]
    short = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 5
    # max_tokens=None: until the context is full
    ids = list(range(100, 340))
    full = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                        use_tqdm=False)[0]
    assert len(ids) + len(full.outputs[0].token_ids) == 256
    assert full.outputs[0].finish_reason == "length"


def test_logprobs(llm):
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = llm.generate("The sun rises in the", sp, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy: the sampled token is the top one
        assert len(entry) == 3
        ranks = sorted(e.rank for e in entry.values())
        assert ranks == [1, 2, 3]
        assert all(e.logprob <= 0 for e in entry.values())
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # the logprob equals log_softmax of the model's logits at that position
    eng = llm.llm_engine
    ids = llm.get_tokenizer().encode("The sun rises in the")
    ref = _next_logprobs(llm, ids)
    assert out.logprobs[0][out.token_ids[0]].logprob == pytest.approx(ref[out.token_ids[0]].item(), abs=1e-4)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


def _next_logprobs(llm, ids):
    eng = llm.llm_engine
    rid = eng.add_request(None, {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=20))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid:
                out = o
    entry = out.outputs[0].logprobs[0]
    v = torch.full((eng.vocab_size,), -math.inf)
    for t, lp in entry.items():
        v[t] = lp.logprob
    return v

def test_text_offsets_follow_the_detokenized_text(llm):
    """CompletionOutput.text_offsets (with logprobs): where each token's text starts in the output
    text; past a stop string's cut, the cut."""
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    out = llm.generate("The capital of France is", sp, use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    assert len(out.text_offsets) == len(ids)
    want = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]
    assert out.text_offsets == want
    cut = len(out.text) // 2
    stop = out.text[cut : cut + 2]
    cut = out.text.find(stop)
    stopped = llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.text == out.text[:cut]
    n = len(stopped.token_ids)
    assert stopped.text_offsets == [min(o, cut) for o in want[:n]]
    assert llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].text_offsets is None



@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_others_keep_going(llm):
    eng = llm.llm_engine
    good = [eng.add_request(None, "Tell me a story", SamplingParams(temperature=0, max_tokens=6)) for _ in range(2)]
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(None, "", SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(None, {"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(None, {"prompt_token_ids": [5] * 300}, SamplingParams())
    # prompt + max_tokens past the context: as vLLM's engine, the output stops at the context ("length");
    # the server refuses such a request (a 400, tests/test_server.py), as vLLM's does
    long = eng.add_request(None, {"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=16, ignore_eos=True))
    with pytest.raises(ValueError, match=r"250.*max_tokens \(16\)"):
        eng.validate_request([5] * 250, SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request(None, {"prompt_token_ids": [10**7]}, SamplingParams())
    with pytest.raises(TypeError):
        eng.add_request(None, 12.5, SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(good[0], "dup", SamplingParams())
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    o = done.pop(long)
    assert len(o.outputs[0].token_ids) == 6 and o.outputs[0].finish_reason == "length"
    assert sorted(done) == sorted(good)
    assert all(len(o.outputs[0].token_ids) == 6 or o.outputs[0].finish_reason == "stop" for o in done.values())
    assert free_all(llm)


def test_prompt_types(llm):
    """Token ids as numpy arrays / torch tensors / numpy ints are taken; a wrong type names itself."""
    np = pytest.importorskip("numpy")
    sp = SamplingParams(temperature=0, max_tokens=3)
    ids = llm.get_tokenizer().encode("The capital of France is")
    ref = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].outputs[0].token_ids
    for p in (np.array(ids), torch.tensor(ids), [np.int64(i) for i in ids], {"prompt_token_ids": np.array(ids)}):
        assert llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert [o.outputs[0].token_ids for o in llm.generate(np.array([ids, ids]), sp, use_tqdm=False)] == [ref, ref]
    for bad, what in ((None, "NoneType"), (5, "int"), (b"hi", "bytes")):
        with pytest.raises(TypeError, match=what):
            llm.generate(bad, sp, use_tqdm=False)
    with pytest.raises(TypeError, match="list of ints"):
        llm.generate({"prompt_token_ids": [1.0, 2.0]}, sp, use_tqdm=False)
    with pytest.raises(TypeError, match="list of ints"):
        llm.generate({"prompt_token_ids": [True, 2]}, sp, use_tqdm=False)
    with pytest.raises(TypeError, match="'prompt' must be a str"):
        llm.generate({"prompt": 7, "prompt_token_ids": ids}, sp, use_tqdm=False)
    out = llm.generate({"prompt": "The capital of France is", "prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert out.prompt == "The capital of France is" and out.outputs[0].token_ids == ref
    assert free_all(llm)


def test_chat_content_parts_and_none(llm):
    sp = SamplingParams(temperature=0, max_tokens=4)
    # text parts are joined one a line, as vLLM joins them (and the server)
    plain = [{"role": "user", "content": "H\ni"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "Yes?"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]},
             {"role": "assistant", "content": None}, {"role": "user", "content": "Yes?"}]
    a, b = (llm.chat(m, sp, use_tqdm=False)[0] for m in (plain, parts))
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], sp, use_tqdm=False)
    with pytest.raises(TypeError, match="content"):
        llm.chat([{"role": "user", "content": 5}], sp, use_tqdm=False)


def test_chat_bad_input_is_a_value_or_type_error_naming_it(llm):
    """What a template or the tokenizer would fail on with their own exceptions (jinja2's, a
    tokenizers TypeError) is a ValueError / TypeError naming the argument, and nothing is queued."""
    sp = SamplingParams(temperature=0, max_tokens=2)
    hi = [{"role": "user", "content": "Hi"}]
    for bad, exc, words in (
        (dict(messages=[{"role": None, "content": "x"}]), ValueError, "role"),
        (dict(messages=[{"role": 5, "content": "x"}]), ValueError, "role"),
        (dict(messages=hi, chat_template="{% if %}"), ValueError, "chat_template"),
        (dict(messages=hi, chat_template="{{ raise_exception('roles must alternate') }}"), ValueError,
         "messages.*roles must alternate"),
        (dict(messages=hi, chat_template="{{ messages[5].content }}"), ValueError, "messages"),
        (dict(messages=hi, chat_template=5), TypeError, "chat_template"),
        (dict(messages=hi, tools=5), TypeError, "tools"),
        (dict(messages=hi, tools=["f"]), TypeError, "tools"),
        (dict(messages=hi, chat_template_kwargs=5), TypeError, "chat_template_kwargs"),
        (dict(messages=hi, chat_template_kwargs={"tokenize": True}), ValueError, "chat_template_kwargs.*tokenize"),
        (dict(messages=[{"role": "user", "content": "a \ud800 b"}]), ValueError, "messages.*not valid Unicode"),
    ):
        with pytest.raises(exc, match=words):
            llm.chat(bad.pop("messages"), sp, use_tqdm=False, **bad)
    with pytest.raises(ValueError, match="prompt 1: prompt is not valid Unicode.*ud800"):
        llm.generate(["fine", "bad \ud800"], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="2 pooling_params for 1 prompts"):
        llm.embed("one", [PoolingParams(), PoolingParams()], use_tqdm=False)
    assert free_all(llm)
    assert llm.chat(hi, sp, use_tqdm=False)[0].outputs[0].token_ids  # and the engine goes on


def test_seed_minus_one_is_no_seed(llm):
    """seed=-1 is vLLM's "no seed": normalized to None, so two calls draw differently (a fixed seed
    repeats itself)."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    sp = SamplingParams(temperature=1.0, seed=-1, max_tokens=12, ignore_eos=True)
    runs = {tuple(llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(runs) > 1
    fixed = SamplingParams(temperature=1.0, seed=-2, max_tokens=12, ignore_eos=True)
    assert len({tuple(llm.generate("Once upon a time", fixed, use_tqdm=False)[0].outputs[0].token_ids)
                for _ in range(2)}) == 1
    assert free_all(llm)


def test_logprobs_minus_one_is_the_whole_vocabulary():
    """logprobs / prompt_logprobs -1: every token's logprob (vLLM's), allowed when max_logprobs is -1,
    else an error naming the cap; the entries are log_softmax over the vocabulary."""
    llm = LLM(max_model_len=64, num_kv_blocks=16, max_logprobs=-1)
    v = llm.llm_engine.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1, ignore_eos=True)
    out = llm.generate("The sun rises in the", sp, use_tqdm=False)[0]
    assert sp.logprobs == -1  # the caller's params are left as they were
    entry = out.outputs[0].logprobs[0]
    assert len(entry) == v and sorted(e.rank for e in entry.values()) == list(range(1, v + 1))
    total = torch.tensor([e.logprob for e in entry.values()]).double().exp().sum().item()
    assert total == pytest.approx(1.0, abs=1e-3)
    assert all(len(p) >= v for p in out.prompt_logprobs[1:])  # (the prompt's own token too, if not in top v)
    capped = LLM(max_model_len=64, num_kv_blocks=16)  # max_logprobs 20
    with pytest.raises(ValueError, match="max_logprobs"):
        capped.generate("x", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)


def test_seed_wraps_for_n_copies(llm):
    # child j of a seeded request draws from seed + j: at the top of the range that wraps, not crashes
    out = llm.generate("Hi", SamplingParams(temperature=1.0, max_tokens=3, n=2, seed=2**64 - 1), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]
    assert free_all(llm)


def test_engine_seed_makes_unseeded_sampling_reproducible():
    """LLM(seed=...) seeds the generators that unseeded random requests draw from (as vLLM's workers
    do): the same script run twice gives the same tokens."""
    sp = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    prompts = ["Once upon a time", "My favourite food is"]

    def run(seed):
        torch.rand(3)  # whatever the caller did with torch's RNG before: the engine starts from its seed
        llm = LLM(max_model_len=64, num_kv_blocks=16, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    assert run(3) == run(3)
    assert run(3) != run(4)
    with pytest.raises(ValueError, match="seed"):
        LLM(max_model_len=64, num_kv_blocks=16, seed=2**64)


def test_truncate_prompt_tokens(llm):
    text = "The quick brown fox jumps over the lazy dog"
    ids = llm.get_tokenizer().encode(text)
    got = llm.generate(text, SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3), use_tqdm=False)[0]
    want = llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert got.prompt_token_ids == ids[-3:] and got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    # vLLM's -1: the last max_model_len tokens (offline, generation then stops at the context at once)
    long = ids * (llm.llm_engine.max_model_len // len(ids) + 2)
    with pytest.raises(ValueError, match="max_model_len"):  # a full context leaves no room to generate
        llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1),
                     use_tqdm=False)  # fmt: skip
    assert SamplingParams(truncate_prompt_tokens=-1).truncate_prompt(long, 5) == long[-5:]
    assert free_all(llm)


def test_generate_validates_whole_batch_first(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(TypeError, match=r"got a dict: pass SamplingParams\(\*\*your_dict\)"):
        llm.generate("fine", {"max_tokens": 2}, use_tqdm=False)
    assert free_all(llm)


def test_abort_frees_blocks(llm):
    eng = llm.llm_engine
    rid = eng.add_request(None, "Write a long essay about rivers.", SamplingParams(max_tokens=100, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv.num_free_blocks < eng.kv.pool.num_blocks
    eng.abort_request(rid)
    assert free_all(llm)


def test_chat_continue_final_message_tools_and_template_kwargs(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite color is"}]
    sp = SamplingParams(temperature=0, max_tokens=5)
    out = llm.chat(conv, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("My favourite color is")
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot both be True"):
        llm.chat(conv, sp, continue_final_message=True)
    with pytest.raises(ValueError, match="assistant message"):
        llm.chat(conv[:1], sp, add_generation_prompt=False, continue_final_message=True)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ sep }}{{ tools | length }}"
    out = llm.chat(conv[:1], sp, use_tqdm=False, chat_template=template, chat_template_kwargs={"sep": " |"},
                   tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])[0]
    assert out.prompt_token_ids == tok.encode("Name a color. |1", add_special_tokens=False)


def test_vllm_call_shapes(llm):
    """vLLM's call shapes: logprobs=True (one top logprob), output_kind (offline: the final output
    whatever it says), a callable use_tqdm, priority 0s, LLM.chat's arguments in vLLM's order with
    chat_template_content_format, and vLLM's output attributes; stop_token_ids outside the vocabulary
    and a truncate_prompt_tokens above max_model_len are errors naming them."""
    from pageflash.sampling_params import RequestOutputKind

    assert SamplingParams(logprobs=True).logprobs == 1 and SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    for bad in (5, "delta", True, [1]):
        with pytest.raises(ValueError, match="output_kind"):
            SamplingParams(output_kind=bad)
    sp = SamplingParams(temperature=0, max_tokens=4)
    ref = llm.generate("The capital of France is", sp, use_tqdm=False)[0]
    made = []

    def bar(**kw):
        import tqdm

        made.append(kw)
        return tqdm.tqdm(disable=True, **kw)

    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, output_kind=1),
                       use_tqdm=bar, priority=[0])[0]
    assert made and made[0]["total"] == 1
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.finished
    assert out.lora_request is None and out.outputs[0].lora_request is None
    assert out.encoder_prompt is None and out.encoder_prompt_token_ids is None and out.kv_transfer_params is None
    with pytest.raises(ValueError, match="priority"):
        llm.generate("hi", sp, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], sp, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="stop_token_ids contains 1000000"):
        llm.generate("hi", SamplingParams(max_tokens=2, stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(100000\) is greater than max_model_len"):
        llm.generate("hi", SamplingParams(max_tokens=2, truncate_prompt_tokens=100000), use_tqdm=False)
    conv = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    loop_parts = "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
    as_text = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    # positional, in vLLM's order: messages, sampling_params, use_tqdm, lora_request, chat_template,
    # chat_template_content_format, add_generation_prompt
    a = llm.chat(conv, sp, False, None, loop_parts, "openai", True)[0]
    b = llm.chat(conv, sp, False, None, as_text, "string", True)[0]
    assert a.prompt == "[H][i]" and b.prompt == "[H\ni]"
    assert llm.chat(conv, sp, False, None, as_text)[0].prompt == b.prompt  # "auto": the text
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(conv, sp, False, None, None, "parts")
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat(conv, sp, use_tqdm=False, mm_processor_kwargs={"num_crops": 4})
    assert free_all(llm)
