"""What scripts written for vLLM expect of the offline API and the command lines: the model folder's
generation_config.json (EOS ids, default sampling parameters), vLLM's LLM() / SamplingParams / serve
options that change nothing here, an offline request longer than the context stopping there, tool-call
turns without content in LLM.chat, and clear errors for what is not supported (multimodal data, a LoRA
request to an engine without enable_lora, per-request logits processors)."""

from __future__ import annotations

import json

import pytest

from hf_ref import make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.llm import VLLM_COMPAT_OPTIONS
from test_engine_hf import CONFIGS


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, num_kv_blocks=64, max_num_seqs=8, trust_remote_code=True, tokenizer_mode="auto",
               disable_log_stats=True, enable_chunked_prefill=True, swap_space=4, max_logprobs=20)


def free(llm) -> bool:
    kv = llm.llm_engine.kv
    return kv.num_free_blocks == kv.pool.num_blocks and not llm.llm_engine.has_unfinished_requests()


def test_generation_config_gives_eos_and_default_sampling(tmp_path):
    """generation_config.json's eos_token_id stops generation (Gemma 2's <end_of_turn> lives only
    there); its temperature / top_k... are the defaults of requests that set
    none, offline and in the server; generation_config="vllm" ignores the file."""
    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    plain = LLM(folder, max_model_len=64, num_kv_blocks=32, dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=12)
    ids = [3, 1, 4, 1, 5]
    out = plain.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = out[4]
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7777, stop_id], "temperature": 0.6, "top_k": 20, "do_sample": True}))
    llm = LLM(folder, max_model_len=64, num_kv_blocks=32, dtype="float32")
    eng = llm.llm_engine
    assert stop_id in eng.eos_token_ids and eng.default_sampling == {"temperature": 0.6, "top_k": 20}
    o = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0]
    assert o.token_ids == out[:out.index(stop_id) + 1] and o.finish_reason == "stop"
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p) == (0.6, 20, 1.0)
    ignored = LLM(folder, max_model_len=64, num_kv_blocks=32, dtype="float32", generation_config="vllm")
    assert stop_id not in ignored.llm_engine.eos_token_ids and ignored.get_default_sampling_params().temperature == 1.0
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        LLM(folder, max_model_len=64, num_kv_blocks=32)


def test_server_requests_take_the_model_defaults(tmp_path):
    from pageflash.server.app import OpenAIServing

    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.8}))
    llm = LLM(folder, max_model_len=64, num_kv_blocks=32, dtype="float32")

    class Eng:  # what OpenAIServing.sampling_params reads: engine.engine.default_sampling
        engine = llm.llm_engine

    serving = OpenAIServing.__new__(OpenAIServing)
    serving.engine = Eng
    p = serving.sampling_params({"max_tokens": 5, "top_p": 0.5})
    assert (p.temperature, p.top_p, p.max_tokens) == (0.3, 0.5, 5)


def test_offline_request_past_the_context_stops_there(llm):
    """As vLLM's LLM: prompt + max_tokens beyond max_model_len generates up to the context, finish
    "length" (the server refuses such a request with a 400, tests/test_server.py)."""
    o = llm.generate({"prompt_token_ids": [504] * 120}, SamplingParams(ignore_eos=True, temperature=0),
                     use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == 8 and o.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [504] * 128}, SamplingParams(), use_tqdm=False)
    assert free(llm)


