"""Run a test function on several ranks of a gloo process group, in this process's forks.

``run_ranks(fn, 2, *args)`` forks two children (torch and transformers are imported already, so a
rank starts in well under a second), joins them into one gloo group through a file store, runs
``fn(*args)`` on each and returns what each returned, in rank order. ``fn`` returns tensors,
numbers, strings, lists or dicts of those (saved with ``torch.save`` and read back with
``weights_only=True``). An error on a rank fails the test with that rank's traceback. For the
library-level checks of the parallel layouts; whole runs go through ``conftest.run_relign``.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, folder: str, fn, args) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        out = fn(*args)
        dist.barrier()  # no rank tears gloo down while another still talks
    finally:
        dist.destroy_process_group()
    torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


def run_ranks(fn, world: int, *args) -> list:
    """``fn(*args)`` on ``world`` forked ranks of one gloo group; each rank's return value."""
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank_main, args=(world, folder, fn, args), nprocs=world, start_method="fork")
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=True) for r in range(world)]
