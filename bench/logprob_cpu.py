"""relign before and after a change, on the CPU, in one script run: the relign side of
``bench/grpo_step.py`` and ``bench/dpo_throughput.py`` (their own workers, their settings), run
from two code trees in alternation: the working tree, and ``--base`` (a commit, archived into a
temporary folder), so each run's peak RSS (VmHWM, a fresh process each) and step times compare
like with like on the same machine in the same hour. TRL is not needed.

    python bench/logprob_cpu.py --base 58c3ee1                   # GRPO and DPO, 2 repeats each, ~12 min on 2 cores
    python bench/logprob_cpu.py --base 58c3ee1 --benches dpo --repeats 3
    python bench/logprob_cpu.py --base 58c3ee1 --micro            # one process, old vs new alternating

``--micro`` times the log-prob paths themselves in one process, old and new alternating on the
same inputs (the base tree's ``relign/models/logprobs.py`` loaded beside the new one: it imports
nothing of relign), forward + backward through the ``tiny:small`` model (10 layers, hidden 256)
at the vocabularies of ``--vocabs`` (0: its tokenizer's 2,294; others by resizing the tied
embedding): SFT's loss (one packed row of 8 x 256 tokens, token-mean), DPO's packed sequence
log-probs (the same row), the RL update's call (8 padded rows of 96 + 128 tokens, temperature 0.7,
entropy detached). Wall and CPU seconds (the process's own, less sensitive to other load), and
the bytes autograd saves for the backward (``saved_tensors_hooks``, distinct storages).

Written for issue 45 item 2 (log-probs with no fp32 [T, V] kept for the backward). Output: a
markdown table on stdout and JSON at --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this tree's relign (the "new" side), not an installed one
sys.path.insert(0, str(REPO / "bench"))
import grpo_step  # noqa: E402


def _archive(rev: str, out: Path) -> str:
    """``rev``'s tree into ``out``; returns its full commit id."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
    git = subprocess.Popen(["git", "archive", sha], cwd=REPO, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(out)], stdin=git.stdout, check=True)
    git.wait()
    return sha


def _worker(tree: Path, bench: str, args: list[str], result: Path, threads: int) -> dict:
    cmd = [sys.executable, str(tree / "bench" / f"{bench}.py"), "--worker", "relign", "--result", str(result),
           "--threads", str(threads), *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}  # relign from this tree, not the installed one
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"{bench} worker in {tree} failed ({proc.returncode})")
    return json.loads(result.read_text())


def _steps(res: dict, warmup: int) -> list[float]:
    rows = res["rows"]
    return [rows[k]["step"] for k in range(max(warmup, 1), len(rows))]


