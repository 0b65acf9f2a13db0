"""Offline entry point with vLLM's habits: LLM(model=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Callable, Optional, Sequence, Union

import jinja2

from pageflash.engine.engine import EngineConfig, LLMEngine, PromptType, check_text, is_array
from pageflash.lora.request import LoRARequest
from pageflash.model.registry import DEFAULT_MODEL
from pageflash.outputs import RequestOutput
from pageflash.sampling_params import MAX_LOGPROBS, PoolingParams, SamplingParams

Conversation = list[dict[str, Any]]

# apply_chat_template's own arguments: chat_template_kwargs cannot set them (here and in the server's requests)
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "return_dict", "return_tensors", "tokenizer_kwargs")

# vLLM options with no effect here, and the values that are accepted (None: any)
VLLM_COMPAT_OPTIONS: dict[str, Optional[tuple]] = {
    "trust_remote_code": None,  # only the built-in architectures run; no remote code is ever loaded
    "tokenizer_mode": ("auto", "hf"),  # the model folder's HF tokenizer
    # models are local paths (no hub): where to download and which revision do not apply, as in vLLM
    # for a local path
    "revision": None, "tokenizer_revision": None, "download_dir": None,
    "disable_log_stats": None,  # statistics are kept, not logged
    "enable_chunked_prefill": (True, None),  # prefill is always chunked (as vLLM V1)
    "swap_space": None, "cpu_offload_gb": (0, 0.0, None),  # preemption recomputes; nothing is offloaded
    "served_model_name": None,  # offline: nothing is served
    "max_seq_len_to_capture": None, "disable_custom_all_reduce": None,
    # LoRA: adapters in the model's dtype (vLLM's "auto"); sharding adapters needs tensor parallelism,
    # which LoRA does not run with here
    "lora_dtype": ("auto", None), "fully_sharded_loras": (False, None),
}


def check_vllm_options(options: dict[str, Any]) -> None:
    """Raise for an option LLM() does not know, or a value of a known vLLM option that would need a
    feature pageflash lacks (a hub revision, a non-HF tokenizer mode...)."""
    for name, value in options.items():
        if name not in VLLM_COMPAT_OPTIONS:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        allowed = VLLM_COMPAT_OPTIONS[name]
        if allowed is not None and value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported here (accepted: "
                             f"{', '.join(repr(a) for a in allowed)})")


class LLM:
    """Holds an LLMEngine; generate() and chat() run it until every submitted request finishes."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        tokenizer: Optional[str] = None,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: Optional[int] = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: Optional[int] = None,
        max_model_len: Optional[int] = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        load_format: str = "auto",
        attention_backend: str = "auto",
        quantization: Optional[str] = None,
        kv_cache_dtype: str = "auto",
        enforce_eager: bool = False,
        async_scheduling: Optional[bool] = None,
        speculative_config: Optional[Union[dict, str, Any]] = None,
        tensor_parallel_size: int = 1,
        generation_config: str = "auto",
        override_generation_config: Optional[Union[dict, str]] = None,
        max_logprobs: int = MAX_LOGPROBS,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: Optional[int] = None,
        **vllm_options: Any,
    ) -> None:
        """Engine settings as EngineConfig's. speculative_config: e.g. {"method": "ngram",
        "num_speculative_tokens": 5}; see pageflash.spec.config.SpeculativeConfig. enable_lora:
        generate / chat / embed take lora_request (pageflash.lora.LoRARequest), up to max_loras
        adapters of rank <= max_lora_rank on the device at once.

        vllm_options: vLLM's LLM(...) options that have nothing to change here are taken, so that
        scripts written for vLLM run (VLLM_COMPAT_OPTIONS says what each means here); any other
        keyword is a TypeError naming it."""
        check_vllm_options(vllm_options)
        self.llm_engine = LLMEngine(
            EngineConfig(
                model=model, tokenizer=tokenizer, dtype=dtype, device=device, block_size=block_size,
                num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching, seed=seed,
                load_format=load_format, attention_backend=attention_backend, quantization=quantization,
                kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager, async_scheduling=async_scheduling,
                speculative_config=speculative_config, tensor_parallel_size=tensor_parallel_size,
                generation_config=generation_config, override_generation_config=override_generation_config,
                max_logprobs=max_logprobs,
                enable_lora=enable_lora, max_loras=max_loras,
                max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            )
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (tensor_parallel_size > 1; also done when this
        object is collected or the process exits)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() / chat() use without sampling_params: SamplingParams' defaults, with the
        model's generation_config.json's temperature / top_p / top_k / min_p / repetition_penalty and
        max_new_tokens (as max_tokens), and override_generation_config's over them (as vLLM)."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def reset_prefix_cache(self) -> int:
        """Forget cached prompt blocks no request holds (as vLLM's); returns how many."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
        priority: Optional[list[int]] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a str, a {"prompt_token_ids": [...]} dict, token ids, or a list of
        these; token ids may be a list of ints or a numpy array / torch tensor, 2-D for a batch).
        lora_request: the LoRA adapter for every prompt, or a list of one per prompt (None: the base
        model); needs LLM(enable_lora=True). use_tqdm: a progress bar, or a tqdm-like callable to make
        it (as vLLM's). priority: vLLM's, one per prompt; the scheduler is first-come first-served
        (vLLM's default policy), so only 0s are taken, as vLLM takes them without priority scheduling.

        Every prompt is validated before any is queued, so a bad one raises (naming its index)
        without leaving half a batch behind.
        """
        prompts = self._as_prompt_list(prompts)
        if priority is not None:
            if not isinstance(priority, (list, tuple)) or len(priority) != len(prompts):
                raise ValueError(f"priority must be a list of one int per prompt ({len(prompts)}), got {priority!r:.80}")
            if any(p != 0 for p in priority):
                raise ValueError("priority needs priority scheduling, which this engine does not have (it serves "
                                 "requests first come, first served, vLLM's default policy): give 0s or None")
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, (SamplingParams, PoolingParams)):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, dict):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, got a dict: "
                            "pass SamplingParams(**your_dict)")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts; they must match")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        elif isinstance(lora_request, (list, tuple)):
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts; they must match")
        else:
            raise TypeError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, got "
                            f"{type(lora_request).__name__}")
        eng = self.llm_engine
        encoded = []
        held = []  # the adapters checked below, held until their requests hold them (each read once)
        for i, (p, sp, lora) in enumerate(zip(prompts, params, loras)):
            try:
                if not isinstance(sp, (SamplingParams, PoolingParams)):
                    raise TypeError(f"sampling params must be a SamplingParams, got {type(sp).__name__}")
                if lora is not None:
                    held.append(eng.get_lora(lora))  # read and checked before anything is queued
                text, ids = eng.tokenize_prompt(p)
                ids = sp.truncate_prompt(ids, eng.max_model_len)
                eng.validate_request(ids, sp, strict_length=False)  # (as vLLM: stops at the context)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from e
            encoded.append(({"prompt": text, "prompt_token_ids": ids} if text is not None else ids, sp, lora))
        return self._run(encoded, use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list:
        """One prompt or a batch of them, as a list of prompts."""
        if is_array(prompts):
            prompts = prompts.tolist()  # numpy / torch token ids: one prompt (1-D) or a batch (2-D)
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and _is_token_id(prompts[0])
        ):
            return [prompts]  # one prompt
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise TypeError("prompts must be a str, a prompt dict, a list of token ids, or a list of these; got "
                            f"{type(prompts).__name__}")  # fmt: skip
        return list(prompts)

    def chat(
        self,
        messages: Union[Conversation, Sequence[Conversation]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict]] = None,
        chat_template_kwargs: Optional[dict] = None,
        mm_processor_kwargs: Optional[dict] = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        As vLLM's LLM.chat, its arguments in its order: lora_request as generate's (one per
        conversation for a list); chat_template replaces the tokenizer's;
        chat_template_content_format: how a message's content reaches the template, "string" (its
        text; "auto" does the same) or "openai" (a list of {"type": "text", "text": ...} parts, for
        templates that loop over parts); continue_final_message leaves the last (assistant) message
        open for the output to continue (add_generation_prompt must then be False); tools (OpenAI's
        {"type": "function", "function": {...}} dicts) and chat_template_kwargs go to the template;
        mm_processor_kwargs: vLLM's multimodal options, refused (no multimodal inputs here)."""
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                             f"{chat_template_content_format!r}")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: this engine takes no multimodal inputs")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        if tools is not None and (not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)):
            raise TypeError(f"tools must be a list of tool dicts ({{'type': 'function', 'function': {{...}}}}) or None, "
                            f"got {tools!r:.80}")  # fmt: skip
        if chat_template_kwargs is not None:
            if not isinstance(chat_template_kwargs, dict):
                raise TypeError(f"chat_template_kwargs must be a dict or None, got {type(chat_template_kwargs).__name__}")
            reserved = sorted(set(chat_template_kwargs) & set(RESERVED_TEMPLATE_KWARGS))
            if reserved:
                raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)} (chat()'s own arguments)")
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a str (a Jinja template) or None, got {type(chat_template).__name__}")
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if not isinstance(messages, (list, tuple)):
            raise TypeError(f"messages must be a list of message dicts (or a list of such lists), got "
                            f"{type(messages).__name__}")  # fmt: skip
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            if not isinstance(conv, (list, tuple)):
                raise TypeError(f"a conversation must be a list of message dicts, got {type(conv).__name__}")
            if not conv:
                raise ValueError("messages is empty: a conversation needs at least one message")
            for m in conv:
                # (an assistant turn that only calls tools may leave its content out, as OpenAI's API allows)
                if not isinstance(m, dict) or "role" not in m or ("content" not in m and m["role"] != "assistant"):
                    raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
                if not isinstance(m["role"], str) or not m["role"]:
                    raise ValueError(f"a message's role must be a non-empty str, got {m['role']!r}")
            conv = [_template_message(m, parts=chat_template_content_format == "openai") for m in conv]
            if continue_final_message and conv[-1].get("role") != "assistant":
                raise ValueError("continue_final_message continues an assistant message, but the last message "
                                 f"is a {conv[-1].get('role')!r} one")  # fmt: skip
            try:
                text = tok.apply_chat_template(
                    conv, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                    continue_final_message=continue_final_message, tools=tools, **(chat_template_kwargs or {}),
                )
            except jinja2.TemplateSyntaxError as e:  # (a TemplateError too: first)
                raise ValueError(f"chat_template is not a valid Jinja template: {e}") from e
            except jinja2.TemplateError as e:  # the template refused the conversation (raise_exception), or failed on it
                raise ValueError(f"messages: the chat template cannot render this conversation: "
                                 f"{type(e).__name__}: {e}") from e
            check_text(text, "messages")
            # The template already holds any BOS: tokenize without adding special tokens again.
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[Any] = None,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list:
        """vLLM's LLM.embed: one EmbeddingRequestOutput per prompt (``.outputs.embedding``), the final
        hidden state at the prompt's last token, normalized (PoolingParams: normalize, dimensions,
        truncate_prompt_tokens; one for all prompts or one per prompt). Runs in the same engine as
        generation (prefix cache included); a prompt may fill max_model_len. lora_request: as generate's."""
        from pageflash.outputs import EmbeddingOutput, EmbeddingRequestOutput

        n = len(self._as_prompt_list(prompts))
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * n
        pooling_params = list(pooling_params) if isinstance(pooling_params, (list, tuple)) else [pooling_params]
        for pp in pooling_params:
            if not isinstance(pp, PoolingParams):
                raise TypeError(f"pooling_params must be a PoolingParams or a list of them, got {type(pp).__name__}")
        if len(pooling_params) != n:
            raise ValueError(f"got {len(pooling_params)} pooling_params for {n} prompts; they must match")
        outs = self.generate(prompts, pooling_params, use_tqdm, lora_request=lora_request)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding), o.prompt_token_ids) for o in outs]

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: Any,
                    lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
                    use_tqdm: bool = False) -> list:  # fmt: skip
        """vLLM's beam search (pageflash.beam_search), with vLLM's argument order: params a
        BeamSearchParams; lora_request as generate's (one adapter for every prompt, or one per
        prompt); one BeamSearchOutput (its .sequences, best first) per prompt."""
        from pageflash.beam_search import beam_search

        return beam_search(self, self._as_prompt_list(prompts), params, use_tqdm, lora_request)

    def _run(self, items: list, use_tqdm: Union[bool, Callable[..., Any]]) -> list[RequestOutput]:
        eng = self.llm_engine
        ids = []
        try:
            for prompt, sp, lora in items:
                ids.append(eng.add_request(None, prompt, sp, lora_request=lora))
        except BaseException:  # (generate validated every prompt: this is not expected) nothing left queued
            eng.abort_request(ids)
            raise
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            if callable(use_tqdm):  # vLLM's: a tqdm-like factory
                tqdm = use_tqdm
            else:
                from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in eng.step(final_only=True):
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            eng.abort_request(list(pending))  # leave no blocks behind (Ctrl-C, errors)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]


