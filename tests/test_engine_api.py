"""The engine's API on the real default model: sampling options, n > 1, stops, logprobs, bad inputs."""

import math

import pytest
import torch

from pageflash import LLM, SamplingParams


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
    assert tok is not None


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
    with pytest.raises(ValueError, match=r"250.*max_tokens \(16\)"):
        eng.add_request(None, {"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=16))
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
    assert sorted(done) == sorted(good)
    assert all(len(o.outputs[0].token_ids) == 6 or o.outputs[0].finish_reason == "stop" for o in done.values())
    assert free_all(llm)


def test_generate_validates_whole_batch_first(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert free_all(llm)


def test_abort_frees_blocks(llm):
    eng = llm.llm_engine
    rid = eng.add_request(None, "Write a long essay about rivers.", SamplingParams(max_tokens=100, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv.num_free_blocks < eng.kv.pool.num_blocks
    eng.abort_request(rid)
    assert free_all(llm)
