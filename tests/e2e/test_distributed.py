"""torchrun + FSDP2 (gloo on CPU): 2 ranks train like 1, and checkpoints move between world sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from relign.checkpoint import list_checkpoints
from relign.tracking import read_metrics

from ..conftest import REPO, run_cli, run_relign
from .test_cli_sft import FACTS, _args

pytestmark = pytest.mark.slow  # the longest end-to-end runs: `pytest -m "not slow"` leaves them out


def _torchrun(args, env=None, real=False):
    """``torchrun --standalone --nproc_per_node 2 -m relign ARGS``: torchrun itself when ``real``
    (it picks a free port itself), else two ranks forked with torchrun's environment
    (conftest.run_relign: 15 s less of imports per run). The tests that resume across world
    sizes keep the real launcher."""
    return run_relign(args, env={"OMP_NUM_THREADS": "1", **(env or {})}, ranks=2, fork=not real)


@pytest.fixture()
def data(tmp_path):
    from ..conftest import write_jsonl

    rows = [{"prompt": q, "response": a} for q, a in FACTS]
    return write_jsonl(tmp_path / "facts.jsonl", rows)


def _losses(run):
    """(step, (loss, grad norm)) per step: equal losses alone would not show a parameter group
    whose gradient is lost (FSDP's root after a no-grad pass: see distributed.reshard)."""
    return [(r["step"], (r["train/loss"], r["train/grad_norm"])) for r in read_metrics(run) if "train/loss" in r]


def _assert_close(a, b):
    """Only the order of float sums differs between the runs. The loss agrees to 1e-5; the
    gradient norm to 1e-4 relative: AdamW's first steps move every weight by about lr whatever
    the size of its gradient, so a near-zero gradient whose sign rounding flips gives weights
    that differ by ~lr, and later gradients a little more than the losses do."""
    assert a[0] == pytest.approx(b[0], abs=1e-5)
    assert a[1] == pytest.approx(b[1], rel=1e-4)


def test_two_ranks_match_one_and_resume_across_world_sizes(tiny_model_dir, data, tmp_path):
    common = ("max_steps=4", "checkpoint.save_every=1", "batch_size=4", "micro_batch_size=1", "packing=false")
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_cli(*_args(tiny_model_dir, data, single, *common))

    # 2 ranks, killed right after checkpoint 2 lands; then resumed on 1 rank.
    proc = _torchrun(_args(tiny_model_dir, data, multi, *common), env={"RELIGN_FAULT": "checkpoint-saved:2"}, real=True)
    assert proc.returncode != 0
    assert [s for s, _ in list_checkpoints(multi)] == [1, 2]
    run_cli(*_args(tiny_model_dir, data, multi, *common, "resume=auto"))

    a, b = _losses(single), _losses(multi)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, la), (_, lb) in zip(a, b):
        _assert_close(la, lb)


