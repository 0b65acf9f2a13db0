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


def hf_fake_quantized(folder: str):
    """HF's model with every decoder projection replaced by dequantize(quantize(w)): what the engine's
    int8 layers compute, run by HF's own code."""
    from transformers import AutoModelForCausalLM

    from pageflash.kernels.w8_linear import dequantize_int8, quantize_int8

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.model.layers.named_modules():
            if isinstance(mod, torch.nn.Linear):
                q, s = quantize_int8(mod.weight)
                mod.weight.copy_(dequantize_int8(q, s, torch.float32))
    return hf


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF greedy continuation of one prompt (no padding), EOS ignored."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0, eos_token_id=None,
    )
    return out[0, len(prompt_ids):].tolist()


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
