"""PEFT LoRA adapter folders, read and checked against the base model.

A folder holds adapter_config.json (r, lora_alpha, target_modules, use_rslora, bias, ...) and
adapter_model.safetensors (or adapter_model.bin) with tensors named
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` ([r, in]) and ``...lora_B.weight``
([out, r]). PEFT's forward adds ``scaling * B(A(x))`` to the projection's output, scaling =
lora_alpha / r (use_rslora: lora_alpha / sqrt(r)); rank_pattern / alpha_pattern give single modules
their own r / alpha.

Targets taken: q/k/v/o_proj and gate/up/down_proj of every decoder layer (Phi-3's fused qkv_proj /
gate_up_proj too: one A shared by the parts, B split by rows). Anything else is refused by name:
embed_tokens, lm_head, modules_to_save, DoRA, trained biases, mixture-of-experts experts / routers.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from pageflash.config import ModelConfig
from pageflash.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "load_adapter", "module_shapes", "write_random_adapter"]

# PEFT module name -> (our merged projection, its slice; None: Phi-3's fused projection, every slice)
_TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
    "qkv_proj": ("qkv_proj", None), "gate_up_proj": ("gate_up_proj", None),
}
_ATTN = ("qkv_proj", "o_proj")
_PEFT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out

_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
_LAYER = re.compile(r"(?:.+\.)?layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<name>[a-z_]+)")


def module_shapes(cfg: ModelConfig, module: str) -> tuple[int, list[int]]:
    """(in_features, output rows of each slice) of one of our targeted projections."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv_proj": (h, [cfg.q_size, cfg.kv_size, cfg.kv_size]), "o_proj": (cfg.q_size, [h]),
            "gate_up_proj": (h, [i, i]), "down_proj": (i, [h])}[module]


@dataclass
class LoRAAdapter:
    """An adapter read from disk (host memory). weights[(layer, module)]: [(slice, scale, A [r, in],
    B [rows of the slice, r])] for module one of qkv_proj, o_proj, gate_up_proj, down_proj."""

    name: str
    int_id: int
    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], list[tuple[int, float, torch.Tensor, torch.Tensor]]]
    uid: int = 0  # the engine's identity of these weights (device slots, prefix-cache hashes)
    base_model_name: Optional[str] = None
    modules: list[str] = field(default_factory=list)  # PEFT target names found, for messages


def _config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter folder {path!r} does not exist")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter folder {path!r} has no adapter_config.json (not a PEFT adapter)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {path!r}: cannot read adapter_config.json: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json is not a JSON object")
    return cfg


def _check_config(cfg: dict[str, Any], path: str) -> None:
    """Refuse, by name, what pageflash does not apply."""
    where = f"LoRA adapter {path!r}"
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: adapter_config.json needs r, a positive integer; got {r!r}")
    alpha = cfg.get("lora_alpha", _PEFT_ALPHA)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    pattern = cfg.get("alpha_pattern") or {}
    if not isinstance(pattern, dict):
        raise ValueError(f"{where}: alpha_pattern must map module names to numbers, got {pattern!r}")
    for key, value in pattern.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: alpha_pattern[{key!r}] must be a number, got {value!r}")
        try:
            re.compile(key)
        except re.error as e:
            raise ValueError(f"{where}: alpha_pattern key {key!r} is not a valid pattern ({e})") from None
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={cfg.get('bias')!r} trains bias vectors, which pageflash does not load; "
                         f"only bias='none' adapters are supported")
    if cfg.get("lora_bias"):
        raise ValueError(f"{where}: lora_bias=True (a bias on lora_B) is not supported")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: use_dora=True (DoRA) is not supported, only plain LoRA")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save={cfg['modules_to_save']!r} (whole modules trained beside "
                         f"the adapter) is not supported")
    if cfg.get("trainable_token_indices"):
        raise ValueError(f"{where}: trainable_token_indices (trained embedding rows) is not supported")
    targets = cfg.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for bad in ("embed_tokens", "lm_head"):
        if any(re.search(rf"(^|\W){bad}(\W|$)", n) for n in names):
            raise ValueError(f"{where} targets {bad} (target_modules); pageflash applies LoRA to the decoder "
                             f"layers' projections only (q/k/v/o, gate/up/down)")
    # fan_in_fan_out: PEFT turns it off for nn.Linear targets (every projection here), and the lora_A /
    # lora_B tensors have the same layout either way, so it changes nothing.