@pytest.mark.parametrize("loss, budget", [("dpo", ("max_tokens_per_micro=720",)), ("kto", ())])
def test_preference_two_ranks_match_one(tiny_model_dir, tmp_path, loss, budget):
    """relign dpo under torchrun: the reference log-probs are computed in shards and summed,
    KTO's reference point is reduced over ranks, and the losses equal the 1-rank run. DPO's two
    ranks cut their packed pairs by a token budget (pairs.micro_batches), the one rank by
    micro_batch_size: at step 1 rank 0's two pairs (706 packed tokens) fit 720 in one pass and rank
    1's (735) do not, so rank 0 runs a zero-weight second pass beside rank 1's (distributed.lockstep)."""
    common = ["dpo", str(REPO / "examples" / "dpo.yaml"), f"model.path={tiny_model_dir}", f"loss={loss}",
              "data.max_rows=16", "data.max_length=256", "data.eval_fraction=0", "batch_size=4", "micro_batch_size=2",
              "max_steps=2", "optim.lr=1e-3", "optim.warmup_ratio=0", "eval_every=0", "checkpoint.save_every=0",
              "logging.tensorboard=false", "logging.progress=false"]
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_cli(*common, "packing=true", f"run_dir={single}")
    proc = _torchrun([*common, "packing=true", *budget, f"run_dir={multi}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _losses(single), _losses(multi)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2]
    for (_, la), (_, lb) in zip(a, b):
        _assert_close(la, lb)


def test_bf16_mixed_two_ranks_match_one(tiny_model_dir, data, tmp_path):
    """model.dtype=bf16-mixed under FSDP2: the sharded fp32 weights are gathered and the
    forward runs under autocast on each rank. 2 ranks train like 1 to bf16 rounding (the sums
    of bf16 products differ in order), and the checkpoint holds fp32 weights."""
    from safetensors.torch import load_file

    common = ("max_steps=3", "batch_size=4", "micro_batch_size=1", "packing=false", "model.dtype=bf16-mixed")
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_cli(*_args(tiny_model_dir, data, single, *common))
    proc = _torchrun(_args(tiny_model_dir, data, multi, *common))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _losses(single), _losses(multi)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3]
    for (_, la), (_, lb) in zip(a, b):
        assert la[0] == pytest.approx(lb[0], abs=2e-3) and la[1] == pytest.approx(lb[1], rel=2e-2)
    weights = load_file(str(multi / "checkpoints" / "step_3" / "model.safetensors"))
    assert {str(w.dtype) for w in weights.values()} == {"torch.float32"}


# One rank's view of a bf16-mixed model under FSDP2 (run by torchrun below).
_MIXED_SCRIPT = """
import sys, torch
from relign import distributed
from relign.models.loading import load_causal_lm
from relign.models.precision import mixed_dtype

distributed.init()
model = load_causal_lm(sys.argv[1], dtype="bf16-mixed")
model = distributed.wrap_fsdp(model, mixed_dtype(model))
seen = {}
layer, root = model.model.layers[0], model.model.embed_tokens
layer.self_attn.q_proj.register_forward_hook(lambda m, a, out: seen.update(layer=m.weight.dtype, x=out.dtype))
layer.register_forward_pre_hook(lambda m, a: seen.update(residual=a[0].dtype))
root.register_forward_pre_hook(lambda m, a: seen.update(root=m.weight.dtype))
layer.input_layernorm.register_forward_pre_hook(lambda m, a: seen.update(norm=m.weight.dtype))
ids = torch.randint(0, 100, (2, 12))
model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
grads = {p.grad.dtype for p in model.parameters()}
params = {p.dtype for p in model.parameters()}
line = " ".join(map(str, [seen["layer"], seen["x"], seen["residual"], seen["root"], seen["norm"], sorted(map(str, grads)), sorted(map(str, params))]))
open(f"{sys.argv[2]}/rank{distributed.rank()}.txt", "w").write(line)  # one file each: two ranks' prints can interleave
distributed.barrier()  # as the recipes end: a rank that tears gloo down while the other still talks aborts
distributed.cleanup()
"""


def test_bf16_mixed_gathers_layers_in_bf16(tiny_model_dir, tmp_path):
    """FSDP2's mixed-precision policy for bf16-mixed: a decoder layer's linear weights arrive in
    bf16 (half the all-gather bytes) and its products come out in bf16; its input, the residual
    stream, stays fp32 (the layers do not cast their inputs), and so do its norms' weights and
    the root's parameters; the gradients and the shards the optimizer updates are fp32."""
    script = tmp_path / "mixed.py"
    script.write_text(_MIXED_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tiny_model_dir), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        ln = (tmp_path / f"rank{rank}.txt").read_text()
        assert ln.split(" ", 5)[:5] == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32", "torch.float32"], ln
        assert ln.endswith("['torch.float32'] ['torch.float32']"), ln


@pytest.mark.parametrize("recipe", ["rm", "dpo"])
def test_uneven_eval_shards_on_two_ranks(tiny_model_dir, tmp_path, recipe):
    """relign rm and dpo (reference precomputed) under torchrun where the ranks' shares of a
    pass split into different numbers of batches: 10 pairs, 3 held out and evaluated in batches
    of 1 (2 on one rank, 1 on the other; dpo's precompute of the 7 others too). Every FSDP2 forward
    all-gathers, so the short rank runs throwaway forwards (distributed.lockstep); before, the
    run hung. rm also used to fail outright: it called the backbone past the FSDP root. The
    2-rank eval and train numbers are the 1-rank run's."""
    common = [recipe, str(REPO / "examples" / f"{recipe}.yaml"), f"model.path={tiny_model_dir}", "data.max_rows=16",
              "data.max_length=256", "data.eval_fraction=0.3", "eval_batch_size=1", "batch_size=2", "micro_batch_size=1",
              "max_steps=2", "eval_every=1", "checkpoint.save_every=0", "checkpoint.save_final=false",
              "logging.tensorboard=false", "logging.progress=false"]
    if recipe == "dpo":
        common += ["reference=precompute"]  # in batches of eval_batch_size
    single, multi = tmp_path / "single", tmp_path / "multi"
    run_cli(*common, f"run_dir={single}")
    proc = _torchrun([*common, f"run_dir={multi}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = [r for r in read_metrics(single) if "eval/loss" in r]
    b = [r for r in read_metrics(multi) if "eval/loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        for k in ("eval/loss", "train/loss", "train/grad_norm"):
            assert x[k] == pytest.approx(y[k], abs=1e-5, rel=1e-4), k


def test_two_torchrun_agents_train_as_two_processes_of_one(tiny_model_dir, data, tmp_path):
    """Multi-node is torchrun's own rendezvous: two agents (``--nnodes 2``, one process each,
    ``--node_rank`` 0 and 1) meet at a c10d rendezvous on localhost, as two machines would, and
    train exactly as ``--nproc_per_node 2`` does: the same losses, gradient norms and final
    weights, bit for bit (the same two ranks, the same gloo sums; only the launch differs)."""
    from safetensors.torch import load_file
    from torch.distributed import TCPStore

    common = ("max_steps=2", "batch_size=4", "micro_batch_size=1", "packing=false", "logging.progress=false")
    two, nodes = tmp_path / "two", tmp_path / "nodes"
    proc = _torchrun(_args(tiny_model_dir, data, two, *common))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the rendezvous store: held here on a port the OS picked (no port probed, then lost to a
    # race); each agent first tries to host it at the endpoint, finds it taken, and joins it
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{store.port}", "--rdzv_id", "relign-two-nodes",
         "-m", "relign", *_args(tiny_model_dir, data, nodes, *common)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    try:
        outs = [a.communicate(timeout=300) for a in agents]
    finally:
        for a in agents:
            a.kill()
        del store
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    assert sum(" x 2 ranks, " in out + err for out, err in outs) == 1  # one world of two: rank 0's banner, on one node
    a, b = _losses(two), _losses(nodes)
    assert [s for s, _ in a] == [1, 2] and a == b
    wa, wb = (load_file(str(run / "checkpoints" / "step_2" / "model.safetensors")) for run in (two, nodes))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
