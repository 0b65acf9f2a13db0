"""Two GPUs: the time of one all-reduce of a decode step's hidden rows (batch x 4096 bf16), 64 in a row,
eager and inside a CUDA graph (what a TP=2 llama-3-8b decode step runs per layer pair)."""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, world: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world)
    for rows in (1, 16, 64, 256):
        x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            for _ in range(64):
                dist.all_reduce(x)
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) / (20 * 64) * 1e6
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g.capture_begin()
            for _ in range(64):
                dist.all_reduce(x)
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        graph = (time.perf_counter() - t0) / (20 * 64) * 1e6
        if rank == 0:
            print(f"all-reduce {rows:4d} x 4096 bf16 ({rows * 8} KB): eager {eager:6.1f} us, in a graph {graph:6.1f} us",
                  flush=True)
        g.reset()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2,), nprocs=2)
