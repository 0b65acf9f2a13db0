"""SpeculativeConfig: what the user asked for (vLLM-style dict), validated once.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": "<name/folder/.gguf>", "num_speculative_tokens": 4}
    {"method": "medusa", "medusa_path": "heads.safetensors", "tree": [2, 2, 1]}
    {"method": "early_exit", "num_layers": 8, "num_speculative_tokens": 3, "adaptive": true}

Accepted as a dict, a JSON string (the CLI's ``--speculative-config``) or a SpeculativeConfig.
Checks that need the models (layer counts, vocabularies, head shapes) happen when the engine builds
the proposer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from pageflash.spec.tree import ExpansionConfig

METHODS = ("ngram", "draft_model", "medusa", "early_exit")
_DTYPES = ("auto", "float32", "float", "fp32", "float16", "half", "fp16", "bfloat16", "bf16")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings.

    method:                 "ngram" | "draft_model" | "medusa" | "early_exit".
    num_speculative_tokens: draft tokens (tree nodes) per request per step, k. Default: the tree's
                            node count when ``tree`` is given (with "ngram": 5), else required.
    prompt_lookup_max/min:  longest / shortest suffix n-gram matched (ngram).
    model:                  draft model: short name, HF folder or .gguf file (draft_model).
    draft_dtype:            dtype of the draft model's weights and KV ("auto": the target's).
    draft_load_format:      load format of the draft ("auto", "dummy", ...).
    draft_num_kv_blocks:    blocks of the draft's paged KV cache (default: as many as the target's).
    quantization:           weight-only quantization of the draft model at load ("int8" / "fp8"; vLLM's key
                            for the draft's quantization): the target's own checkpoint as ``model``
                            with "int8" is a quantized self-draft (draft_model).
    medusa_path:            heads file written by ``pageflash train-medusa`` (medusa).
    num_layers:             early exit after the target's first L layers (then final norm + LM head).
    tree:                   SpecInfer expansion, children per level ([2, 2, 1]: 2 + 4 + 4 nodes);
                            None = a chain. For "ngram", tree[0] continuations are merged into a tree.
    adaptive:               SpecController picks k per request per step from measured acceptance and
                            step cost, and switches speculation off when it would be slower.
    """

    method: str
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Optional[str] = None
    draft_dtype: str = "auto"
    draft_load_format: str = "auto"
    draft_num_kv_blocks: Optional[int] = None
    quantization: Optional[str] = None
    medusa_path: Optional[str] = None
    num_layers: Optional[int] = None
    tree: Optional[tuple[int, ...]] = None
    adaptive: bool = False

    def __post_init__(self) -> None:
        def err(msg: str) -> ValueError:
            return ValueError(f"speculative_config: {msg}")

        def pos_int(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise err(f"{name} must be a positive integer, got {v!r}")

        if self.method not in METHODS:
            raise err(f"method must be one of {list(METHODS)}, got {self.method!r}")
        if self.tree is not None:
            if isinstance(self.tree, (str, bytes)) or not hasattr(self.tree, "__iter__"):
                raise err(f"tree must be a list of positive integers, got {self.tree!r}")
            t = tuple(self.tree)
            if not t or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in t):
                raise err(f"tree must be a non-empty list of positive integers, got {list(t)!r}")
            object.__setattr__(self, "tree", t)
        derived = self.num_speculative_tokens is None and self.tree is not None
        if self.num_speculative_tokens is None:
            if self.tree is not None:
                n = self.tree[0] * 5 if self.method == "ngram" else ExpansionConfig(self.tree).num_nodes
                object.__setattr__(self, "num_speculative_tokens", n)
            elif self.method == "ngram":
                object.__setattr__(self, "num_speculative_tokens", 5)
            else:
                raise err(f"num_speculative_tokens is required for method {self.method!r} without a tree")
        pos_int("num_speculative_tokens", allow_none=False)
        if self.num_speculative_tokens > 64:
            if derived:
                raise err(f"the tree {list(self.tree)} gives {self.num_speculative_tokens} speculative tokens; "
                          "at most 64 (a smaller tree, or set num_speculative_tokens)")
            raise err(f"num_speculative_tokens must be at most 64, got {self.num_speculative_tokens}")
        pos_int("prompt_lookup_max", allow_none=False)
        pos_int("prompt_lookup_min", allow_none=False)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise err(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                      f"({self.prompt_lookup_max})")
        pos_int("draft_num_kv_blocks")
        pos_int("num_layers")
        if self.draft_dtype not in _DTYPES:
            raise err(f"draft_dtype must be one of {list(_DTYPES)}, got {self.draft_dtype!r}")
        if self.quantization is not None:
            from pageflash.layers.linear import QUANTIZATION_METHODS

            if self.quantization not in QUANTIZATION_METHODS:
                raise err(f"quantization must be null or one of {list(QUANTIZATION_METHODS)}, got "
                          f"{self.quantization!r}")
            if self.method != "draft_model":
                raise err(f"quantization applies to a draft model (method 'draft_model'), not {self.method!r}")
        if not isinstance(self.adaptive, bool):
            raise err(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "draft_model" and not self.model:
            raise err("method 'draft_model' needs 'model' (the draft model's name, folder or .gguf file)")
        if self.method == "draft_model":  # found now, not after the target has loaded (no load here)
            from pageflash.model.loader import resolve_model

            try:
                resolve_model(self.model, self.draft_load_format)
            except ValueError as e:
                raise err(f"the draft model: {e}") from None
        if self.method == "medusa" and not self.medusa_path:
            raise err("method 'medusa' needs 'medusa_path' (heads written by `pageflash train-medusa`)")
        if self.method == "early_exit" and self.num_layers is None:
            raise err("method 'early_exit' needs 'num_layers' (the target's first L layers draft)")

    @property
    def expansion(self) -> Optional[ExpansionConfig]:
        """The tree's expansion config, or None for chains."""
        return ExpansionConfig(self.tree) if self.tree is not None else None

    @classmethod
    def parse(cls, value: Union["SpeculativeConfig", dict, str]) -> "SpeculativeConfig":
        """From a SpeculativeConfig, a dict or a JSON object string. Unknown keys raise ValueError."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from e
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError(f"speculative_config: 'method' is required (one of {list(METHODS)})")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["tree"] is not None:
            d["tree"] = list(d["tree"])
        return d
