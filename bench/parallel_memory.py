"""Memory per rank under tensor and context parallel (issue 37, docs/parallel.md): one SFT step on
2 ranks of a gloo group against one process.

    python bench/parallel_memory.py                   # ~1 min on 2 cores; writes bench/results/parallel_memory.json

Two measurements, each a fresh set of forked ranks (rank 0's numbers; the others' are the same):

* **tp**: a 4-layer Qwen2-shaped model with a wide MLP (hidden 256, MLP 4096, 4 heads, 2 kv
  heads, 4096 vocabulary, tied embeddings), fp32, made trainable the way the recipes do
  (``frame.shard``: the decoder layers split over tp, then FSDP2 over dp) and stepped once with
  AdamW. Counted: the bytes each rank holds of parameters, gradients and optimizer state (the
  local shards of DTensors). Goal: <= 0.55x of one process at tp = 2.
* **cp**: the same model's SFT forward and backward of one packed row of 4,096 tokens (8
  sequences of 512) at cp = 1 and cp = 2 (Ulysses, ``models.cp``). Counted: the bytes of the
  tensors autograd keeps for backward (``saved_tensors_hooks``, each storage once, parameters
  left out): the activation memory. Goal: <= 0.6x at cp = 2.

Peak RSS (VmHWM) of each rank is recorded too: on CPU it includes the interpreter, torch and
the other rank's share of nothing, so it moves far less than the counted bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from relign import distributed  # noqa: E402
from relign.models import varlen  # noqa: E402
from relign.models.cp import cp_token_logps, enable_ulysses  # noqa: E402
from relign.models.logprobs import token_logps  # noqa: E402
from relign.optim import build_optimizer  # noqa: E402
from relign.recipes import frame  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0)
ROW, SEQS = 4096, 8


def _model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE)).float()


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _state_bytes(model, tp: int) -> dict:
    """Parameters, gradients and AdamW moments held by this rank after one step."""
    if tp > 1:
        distributed.init_mesh(tp_size=tp)
    model = frame.shard(model)
    opt = build_optimizer(model, lr=1e-4)
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 256), generator=torch.Generator().manual_seed(0))
    lp, _ = token_logps(model, ids)
    (-lp.sum()).backward()
    opt.step()
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters())
    moments = sum(_local_bytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")
    return {"params": params, "grads": grads, "optimizer": moments, "total": params + grads + moments}


class _Saved:
    """The bytes autograd saves for backward, each storage once, parameters left out."""

    def __init__(self, model):
        self.skip = {p.data_ptr() for p in model.parameters()}
        self.seen, self.bytes = set(), 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t


def _activation_bytes(model, cp: int) -> dict:
    """One packed row's forward and backward; the saved activations of this rank."""
    assert varlen.enable(model)
    lens = [ROW // SEQS] * SEQS
    ids = torch.randint(3, SHAPE["vocab_size"], (1, ROW), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    saved = _Saved(model)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        if cp > 1:
            distributed.init_mesh(cp_size=cp)
            enable_ulysses(model, cp)
            lp, _ = cp_token_logps(model, ids, pos, distributed.cp_group())
        else:
            lp, _ = token_logps(model, ids, position_ids=pos)
    (-lp.sum()).backward()
    return {"activations": saved.bytes, "seconds": time.perf_counter() - t0}


def _rank(rank: int, world: int, folder: str, what: str, size: int) -> None:
    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), world), rank=rank,
                                world_size=world)
    out = _state_bytes(_model(), size) if what == "tp" else _activation_bytes(_model(), size)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if world > 1:
        dist.barrier()
        distributed.cleanup()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def measure(what: str, size: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank, args=(size, folder, what, size), nprocs=size, start_method="fork")
        return json.loads(Path(folder, "rank0.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/parallel_memory.json")
    args = ap.parse_args()
    res = {"shape": SHAPE, "row_tokens": ROW, "sequences": SEQS, "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for what in ("tp", "cp"):
        one, two = measure(what, 1), measure(what, 2)
        key = "total" if what == "tp" else "activations"
        res[what] = {"1": one, "2": two, "ratio": two[key] / one[key], "goal": 0.55 if what == "tp" else 0.6}
        print(f"{what}: {key} per rank {one[key] / 2**20:.1f} MiB at {what}=1, {two[key] / 2**20:.1f} MiB at {what}=2: "
              f"{res[what]['ratio']:.3f}x (goal <= {res[what]['goal']}x); peak RSS {one['peak_rss_mb']:.0f} -> "
              f"{two['peak_rss_mb']:.0f} MB", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
