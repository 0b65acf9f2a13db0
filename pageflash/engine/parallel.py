"""Tensor parallelism: N ranks, one GPU each (or N CPU processes over gloo), each holding a shard of
every decoder layer (ModelConfig.shard, LlamaForCausalLM._tp_slice) and its share of the KV heads.

Rank 0 is the engine's process: its scheduler, KV block manager and sampler are the only ones.
Ranks 1..N-1 are worker processes (spawned), each with a ModelRunner over its shard. The runner
calls that touch the device -- sizing and allocating the KV cache, capturing the decode graphs, and
every step -- are mirrored: rank 0 sends the call down a pipe to each worker, then runs it itself;
the ranks meet in the all-reduces inside the model (two per decoder layer; NCCL on CUDA, captured in
the decode graphs; gloo on CPU). A step travels as a compact copy of the SchedulerOutput (each
scheduled sequence's new tokens and counters, not its whole token history) plus the block tables,
so every rank builds the same inputs and plans the same kernels. Rank 0 alone computes logits that
are used (every rank holds the LM head; the workers' logits are dropped).

Async scheduling: a step launched before the previous step's sampled ids reach the host reads its
pending input tokens from them on the device; rank 0 broadcasts those ids to the workers (in stream
order, no host sync) before the step.

Speculative decoding: verify steps (chains and token trees), early-exit drafts and Medusa's steps pass
their options to every rank (STEP_OPTIONS), and a tree's KV compaction and an early-exit drafter's
copy-on-write block copies run on every rank's cache; a
draft model runs on rank 0 alone, unsharded (as vLLM's draft runs at TP 1). Verify and draft steps run
without CUDA graphs with N > 1 (plain decode steps keep theirs).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pageflash.envs import int_env

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeout() -> datetime.timedelta:
    """PAGEFLASH_TP_TIMEOUT seconds (default 600): how long a rank waits for the others (start-up
    rendezvous, a collective) before failing instead of hanging."""
    return datetime.timedelta(seconds=int_env("PAGEFLASH_TP_TIMEOUT", 600, minimum=1))


# ---- a step, as the workers receive it ----------------------------------------------------------

class _Window:
    """A request's token ids as the runner reads them (absolute indices): only [start, start + n) is
    held; len() is the whole length."""

    __slots__ = ("start", "ids", "length")

    def __init__(self, start: int, ids: list[int], length: int) -> None:
        self.start, self.ids, self.length = start, ids, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        if isinstance(i, slice):
            if i.step not in (None, 1):
                raise IndexError("token ids: only contiguous slices")
            lo, hi = i.start or 0, self.length if i.stop is None else min(i.stop, self.length)
            if lo >= hi:
                return []
            if lo < self.start or hi > self.start + len(self.ids):
                raise IndexError(f"token ids [{lo}:{hi}] are outside the step's window")
            return self.ids[lo - self.start: hi - self.start]
        if not self.start <= i < self.start + len(self.ids):
            raise IndexError(f"token id {i} is outside the step's window")
        return self.ids[i - self.start]


@dataclass
class _Req:
    request_id: str
    num_computed_tokens: int
    token_ids: _Window
    spec_token_ids: list[int]
    num_prompt_tokens: int
    needs_prompt_logprobs: bool
    prompt_logprobs: list
    pooling: Any
    num_pending: int = 0
    pending_row: int = -1

    @property
    def num_tokens(self) -> int:  # (a Request's: what LongRoPE's rows depend on, ModelRunner.rope_rows)
        return len(self.token_ids) + self.num_pending


@dataclass
class _Seq:
    request: _Req
    num_new_tokens: int
    num_spec_tokens: int
    samples: bool


class _Sched:
    """A step as the workers receive it: one column per field the runner reads (lists of ints pickle
    several times faster than objects); ``seqs`` rebuilds ScheduledSeq-like objects on the worker."""

    COLUMNS = ("request_ids", "computed", "window", "length", "spec", "num_prompt", "want_prompt_lp",
               "prompt_lp_len", "pooling", "pending", "pending_row", "new", "num_spec", "samples")

    def __init__(self, block_copies: list[tuple[int, int]], is_decode: bool, **columns: list) -> None:
        self.block_copies, self.is_decode = block_copies, is_decode
        self.columns = columns
        self._seqs: Optional[list[_Seq]] = None

    def __getstate__(self) -> tuple:
        return self.block_copies, self.is_decode, self.columns

    def __setstate__(self, state: tuple) -> None:
        self.block_copies, self.is_decode, self.columns = state
        self._seqs = None

    @property
    def seqs(self) -> list[_Seq]:
        if self._seqs is None:
            c = self.columns
            self._seqs = [
                _Seq(_Req(rid, comp, _Window(comp, win, ln), spec, npr, want, [None] * lp_len,
                          True if pool else None, pend, prow), new, nspec, smp)
                for rid, comp, win, ln, spec, npr, want, lp_len, pool, pend, prow, new, nspec, smp
                in zip(*(c[k] for k in self.COLUMNS))
            ]
        return self._seqs


def compact_schedule(sched: Any) -> _Sched:
    """What ModelRunner.execute reads of a SchedulerOutput, without the requests' token histories. Its
    seqs' requests are engine Requests or speculative decoding's Feeds (spec/draft.py, shaped alike)."""
    reqs = [s.request for s in sched.seqs]
    comp = [r.num_computed_tokens for r in reqs]
    new = [s.num_new_tokens for s in sched.seqs]
    nspec = [s.num_spec_tokens for s in sched.seqs]
    want = [bool(getattr(r, "needs_prompt_logprobs", False)) for r in reqs]
    pending = [r.num_pending for r in reqs]
    length = [r.num_tokens - p for r, p in zip(reqs, pending)]  # (a Request's: len(token_ids))
    return _Sched(
        list(sched.block_copies), sched.is_decode,
        request_ids=[r.request_id for r in reqs], computed=comp,
        window=[r.token_ids[c: c + n] for r, c, n in zip(reqs, comp, new)], length=length,
        spec=[r.spec_token_ids[:k] if k else [] for r, k in zip(reqs, nspec)],
        num_prompt=[r.num_prompt_tokens for r in reqs], want_prompt_lp=want,
        prompt_lp_len=[len(r.prompt_logprobs) if w else 0 for r, w in zip(reqs, want)],
        pooling=[r.pooling is not None for r in reqs], pending=pending,
        pending_row=[r.pending_row for r in reqs], new=new, num_spec=nspec,
        # ScheduledSeq.samples, from the columns (num_tokens = len(token_ids) + num_pending)
        samples=[c + n - k >= ln + p for c, n, k, ln, p in zip(comp, new, nspec, length, pending)],
    )


# ---- the worker processes --------------------------------------------------------------------

# ModelRunner.execute options a tensor-parallel step passes to every rank (speculative decoding)
STEP_OPTIONS = ("tree_mask", "positions_override", "num_layers", "need_hidden")


def _init_group(backend: str, init_method: str, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=_timeout())


def _execute(runner: Any, sched: _Sched, block_tables: list[list[int]], prev: Optional[tuple],
             options: Optional[dict] = None) -> None:
    """A worker's step. prev: (numel, dtype) of rank 0's previous sampled ids, which rank 0 broadcasts
    (async scheduling: the inputs of requests with a pending token are read from them on the device).
    options: the step's speculative-decoding options (STEP_OPTIONS; a tree mask as a host tensor)."""
    prev_tokens = None
    if prev is not None:
        import torch.distributed as dist

        prev_tokens = torch.empty(prev[0], dtype=prev[1], device=runner.device)
        dist.broadcast(prev_tokens, src=0)
    options = dict(options or {})
    if options.get("tree_mask") is not None:
        options["tree_mask"] = options["tree_mask"].to(runner.device)
    runner.execute(sched, block_tables, prev_tokens=prev_tokens, **options)