def _scale(cfg: dict[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling for one module: lora_alpha (or its alpha_pattern entry) / r, or / sqrt(r) with
    use_rslora (r: the module's rank, as rank_pattern gives it; read off the tensors)."""
    alpha = cfg.get("lora_alpha", _PEFT_ALPHA)
    for key, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):  # (peft.utils.other.get_pattern_key's rule)
            alpha = value
            break
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    pt = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(pt):
            out = torch.load(pt, map_location="cpu", weights_only=True)
            if not isinstance(out, dict):
                raise ValueError("not a dict of tensors")
            return out
    except Exception as e:  # a truncated or foreign file: whatever the reader raises
        raise ValueError(f"LoRA adapter {path!r}: cannot read its weights ({type(e).__name__}: {e})") from None
    raise ValueError(f"LoRA adapter {path!r} has no adapter_model.safetensors or adapter_model.bin")


def _unsupported(module: str, path: str) -> ValueError:
    where = f"LoRA adapter {path!r}"
    if module.endswith(("embed_tokens", "lm_head")) or "lora_embedding" in module:
        what = "embed_tokens" if "embed" in module else "lm_head"
        return ValueError(f"{where} targets {what} ({module}); pageflash applies LoRA to the decoder layers' "
                          f"projections only (q/k/v/o, gate/up/down)")
    if ".experts." in module or module.endswith((".experts", ".mlp.gate")) or ".shared_expert" in module:
        return ValueError(f"{where} targets {module}, part of a mixture-of-experts block; LoRA on experts, shared "
                          f"experts and routers is not supported (attention projections and dense MLPs are)")
    return ValueError(f"{where} targets {module}, which pageflash does not support as a LoRA target "
                      f"(q/k/v/o_proj and gate/up/down_proj of the decoder layers are)")


def load_adapter(req: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read req.lora_path and check it against the base model's shapes; ValueError naming what is
    wrong (missing or corrupt folder, rank above max_rank, an unsupported target, a shape that is
    not the model's)."""
    path = req.lora_path
    conf = _config(path)
    _check_config(conf, path)
    where = f"LoRA adapter {path!r}"
    tensors = _read_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if "lora_magnitude_vector" in key:
            raise ValueError(f"{where}: {key} is a DoRA magnitude; DoRA is not supported")
        m = _KEY.fullmatch(key)
        if m is None:
            if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
                raise _unsupported(key, path)
            raise ValueError(f"{where}: unexpected tensor {key!r} (a PEFT LoRA adapter holds only "
                             f"base_model.model.<module>.lora_A/lora_B.weight tensors)")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    if not pairs:
        raise ValueError(f"{where}: its weights file holds no LoRA tensors")
    weights: dict[tuple[int, str], list] = {}
    found: set[str] = set()
    rank = 0
    for module, ab in sorted(pairs.items()):
        lm = _LAYER.fullmatch(module)
        if lm is None or lm["name"] not in _TARGETS:
            raise _unsupported(module, path)
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has lora_{'A' if 'A' in ab else 'B'} without "
                             f"lora_{'B' if 'A' in ab else 'A'}")
        layer, name = int(lm["layer"]), lm["name"]
        ours, part = _TARGETS[name]
        if layer >= cfg.num_hidden_layers:
            raise ValueError(f"{where}: {module} is past the base model's {cfg.num_hidden_layers} layers (an "
                             f"adapter for another model?)")
        if ours not in _ATTN and cfg.is_moe_layer(layer):
            raise ValueError(f"{where}: {module}: layer {layer} of the base model is a mixture of experts; LoRA "
                             f"on experts is not supported (attention projections and dense MLPs are)")
        a, b = ab["A"], ab["B"]
        in_features, slices = module_shapes(cfg, ours)
        out = sum(slices) if part is None else slices[part]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise ValueError(f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                             f"[r, in] and [out, r] of one rank")
        if a.shape[1] != in_features or b.shape[0] != out:
            raise ValueError(f"{where}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                             f"base model (expected [r, {in_features}] / [{out}, r]); was it trained on "
                             f"another model?")
        if r > max_rank:
            raise ValueError(f"{where}: {module} has rank {r}, above max_lora_rank={max_rank}; start the engine "
                             f"with max_lora_rank >= {r}")
        scale = _scale(conf, module, r)
        entry = weights.setdefault((layer, ours), [])
        if any(e[0] in (range(len(slices)) if part is None else (part,)) for e in entry):
            raise ValueError(f"{where}: {module} overlaps another target of layers.{layer}.{ours} (fused and "
                             f"separate projections both given)")
        if part is None:  # a fused projection: each slice takes its rows of B, all with the same A
            off = 0
            for i, width in enumerate(slices):
                entry.append((i, scale, a, b[off: off + width]))
                off += width
        else:
            entry.append((part, scale, a, b))
        found.add(name)
        rank = max(rank, r)
    return LoRAAdapter(req.lora_name, req.lora_int_id, path, rank, weights,
                       base_model_name=req.base_model_name, modules=sorted(found))


def write_random_adapter(path: str, cfg: ModelConfig, rank: int, seed: int = 0, std_b: float = 0.1) -> str:
    """Write a random PEFT adapter folder of this rank for every q/k/v/o and gate/up/down projection of
    a dense model of config cfg (benchmarks and GPU tests over named configs, which have no HF folder
    for peft to build from). A ~ N(0, 1/in), B ~ N(0, std_b^2), lora_alpha 2 x rank. Returns path."""
    from safetensors.torch import save_file

    if cfg.num_experts:
        raise ValueError("write_random_adapter: mixture-of-experts models take adapters on attention only")
    os.makedirs(path, exist_ok=True)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, bias="none", target_modules=targets,
                       fan_in_fan_out=False), f)
    g = torch.Generator().manual_seed(seed)
    shapes = {}  # "block.name" -> (in_features, the slice's rows), from the slots' own shapes
    for name in targets:
        module, part = _TARGETS[name]
        fan_in, rows = module_shapes(cfg, module)
        shapes[f"{'self_attn' if module in _ATTN else 'mlp'}.{name}"] = (fan_in, rows[part])
    t = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            t[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            t[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std_b
    save_file(t, os.path.join(path, "adapter_model.safetensors"))
    return path
