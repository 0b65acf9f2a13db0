"""pageflash command line: generate (streams), chat (interactive), serve, bench.

  pageflash generate "prompt" [--chat] [sampling options]
  pageflash generate --input prompts.jsonl --output out.jsonl
  pageflash chat
  pageflash serve --model smollm2-135m --port 8000
  pageflash bench {latency,throughput,kernels,spec} ...
  pageflash train-medusa --output medusa.safetensors
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Optional

from pageflash.model.registry import DEFAULT_MODEL
from pageflash.sampling_params import MAX_LOGPROBS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help="short name, HF folder or .gguf file (default: %(default)s)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="auto")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action=argparse.BooleanOptionalAction,
                   default=True, help="vLLM's spelling of the above (default: on)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy", "gguf", "safetensors", "pt"])
    g.add_argument("--attention-backend", default="auto")
    g.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8"],
                   help="quantization of the decoder layers at load: int8 (weight-only, per-row int8 codes) or "
                        "fp8 (per-row e4m3 codes; W8A8 on FP8 tensor cores for larger products, as vLLM's fp8)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_e4m3"],
                   help="KV cache element type (auto: the model's dtype; int8 / fp8 (e4m3): codes with one "
                        "float32 scale per token and KV head, about half the bytes of bf16)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N's tokens are processed (default: on for CUDA)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many GPUs, cuda:0..N-1 (NCCL; on the CPU: N processes over gloo); "
                        "speculative decoding works over the ranks")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' '
                        "(methods: ngram, draft_model, medusa, early_exit; docs/SPEC.md)")
    g.add_argument("--enable-lora", action="store_true",
                   help="requests may run under LoRA adapters (serve: --lora-modules; generate / chat: --lora)")
    g.add_argument("--max-loras", type=int, default=1, help="adapters on the device at once (default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (default: %(default)s)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory once read (default: --max-loras)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="auto: the model folder's generation_config.json gives EOS ids and the default "
                        "temperature / top_p / top_k / min_p / repetition_penalty / max_new_tokens (as vLLM); "
                        "vllm: ignore it; a folder: its generation_config.json instead")
    g.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                   help="the most logprobs / prompt_logprobs a request may ask for per token (-1: the whole "
                        "vocabulary; default: %(default)s, as vLLM)")
    g.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help='defaults over --generation-config\'s, e.g. \'{"temperature": 0.6}\' (vLLM\'s; '
                        "max_new_tokens is also the server's ceiling on max_tokens)")
    # vLLM's flags that change nothing here, taken so that vLLM command lines run (pageflash.llm's
    # VLLM_COMPAT_OPTIONS says why each has no effect); values that would need a missing feature error
    c = p.add_argument_group("vLLM compatibility (no effect here)")
    for flag in ("--trust-remote-code", "--disable-log-stats", "--disable-custom-all-reduce",
                 "--fully-sharded-loras"):
        c.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    c.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill is always chunked (as vLLM V1)")
    for flag, kind in (("--swap-space", float), ("--max-seq-len-to-capture", int),
                       ("--revision", str), ("--tokenizer-revision", str), ("--download-dir", str),
                       ("--tokenizer-mode", str), ("--cpu-offload-gb", float), ("--lora-dtype", str)):
        c.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)


def _json_object(s: str) -> dict:
    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        model=a.model, tokenizer=a.tokenizer, dtype=a.dtype, device=a.device, block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks, gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len, enable_prefix_caching=a.enable_prefix_caching, seed=a.seed,
        load_format=a.load_format, attention_backend=a.attention_backend,
        quantization=getattr(a, "quantization", None), kv_cache_dtype=getattr(a, "kv_cache_dtype", "auto"),
        enforce_eager=a.enforce_eager,
        async_scheduling=getattr(a, "async_scheduling", None),
        speculative_config=getattr(a, "speculative_config", None),
        tensor_parallel_size=getattr(a, "tensor_parallel_size", 1),
        generation_config=getattr(a, "generation_config", "auto"),
        override_generation_config=getattr(a, "override_generation_config", None),
        max_logprobs=getattr(a, "max_logprobs", MAX_LOGPROBS),
        enable_lora=getattr(a, "enable_lora", False), max_loras=getattr(a, "max_loras", 1),
        max_lora_rank=getattr(a, "max_lora_rank", 16), max_cpu_loras=getattr(a, "max_cpu_loras", None),
    )


def check_vllm_flags(a: argparse.Namespace, error) -> None:
    """error(message) for a vLLM compatibility flag whose value would need a missing feature."""
    from pageflash.llm import VLLM_COMPAT_OPTIONS, check_vllm_options

    if getattr(a, "enable_chunked_prefill", None) is False:
        error("--no-enable-chunked-prefill is not supported: prefill is always chunked")
    given = {k: getattr(a, k) for k in VLLM_COMPAT_OPTIONS if getattr(a, k, None) is not None}
    given = {k: v for k, v in given.items() if v is not False}  # (store_true flags left off)
    try:
        check_vllm_options(given)
    except (TypeError, ValueError) as e:
        error(f"--{str(e).split('=')[0].replace('_', '-')}: {e}")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="default: the model's max_new_tokens (generation config), else 256")
    # unset: the model's generation_config.json default (EngineConfig.generation_config), else these
    g.add_argument("--temperature", type=float, default=None, help="(default: the model's, else 0.7)")
    g.add_argument("--top-p", type=float, default=None, help="(default: the model's, else 1.0)")
    g.add_argument("--top-k", type=int, default=None, help="(default: the model's, else -1: off)")
    g.add_argument("--min-p", type=float, default=None, help="(default: the model's, else 0.0)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="(default: the model's, else 1.0)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("-n", type=int, default=1)
    g.add_argument("--bad-word", dest="bad_words", action="append", default=None, metavar="WORD",
                   help="a word never to complete (repeatable)")
    so = p.add_argument_group("structured outputs (one at most)").add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="FILE_OR_JSON", help="the output is JSON satisfying this schema")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", help="the output matches this regular expression (Rust regex syntax)")
    so.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    so.add_argument("--grammar", metavar="FILE_OR_TEXT", help="the output follows this Lark or GBNF grammar")


def _file_or_text(value: str) -> str:
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def structured_outputs(a: argparse.Namespace) -> Optional[dict]:
    """The --json-schema / --json-object / --regex / --choice / --grammar constraint, or None."""
    if getattr(a, "json_schema", None) is not None:
        text = _file_or_text(a.json_schema)
        try:
            return {"json": json.loads(text)}
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema is neither a file nor JSON: {e}") from None
    if getattr(a, "json_object", False):
        return {"json_object": True}
    if getattr(a, "regex", None) is not None:
        return {"regex": a.regex}
    if getattr(a, "choice", None):
        return {"choice": a.choice}
    if getattr(a, "grammar", None) is not None:
        return {"grammar": _file_or_text(a.grammar)}
    return None


_CLI_SAMPLING_DEFAULTS = dict(temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)


def sampling_params(a: argparse.Namespace, model_defaults: Optional[dict] = None):
    """The flags' SamplingParams; the flags left unset take the model's defaults (its
    generation_config.json and --override-generation-config, LLMEngine.default_sampling), else
    _CLI_SAMPLING_DEFAULTS (and 256 tokens)."""
    from pageflash.sampling_params import SamplingParams

    defaults = model_defaults or {}
    knobs = {**_CLI_SAMPLING_DEFAULTS, **{k: v for k, v in defaults.items() if k in _CLI_SAMPLING_DEFAULTS}}
    knobs.update({k: getattr(a, k) for k in _CLI_SAMPLING_DEFAULTS if getattr(a, k, None) is not None})
    return SamplingParams(
        n=a.n, max_tokens=a.max_tokens if a.max_tokens is not None else defaults.get("max_tokens", 256),
        presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, seed=a.sample_seed, stop=a.stop, ignore_eos=a.ignore_eos,
        bad_words=getattr(a, "bad_words", None), structured_outputs=structured_outputs(a), **knobs,
    )


def _lora(a: argparse.Namespace):
    """--lora PATH as the LoRARequest every prompt runs under (None without it)."""
    if getattr(a, "lora", None) is None:
        return None
    from pageflash.lora.request import LoRARequest

    return LoRARequest(os.path.basename(os.path.normpath(a.lora)) or "lora", 1, a.lora)


def _stream(engine, prompt, params, out=None, lora=None) -> str:
    """Add one request and print its text as it grows; returns the final text (the first sample's).
    While it runs, the last len(longest stop string) - 1 characters wait: a stop string completed by
    a later token cuts them off, and nothing printed is taken back. With n > 1 the first sample streams
    under a "--- sample 1 of n ---" line, and the others follow, each under its own, once all are done.
    out: sys.stdout (as it is at the call) unless given."""
    out = sys.stdout if out is None else out
    from pageflash.engine.detokenizer import stop_holdback

    rid = engine.add_request(None, prompt, params, lora_request=lora)
    holdback = stop_holdback(params.stop, params.include_stop_str_in_output)
    printed = 0
    text = ""
    last = None
    if params.n > 1:
        out.write(f"--- sample 1 of {params.n} ---\n")
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id != rid:
                    continue
                last = o
                text = o.outputs[0].text
                ready = len(text) if o.finished else len(text) - holdback
                if ready > printed:
                    out.write(text[printed:ready])
                    out.flush()
                    printed = ready
    except KeyboardInterrupt:
        engine.abort_request(rid)
        raise
    out.write("\n")
    for c in (last.outputs[1:] if last is not None else ()):
        out.write(f"--- sample {c.index + 1} of {params.n} ---\n{c.text}\n")
    out.flush()
    return text


def _chat_prompt(engine, messages: list[dict]) -> dict:
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer, so no chat template")
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2's errors (a message without content, a role the template refuses)
        raise ValueError(f"the chat template refused the messages: {type(e).__name__}: {e}") from None
    return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def cmd_generate(a: argparse.Namespace) -> int:
    from pageflash.llm import LLM

    if (a.prompt is None) == (a.input is None):
        print("error: give a prompt or --input FILE (one of them; '-' reads standard input)", file=sys.stderr)
        return 2
    if a.prompt == "-":  # the prompt is standard input, whole (one trailing newline dropped, as `$(cat)` would)
        a.prompt = sys.stdin.read()
        if a.prompt.endswith("\n"):
            a.prompt = a.prompt[:-1]
        if not a.prompt.strip():
            print("error: the prompt read from standard input is empty", file=sys.stderr)
            return 2
    rows = []
    if a.input is not None:  # read (and --output checked) before the model loads
        name = "<stdin>" if a.input == "-" else a.input
        with (contextlib.nullcontext(sys.stdin) if a.input == "-" else open(a.input)) as f:
            for ln, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    print(f"error: {name}:{ln}: not JSON ({e})", file=sys.stderr)
                    return 2
        for i, r in enumerate(rows):
            if not isinstance(r, (str, dict)):
                print(f"error: {name}: row {i + 1} must be a JSON object or string, got {type(r).__name__}",
                      file=sys.stderr)  # fmt: skip
                return 2
            if isinstance(r, dict) and "messages" in r and not (
                isinstance(r["messages"], list) and all(isinstance(m, dict) for m in r["messages"])
            ):
                print(f"error: {name}: row {i + 1}: 'messages' must be a list of {{'role', 'content'}} objects",
                      file=sys.stderr)  # fmt: skip
                return 2
        out_dir = os.path.dirname(os.path.abspath(a.output)) if a.output else None
        if out_dir and not os.path.isdir(out_dir):
            print(f"error: --output: folder {out_dir!r} does not exist", file=sys.stderr)
            return 2
    llm = LLM(**engine_kwargs(a))
    params = sampling_params(a, llm.llm_engine.default_sampling)
    if a.input is None:
        eng = llm.llm_engine
        prompt = _chat_prompt(eng, [{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
        _stream(eng, prompt, params, lora=_lora(a))
        return 0
    prompts, plist = [], []
    for i, r in enumerate(rows):
        if isinstance(r, str):
            r = {"prompt": r}
        if "messages" in r:
            prompts.append(_chat_prompt(llm.llm_engine, r["messages"]))
        elif "prompt" in r or "prompt_token_ids" in r:
            prompts.append({k: r[k] for k in ("prompt", "prompt_token_ids") if k in r})
        else:
            print(f"error: {name}: row {i + 1} needs 'prompt', 'prompt_token_ids' or 'messages'", file=sys.stderr)
            return 2
        plist.append(params)
    outs = llm.generate(prompts, plist, use_tqdm=True, lora_request=_lora(a))
    dst = open(a.output, "w") if a.output else sys.stdout
    try:
        for r, o in zip(rows, outs):
            rec = {"prompt": o.prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in o.outputs]}
            if isinstance(r, dict) and "id" in r:
                rec["id"] = r["id"]
            dst.write(json.dumps(rec) + "\n")
    finally:
        if dst is not sys.stdout:
            dst.close()
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    from pageflash.llm import LLM

    if a.n != 1:
        print("error: pageflash chat keeps one reply per turn in the conversation: -n must be 1", file=sys.stderr)
        return 2
    llm = LLM(**engine_kwargs(a))
    eng = llm.llm_engine
    params = sampling_params(a, eng.default_sampling)
    history: list[dict] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("pageflash chat: empty line or Ctrl-D to quit, /reset to forget the conversation.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if a.system else []
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = _stream(eng, _chat_prompt(eng, history), params, lora=_lora(a))
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """The `pageflash` command. Ctrl-C (SIGINT) before a command's own handling takes over -- while a
    model loads, say -- ends it with status 130 and one line, not a KeyboardInterrupt traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("pageflash: interrupted", file=sys.stderr)
        return 130


def _main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        from pageflash.server.app import main as serve_main

        return serve_main(argv[1:]) or 0
    if argv and argv[0] == "bench":
        kinds = ("latency", "throughput", "kernels", "spec")
        if len(argv) < 2 or argv[1] not in kinds:
            usage = f"usage: pageflash bench {{{','.join(kinds)}}} [options]  (`pageflash bench KIND --help`)"
            if len(argv) >= 2 and argv[1] in ("-h", "--help"):
                print(usage)
                return 0
            print(usage, file=sys.stderr)
            what = f"invalid choice {argv[1]!r}" if len(argv) >= 2 else "a benchmark kind is needed"
            print(f"pageflash bench: error: {what} (choose from {', '.join(kinds)})", file=sys.stderr)
            return 2
        import importlib

        return importlib.import_module(f"pageflash.bench.{argv[1]}").main(argv[2:]) or 0
    if argv and argv[0] == "train-medusa":
        from pageflash.spec.train_medusa import main as train_main

        return train_main(argv[1:]) or 0

    p = argparse.ArgumentParser(prog="pageflash", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from a prompt (streams) or a JSONL file")
    g.add_argument("prompt", nargs="?", help="the prompt ('-': read it from standard input)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--input",
                   help="JSONL: one {'prompt'|'prompt_token_ids'|'messages', 'id'?} per line ('-': standard input)")
    g.add_argument("--output", help="JSONL results (default: stdout)")
    add_engine_args(g)
    add_sampling_args(g)
    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--system", default=None, help="system message")
    add_engine_args(c)
    add_sampling_args(c)
    for q in (g, c):
        q.add_argument("--lora", default=None, metavar="PATH",
                       help="run under this PEFT LoRA adapter folder (implies --enable-lora; see --max-lora-rank)")
    sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `pageflash serve --help`)")
    sub.add_parser("bench", help="benchmarks: latency, throughput, kernels, spec")
    sub.add_parser("train-medusa", help="train Medusa heads on the model's own generations")
    a = p.parse_args(argv)
    check_vllm_flags(a, p.error)
    if a.lora is not None:
        a.enable_lora = True
    try:
        return {"generate": cmd_generate, "chat": cmd_chat}[a.cmd](a)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
