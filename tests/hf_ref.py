"""Helpers that build HF transformers references for the engine's tests (CPU, float32)."""

from __future__ import annotations

import os

import torch


def default_gguf() -> tuple[str, str]:
    from pageflash.model.loader import _embedded_path

    path = _embedded_path("smollm2-135m")
    return os.path.dirname(path), os.path.basename(path)


def hf_model_from_gguf():
    from transformers import AutoModelForCausalLM

    folder, name = default_gguf()
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def make_random_hf_folder(tmp_path, cfg_dict: dict, seed: int = 0, std: float = 0.08) -> str:
    """Save a random HF model with this config to tmp_path (safetensors, sharded); returns the folder.

    std is larger than usual so that logits have clear winners and greedy decoding is not decided
    by float rounding.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(**cfg_dict)
    cfg.initializer_range = std
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "bias" in n:
                p.normal_(0, 0.5)
    model.save_pretrained(str(tmp_path), max_shard_size="200KB", safe_serialization=True)
    return str(tmp_path)


def make_peft_adapter(model_folder: str, out_dir, target_modules, r: int = 8, lora_alpha: float = 16,
                      seed: int = 0, std: float = 0.1, **lora_kwargs) -> str:
    """Save a random PEFT LoRA adapter for the model in model_folder to out_dir (written by peft itself);
    returns the folder. A and B are drawn from N(0, std) (PEFT starts B at zero, which changes nothing),
    so the adapter moves the outputs without swamping the base model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                                            lora_dropout=0.0, **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


def hf_with_adapter(model_folder: str, adapter_dir: str, base=None):
    """HF transformers' model (or `base`, e.g. one with changed weights) with the PEFT adapter applied."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if base is None:
        base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def hf_fake_quantized(folder: str, method: str = "int8"):
    """HF's model with every decoder projection replaced by dequantize(quantize(w)): what the engine's
    int8 / fp8 layers compute (weight-only), run by HF's own code."""
    from transformers import AutoModelForCausalLM

    from pageflash.kernels.w8_linear import dequantize_int8
    from pageflash.layers.linear import quantize_weight

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.model.layers.named_modules():
            if isinstance(mod, torch.nn.Linear):
                q, s = quantize_weight(mod.weight, method)
                mod.weight.copy_(dequantize_int8(q, s, torch.float32))
    return hf


def hf_reference(folder: str):
    """HF's float32 model of a folder on its eager attention: each architecture's own arithmetic on
    every transformers version. (Left to choose, transformers 5.17 runs Gemma 2 on SDPA, which has
    no attention-score softcapping, and its greedy tokens then part from the model's from the third
    on; 5.25 picks eager for it by itself.)"""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of one prompt (no padding), EOS ignored."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0, eos_token_id=None,
    )
    return out[0, len(prompt_ids):].tolist()


def triton_paths_match_hf(tmp_path, monkeypatch, cfg_dict: dict, mode: str, prompts: list[list[int]],
                          max_new_tokens: int = 10) -> list[bool]:
    """A random model of cfg_dict through the Triton backend (under the interpreter on the CPU), float32,
    against HF's greedy tokens. mode "fused": the rotary embedding inside the K/V store (prefill) and
    the decode launch (rotary's fused path forced on); returns, per backend attention call, whether
    it was given rope=. "speculative": the model drafting for itself (draft_model), verified through
    the static-buffer step path (StepGraphs, eager); returns []. Both end with every block free."""
    from pageflash import LLM, SamplingParams
    from pageflash.kernels import backend as backend_mod
    from pageflash.layers import rotary as rotary_layer

    folder = make_random_hf_folder(tmp_path, cfg_dict)
    hf = hf_reference(folder)
    kw = dict(block_size=4, max_num_batched_tokens=32, max_model_len=64, num_kv_blocks=96, dtype="float32",
              attention_backend="triton")
    ropes: list[bool] = []
    if mode == "fused":
        monkeypatch.setattr(rotary_layer, "_use_fused", lambda q, k: True)
        real = backend_mod.TritonBackend.forward

        def spy(self, *a, rope=None, **k):
            ropes.append(rope is not None)
            return real(self, *a, rope=rope, **k)

        monkeypatch.setattr(backend_mod.TritonBackend, "forward", spy)
    else:
        kw["speculative_config"] = dict(method="draft_model", model=folder, num_speculative_tokens=3)
    llm = LLM(folder, **kw)
    eng = llm.llm_engine
    if mode == "speculative":
        for r in (eng.runner, eng.spec.draft_runner):
            r.enable_step_graphs(4, cuda_graphs=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, max_new_tokens)
    assert eng.runner.backend.decode_rope
    if mode == "speculative":
        assert eng.runner.step_graphs.replays > 0
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks
    return ropes


def prefix_hits_and_prompt_logprobs_match_hf(folder: str, hf, shared: list[int], tails: list[list[int]]) -> None:
    """Prompts shared + tail hit the prefix cache (blocks of 4, prefill chunks of 8) and give HF's
    greedy tokens; prompt log-probabilities equal HF's log-softmax over the prompt, position by
    position; every block is free at the end. tails: at least 2; the shared part >= 20 tokens."""
    import pytest

    from pageflash import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(folder, block_size=4, max_num_batched_tokens=8, max_model_len=64, num_kv_blocks=96)
    eng = llm.llm_engine
    first = shared + tails[0]
    assert llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        hf_greedy(hf, first, 10)
    hits0 = eng.get_stats()["prefix_cache_hits"]
    rest = [shared + t for t in tails[1:]]
    outs = llm.generate([{"prompt_token_ids": p} for p in rest], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in rest]
    assert eng.get_stats()["prefix_cache_hits"] - hits0 >= len(rest) * (len(shared) // 4 * 4)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    p = rest[0]
    plp = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].prompt_logprobs
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
    assert plp[0] is None
    for t in range(1, len(p)):
        assert plp[t][p[t]].logprob == pytest.approx(ref[t - 1, p[t]].item(), abs=1e-4)
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


@torch.no_grad()
def hf_greedy_processed(model, prompt_ids: list[int], process, max_new_tokens: int, eos_ids) -> list[int]:
    """A plain greedy reference with a logits processor: HF forward over the whole sequence each step,
    process(logits [V] float32, outputs so far) changes the logits in place, argmax; stops at EOS."""
    ids, out = list(prompt_ids), []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        process(logits, out)
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        if tok in eos_ids:
            break
    return out
