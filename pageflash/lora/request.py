"""LoRARequest: which adapter a request runs under, as vLLM's ``vllm.lora.request.LoRARequest``."""

from __future__ import annotations

from typing import Optional

__all__ = ["LoRARequest"]


class LoRARequest:
    """A LoRA adapter to run a request under: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    lora_name: the adapter's name (the server's model name for it); lora_int_id: a positive integer
    unique per adapter in this engine (vLLM's rule: 0 and negatives are refused); lora_path: a PEFT
    adapter folder (adapter_config.json + adapter_model.safetensors or .bin). base_model_name: the
    model it was trained on (the server shows it as the adapter's parent; not checked).
    As vLLM's, two requests are equal when their names are."""

    __slots__ = ("lora_name", "lora_int_id", "lora_path", "base_model_name")

    def __init__(self, lora_name: str, lora_int_id: int, lora_path: str = "",
                 base_model_name: Optional[str] = None, lora_local_path: Optional[str] = None) -> None:
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {lora_name!r}")
        if isinstance(lora_int_id, bool) or not isinstance(lora_int_id, int) or lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {lora_int_id!r}")
        path = lora_path or lora_local_path or ""  # (lora_local_path: vLLM's deprecated spelling)
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_path must name the adapter's folder, got {lora_path!r}")
        if base_model_name is not None and not isinstance(base_model_name, str):
            raise ValueError(f"base_model_name must be a string or None, got {base_model_name!r}")
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.lora_path = path
        self.base_model_name = base_model_name

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and other.lora_name == self.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    def __repr__(self) -> str:
        return (f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id}, "
                f"lora_path={self.lora_path!r})")