def _load_old(tree: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("old_logprobs", tree / "relign" / "models" / "logprobs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_logprobs"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _saved_mb(fn) -> float:
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values()) / 2**20


def micro(base_tree: Path, rounds: int, threads: int, vocabs: list[int]) -> dict:
    import torch

    from relign.algorithms.aggregation import aggregate
    from relign.models import lean
    from relign.models import logprobs as new
    from relign.models.tiny import build_tiny_model

    torch.set_num_threads(threads)
    old = _load_old(base_tree)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for vocab in vocabs:  # 0: the tokenizer's own
        model, _ = build_tiny_model(None, arch="qwen2", size="small")
        base_vocab = model.config.vocab_size
        if vocab:
            model.resize_token_embeddings(vocab, mean_resizing=False)
        vocab = model.config.vocab_size
        lean.lean_activations(model)
        # SFT/DPO-like: one packed row of 8 sequences of 256 tokens, the first 64 of each not scored
        ids = torch.randint(3, base_vocab, (1, 2048), generator=gen)
        pos = torch.arange(256).repeat(8)[None]
        mask = ((pos >= 64)).float()
        N = mask.sum()
        # RL-like: 8 padded rows of 96 prompt + 128 response tokens
        rl_ids = torch.randint(3, base_vocab, (8, 224), generator=gen)
        rl_mask = torch.zeros(8, 224)
        rl_mask[:, 96:] = 1

        def sft(mod):
            if mod is new:
                v = torch.zeros(mask.shape, requires_grad=True)
                (c,) = torch.autograd.grad(aggregate(v, mask, "token-mean", N), v)
                return -new.weighted_token_logps(model, ids, c, position_ids=pos)
            lp, _ = mod.token_logps(model, ids, position_ids=pos, target_mask=mask)
            return aggregate(-lp, mask, "token-mean", N)

        def dpo(mod):
            lp, _ = mod.token_logps(model, ids, position_ids=pos, target_mask=mask)
            return -(lp * mask).sum() / N

        def rl(mod):
            lp, ent = mod.token_logps(model, rl_ids, target_mask=rl_mask, temperature=0.7, with_entropy=True)
            return -(lp * rl_mask).sum() / rl_mask.sum()

        res = {}
        for name, fn in (("sft", sft), ("dpo", dpo), ("rl", rl)):
            times = {"old": [], "new": []}
            cpu = {"old": [], "new": []}
            losses = {}
            for r in range(rounds + 1):
                for which, mod in ((("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))):
                    model.zero_grad(set_to_none=True)
                    t, c = time.perf_counter(), time.process_time()
                    loss = fn(mod)
                    loss.backward()
                    if r:  # the first round warms up
                        times[which].append(time.perf_counter() - t)
                        cpu[which].append(time.process_time() - c)
                    losses[which] = float(loss.detach())
            med = {k: statistics.median(v) for k, v in times.items()}
            med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
            res[name] = {
                "old_ms": 1e3 * med["old"], "new_ms": 1e3 * med["new"], "new_over_old": med["new"] / med["old"],
                # CPU seconds of this process: less sensitive than wall time to other processes on the cores
                "old_cpu_ms": 1e3 * med_cpu["old"], "new_cpu_ms": 1e3 * med_cpu["new"],
                "new_over_old_cpu": med_cpu["new"] / med_cpu["old"],
                "saved_mb_old": _saved_mb(lambda: fn(old)), "saved_mb_new": _saved_mb(lambda: fn(new)),
                "loss_old": losses["old"], "loss_new": losses["new"],
            }
            print(f"vocab {vocab} {name}: {json.dumps(res[name])}", file=sys.stderr, flush=True)
        out[str(vocab)] = res
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare the working tree with")
    p.add_argument("--benches", default="grpo,dpo")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="grpo: model.dtype fp32 or bf16-mixed")
    p.add_argument("--vocab", type=int, default=0,
                   help="resize the tiny model's (tied) vocabulary to this many rows (Qwen's: 151936); 0 = the tokenizer's 2,294")
    p.add_argument("--max-new-tokens", type=int, default=128, help="grpo")
    p.add_argument("--max-length", type=int, default=512, help="dpo")
    p.add_argument("--micro", action="store_true", help="the in-process A/B of the log-prob paths instead")
    p.add_argument("--rounds", type=int, default=5, help="--micro: timed rounds (old and new each)")
    p.add_argument("--vocabs", default="0,151936", help="--micro: vocabulary sizes (0: the tiny tokenizer's own)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "logprob_cpu.json"))
    a = p.parse_args(argv)
    if a.micro:
        with tempfile.TemporaryDirectory(prefix="logprob-cpu-") as tmp:
            sha = _archive(a.base, Path(tmp))
            res = {"base": sha, "command": " ".join(["python bench/logprob_cpu.py", *(argv or sys.argv[1:])]),
                   "threads": a.threads, "micro": micro(Path(tmp), a.rounds, a.threads,
                                                                  [int(v) for v in a.vocabs.split(",")])}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        print("| vocab | path | old ms | new ms | new/old | CPU s new/old | saved MB old | new |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for vocab, r in res["micro"].items():
            for name, x in r.items():
                print(f"| {vocab} | {name} | {x['old_ms']:.0f} | {x['new_ms']:.0f} | {x['new_over_old']:.2f} | "
                      f"{x['new_over_old_cpu']:.2f} | "
                      f"{x['saved_mb_old']:.0f} | {x['saved_mb_new']:.0f} |")
        return res
    from relign.models.tiny import build_tiny_model

    out: dict = {"base": None, "benches": {}, "command": " ".join(["python bench/logprob_cpu.py", *(argv or sys.argv[1:])])}
    with tempfile.TemporaryDirectory(prefix="logprob-cpu-") as tmp:
        tmp = Path(tmp)
        (tmp / "base").mkdir()
        out["base"] = _archive(a.base, tmp / "base")
        trees = {"base": tmp / "base", "new": REPO}
        model = tmp / "model"
        net, _ = build_tiny_model(model, arch="qwen2", size="small")
        if a.vocab:  # the tokenizer's ids are a subset of the larger vocabulary (as bench/gpu_checks.py does)
            net.resize_token_embeddings(a.vocab, mean_resizing=False)
            net.save_pretrained(model)
        prompts = tmp / "prompts.jsonl"
        grpo_step._write_prompts(str(prompts), 64)
        common = ["--model", str(model), "--steps", str(a.steps), "--warmup", str(a.warmup)]
        args = {
            "grpo": ["grpo_step", [*common, "--prompts", str(prompts), "--precision", a.precision,
                                   "--max-new-tokens", str(a.max_new_tokens)]],
            "dpo": ["dpo_throughput", [*common, "--mode", "precompute", "--kept", str(tmp / "unused.jsonl"),
                                       "--max-length", str(a.max_length)]],
        }
        for bench in a.benches.split(","):
            script, bargs = args[bench]
            runs: dict[str, list[dict]] = {"base": [], "new": []}
            for rep in range(a.repeats):
                for name in (("base", "new") if rep % 2 == 0 else ("new", "base")):
                    print(f"[{bench} {rep + 1}/{a.repeats}] {name} ...", file=sys.stderr, flush=True)
                    t0 = time.perf_counter()
                    res = _worker(trees[name], script, bargs, tmp / f"{bench}-{name}-{rep}.json", a.threads)
                    runs[name].append({"peak_rss_mb": res["peak_rss_mb"], "step_s": _steps(res, a.warmup),
                                       "wall_s": time.perf_counter() - t0,
                                       "losses": [r.get("loss") for r in res["rows"]] if bench == "dpo" else None})
            summary = {}
            for name, rs in runs.items():
                # each timed step counts with its fastest repeat (the repeats do the same work)
                best = [min(r["step_s"][k] for r in rs) for k in range(len(rs[0]["step_s"]))]
                summary[name] = {"peak_rss_mb": [r["peak_rss_mb"] for r in rs], "median_step_s": statistics.median(best)}
            summary["rss_new_over_base"] = max(summary["new"]["peak_rss_mb"]) / max(summary["base"]["peak_rss_mb"])
            summary["step_new_over_base"] = summary["new"]["median_step_s"] / summary["base"]["median_step_s"]
            out["benches"][bench] = {"summary": summary, "runs": runs}
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(out, indent=1))
    print("| bench | peak RSS MB base | new | new/base | median step s base | new | new/base |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for bench, r in out["benches"].items():
        s = r["summary"]
        print(f"| {bench} | {max(s['base']['peak_rss_mb']):,.0f} | {max(s['new']['peak_rss_mb']):,.0f} | "
              f"{s['rss_new_over_base']:.2f} | {s['base']['median_step_s']:.2f} | {s['new']['median_step_s']:.2f} | "
              f"{s['step_new_over_base']:.2f} |")
    return out


if __name__ == "__main__":
    main()
