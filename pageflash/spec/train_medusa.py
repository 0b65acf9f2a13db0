"""``pageflash train-medusa``: train Medusa heads on the target's own generations (self-distillation).

1. Data: prompts from the training split of the pydoc topics (``pageflash.spec.corpus``; grounded
   and chat in equal parts, in the model's chat template), answered by the target itself with the
   engine (greedy by default, so the labels are the target's own argmax tokens).
2. Features: one forward of the target over every prompt + answer gives the final hidden state h_t
   at every position; head i learns to predict token t + 2 + i from h_t, at every position whose
   label is an answer token.
3. Training: AdamW, linear warm-up then cosine decay, cross-entropy per head weighted 0.8^i (the
   Medusa paper's decay). The target is frozen; with the default shared LM head only the residual
   blocks (hidden^2 + hidden parameters per layer per head) are trained.
4. Output: a safetensors file with the config in its metadata, and ``<file>.json``; a summary with
   each head's top-1 accuracy on a held-back tenth of the sequences is printed (``--json`` writes it).

    pageflash train-medusa --output medusa.safetensors            # default model, minutes on a GPU
    pageflash train-medusa --model FOLDER --num-prompts 8 --max-tokens 16 --epochs 1   # tiny (tests)

Use the heads with ``--speculative-config '{"method": "medusa", "medusa_path": "medusa.safetensors",
"num_speculative_tokens": 4}'`` (or a "tree").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

import torch

from pageflash.model.registry import DEFAULT_MODEL


def forward_hidden(engine, seqs: Sequence[Sequence[int]], max_tokens: int = 8192) -> list[torch.Tensor]:
    """The target's final hidden states at every position of each sequence: [len(seq), H] each.

    Runs the engine's own model over the engine's KV pool (the engine must be idle), several
    sequences per forward up to max_tokens tokens.
    """
    from pageflash.engine.scheduler import ScheduledSeq, SchedulerOutput
    from pageflash.spec.draft import Feed

    runner, kv = engine.runner, engine.kv
    out: list[Optional[torch.Tensor]] = [None] * len(seqs)
    order = list(range(len(seqs)))
    i = 0
    while i < len(order):
        group, total = [], 0
        while i < len(order) and (not group or total + len(seqs[order[i]]) <= max_tokens):
            group.append(order[i])
            total += len(seqs[order[i]])
            i += 1
        ids = [f"__medusa_{j}__" for j in group]
        try:
            for rid, j in zip(ids, group):
                if not kv.allocate(rid, 0, len(seqs[j])):
                    raise RuntimeError("the KV pool is too small for forward_hidden; lower max_tokens")
            # (whole sequences: their num_tokens is their length, which LongRoPE's rows follow)
            feeds = [Feed(0, list(seqs[j])) for j in group]
            sched = SchedulerOutput([ScheduledSeq(f, len(f.tokens), 0) for f in feeds])  # type: ignore[arg-type]
            tables = [kv.block_ids(r) for r in ids]
            tok, pos, slots, qlens, seq_lens, _, _ = runner.prepare(sched, tables)
            dev = runner.device
            meta = runner.metadata(qlens, seq_lens, slots, tables)
            # each sequence's rows of the rotary tables (LongRoPE: short or long by its own length;
            # the model's default reads the whole batch as one sequence)
            rows = runner.rope_rows(sched, pos)
            with torch.inference_mode():
                h = runner.model(torch.tensor(tok, device=dev), torch.tensor(pos, device=dev), runner.kv_caches,
                                 runner.backend, runner.backend.plan(meta),
                                 rope_rows=None if rows is None else torch.tensor(rows, device=dev))
            o = 0
            for j, q in zip(group, qlens):
                out[j] = h[o : o + q].clone()
                o += q
        finally:
            for rid in ids:
                kv.free(rid)
    return out  # type: ignore[return-value]


def build_dataset(engine, prompts: list[list[int]], answers: list[list[int]], num_heads: int, max_tokens: int):
    """(hidden [N, H] float32 on the CPU, labels [N, num_heads] int64 with -100 where no label,
    seq [N] int64: which sequence each position comes from)."""
    seqs = [p + a for p, a in zip(prompts, answers)]
    hiddens = forward_hidden(engine, seqs, max_tokens)
    hs, ls, ids_ = [], [], []
    for j, (p, s, h) in enumerate(zip(prompts, seqs, hiddens)):
        t0 = len(p) - 1  # h_{t0} predicts the first answer token; head i predicts t + 2 + i
        t = torch.arange(t0, len(s) - 2)
        if t.numel() == 0:
            continue
        ids = torch.tensor(s + [-100] * (num_heads + 2))
        lab = torch.stack([ids[t + 2 + i] for i in range(num_heads)], 1)
        hs.append(h[t0 : len(s) - 2].float().cpu())
        ls.append(lab)
        ids_.append(torch.full((t.numel(),), j, dtype=torch.int64))
    if not hs:
        raise ValueError("no training positions: answers are too short (raise --max-tokens)")
    return torch.cat(hs), torch.cat(ls), torch.cat(ids_)


def train_heads(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head_weight: torch.Tensor,
    config,
    *,
    seq: Optional[torch.Tensor] = None,
    epochs: int = 2,
    lr: float = 1e-3,
    batch_size: int = 256,
    weight_decay: float = 0.0,
    device: torch.device | str = "cpu",
    seed: int = 0,
    log=None,
):
    """Train MedusaHeads on (hidden, labels); returns (heads, summary dict).

    seq: the sequence of each position; a tenth of the sequences (not of the positions, which
    would leak their neighbours) is held back to measure each head's top-1 accuracy."""
    from pageflash.spec.medusa import MedusaHeads

    torch.manual_seed(seed)
    device = torch.device(device)
    w = lm_head_weight.detach().to(device, torch.float32)
    heads = MedusaHeads(config, w).to(device)
    n = hidden.shape[0]
    g = torch.Generator().manual_seed(seed)
    if seq is None:
        seq = torch.arange(n)
    groups = torch.unique(seq)
    # a tenth of the sequences, but at least one whenever there are two (tiny runs still report accuracy)
    n_held = max(len(groups) // 10, 1 if len(groups) >= 2 else 0)
    held = groups[torch.randperm(len(groups), generator=g)[:n_held]]
    is_val = torch.isin(seq, held)
    val, tr = torch.nonzero(is_val).squeeze(1), torch.nonzero(~is_val).squeeze(1)
    n_val = len(val)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=weight_decay)
    steps = max(1, epochs * math.ceil(len(tr) / batch_size))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    decay = torch.tensor([0.8**i for i in range(config.num_heads)], device=device)
    step = 0
    t0 = time.perf_counter()
    losses = []
    for ep in range(epochs):
        order = tr[torch.randperm(len(tr), generator=g)]
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            h = hidden[idx].to(device)
            y = labels[idx].to(device)
            logits = heads(h, w)  # [K, B, V]
            ce = torch.stack([
                torch.nn.functional.cross_entropy(logits[i], y[:, i], ignore_index=-100)
                if (y[:, i] >= 0).any() else logits[i].sum() * 0.0
                for i in range(config.num_heads)
            ])
            loss = (decay * ce).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            losses.append(float(loss.detach()))
            if log is not None and (step % 50 == 0 or step == steps):
                log(f"epoch {ep + 1}/{epochs} step {step}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                    f"({time.perf_counter() - t0:.0f} s)")
    acc = []
    with torch.no_grad():
        if n_val:
            h, y = hidden[val].to(device), labels[val].to(device)
            pred = torch.cat([heads(h[b : b + 1024], w).argmax(-1) for b in range(0, len(h), 1024)], 1)  # [K, n_val]
            for i in range(config.num_heads):
                ok = y[:, i] >= 0
                acc.append(float((pred[i][ok] == y[ok, i]).float().mean()) if ok.any() else None)
    summary = {"positions": n, "train_positions": len(tr), "val_positions": n_val,
               "val_sequences": len(held), "steps": step,
               "final_loss": losses[-1] if losses else None, "val_top1_per_head": acc,
               "seconds": round(time.perf_counter() - t0, 2)}
    return heads.eval(), summary


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pageflash train-medusa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--output", default="medusa.safetensors", help="heads file (default: %(default)s)")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    p.add_argument("--own-lm-head", action="store_true",
                   help="a private LM head per head (the paper's; large), instead of the target's")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=256, help="answer length per prompt")
    p.add_argument("--text-tokens", type=int, default=400, help="quoted text per grounded prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="of the self-generated answers")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=256, help="positions per optimizer step")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-cache", metavar="JSON", help="generated answers: read if it exists, else written")
    p.add_argument("--json", metavar="PATH", help="write the summary here")
    a = p.parse_args(argv)
    # checked before the model loads and the answers are generated (minutes at the defaults)
    for flag, v, lo in (("--num-heads", a.num_heads, 1), ("--num-layers", a.num_layers, 1),
                        ("--num-prompts", a.num_prompts, 1), ("--max-tokens", a.max_tokens, 1),
                        ("--text-tokens", a.text_tokens, 1), ("--epochs", a.epochs, 1),
                        ("--batch-size", a.batch_size, 1), ("--max-model-len", a.max_model_len, 2)):
        if v < lo:
            p.error(f"{flag} must be at least {lo}, got {v}")
    if not (a.lr > 0 and math.isfinite(a.lr)):
        p.error(f"--lr must be a positive number, got {a.lr}")
    if not (a.temperature >= 0 and math.isfinite(a.temperature)):
        p.error(f"--temperature must be >= 0, got {a.temperature}")
    for flag, path in (("--output", a.output), ("--json", a.json)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            p.error(f"{flag}: folder {folder!r} does not exist")
    try:
        return _run(a)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    from pageflash import LLM
    from pageflash.spec.medusa import save_heads

    def log(msg: str) -> None:
        print(f"[train-medusa] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    llm = LLM(a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, seed=a.seed,
              load_format=a.load_format, num_kv_blocks=a.num_kv_blocks)
    heads, summary = train_on_engine(
        llm, num_prompts=a.num_prompts, max_tokens=a.max_tokens, text_tokens=a.text_tokens,
        temperature=a.temperature, num_heads=a.num_heads, num_layers=a.num_layers,
        shared_lm_head=not a.own_lm_head, epochs=a.epochs, lr=a.lr, batch_size=a.batch_size,
        weight_decay=a.weight_decay, seed=a.seed, log=log, base_model=str(a.model), data_cache=a.data_cache,
    )
    save_heads(heads, a.output)
    summary.update(output=a.output, total_seconds=round(time.perf_counter() - t0, 1))
    log(f"saved {a.output}; val top-1 per head: {summary['val_top1_per_head']}")
    print(json.dumps(summary, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def train_on_engine(
    llm,
    *,
    num_prompts: int = 512,
    max_tokens: int = 256,
    text_tokens: int = 400,
    temperature: float = 0.0,
    num_heads: int = 4,
    num_layers: int = 1,
    shared_lm_head: bool = True,
    epochs: int = 2,
    lr: float = 1e-3,
    batch_size: int = 256,
    weight_decay: float = 0.0,
    seed: int = 0,
    log=None,
    base_model: str = "",
    data_cache: Optional[str] = None,
):
    """Self-distillation with an existing LLM (its engine must be idle and speculation-free while
    this runs): generate, collect hidden states, train. Returns (heads, summary).

    data_cache: a JSON file of the generated (prompt, answer) token ids; read instead of generating
    when it exists, written after generating otherwise (to tune training without regenerating)."""
    from pageflash.spec.medusa import MedusaConfig

    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    eng = llm.llm_engine
    if data_cache and os.path.isfile(data_cache):
        with open(data_cache) as f:
            data = json.load(f)
        p_ids, answers = data["prompts"], data["answers"]
        log(f"read {len(answers)} answers from {data_cache}")
    else:
        p_ids, answers = _generate(llm, num_prompts, max_tokens, text_tokens, temperature, seed, log)
        if data_cache:
            with open(data_cache, "w") as f:
                json.dump({"prompts": p_ids, "answers": answers}, f)
    n_ans = sum(len(x) for x in answers)
    gen_s = time.perf_counter() - t0
    log(f"{n_ans} answer tokens ({gen_s:.0f} s); computing hidden states")
    budget = max(eng.max_num_batched_tokens, eng.max_model_len)
    hidden, labels, seq = build_dataset(eng, p_ids, answers, num_heads, budget)
    mc = eng.model_config
    cfg = MedusaConfig(mc.hidden_size, mc.vocab_size, num_heads, num_layers, shared_lm_head, base_model)
    w = eng.runner.model.head_weight
    log(f"training {num_heads} heads on {hidden.shape[0]} positions")
    heads, summary = train_heads(hidden, labels, w, cfg, seq=seq, epochs=epochs, lr=lr, batch_size=batch_size,
                                 weight_decay=weight_decay, device=eng.device, seed=seed, log=log)
    summary.update(model=base_model, prompts=len(p_ids), answer_tokens=n_ans, config=cfg.__dict__,
                   generate_seconds=round(gen_s, 1))
    return heads, summary


def _generate(llm, num_prompts, max_tokens, text_tokens, temperature, seed, log):
    """(prompt token ids, answer token ids) of the target's own answers to training-split prompts."""
    from pageflash import SamplingParams
    from pageflash.spec.corpus import build_prompts, chat_prompt

    eng = llm.llm_engine
    tok = eng.tokenizer
    if num_prompts < 1 or max_tokens < 3:
        raise ValueError("num_prompts must be >= 1 and max_tokens >= 3")
    # Prompts: the training split, grounded and chat alternating; token ids without a tokenizer.
    if tok is not None:
        count = lambda s: len(tok.encode(s))  # noqa: E731
        half = (num_prompts + 1) // 2
        msgs = build_prompts("grounded", half, "train", text_tokens, seed, count)
        msgs += build_prompts("chat", num_prompts - half, "train", seed=seed)
        prompts = [chat_prompt(tok, m) for m in msgs]
        limit = eng.max_model_len - max_tokens
        prompts = [x for x in prompts if len(x["prompt_token_ids"]) < limit]
    else:  # a model without a tokenizer (random test models): random token prompts
        g = torch.Generator().manual_seed(seed)
        prompts = [{"prompt_token_ids": torch.randint(0, eng.vocab_size, (16,), generator=g).tolist()}
                   for _ in range(num_prompts)]
    if not prompts:
        raise ValueError("every training prompt is longer than max_model_len - max_tokens")
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    log(f"generating {len(prompts)} answers of up to {max_tokens} tokens")
    spec, eng.spec = eng.spec, None
    try:
        outs = llm.generate(prompts, sp, use_tqdm=sys.stderr.isatty())
    finally:
        eng.spec = spec
    return [o.prompt_token_ids for o in outs], [o.outputs[0].token_ids for o in outs]


if __name__ == "__main__":
    sys.exit(main())
