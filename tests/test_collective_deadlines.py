"""No silent hang in a collective: every wait on the other ranks runs under the watchdog.

Two gloo ranks, rank 1 never joins; rank 0 must stop at its deadline with status 124, the
one relign line naming the collective and the stacks in ``hang_rank0.txt``. NCCL returns from
a collective once it is enqueued and the CPU blocks later (the copy back, the caller's
``.item()``); gloo blocks inside the call. The ``enqueued`` case gives gloo NCCL's behaviour:
``dist.all_reduce`` without ``async_op`` returns at once and the work is waited on at the next
host read, as a CUDA stream makes ``.item()`` wait. Today's code then waited outside its
watched block, and the run hung until gloo's own 30-minute timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from relign import distributed, optim, watchdog


def _nccl_semantics() -> None:
    """gloo as NCCL behaves: ``dist.all_reduce`` without ``async_op`` returns once the work is
    enqueued, and the next host read (``.item()``, ``float``) waits for it, as a CUDA stream does."""
    real, pending = dist.all_reduce, []

    def enqueued(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        work = real(tensor, op=op, group=group, async_op=True)
        if async_op:
            return work
        pending.append(work)  # the CPU goes on

    def after_the_stream(read):
        def host_read(self, *args):
            while pending:  # a host read waits for every collective enqueued before it
                pending.pop().wait()
            return read(self, *args)
        return host_read

    dist.all_reduce = enqueued
    torch.Tensor.item = after_the_stream(torch.Tensor.item)
    torch.Tensor.__float__ = after_the_stream(torch.Tensor.__float__)


def _rank(rank: int, folder: str, case: str) -> None:
    """One rank, a fresh interpreter (spawned: a fork of a pytest worker that has run other tests
    inherits their threads and locks, and once hung before its watchdog started). Rank 1 never joins."""
    sys.stderr = open(os.path.join(folder, f"stderr{rank}"), "w", buffering=1)  # open until the watchdog's os._exit
    os.dup2(sys.stderr.fileno(), 2)  # pytest's capture holds the parent's
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
    if case == "enqueued":
        _nccl_semantics()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 2), rank=rank, world_size=2)
    if case == "grad_norm":  # an FSDP-sharded gradient: DTensor sums its norm over the ranks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (2,))
        p = torch.nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Shard(0)], run_check=False))
        p.grad = DTensor.from_local(torch.full((3,), 2.0), mesh, [Shard(0)], run_check=False)
    watchdog.configure(2, Path(folder), key="rollout.wait_timeout")
    if rank == 1:
        time.sleep(300)
    elif case == "enqueued":
        distributed.lockstep([1, 2], 0)  # all_reduce_max, then .item()
    else:
        optim.clip_gradients([p], 1.0)
    Path(folder, "returned").write_text("")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo ranks on one Linux machine")
@pytest.mark.parametrize("case, names, caller", [
    ("enqueued", "a collective (all_reduce)", "lockstep"),
    ("grad_norm", "a collective (the gradient norm, summed over the ranks' shards)", "clip_gradients"),
])
def test_a_rank_that_never_joins_stops_the_others_at_the_deadline_with_the_stacks(tmp_path, case, names, caller):
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_rank, args=(r, str(tmp_path), case)) for r in (0, 1)]
    for p in ranks:
        p.start()
    t0 = time.monotonic()
    try:
        ranks[0].join(timeout=30)  # a hang outlives this and the test fails below
        took = time.monotonic() - t0
    finally:
        for p in ranks:
            p.kill()
            p.join()
    err = (tmp_path / "stderr0").read_text()
    assert ranks[0].exitcode == 124, err
    assert 2 <= took < 30
    assert not (tmp_path / "returned").exists()  # the collective never returned
    lines = [line for line in err.splitlines() if line.startswith("relign:")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"relign: rank 0 waited 2 s for {names} with the other ranks and stopped "
                               f"(rollout.wait_timeout)"), err
    dump = (tmp_path / "hang_rank0.txt").read_text()
    assert dump.startswith(f"timed out after 2 s waiting for {names}")
    assert f"in {caller}" in dump  # the main thread's stack, down to the caller's wait


def test_the_process_group_times_out_a_minute_after_the_runs_wait_timeout(monkeypatch, tmp_path):
    """The collectives relign does not wait on itself (FSDP2's, inside the forward and backward)
    fall to the process group's own timeout: ``relign rl`` sets it to rollout.wait_timeout + 60 s,
    so that the watchdog (stacks, status 124) still fires first on every wait relign watches.
    Read where ``frame.open`` creates the group; the run stops there."""
    from datetime import timedelta

    from relign.recipes import frame, rl, sft

    seen = []

    class Stop(Exception):
        pass

    def init_process_group(backend, timeout):  # gloo here, nccl on a GPU
        seen.append(timeout)
        raise Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = rl.Config()
    cfg.rollout.wait_timeout = 5.0
    for c in (cfg, sft.Config()):
        with pytest.raises(Stop):
            frame.open(c, "test")
    cfg.rollout.wait_timeout = 0  # no deadline: torch's 30 minutes, as before
    with pytest.raises(Stop):
        frame.open(cfg, "test")
    assert seen == [timedelta(seconds=65), timedelta(minutes=30), timedelta(minutes=30)]
