"""SamplingParams: vLLM defaults, normalization, and one clear error per bad field."""

from __future__ import annotations

import math

import pytest

from pageflash.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, -1, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.max_tokens, p.min_tokens, p.ignore_eos, p.logprobs) == (16, 0, False, None)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.greedy and not p.uses_penalties


def test_normalization():
    p = SamplingParams(stop="###", top_k=0, temperature=1, stop_token_ids=(7, 8))
    assert p.stop == ["###"] and p.top_k == -1 and p.stop_token_ids == [7, 8]
    assert isinstance(p.temperature, float)
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    "temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False), (2.0, False)]
)
def test_greedy_property(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_all_stop_token_ids():
    p = SamplingParams(stop_token_ids=[5])
    assert p.all_stop_token_ids(2) == {2, 5}
    assert p.all_stop_token_ids([2, 3]) == {2, 3, 5}
    assert p.all_stop_token_ids(None) == {5}
    assert SamplingParams(stop_token_ids=[5], ignore_eos=True).all_stop_token_ids(2) == {5}


def test_valid_edges_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, top_k=1, n=1, max_tokens=1)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01)
    SamplingParams(min_tokens=16, max_tokens=16, logprobs=0, seed=0)
    SamplingParams(logprobs=MAX_LOGPROBS, seed=2**64 - 1, min_tokens=100, max_tokens=None)
    SamplingParams(seed=-(2**63))
    SamplingParams(temperature=3.0e38, repetition_penalty=3.0e38)  # still finite in float32


BAD = [
    # (kwargs, exception, words the message must contain)
    (dict(temperature=-0.1), ValueError, ["temperature", ">= 0"]),
    (dict(temperature=math.nan), ValueError, ["temperature", "NaN"]),
    (dict(temperature=math.inf), ValueError, ["temperature", "finite"]),
    (dict(temperature="1"), TypeError, ["temperature", "number"]),
    # past float32's range: inf in the sampler, NaN probabilities, garbage (even forbidden) tokens
    (dict(temperature=1e39), ValueError, ["temperature", "finite", "float32"]),
    (dict(temperature=1e308), ValueError, ["temperature", "finite"]),
    (dict(top_p=0.0), ValueError, ["top_p", "(0, 1]"]),
    (dict(top_p=1.01), ValueError, ["top_p", "(0, 1]"]),
    (dict(top_p=math.nan), ValueError, ["top_p", "NaN"]),
    (dict(top_k=-2), ValueError, ["top_k", "-1"]),
    (dict(top_k=2.0), TypeError, ["top_k", "int"]),
    (dict(top_k=True), TypeError, ["top_k", "int"]),
    (dict(min_p=-0.1), ValueError, ["min_p", "[0, 1]"]),
    (dict(min_p=1.5), ValueError, ["min_p", "[0, 1]"]),
    (dict(n=0), ValueError, ["n must", "at least 1"]),
    (dict(n=True), TypeError, ["n must", "int"]),
    (dict(max_tokens=0), ValueError, ["max_tokens", "at least 1"]),
    (dict(max_tokens=16.0), TypeError, ["max_tokens", "int"]),
    (dict(min_tokens=-1), ValueError, ["min_tokens", "at least 0"]),
    (dict(min_tokens=17), ValueError, ["min_tokens", "max_tokens=16"]),
    (dict(presence_penalty=2.5), ValueError, ["presence_penalty", "[-2, 2]"]),
    (dict(frequency_penalty=-2.1), ValueError, ["frequency_penalty", "[-2, 2]"]),
    (dict(frequency_penalty=False), TypeError, ["frequency_penalty", "number"]),
    (dict(repetition_penalty=0.0), ValueError, ["repetition_penalty", "> 0"]),
    (dict(repetition_penalty=-1.0), ValueError, ["repetition_penalty", "> 0"]),
    (dict(repetition_penalty=math.nan), ValueError, ["repetition_penalty", "NaN"]),
    (dict(repetition_penalty=1e39), ValueError, ["repetition_penalty", "finite", "float32"]),
    (dict(logprobs=-2), ValueError, ["logprobs", "at least 0, -1"]),
    (dict(prompt_logprobs=-2), ValueError, ["prompt_logprobs", "at least 0"]),
    (dict(logprobs=False), TypeError, ["logprobs", "int"]),  # (True is vLLM's "one": test_engine_api)
    (dict(seed=1.5), TypeError, ["seed", "int"]),
    (dict(seed=True), TypeError, ["seed", "int"]),
    (dict(seed=2**64), ValueError, ["seed", "2**64"]),
    (dict(stop=5), TypeError, ["stop", "str"]),
    (dict(stop=["ok", 5]), TypeError, ["stop", "str"]),
    (dict(stop=""), ValueError, ["stop", "empty"]),
    (dict(stop_token_ids=3), TypeError, ["stop_token_ids", "list"]),
    (dict(stop_token_ids=[1, "2"]), TypeError, ["stop_token_ids", "int"]),
    (dict(stop_token_ids=[True]), TypeError, ["stop_token_ids", "int"]),
    (dict(stop_token_ids=[-1]), ValueError, ["stop_token_ids", ">= 0"]),
    (dict(ignore_eos=1), TypeError, ["ignore_eos", "bool"]),
    (dict(skip_special_tokens=None), TypeError, ["skip_special_tokens", "bool"]),
    (dict(include_stop_str_in_output="yes"), TypeError, ["include_stop_str_in_output", "bool"]),
]


@pytest.mark.parametrize("kwargs, exc, words", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_values_name_the_field_and_the_limit(kwargs, exc, words):
    with pytest.raises(exc) as info:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
