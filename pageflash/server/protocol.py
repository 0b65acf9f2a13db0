"""Pydantic models of the OpenAI request and response bodies that the server speaks.

Requests follow OpenAI's /v1/completions and /v1/chat/completions plus vLLM's sampling extras
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output, skip_special_tokens). Types are strict (a string is not a number), so a
wrong type is a 400 rather than a silent coercion; limits that the spec names (max_tokens >= 1,
temperature >= 0, 0 < top_p <= 1, n >= 1, non-empty messages, known roles) are checked here so that
the error names the field. Everything else is checked by SamplingParams and the engine.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

# n per prompt (OpenAI's limit); prompts x n per HTTP request is bounded in app.py (MAX_CHOICES).
MAX_N = 128

Float = float  # strict float: JSON ints are accepted, strings and booleans are not


def _unless_asked(v: Any, empty_dict: bool = False) -> Any:
    """An unimplemented option's value if it asks for nothing (null, false, an empty list or string;
    with empty_dict an empty object too: chat_template_kwargs), else the 400. An empty object
    elsewhere (guided_json: {}, the schema of any JSON value) does ask for something."""
    if v is None or v is False or v == [] or v == "" or (empty_dict and v == {}):
        return v
    raise ValueError("not supported by this server (leave it out)")


class _Strict(BaseModel):
    # strict: no "5" -> 5; extra fields (e.g. user, logit_bias) are ignored as vLLM does.
    model_config = ConfigDict(strict=True, extra="ignore")
    # fields whose JSON null means "the default" (OpenAI marks them nullable; clients send nulls)
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _nulls_to_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls.NULL_IS_DEFAULT):
            data = {k: v for k, v in data.items() if not (v is None and k in cls.NULL_IS_DEFAULT)}
        return data


class StreamOptions(_Strict):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints; bounds that the issue names are enforced here."""

    NULL_IS_DEFAULT = ("n", "add_generation_prompt")
    model: StrictStr | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    # no upper bound, as vLLM's (OpenAI's is 2; /v1/responses keeps it): SamplingParams refuses what
    # float32 cannot hold
    temperature: Float | None = Field(None, ge=0.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = None
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = None
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Float | None = Field(None, gt=0.0)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt | None = Field(None, ge=0)
    ignore_eos: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # OpenAI's: {"token id": bias in [-100, 100]} (checked by SamplingParams, token ids against the vocabulary by the engine)
    logit_bias: dict[str, Any] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its
    # earlier guided_* fields (at most one of them per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    _structured: dict[str, Any] | None = PrivateAttr(None)
    _structured_field: str = PrivateAttr("structured_outputs")
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: Any = None
    allowed_token_ids: list[StrictInt] | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    # vLLM's: the prompt's tokens' logprobs and top k (completions: per choice; chat: the response's);
    # -1: the whole vocabulary (as vLLM; the server's --max-logprobs must allow it)
    prompt_logprobs: StrictInt | None = Field(None, ge=-1)
    bad_words: list[StrictStr] | None = None
    # vLLM's extra parameters that change the result and that pageflash does not implement: asking
    # for one (anything but null / false) is a 400 naming it, not a silently different result.
    logits_processors: Any = None
    # vLLM's beam search: n beams (beam_width = n), ranked by cum_logprob / len ** length_penalty
    use_beam_search: StrictBool | None = None
    length_penalty: Float | None = None
    # vLLM's: logprobs name each token "token_id:ID" (tokens that are not valid text alone stay apart)
    return_tokens_as_token_ids: StrictBool | None = None

    @field_validator("guided_whitespace_pattern", "logits_processors")
    @classmethod
    def _not_implemented(cls, v: Any) -> Any:
        return _unless_asked(v)

    @model_validator(mode="after")
    def _one_constraint(self) -> "_SamplingFields":
        self._structured = self._structured_outputs()
        return self

    @property
    def structured_from(self) -> str:
        """The request field the output constraint came from (what a 400 about it names)."""
        return self._structured_field

    def _structured_outputs(self) -> dict[str, Any] | None:
        """The request's constraint as StructuredOutputsParams fields, or None."""
        asked: dict[str, dict[str, Any]] = {}
        rf = self.response_format
        if rf is not None:
            if "type" not in rf:  # (OpenAI and vLLM require it)
                raise ValueError("response_format needs a type: 'text', 'json_object' or 'json_schema'")
            kind = rf["type"]
            if kind == "json_object":
                asked["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format json_schema needs json_schema.schema, a JSON schema object")
                asked["response_format"] = {"json": schema}
            elif kind != "text":
                raise ValueError(f"response_format type {kind!r} is not supported; "
                                 "use 'text', 'json_object' or 'json_schema'")  # fmt: skip
        if self.structured_outputs:
            asked["structured_outputs"] = dict(self.structured_outputs)
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
            v = getattr(self, name)
            if v is not None and v != "" and v != []:  # as _unless_asked: "" and [] ask for nothing
                asked[name] = {key: v}
        if len(asked) > 1:
            raise ValueError(f"{', '.join(asked)}: give at most one output constraint")  # (the 400 names the first)
        self._structured_field = next(iter(asked), "structured_outputs")
        return next(iter(asked.values()), None)

    # what a beam search request may set besides n and the length limit (sampling_kwargs' names)
    BEAM_FIELDS: ClassVar[frozenset[str]] = frozenset({"n", "temperature", "seed", "ignore_eos"})

    def beam_search_conflicts(self) -> list[str]:
        """The fields set that beam search does not take (it ranks the model's own log-probabilities:
        no sampling knobs, constraints, stop strings or logprobs), besides a non-zero temperature."""
        from pageflash.sampling_params import SamplingParams

        defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
        kw = self.sampling_kwargs()
        # a field sent at its default value asks for nothing (clients send presence_penalty: 0 and such)
        bad = sorted(self.structured_from if k == "structured_outputs" else k for k, v in kw.items()
                     if k not in self.BEAM_FIELDS and v != defaults.get(k, object()) and v not in ([], {}))
        if kw.get("temperature"):
            bad.append("temperature")
        if self.stream:
            bad.append("stream")
        return bad

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as vLLM)")
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments this request sets (None = engine default)."""
        names = (
            "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "stop_token_ids", "min_tokens",
            "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
            "allowed_token_ids", "bad_words", "prompt_logprobs", "logit_bias",
        )  # fmt: skip
        kw = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self._structured is not None:
            kw["structured_outputs"] = self._structured
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: usage on every chunk, only together with include_usage."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


# --------------------------------------------------------------------------- completions
PromptType = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


def _prompt_list(p: Any, field: str, limit: int | None = None) -> list[str | list[int]]:
    """A string, token ids, or a list of either, as a list of prompts (at most limit of them)."""
    if isinstance(p, str):
        return [p]
    if not p:
        raise ValueError(f"{field} must not be empty")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if limit is not None and len(p) > limit:
        raise ValueError(f"at most {limit} {field}s per request, got {len(p)}")
    return list(p)


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    echo: StrictBool | None = False  # before max_tokens, whose check reads it
    max_tokens: StrictInt | None = Field(16, ge=0)  # 0: only with echo (the prompt's logprobs, vLLM)
    logprobs: StrictInt | None = Field(None, ge=0)
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @field_validator("max_tokens")
    @classmethod
    def _zero_needs_echo(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v == 0 and not info.data.get("echo"):
            raise ValueError("must be at least 1, or 0 with echo (the prompt alone, with its logprobs if asked)")
        return v

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (best_of > n is not supported)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        return _prompt_list(self.prompt, "prompt")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # OpenAI's: prompt tokens served from the prefix cache
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of prompt_logprobs: one token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token, keyed by token id; the first null


class _WithPromptLogprobs(BaseModel):
    """prompt_logprobs (vLLM's field) appears only when asked for."""

    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        d = handler(self)
        if d.get("prompt_logprobs") is None:
            d.pop("prompt_logprobs", None)
        return d


class CompletionChoice(_WithPromptLogprobs):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------- chat
ROLES = ("system", "developer", "user", "assistant", "tool")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class RefusalPart(_Strict):
    """An assistant message's refusal (OpenAI); the template sees its text."""

    type: Literal["refusal"]
    refusal: StrictStr

    @property
    def text(self) -> str:
        return self.refusal


CONTENT_PART_TYPES = ("text", "refusal")


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Roles are checked by hand so that an unknown one gets a clear message naming the known ones.
    model_config = ConfigDict(strict=True, extra="ignore")
    role: StrictStr
    content: StrictStr | list[TextPart | RefusalPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls

    @model_validator(mode="before")
    @classmethod
    def _part_types(cls, data: Any) -> Any:
        # an unsupported part (image_url, input_audio, file) gets one clear message, not a union error
        parts = data.get("content") if isinstance(data, dict) else None
        if isinstance(parts, list):
            for part in parts:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in CONTENT_PART_TYPES:
                    raise ValueError(f"content part type {kind!r} is not supported; this server takes "
                                     f"{' and '.join(CONTENT_PART_TYPES)} parts")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _check(self) -> "ChatMessage":
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {', '.join(ROLES)}")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role} ones")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # text parts one a line, as vLLM joins them


class ToolFunction(_Strict):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


class _ChoiceName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _ChoiceName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM's; --max-logprobs -1)
    add_generation_prompt: StrictBool = True
    # Function calling: the tools go to the chat template; tool_choice "required" or a named function
    # constrains the output to their arguments' JSON (structured outputs), answered as tool_calls.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    _tool_choice: Any = PrivateAttr("none")
    # Not supported; present so that asking for them is a clear 400 rather than silently ignored.
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM's chat extras: echo the open last message, continue it, another template (the server must
    # trust request templates), extra template variables
    echo: StrictBool | None = False
    continue_final_message: StrictBool | None = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: Any = None  # not implemented: a 400 unless null / []
    # vLLM's: with a --reasoning-parser, false leaves the reasoning out of the response
    include_reasoning: StrictBool = True

    @field_validator("documents")
    @classmethod
    def _chat_not_implemented(cls, v: Any) -> Any:
        return _unless_asked(v)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        from pageflash.llm import RESERVED_TEMPLATE_KWARGS  # (one list, LLM.chat's)

        bad = sorted(set(v or ()) & set(RESERVED_TEMPLATE_KWARGS))
        if bad:
            raise ValueError(f"{', '.join(bad)} cannot be set through chat_template_kwargs (use the request's own fields)")
        return v

    @model_validator(mode="after")
    def _check(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be true: "
                                 "send add_generation_prompt: false to continue the last message")
            if self.messages[-1].role != "assistant":
                raise ValueError(f"continue_final_message continues an assistant message, but the last message "
                                 f"is a {self.messages[-1].role} one")  # fmt: skip
        if self.functions:
            raise ValueError("functions (the deprecated function calling) are not supported; use tools")
        if self.function_call not in (None, "none"):
            raise ValueError("function_call (the deprecated function calling) is not supported; use tools and tool_choice")
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if choice != "none" and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice_name!r} needs tools")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among "
                                 f"the tools ({', '.join(names)})")  # fmt: skip
        if choice not in ("none", "auto") and self._structured_outputs() is not None:
            raise ValueError("tool_choice calling tools constrains the output already: leave out "
                             "response_format / structured_outputs / guided_*")
        self._tool_choice = choice
        if choice not in ("none", "auto"):  # "auto": free text, read by the server's tool-call parser
            self._structured = {"json": self.tool_schema()}
            self._structured_field = "tools"
        return self

    @property
    def response_role(self) -> str:
        """The reply's role (vLLM's rule): the assistant's after a generation prompt, else the last
        message's (the one the reply continues)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echo_prefix(self) -> str:
        """With echo, the text the reply starts with: the last message's, if it has the reply's role,
        else nothing (vLLM's rule)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role else ""

    @property
    def tool_choice_name(self) -> str:
        c = self.tool_choice
        return c.function.name if isinstance(c, NamedToolChoice) else str(c)

    @property
    def calls_tools(self) -> Literal["named", "required", "auto"] | None:
        """How this request's output is read: one named function's arguments, a list of calls, text
        that may hold calls (auto), or text."""
        c = self._tool_choice
        if isinstance(c, NamedToolChoice):
            return "named"
        return c if c in ("required", "auto") else None

    def tool_schema(self) -> dict[str, Any]:
        """The JSON schema the output follows: the named function's parameters, or (required) a list of
        {"name", "parameters"} objects, one of the tools each (at most one with parallel_tool_calls false)."""
        c = self._tool_choice
        tools = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools or []}
        if isinstance(c, NamedToolChoice):
            return tools[c.function.name]
        # Each tool's $defs move to the root, where its "#/$defs/..." references point (as vLLM does).
        defs: dict[str, Any] = {}
        items = []
        for name, params in tools.items():
            params = dict(params)
            own = params.pop("$defs", None) or {}
            if not isinstance(own, dict):
                raise ValueError(f"tools: function {name!r}: parameters.$defs must be an object (a schema per "
                                 f"name), got {type(own).__name__}")
            for key, value in own.items():
                if key in defs and defs[key] != value:
                    raise ValueError(f"tools: the definition {key!r} has different schemas in different tools")
                defs[key] = value
            items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                           "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})  # fmt: skip
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if defs:
            schema["$defs"] = defs
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (HF's {"type": "function", "function": {...}})."""
        if not self.tools:
            return None
        return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in self.tools]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template: plain-text content; 'developer' is OpenAI's new 'system'."""
        from pageflash.llm import json_or_text  # (one definition, shared with LLM.chat)

        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": m.text()}
            if m.tool_calls:  # arguments as objects, as chat templates expect them (vLLM does the same)
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": json_or_text(c.function.arguments)}}
                                     for c in m.tool_calls]  # fmt: skip
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # with a --reasoning-parser: the model's thought (vLLM's `reasoning`; `reasoning_content`, its
    # earlier name, for the clients that read that); left out otherwise
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset_reasoning(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k not in ("reasoning", "reasoning_content")}


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_WithPromptLogprobs):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    """A streamed chat delta; unset fields are left out, as OpenAI does ({"content": "..."})."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # (and reasoning_content: the same text, see ChatResponseMessage)
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # {"index", "id"?, "type"?, "function": {"name"?, "arguments"}}

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


# --------------------------------------------------------------------------- /v1/responses
class ResponsesRequest(_Strict):
    """OpenAI's Responses API, the stateless text subset: `input` (a string, or message items whose
    content is a string or input_text / output_text parts), `instructions` (a system message first),
    `max_output_tokens`, `temperature`, `top_p`, `text.format` (text, json_object, json_schema),
    `stream`, and the sampling extras both generation endpoints take. Nothing is stored."""

    NULL_IS_DEFAULT = ("store", "parallel_tool_calls", "truncation")
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    stream: StrictBool | None = False
    store: StrictBool = True  # accepted; responses are never stored here
    metadata: dict[StrictStr, StrictStr] | None = None  # OpenAI's: string keys and values (echoed back)
    user: StrictStr | None = None
    parallel_tool_calls: StrictBool = True
    truncation: Literal["disabled", "auto"] = "disabled"
    tool_choice: Any = None
    # not served here: a 400 naming the field unless left empty / null
    tools: list[Any] | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    prompt: Any = None  # a stored prompt template
    background: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[Any] | None = None
    top_logprobs: StrictInt | None = None
    # vLLM's sampling extras, as on the other endpoints
    top_k: StrictInt | None = None
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    seed: StrictInt | None = None
    repetition_penalty: Float | None = Field(None, gt=0.0)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    stop: StrictStr | list[StrictStr] | None = None
    # vLLM's output constraints, as on the other endpoints (at most one, text.format included)
    structured_outputs: dict[str, Any] | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @field_validator("text")
    @classmethod
    def _json_compliant(cls, v: Any) -> Any:
        # echoed back in the response: a NaN or an overflowing 1e400 (inf) there could not be sent as JSON
        try:
            json.dumps(v, allow_nan=False)
        except ValueError:
            raise ValueError("must hold only finite numbers (no NaN, Infinity or out-of-range values like 1e400)") from None
        return v

    @field_validator("tools", "include")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported on /v1/responses by this server (use /v1/chat/completions for tools)")
        return v

    @field_validator("previous_response_id", "conversation", "prompt", "background", "reasoning", "top_logprobs")
    @classmethod
    def _stateless(cls, v: Any) -> Any:
        if v is None or v is False or v == {} or v == 0:
            return v
        raise ValueError("not supported by this server's /v1/responses (it is stateless and stores nothing)")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto"):
            return v
        raise ValueError('must be "none" or "auto": this server takes no tools on /v1/responses')

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return v
        if not v:
            raise ValueError("must hold at least one item")
        for i, item in enumerate(v):
            kind = item.get("type", "message")
            if kind != "message":
                raise ValueError(f"item {i}: type {kind!r} is not supported; this server takes message items")
            if not isinstance(item.get("role"), str):
                raise ValueError(f"item {i}: a message needs a role")
            content = item.get("content")
            if isinstance(content, list):
                for part in content:
                    ptype = part.get("type") if isinstance(part, dict) else None
                    if ptype not in ("input_text", "output_text"):
                        raise ValueError(f"item {i}: content part type {ptype!r} is not supported; this server "
                                         "takes input_text and output_text parts")  # fmt: skip
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"item {i}: an {ptype} part's text must be a string")
            elif not isinstance(content, str):
                raise ValueError(f"item {i}: content must be a string or a list of text parts")
        return v

    def chat_request(self, drop: int = 0) -> dict[str, Any]:
        """The equivalent chat completions request (as a dict for ChatCompletionRequest); drop: leave
        out that many of the oldest input items (truncation "auto")."""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input[drop:]
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in items:
            content = item["content"]
            if isinstance(content, list):
                content = "\n".join(part["text"] for part in content)  # (as chat's text parts)
            messages.append({"role": item["role"], "content": content})
        out: dict[str, Any] = {"messages": messages, "max_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "stop", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar"):
            out[name] = getattr(self, name)
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
                raise ValueError("text.format.type must be text, json_object or json_schema")
            if fmt["type"] == "json_schema":
                out["response_format"] = {"type": "json_schema", "json_schema": {
                    k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}  # fmt: skip
            else:
                out["response_format"] = {"type": fmt["type"]}
        return {k: v for k, v in out.items() if v is not None}


# --------------------------------------------------------------------------- /v1/embeddings
MAX_EMBED_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request (and vLLM's truncate_prompt_tokens, add_special_tokens)."""

    model: StrictStr | None = None
    input: PromptType
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    add_special_tokens: StrictBool = True

    def inputs(self) -> list[str | list[int]]:
        return _prompt_list(self.input, "input", MAX_EMBED_INPUTS)


# --------------------------------------------------------------------------- /tokenize, /detokenize
class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt (add_special_tokens default true), or chat messages through the chat
    template (add_special_tokens default false: the template writes them), never both."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Any] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            got = "neither" if self.prompt is None else "both"
            raise ValueError(f"prompt or messages: give exactly one of them (got {got})")
        return self

    def chat_fields(self) -> dict[str, Any]:
        """The fields a ChatCompletionRequest takes from this request."""
        names = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                 "chat_template_kwargs", "tools")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


# --------------------------------------------------------------------------- models, errors
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pageflash"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field; null for the base itself)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id: taken, as vLLM's, and not needed)."""

    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