def _is_token_id(x: Any) -> bool:
    return not isinstance(x, bool) and (isinstance(x, int) or (hasattr(x, "__index__") and not is_array(x)))


def _template_message(m: dict[str, Any], parts: bool = False) -> dict[str, Any]:
    """A message as chat templates take it: plain-text content (parts: as OpenAI text parts,
    [{"type": "text", "text": ...}], vLLM's "openai" content format); tool calls' JSON arguments as
    objects (as the server and vLLM pass them)."""
    content = m.get("content")
    text = _message_text(content)  # (checks the parts)
    if parts:
        texts = [] if content is None else [content] if isinstance(content, str) else [p["text"] for p in content]
        out = {**m, "content": [{"type": "text", "text": t} for t in texts]}
    else:
        out = {**m, "content": text}
    if isinstance(m.get("tool_calls"), list):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": json_or_text(c["function"].get("arguments", "{}"))}}
            if isinstance(c, dict) and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("arguments", "{}"), str) else c
            for c in m["tool_calls"]
        ]
    return out


def json_or_text(text: str) -> Any:
    """A tool call's JSON arguments as an object (as chat templates expect them), or the text itself
    when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _message_text(content: Any) -> str:
    """A chat message's content as the template's text: a str, None (an assistant turn with no text),
    or OpenAI-style parts ``[{"type": "text", "text": ...}]``, joined one a line (as vLLM joins them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"message content parts must be {{'type': 'text', 'text': str}}, got {part!r}")
            out.append(part["text"])
        return "\n".join(out)
    raise TypeError(f"message content must be a str, a list of text parts or None, got {type(content).__name__}")