def test_chat_tool_call_turn_without_content(llm):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    o = llm.chat(msgs, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False, lora_request=None)
    assert len(o[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="'role' and 'content'"):
        llm.chat([{"role": "user"}], use_tqdm=False)
    # the arguments reach the template as an object, also where pydantic (the server's extra) is missing
    import subprocess
    import sys

    code = ("import sys; sys.modules['pydantic'] = None; from pageflash.llm import _template_message; "
            f"print(_template_message({msgs[1]!r})['tool_calls'][0]['function']['arguments'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "{'city': 'Paris'}", out.stderr


def test_sampling_params_options():
    sp = SamplingParams(temperature=0.5, extra_args={"k": [1]}, spaces_between_special_tokens=False)
    c = sp.clone()
    assert c == sp and c is not sp and c.extra_args is not sp.extra_args
    assert SamplingParams(logits_processors=[]).logits_processors == []
    with pytest.raises(ValueError, match="logits_processors are not supported"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(TypeError, match="detokenize"):
        SamplingParams(detokenize="no")


def test_detokenize_false_gives_ids_only(llm):
    sp = SamplingParams(temperature=0, max_tokens=5)
    ref = llm.generate("Hello", sp, use_tqdm=False)[0].outputs[0]
    o = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=5, detokenize=False), use_tqdm=False)[0]
    assert o.outputs[0].token_ids == ref.token_ids and ref.text and o.outputs[0].text == ""


def test_unsupported_inputs_are_named(llm):
    with pytest.raises(ValueError, match="multi_modal_data is not supported"):
        llm.generate({"prompt": "What is in this image?", "multi_modal_data": {"image": object()}}, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt is not supported"):
        llm.generate({"prompt": "hi", "cache_salt": "user-1"}, use_tqdm=False)
    unshared = LLM(max_model_len=64, num_kv_blocks=16, enable_prefix_caching=False)
    o = unshared.generate({"prompt": "hi", "cache_salt": "user-1"}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(o[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"unknown prompt key\(s\) \['promt'\]"):
        llm.generate({"promt": "typo"}, use_tqdm=False)
    from pageflash.lora import LoRARequest

    with pytest.raises(ValueError, match="lora_request needs an engine started with enable_lora=True"):
        llm.generate("hi", lora_request=LoRARequest("a", 1, "/no/such/adapter"), use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate("hi", lora_request=object(), use_tqdm=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'enable_lora_x'"):
        LLM(enable_lora_x=True)
    with pytest.raises(ValueError, match="tokenizer_mode='mistral'"):
        LLM(tokenizer_mode="mistral")
    assert free(llm)


def test_cli_sampling_flags_fall_back_to_the_model_defaults():
    """`pageflash generate` / `chat`: a flag left unset takes the model's generation_config.json value,
    else the CLI's default; a flag given wins."""
    import argparse

    from pageflash.cli import add_sampling_args, sampling_params

    p = argparse.ArgumentParser()
    add_sampling_args(p)
    sp = sampling_params(p.parse_args([]), {"temperature": 0.6, "top_k": 20})
    assert (sp.temperature, sp.top_k, sp.top_p) == (0.6, 20, 1.0)
    sp = sampling_params(p.parse_args(["--temperature", "0", "--top-p", "0.5"]), {"temperature": 0.6})
    assert (sp.temperature, sp.top_p) == (0.0, 0.5)
    assert sampling_params(p.parse_args([])).temperature == 0.7


def test_vllm_command_lines_parse():
    from pageflash.cli import check_vllm_flags, engine_kwargs
    from pageflash.server.app import make_arg_parser

    p = make_arg_parser()
    a = p.parse_args(["smollm2-135m", "--port", "8001", "--disable-log-requests", "--trust-remote-code",
                      "--disable-log-stats", "--no-enable-prefix-caching", "--uvicorn-log-level", "warning",
                      "--generation-config", "vllm", "--max-logprobs", "20", "--enable-chunked-prefill",
                      "--response-role", "assistant", "--root-path", "/api", "--download-dir", "/tmp",
                      "--swap-space", "4", "--revision", "main"])
    errors = []
    check_vllm_flags(a, errors.append)
    assert not errors
    kw = engine_kwargs(a)
    assert kw["enable_prefix_caching"] is False and kw["generation_config"] == "vllm"
    assert (a.root_path, a.uvicorn_log_level) == ("/api", "warning")
    check_vllm_flags(p.parse_args(["--no-enable-chunked-prefill"]), errors.append)
    check_vllm_flags(p.parse_args(["--tokenizer-mode", "slow"]), errors.append)
    assert "always chunked" in errors[0] and errors[1].startswith("--tokenizer-mode")
    with pytest.raises(SystemExit):
        p.parse_args(["--response-role", "bot"])
    assert set(VLLM_COMPAT_OPTIONS) >= {"trust_remote_code", "swap_space", "enable_chunked_prefill"}


def test_generation_config_folder_and_override(tmp_path):
    """vLLM's generation_config=<folder> (that folder's generation_config.json instead of the model's)
    and override_generation_config (merged over it; over nothing with "vllm"); max_new_tokens is the
    default max_tokens. Bad values name the option."""
    folder = make_random_hf_folder(tmp_path / "model", CONFIGS["llama-gqa"])
    (tmp_path / "model" / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": 7777}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 5, "max_new_tokens": 9, "eos_token_id": 8888}))
    kw = dict(max_model_len=64, num_kv_blocks=32, dtype="float32")
    eng = LLM(folder, generation_config=str(other), **kw).llm_engine
    assert eng.default_sampling == {"top_k": 5, "max_tokens": 9}
    assert 8888 in eng.eos_token_ids and 7777 not in eng.eos_token_ids and eng.max_tokens_ceiling is None
    llm = LLM(folder, override_generation_config={"top_p": 0.5, "max_new_tokens": 7, "do_sample": True}, **kw)
    assert llm.llm_engine.default_sampling == {"temperature": 0.6, "top_p": 0.5, "max_tokens": 7}
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.max_tokens) == (0.6, 0.5, 7) and llm.llm_engine.max_tokens_ceiling == 7
    eng = LLM(folder, generation_config="vllm", override_generation_config='{"temperature": 0.2}', **kw).llm_engine
    assert eng.default_sampling == {"temperature": 0.2} and 7777 not in eng.eos_token_ids
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        LLM(folder, generation_config=str(tmp_path / "missing"), **kw)
    with pytest.raises(ValueError, match="holds no generation_config.json"):
        LLM(folder, generation_config=str(tmp_path), **kw)
    with pytest.raises(ValueError, match="override_generation_config: temperature"):
        LLM(folder, override_generation_config={"temperature": -1}, **kw)
    with pytest.raises(ValueError, match="override_generation_config is not valid JSON"):
        LLM(folder, override_generation_config="{temperature", **kw)


def test_server_max_tokens_default_and_ceiling(tmp_path):
    """As vLLM's server: the generation config's max_new_tokens is the max_tokens of a request that
    sets none, cut to the prompt's room (not a 400); an override's max_new_tokens is also a ceiling
    on the request's max_tokens; without either, an unset max_tokens runs to the end of the context."""
    from pageflash.server.app import OpenAIServing

    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 20}))

    def serving(**kw):
        llm = LLM(folder, max_model_len=64, num_kv_blocks=32, dtype="float32", **kw)

        class Eng:  # what sampling_params / fit_room / validate read
            engine = llm.llm_engine
            max_model_len = llm.llm_engine.max_model_len

        s = OpenAIServing.__new__(OpenAIServing)
        s.engine = Eng
        return s

    s = serving()
    short, long = [5] * 10, [5] * 50
    p = s.sampling_params({"max_tokens": None})
    assert p.max_tokens == 20 and s.fit_room(short, p) is p
    cut = s.fit_room(long, p)
    assert cut.max_tokens == 14 and p.max_tokens == 20
    s.validate(long, cut, "prompt")
    assert s.sampling_params({"max_tokens": 30}).max_tokens == 30  # the file's default is no ceiling
    with pytest.raises(Exception, match="max_tokens"):  # a max_tokens the request set is not cut
        s.validate(long, s.fit_room(long, s.sampling_params({"max_tokens": 30})), "prompt")
    s = serving(override_generation_config={"max_new_tokens": 12})
    assert [s.sampling_params({"max_tokens": m}).max_tokens for m in (None, 30, 5)] == [12, 12, 5]
    s = serving(generation_config="vllm")
    assert s.sampling_params({"max_tokens": None}).max_tokens is None


def test_cli_override_generation_config(tmp_path):
    from pageflash.cli import add_sampling_args, engine_kwargs, sampling_params
    from pageflash.server.app import make_arg_parser

    a = make_arg_parser().parse_args(["--generation-config", str(tmp_path),
                                      "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 40}'])
    kw = engine_kwargs(a)
    assert kw["generation_config"] == str(tmp_path)
    assert kw["override_generation_config"] == {"temperature": 0.5, "max_new_tokens": 40}
    import argparse

    p = argparse.ArgumentParser()
    add_sampling_args(p)
    assert sampling_params(p.parse_args([]), {"max_tokens": 40, "temperature": 0.5}).max_tokens == 40
    assert sampling_params(p.parse_args(["--max-tokens", "3"]), {"max_tokens": 40}).max_tokens == 3
    assert sampling_params(p.parse_args([])).max_tokens == 256


def test_max_logprobs_sets_the_cap(tmp_path):
    """vLLM's max_logprobs (LLM option, serve --max-logprobs): the most logprobs / prompt_logprobs a
    request may ask for, 20 by default, -1 the whole vocabulary; past it a clear error at add time and
    the engine goes on. Values past 20 are the model's own, ranked as any."""
    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    kw = dict(max_model_len=64, num_kv_blocks=32, dtype="float32")
    ids = {"prompt_token_ids": [3, 1, 4, 1, 5]}
    wide = LLM(folder, max_logprobs=30, **kw)
    o = wide.generate(ids, SamplingParams(temperature=0, max_tokens=2, logprobs=30, prompt_logprobs=25),
                      use_tqdm=False)[0]  # fmt: skip
    top = o.outputs[0].logprobs[0]
    assert len(top) == 30 and sorted(v.rank for v in top.values()) == list(range(1, 31))
    assert all(len(p) in (25, 26) for p in o.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="logprobs=31 is more than the 30 logprobs allowed"):
        wide.generate(ids, SamplingParams(logprobs=31), use_tqdm=False)
    narrow = LLM(folder, max_logprobs=0, **kw)
    with pytest.raises(ValueError, match="prompt_logprobs=1 .*max_logprobs"):
        narrow.generate(ids, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    assert len(narrow.generate(ids, SamplingParams(logprobs=0, max_tokens=1), use_tqdm=False)[0].outputs[0].logprobs[0]) == 1
    assert free(narrow)
    vocab = LLM(folder, max_logprobs=-1, **kw)
    v = vocab.llm_engine.vocab_size
    assert len(vocab.generate(ids, SamplingParams(logprobs=v, max_tokens=1), use_tqdm=False)[0].outputs[0].logprobs[0]) == v
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= 0, or -1"):
        LLM(folder, max_logprobs=-2, **kw)