def _worker_main(rank: int, world: int, backend: str, init_method: str, runner_kwargs: dict, conn) -> None:
    """A worker rank: build its runner, then run the calls rank 0 sends until None (or the pipe closes)."""
    conn.send(("started", None))  # (rank 0 waits for this before the rendezvous: _await_start)
    try:
        device = runner_kwargs["device"]
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        _init_group(backend, init_method, rank, world)
        from pageflash.engine.model_runner import ModelRunner

        runner = ModelRunner(**runner_kwargs, tp_rank=rank, tp_size=world)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    timing = os.environ.get("PAGEFLASH_TP_STEP_TIMES") == "1"  # (a probe: the worker's host time per step)
    prof_path = os.environ.get("PAGEFLASH_TP_PROFILE")  # (a probe: cProfile of the worker's loop, to that path)
    prof = None
    if prof_path:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    waited = busy = 0.0
    steps = 0
    while True:
        t0 = time.perf_counter()
        try:
            msg = conn.recv()
        except EOFError:
            return
        t1 = time.perf_counter()
        if msg is None:
            break
        method, args, kwargs, reply = msg
        try:
            out = _execute(runner, *args) if method == "execute" else getattr(runner, method)(*args, **kwargs)
            if timing and method == "execute":
                steps += 1
                waited += t1 - t0
                busy += time.perf_counter() - t1
            if reply:
                conn.send(("ok", out))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return
    if prof is not None:
        prof.disable()
        prof.dump_stats(f"{prof_path}.rank{rank}")
    if timing and steps:
        print(f"tensor parallel rank {rank}: {steps} steps, host per step {busy / steps * 1e3:.3f} ms busy "
              f"(unpickle not included), {waited / steps * 1e3:.3f} ms waiting for rank 0", flush=True)
    runner.release_graphs()
    _leave_group()


