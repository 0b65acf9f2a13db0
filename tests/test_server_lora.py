"""LoRA adapters behind the OpenAI-compatible server, through the real `openai` client: a request's
model names the adapter (or the base); /v1/models lists the adapters with their parent; unknown names
are 404; vLLM's runtime /v1/load_lora_adapter and /v1/unload_lora_adapter; `--lora-modules` parsing.

A tiny random Llama with SmolLM2's tokenizer (so that chat templates work), two PEFT adapters; the
server's greedy output equals the offline engine's under the same adapter, which tests/test_lora.py
checks against HF + peft (here once more directly for one request)."""

from __future__ import annotations

from typing import Any, Iterator

import openai
import pytest

from hf_ref import hf_greedy, hf_with_adapter, make_peft_adapter, make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.engine.async_engine import AsyncLLMEngine
from pageflash.lora import LoRARequest
from pageflash.server.app import build_app, main, parse_lora_modules
from test_engine_hf import CONFIGS
from test_server import Srv, assert_error, serve

CHAT = [{"role": "user", "content": "Name a color."}]
PROMPT = [12, 345, 6789, 10, 2024, 7]


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Srv]:
    from pageflash.model.loader import load_tokenizer, resolve_model

    tmp = tmp_path_factory.mktemp("lora_server")
    folder = make_random_hf_folder(tmp / "model", dict(CONFIGS["llama-gqa"], vocab_size=49152))
    load_tokenizer(resolve_model("smollm2-135m", "auto")).save_pretrained(folder)
    paths = {"a": make_peft_adapter(folder, tmp / "a", ["q_proj", "v_proj", "down_proj"], r=4, seed=1),
             "b": make_peft_adapter(folder, tmp / "b", ["q_proj", "k_proj", "o_proj", "up_proj"], r=8, seed=2),
             "c": make_peft_adapter(folder, tmp / "c", ["gate_proj"], r=8, seed=3, std=0.3)}
    llm = LLM(folder, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128, async_scheduling=True)
    loras = [LoRARequest("a", 1, paths["a"]), LoRARequest("b", 2, paths["b"], base_model_name="tiny-llama")]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    refs: dict[str, Any] = {"paths": paths, "folder": folder}
    for name, lora in (("base", None), ("a", loras[0]), ("b", loras[1]),
                       ("c", LoRARequest("c", 9, paths["c"]))):
        refs[name] = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False,
                                  lora_request=lora)[0].outputs[0].token_ids
        refs["chat-" + name] = llm.chat(CHAT, greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    llm.llm_engine.remove_lora(9)  # (c is loaded at run time below)
    aeng = AsyncLLMEngine(llm.llm_engine)
    try:
        app = build_app(aeng, "base", lora_modules=loras, allow_runtime_lora_updating=True)
        with serve(app) as base:
            s = Srv(base, aeng, refs)
            s.app = app  # (tests reach the OpenAIServing through app.state.serving)
            yield s
            s.http.close()
    finally:
        aeng.shutdown()


def _complete(srv: Srv, model: str, stream: bool = False) -> list[int]:
    kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    if not stream:
        r = srv.client.completions.create(**kw)
        tokens = r.choices[0].logprobs.tokens
    else:
        tokens = [t for c in srv.client.completions.create(stream=True, **kw) for t in c.choices[0].logprobs.tokens]
    return [int(t.split(":")[1]) for t in tokens]


def test_models_list_the_adapters_with_their_parent(srv: Srv) -> None:
    cards = {m.id: m for m in srv.client.models.list().data}
    assert list(cards) == ["base", "a", "b"]
    assert cards["a"].model_extra["parent"] == "base" and cards["a"].model_extra["root"] == srv.refs["paths"]["a"]
    assert cards["b"].model_extra["parent"] == "tiny-llama"
    assert cards["base"].model_extra["parent"] is None
    assert srv.client.models.retrieve("b").id == "b"


def test_completions_and_chat_select_the_adapter_by_model_name(srv: Srv) -> None:
    refs = srv.refs
    assert refs["a"] != refs["base"] and refs["b"] != refs["base"]  # the adapters change the output
    ref_a = hf_greedy(hf_with_adapter(refs["folder"], refs["paths"]["a"]), PROMPT, 8)
    assert refs["a"] == ref_a  # (offline engine == HF + peft)
    for model in ("a", "base", "b"):
        assert _complete(srv, model) == refs[model], model
    assert _complete(srv, "b", stream=True) == refs["b"]
    for model in ("b", "base"):
        r = srv.client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == refs["chat-" + model] and r.model == model
    assert srv.wait_idle()["num_free_blocks"] > 0


def test_unknown_model_is_404(srv: Srv) -> None:
    assert_error(srv.post("/v1/completions", {"model": "c", "prompt": "hi"}), 404, param="model",
                 contains=("`c`", "base, a, b"))
    with pytest.raises(openai.NotFoundError):
        srv.client.chat.completions.create(model="nope", messages=CHAT, max_tokens=1)


def test_runtime_load_and_unload(srv: Srv) -> None:
    paths = srv.refs["paths"]
    r = srv.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": paths["c"]})
    assert r.status_code == 200 and "added successfully" in r.text
    assert [m.id for m in srv.client.models.list().data] == ["base", "a", "b", "c"]
    assert _complete(srv, "c") == srv.refs["c"]
    assert_error(srv.post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": paths["c"]}), 400,
                 param="lora_name", contains=("already been loaded",))
    assert_error(srv.post("/v1/load_lora_adapter", {"lora_name": "d", "lora_path": "/no/such/dir"}), 400,
                 param="lora_path", contains=("does not exist",))
    assert_error(srv.post("/v1/load_lora_adapter", {"lora_name": "", "lora_path": paths["c"]}), 400,
                 param="lora_name", contains=("must not be empty",))
    r = srv.post("/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 200 and "removed successfully" in r.text
    assert_error(srv.post("/v1/completions", {"model": "c", "prompt": "hi"}), 404, param="model")
    assert_error(srv.post("/v1/unload_lora_adapter", {"lora_name": "c"}), 404, param="lora_name")
    assert _complete(srv, "a") == srv.refs["a"]  # the others go on


def test_adapter_unloaded_while_a_request_is_prepared_still_runs_it(srv: Srv, monkeypatch) -> None:
    """A request whose adapter is unloaded while its prompt is being tokenized (off the event loop) runs
    under that adapter, as the requests already running under it do (it ran the base model while
    answering as the adapter); later requests for the name are 404s."""
    import threading

    r = srv.post("/v1/load_lora_adapter", {"lora_name": "c2", "lora_path": srv.refs["paths"]["c"]})
    assert r.status_code == 200, r.text

    def complete(model: str) -> str:
        r = srv.post("/v1/completions", {"model": model, "prompt": "The sky is", "max_tokens": 8, "temperature": 0,
                                         "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    want = complete("c2")
    assert want != complete("base")
    tokenizer = srv.app.state.serving.tokenizer
    entered, release = threading.Event(), threading.Event()
    run = tokenizer.run

    async def held_run(fn: Any, what: str, param: str) -> Any:
        def held(t: Any) -> Any:
            entered.set()
            release.wait(30)
            return fn(t)

        return await run(held, what, param)

    monkeypatch.setattr(tokenizer, "run", held_run)
    out: dict[str, str] = {}
    t = threading.Thread(target=lambda: out.update(text=complete("c2")))
    t.start()
    try:
        assert entered.wait(30)
        assert srv.post("/v1/unload_lora_adapter", {"lora_name": "c2"}).status_code == 200
    finally:
        release.set()
        t.join(60)
    monkeypatch.undo()
    assert out["text"] == want
    assert_error(srv.post("/v1/completions", {"model": "c2", "prompt": "hi"}), 404, param="model")
    assert srv.wait_idle()["num_free_blocks"] > 0


def test_async_engine_generate_takes_lora_request(srv: Srv) -> None:
    """AsyncLLMEngine.generate(prompt, params, request_id, lora_request), as vLLM's."""
    import asyncio

    async def run() -> list[int]:
        outs = [o async for o in srv.aeng.generate({"prompt_token_ids": PROMPT}, SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True), lora_request=LoRARequest("b", 2, srv.refs["paths"]["b"]))]
        return outs[-1].outputs[0].token_ids

    assert asyncio.run(run()) == srv.refs["b"]


def test_runtime_updates_are_off_unless_asked(srv: Srv) -> None:
    app = build_app(srv.aeng, "base")
    assert not any(getattr(r, "path", "") == "/v1/load_lora_adapter" for r in app.routes)
    with pytest.raises(ValueError, match="is used twice"):
        build_app(srv.aeng, "base", lora_modules=[LoRARequest("base", 1, "/x")])


def test_lora_modules_syntax(capsys) -> None:
    mods = parse_lora_modules(["x=/p/x", '{"name": "y", "path": "/p/y", "base_model_name": "m"}'])
    assert [(m.lora_name, m.lora_int_id, m.lora_path, m.base_model_name) for m in mods] == [
        ("x", 1, "/p/x", None), ("y", 2, "/p/y", "m")]
    for bad, msg in (("x", "expected name=path"), ('{"name": "y"}', "needs string 'name' and 'path'"),
                     ("{oops", "not valid JSON"),
                     ('{"name": "y", "path": "/p", "base_model_name": 5}', "base_model_name must be a string")):
        with pytest.raises(ValueError, match=msg):
            parse_lora_modules([bad])
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", "--lora-modules", "x=/p/x"])
    assert e.value.code == 2 and "--lora-modules needs --enable-lora" in capsys.readouterr().err
    # a name given twice, or a served model's name: refused before the model loads (was a traceback after)
    for argv in (["--lora-modules", "x=/p/x", "x=/p/y"], ["--served-model-name", "m", "--lora-modules", "m=/p/x"]):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--port", "0", "--model", "/no/such/model", "--enable-lora", *argv])
        assert e.value.code == 2 and "is used twice (or is a served model name)" in capsys.readouterr().err
