"""Host cost of mirroring one step to a tensor-parallel worker (engine/parallel.py): on rank 0
compact_schedule plus pickling the message, on the worker unpickling it and rebuilding the
sequences, for decode batches over long histories. CPU only; prints a table.

    python scripts/tp_message_cost.py
"""
import pickle
import time

from pageflash.engine.parallel import compact_schedule
from pageflash.engine.scheduler import ScheduledSeq, SchedulerOutput
from pageflash.engine.sequence import Request
from pageflash.sampling_params import SamplingParams


def main() -> None:
    print(f"{'batch':>5} {'context':>7} {'compact us':>10} {'pickle us':>9} {'bytes':>8} {'worker us':>10}")
    for b, ctx in [(1, 2048), (16, 2048), (64, 2048), (256, 1024)]:
        seqs, tables = [], []
        for i in range(b):
            r = Request(f"r{i}", None, list(range(ctx)), SamplingParams(max_tokens=8), 0.0)
            r.num_computed_tokens = ctx - 1
            seqs.append(ScheduledSeq(r, 1, 0))
            tables.append(list(range(i * (ctx // 16), (i + 1) * (ctx // 16))))
        sched = SchedulerOutput(seqs)
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            c = compact_schedule(sched)
        t1 = time.perf_counter()
        for _ in range(n):
            msg = pickle.dumps(("execute", (c, tables, None), {}, False), protocol=pickle.HIGHEST_PROTOCOL)
        t2 = time.perf_counter()
        for _ in range(n):  # the worker's side
            _, (w, _, _), _, _ = pickle.loads(msg)
            w.seqs
        t3 = time.perf_counter()
        print(f"{b:>5} {ctx:>7} {(t1 - t0) / n * 1e6:>10.1f} {(t2 - t1) / n * 1e6:>9.1f} {len(msg):>8} "
              f"{(t3 - t2) / n * 1e6:>10.1f}")


if __name__ == "__main__":
    main()