# How long a rank waits for its teardown of the process group at shutdown before going on without it.
# NCCL's communicator teardown (ncclCommDestroy, what destroy_process_group runs) is collective: a rank
# returns once every rank has called it, so the ranks leave at the same time (_shutdown), and it waits
# for every CUDA graph that captured a collective to be destroyed (ModelRunner.release_graphs;
# pytorch/pytorch#115388). The bound is the safety net for a rank that never arrives.
_LEAVE_WAIT_S = 10.0


def _leave_mode() -> str:
    """PAGEFLASH_TP_LEAVE: "destroy" (default: destroy_process_group, every rank at once) or "abort"
    (torch's _abort_process_group: ncclCommAbort, no rendezvous; the A/B of run 48: the same ~1.4 s)."""
    mode = os.environ.get("PAGEFLASH_TP_LEAVE", "destroy")
    if mode not in ("destroy", "abort"):
        raise ValueError(f"PAGEFLASH_TP_LEAVE must be 'destroy' or 'abort', got {mode!r}")
    return mode


def _start_leave() -> Optional[threading.Thread]:
    """Start leaving the process group (when there is one) on a daemon thread; _finish_leave waits for it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    leave = dist.destroy_process_group
    if _leave_mode() == "abort" and dist.get_backend() == "nccl":
        from torch.distributed import distributed_c10d

        leave = getattr(distributed_c10d, "_abort_process_group", leave)
    t = threading.Thread(target=leave, name=f"pageflash-tp-teardown-rank{dist.get_rank()}", daemon=True)
    t.start()
    return t


def _finish_leave(t: Optional[threading.Thread], wait: float = _LEAVE_WAIT_S) -> None:
    """Wait up to `wait` s for _start_leave's thread: a teardown that blocks is left behind with a
    warning instead of hanging the process (at exit: for good)."""
    if t is None:
        return
    t.join(wait)
    if t.is_alive():
        logger.warning("tensor parallel: leaving the process group did not finish in %.0f s (%s); going on "
                       "without it", wait, t.name)


def _leave_group(wait: float = _LEAVE_WAIT_S) -> None:
    """Leave the process group, waiting for that at most `wait` s (_start_leave, _finish_leave)."""
    _finish_leave(_start_leave(), wait)


class TensorParallelRunner:
    """Rank 0's view of N ranks: a ModelRunner over rank 0's shard (what every attribute not mirrored
    here reads) and N - 1 worker processes that repeat its device calls on their shards."""

    def __init__(self, tp_size: int, **runner_kwargs: Any) -> None:
        import multiprocessing as mp

        import torch.distributed as dist

        from pageflash.engine.model_runner import ModelRunner

        if tp_size < 2:
            raise ValueError(f"TensorParallelRunner needs tp_size >= 2, got {tp_size}")
        if dist.is_available() and dist.is_initialized():
            raise ValueError("tensor parallelism: torch.distributed is already initialized in this process "
                             "(one tensor-parallel engine per process)")
        device: torch.device = runner_kwargs["device"]
        # PAGEFLASH_TP_ONE_DEVICE=1 (a test mode): every rank on the engine's GPU, over gloo (NCCL refuses two
        # ranks on one GPU), without decode graphs (gloo's collectives cannot be captured)
        self.one_device = device.type == "cuda" and os.environ.get("PAGEFLASH_TP_ONE_DEVICE", "0") == "1"
        if device.type == "cuda" and not self.one_device:
            n = torch.cuda.device_count()
            if n < tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs; this machine has {n}")
            backend = "nccl"
        else:
            backend = "gloo"
        self.comm_backend = backend  # (self.backend: rank 0 runner's attention backend)
        runner_kwargs["model_cfg"].shard(tp_size)  # a size that does not divide fails here, before any process starts
        self.tp_size = tp_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        for rank in range(1, tp_size):
            kw = dict(runner_kwargs)
            if device.type == "cuda" and not self.one_device:
                kw["device"] = torch.device("cuda", rank)
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, tp_size, backend, init_method, kw, child),
                            name=f"pageflash-tp{rank}", daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._local: list = []  # rank 0's runner once built (the finalizer drops its graphs first)
        self._finalizer = weakref.finalize(self, _shutdown, self._conns, self._procs, self._local)
        try:
            self._await_start()
            _init_group(backend, init_method, 0, tp_size)
            self.local = ModelRunner(**runner_kwargs, tp_rank=0, tp_size=tp_size)
            self._local.append(self.local)
            self._gather()  # the workers' runners are built
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallel: %d ranks (%s)", tp_size, backend)

    def _await_start(self) -> None:
        """Wait until every worker process runs (before the rendezvous, which would otherwise wait out
        PAGEFLASH_TP_TIMEOUT for a worker that died starting up)."""
        for rank, (c, p) in enumerate(zip(self._conns, self._procs), start=1):
            while not c.poll(0.2) and p.is_alive():
                pass
            try:
                self._raise(c.recv())
            except EOFError:  # it died before its first word
                p.join(timeout=10)
                raise RuntimeError(
                    f"tensor-parallel worker {rank} exited with code {p.exitcode} while starting. Workers are "
                    f"spawned processes that import the main module: a script that creates a tensor-parallel "
                    f"LLM must do so under `if __name__ == \"__main__\":`") from None

    # -- mirroring ------------------------------------------------------------------------------
    _broken: Optional[str] = None  # why the ranks are out of step (a call failed on some rank)

    def _send(self, method: str, args: tuple, kwargs: dict, reply: bool) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this tensor-parallel engine was shut down")
        if self._broken is not None:
            raise RuntimeError(f"the tensor-parallel ranks are out of step since a failed step ({self._broken}); "
                               f"start a new engine")
        for c in self._conns:
            if c.poll():  # a worker that failed reported it before exiting
                self._raise(c.recv())
            c.send((method, args, kwargs, reply))

    def _gather(self) -> list:
        out = []
        for c in self._conns:
            try:
                msg = c.recv()
            except EOFError:
                raise RuntimeError("a tensor-parallel worker process exited") from None
            out.append(self._raise(msg))
        return out

    @staticmethod
    def _raise(msg: tuple) -> Any:
        status, value = msg
        if status == "error":
            raise RuntimeError(f"tensor-parallel worker failed:\n{value}")
        return value

    def _call(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, list]:
        """Run method on every rank (the workers first, so that rank 0's collectives find them);
        (rank 0's result, the workers' results)."""
        self._send(method, args, kwargs, reply=True)
        try:
            local = getattr(self.local, method)(*args, **kwargs)
        finally:
            rest = self._gather()
        return local, rest

    def auto_num_blocks(self, *args: Any) -> int:
        """The blocks every rank can hold (each sizes its own memory)."""
        local, rest = self._call("auto_num_blocks", *args)
        return min([local, *rest])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)

    def capture_decode_graphs(self, max_batch: int) -> None:
        if self.comm_backend == "gloo":
            return
        self._call("capture_decode_graphs", max_batch)

    def execute(self, sched: Any, block_tables: list[list[int]], prev_tokens: Optional[torch.Tensor] = None,
                **options: Any):
        """One step on every rank. prev_tokens (async scheduling): the sampled ids of the step in flight,
        on rank 0's device; broadcast to the workers in stream order (no host sync) when a scheduled
        request's input token is among them. options: speculative decoding's (STEP_OPTIONS: a verify
        step's tree mask and positions, an early-exit draft's layer count, Medusa's hidden states),
        passed to every rank so that all take the same path through the model."""
        bad = sorted(set(options) - set(STEP_OPTIONS))
        if bad:
            raise ValueError(f"tensor parallelism: execute() options {bad} are not supported")
        sent = dict(options)
        if sent.get("tree_mask") is not None:  # down the pipe as a host tensor
            sent["tree_mask"] = sent["tree_mask"].cpu()
        compact = compact_schedule(sched)
        if prev_tokens is not None and not any(compact.columns["pending"]):
            prev_tokens = None
        prev = None
        if prev_tokens is not None:
            prev_tokens = prev_tokens.contiguous()
            prev = (prev_tokens.numel(), prev_tokens.dtype)
        self._send("execute", (compact, block_tables, prev, sent), {}, reply=False)
        try:
            if prev is not None:
                import torch.distributed as dist

                dist.broadcast(prev_tokens, src=0)
            return self.local.execute(sched, block_tables, prev_tokens=prev_tokens, **options)
        except BaseException as ex:
            self._fail_step(ex)
            raise

    def _mirror(self, method: str, *args: Any) -> None:
        """A cache operation on every rank, in order with the steps (no reply awaited)."""
        self._send(method, args, {}, reply=False)
        try:
            getattr(self.local, method)(*args)
        except BaseException as ex:
            self._fail_step(ex)
            raise

    def move_kv_slots(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Speculative tree compaction on every rank's cache."""
        if src_slots:
            self._mirror("move_kv_slots", src_slots, dst_slots)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write block copies on every rank's cache: those an early-exit drafter's allocations
        record (the scheduler's travel with their step)."""
        if copies:
            self._mirror("copy_blocks", copies)

    def enable_step_graphs(self, *args: Any, **kwargs: Any) -> None:
        """No CUDA graphs for verify / draft steps with N ranks: capturing runs a warm-up forward whose
        collectives the workers would not meet (these steps run eagerly; plain decode keeps its graphs)."""
        return None

    def _fail_step(self, ex: BaseException) -> None:
        """A step failed on rank 0 (or a worker's failure surfaced here as a collective error): the
        workers may be waiting inside that step's collectives, so every later step would pair its
        all-reduces with theirs one step off. Stop the workers; later calls raise."""
        why = f"{type(ex).__name__}: {ex}"
        for c in self._conns:  # a worker that failed says why (it exits after that)
            try:
                if c.poll(1.0):
                    status, value = c.recv()
                    if status == "error":
                        why += f"; a worker failed:\n{value}"
            except (EOFError, OSError):
                pass
        self._broken = why
        for p in self._procs:
            if p.is_alive():
                p.terminate()

    def __getattr__(self, name: str) -> Any:  # everything else: rank 0's runner (cfg, model, kv_cache, ...)
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    def close(self) -> None:
        """Stop the workers and leave the process group. Idempotent (also run when this is collected,
        and at exit)."""
        self._finalizer()


def _shutdown(conns: list, procs: list, local: list) -> None:
    for runner in local:  # (before the group goes: see ModelRunner.release_graphs)
        try:
            runner.release_graphs()
        except Exception:  # a device already failing: still stop the workers
            logger.exception("tensor parallel: releasing rank 0's CUDA graphs failed")
    local.clear()
    for c in conns:
        try:
            c.send(None)
        except (OSError, ValueError):
            pass
    # rank 0 leaves while the workers do: the teardown is collective (run 48: rank 0 leaving only after
    # the workers had exited cost each worker the whole bound, eager or not)
    leaving = _start_leave()
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    for c in conns:
        c.close()
    _finish_leave(leaving)
