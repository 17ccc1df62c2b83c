"""The "nothing moves but code" golden check: every shipped preset, shrunk to a few seconds, run
through the real command line; its metrics and final weights recorded, and two recordings compared.

    python tools/golden.py record OUT.json [--only a,b] [--model /tmp/golden-model] [--repo PATH] [--keep DIR]
    python tools/golden.py check REF.json NEW.json [--rtol 1e-6] [--atol A] [--only a,b] [--metrics-only | --cross-cpu]

Before and after a refactor, on one machine (the model: ``python -m relign tiny-model /tmp/golden-model
--size micro --seed 0``, byte-identical on every build and CPU):

    cd OLD_TREE && PYTHONPATH=$PWD python /path/to/tools/golden.py record /tmp/before.json
    cd NEW_TREE && PYTHONPATH=$PWD python tools/golden.py record /tmp/after.json
    python tools/golden.py check /tmp/before.json /tmp/after.json --rtol 0    # bitwise, weights too

``record`` runs ``python -m relign RECIPE relign/presets/NAME.yaml OVERRIDES...`` for each preset of
``PRESETS`` in a fresh process (OMP_NUM_THREADS=1, PYTHONPATH and working directory = the repository
under test, RELIGN_CACHE = a fresh cache whose ``tiny:micro`` is ``--model``, HF_HUB_OFFLINE=1), one
at a time, and writes per preset:

- ``recipe`` and ``args``: the exact argument list, with ``{model}`` and ``{run_dir}`` standing for
  the model folder and the run's (temporary) directory;
- ``metrics``: every row of every ``metrics.jsonl`` under the run directory (``{relative path: rows}``:
  the demo has one per stage), with the keys that depend on time removed (the rule below);
- ``summaries``: for the runs that write them, the numbers of ``eval.json``'s ``metrics``, the rows of
  ``sweep.json`` and ``demo.json``'s ``before`` / ``after``, flattened to ``a.b.0.c`` keys, same rule;
- ``weights``: sha256 per ``*.safetensors`` file of the final checkpoint (the newest
  ``checkpoints/step_N``; rest_em: the checkpoint ``rest_state.json`` chose; demo: the rl stage's
  newest), over each tensor's name, dtype, shape and raw bytes in sorted key order, so that neither
  the header's layout nor its metadata counts. Eval presets have none (``{}``);
- ``wall_s``: seconds the run took (information only, never compared).

Time-dependent keys, dropped everywhere (``is_time_key``): a key any of whose ``/`` or ``.``
separated parts is ``time``, ``perf``, ``seconds``, ``wall`` or ``stage_seconds``, or ends in ``_s``,
``_seconds``, ``_sec``, ``_time`` or ``_per_s`` (``time/step_s``, ``perf/tokens_per_s``,
``time/eval_s``, a row's ``time`` stamp, demo.json's ``seconds`` and ``stage_seconds``).

``check`` compares two recordings: the same presets, the same metric files, row counts and keys,
each number within ``|a - b| <= atol + rtol * max(|a|, |b|)`` (NaN equals NaN; strings and bools
exactly), and equal weight hashes (unless ``--metrics-only``). ``atol`` defaults to ``rtol * 1e-3``:
0 when rtol is 0 (bitwise), else a floor that keeps a value that is 0 up to rounding (a loss of
3e-10 against 0) from failing on relative terms alone. ``--cross-cpu`` applies the suite's
tolerance instead (``CROSS_CPU``: rtol 3e-3, atol 1e-6, larger floors for two noise-only metrics;
weights not compared). One line per preset (``ok`` or the first difference with both values, and
the largest relative difference seen, often a value that is 0 up to rounding), exit status 1 on
any difference.

Run to run on one machine the recordings are bitwise equal (weights included); only the kernels'
rounding differs across CPUs (see CROSS_CPU). Nothing of relign is imported (only its location is
looked up), so the same script records the code before and after a refactor.
``tests/e2e/test_golden_presets.py`` uses ``PRESETS``, ``preset_args``, ``model_cache``,
``write_reward``, ``collect``, ``compare`` and ``CROSS_CPU`` from here.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# -------------------------------------------------------------------------------------------------
# The presets, shrunk. Each runs the shipped preset file with its own task and data; only sizes
# change (2 optimizer steps, tiny batches, <= 8 new tokens), plus what makes a short run exercise
# the code at all. {model} and {run_dir} are filled in at run time.

LOG = ["logging.tensorboard=false", "logging.progress=false"]
# SFT-shaped runs (sft, rm, verifier, the dpo family): 16 rows of the preset's data, a quarter held
# out, 2 steps of 4 examples in micro-batches of 2, eval and a checkpoint after every step.
SMALL = ["model.path={model}", "data.max_rows=16", "data.max_length=192", "data.eval_fraction=0.25", "batch_size=4",
         "micro_batch_size=2", "max_steps=2", "eval_every=1", "checkpoint.save_every=1", *LOG]
# RL runs: 2 steps x 2 prompts x 2 samples of <= 8 tokens, rewards in-process, greedy eval of 2
# problems of the task's test set and a checkpoint after every step. A random model scores 0 on
# every built-in task, so every group's rewards are equal, every advantage is 0 and (without a KL
# or entropy term) no update happens at all: the tiny model itself is added as a learned reward
# (reward.model: a causal LM is read as a generative verifier, P(Yes)), which gives every
# completion its own reward next to the rule reward, so advantages, clipping, the critic and
# dynamic sampling all see real numbers. Its P(Yes) is ~4e-4 (a random model): weight 1000 makes
# the rewards ~0.4, so the rewards, the updates without std scaling (Dr. GRPO, RLOO, PPO, ...)
# and their metrics are of order 1, where a relative tolerance means something.
RL = ["model.path={model}", "max_steps=2", "prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8",
      "task.max_rows=8", "task.reward_workers=0", "reward.model={model}", "reward.weight=1000",
      "checkpoint.save_every=1", "eval.every=1", "eval.max_rows=2", *LOG]


def _without(args: list[str], *prefixes: str) -> list[str]:
    return [a for a in args if not a.startswith(prefixes)]


PRESETS: dict[str, tuple[str, list[str]]] = {
    "sft_tiny": ("sft", [*SMALL]),
    "rm": ("rm", [*SMALL]),
    # the verifier's data has no max_rows (256 graded solutions; 5% held out) and no eval_every
    # (it evaluates at the end)
    "verifier": ("verifier", [*_without(SMALL, "data.max_rows", "data.eval_fraction", "eval_every"),
                              "data.eval_fraction=0.05"]),
    "dpo": ("dpo", [*SMALL]),
    "dpop": ("dpo", [*SMALL]),
    "ipo": ("dpo", [*SMALL]),
    "kto": ("dpo", [*SMALL]),
    "orpo": ("dpo", [*SMALL]),
    "simpo": ("dpo", [*SMALL]),
    "sdpo": ("dpo", [*SMALL]),
    # Multi-turn: relign rl refuses eval.every and reward.model with a multi-turn environment, and
    # the environment's own reward ignores task.reward_fn: an entropy bonus makes the update run
    # (as in tests/e2e/test_cli_rl.py).
    "calculator_tool": ("rl", [*_without(RL, "eval.", "reward."), "algorithm.entropy_coef=0.01"]),
    # the overlong window must fit in the token budget (8 here, 48 in the preset)
    "dapo": ("rl", [*RL, "algorithm.overlong_cache=4"]),
    "dr_grpo": ("rl", [*RL]),
    "grpo": ("rl", [*RL]),
    "grpo_async": ("rl", [*RL]),
    "gspo": ("rl", [*RL]),
    "ppo": ("rl", [*RL]),
    "reinforce_pp": ("rl", [*RL]),
    "rloo": ("rl", [*RL]),
    "trpo": ("rl", [*RL]),
    # VinePPO scores its Monte-Carlo continuations with the task's reward and refuses reward.model:
    # the task's reward is replaced by REWARD_SRC's text reward instead (the gsm8k prompts and the
    # preset's step delimiter stay). K = 2 continuations per step boundary instead of 9.
    "vineppo": ("rl", [*_without(RL, "reward."), "task.reward_fn={reward_fn}", "vine.k=2"]),
    # One iteration. A random model solves nothing and never ends a completion by itself (a
    # truncated one counts as failed), so as shipped the run stops before fine-tuning. A stop
    # string ("e", a frequent letter) ends completions early and threshold 0 keeps them, so the
    # filter, the SFT of 2 epochs, the validation and the checkpoint choice run too.
    "rest_em": ("rest", ["model.path={model}", "iterations=1", "task.max_rows=8", "val.size=2", "rollout.n=2",
                         "rollout.max_new_tokens=8", "rollout.stop=[e]", "threshold=0.0", "epochs=2", "batch_size=4",
                         "micro_batch_size=2", "max_length=128", "task.reward_workers=0", *LOG]),
    "eval_gsm8k": ("eval", ["model.path={model}", "task.max_rows=2", "n=2", "k=2", "max_new_tokens=8",
                            "task.reward_workers=0", *LOG]),
    # the preset's four strategies at two budgets, on 2 problems
    "eval_search": ("eval", ["model.path={model}", "task.max_rows=2", "max_new_tokens=8", "search.step_max_tokens=4",
                             "search.max_depth=2", "sweep.budgets=[16,32]", "task.reward_workers=0", *LOG]),
    # tiny:micro is the golden model (RELIGN_CACHE), so the preset's own tiny-model path runs. Its
    # GRPO stage gets the learned reward too (the arith reward is 0 after a 2-step warm start).
    "demo": ("demo", ["demo.rl_overrides=[reward.model={model},reward.weight=1000]", "demo.model_size=micro",
                      "demo.threads=1", "demo.train_problems=32", "demo.test_problems=2", "demo.sft_steps=2",
                      "demo.sft_batch_size=4", "demo.steps=2", "demo.prompts_per_step=2", "demo.group_size=2",
                      "demo.max_new_tokens=8", "demo.eval_samples=2", "demo.eval_every=1", *LOG]),
}


# A reward that depends on the completion's text alone and differs for nearly every completion
# (written next to the runs as golden_reward.py; only vineppo uses it).
REWARD_SRC = '''
def reward(prompt, response, extra_info):
    return (sum(map(ord, response)) % 97) / 96.0
'''


def write_reward(folder: Path) -> str:
    """Write REWARD_SRC into ``folder``; the value of {reward_fn}."""
    path = Path(folder) / "golden_reward.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(REWARD_SRC)
    return f"{path}:reward"


def preset_args(name: str, model: str, run_dir: str, reward_fn: str = "{reward_fn}") -> list[str]:
    """The command line after ``python -m relign``: recipe, preset file (relative to the repository
    root, the run's working directory), overrides with {model}, {run_dir} and {reward_fn} filled in."""
    recipe, overrides = PRESETS[name]
    fill = {"{model}": str(model), "{run_dir}": str(run_dir), "{reward_fn}": str(reward_fn)}
    out = [recipe, f"relign/presets/{name}.yaml"]
    for a in [*overrides, "run_dir={run_dir}"]:
        for k, v in fill.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def model_cache(model: Path, cache: Path) -> Path:
    """A RELIGN_CACHE in which ``tiny:micro`` (qwen2) is ``model``: presets that name a tiny model
    (the demo's) then run on the golden model, and nothing is built or read from ~/.cache."""
    (cache / "tiny").mkdir(parents=True, exist_ok=True)
    link = cache / "tiny" / "qwen2-micro"
    if not link.exists():
        link.symlink_to(Path(model).resolve(), target_is_directory=True)
    return cache


# -------------------------------------------------------------------------------------------------
# What a run left behind

TIME_PARTS = {"time", "perf", "seconds", "wall", "stage_seconds"}
TIME_SUFFIXES = ("_s", "_seconds", "_sec", "_time", "_per_s")


def is_time_key(key: str) -> bool:
    parts = key.replace(".", "/").split("/")
    return any(p in TIME_PARTS or p.endswith(TIME_SUFFIXES) for p in parts)


def _flatten(obj, prefix: str = "") -> dict:
    """Nested dicts and lists to {"a.b.0.c": scalar}; time keys dropped."""
    out = {}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return {prefix: obj} if not is_time_key(prefix) else {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _clean_row(row: dict) -> dict:
    return {k: v for k, v in _flatten(row).items() if not is_time_key(k)}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def hash_safetensors(path: Path) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, in sorted name order. Read from
    the file's own layout (8-byte little-endian header length, JSON header, data) with no library."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    h = hashlib.sha256()
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        begin, end = t["data_offsets"]
        h.update(json.dumps([name, t["dtype"], t["shape"]]).encode())
        h.update(body[begin:end])
    return h.hexdigest()


def _newest_checkpoint(run: Path) -> Path | None:
    steps = [(int(p.name.split("_")[1]), p) for p in (run / "checkpoints").glob("step_*")
             if p.name.split("_")[1].isdigit()]
    return max(steps)[1] if steps else None


def final_checkpoint(run: Path, recipe: str) -> Path | None:
    if recipe == "rest":
        state = run / "rest_state.json"
        return run / json.loads(state.read_text())["checkpoint"] if state.is_file() else None
    if recipe == "demo":
        return _newest_checkpoint(run / "rl")
    if recipe == "eval":
        return None
    return _newest_checkpoint(run)


def collect(run: Path, recipe: str, *, weights: bool = True) -> dict:
    """The comparable content of a finished run directory: metrics, summaries, weight hashes."""
    run = Path(run)
    metrics = {str(p.relative_to(run)): [_clean_row(r) for r in _read_jsonl(p)]
               for p in sorted(run.rglob("metrics.jsonl"))}
    summaries = {}
    for p in sorted(run.rglob("eval.json")):
        summaries[f"{p.relative_to(run)}:metrics"] = _clean_row(json.loads(p.read_text())["metrics"])
    if (run / "sweep.json").is_file():
        summaries["sweep.json:rows"] = _clean_row({"rows": json.loads((run / "sweep.json").read_text())["rows"]})
    if (run / "demo.json").is_file():
        demo = json.loads((run / "demo.json").read_text())
        summaries["demo.json:before_after"] = _clean_row({"before": demo["before"], "after": demo["after"]})
    out = {"metrics": metrics, "summaries": summaries}
    if weights:
        ckpt = final_checkpoint(run, recipe)
        out["checkpoint"] = str(ckpt.relative_to(run)) if ckpt is not None else None
        out["weights"] = ({str(p.relative_to(ckpt)): hash_safetensors(p) for p in sorted(ckpt.rglob("*.safetensors"))}
                          if ckpt is not None else {})
    return out


# -------------------------------------------------------------------------------------------------
# Comparing two recordings

# The tolerance across CPUs (tests/e2e/test_golden_presets.py; check --cross-cpu), measured at
# 58f161f by recording on this AVX-512 EPYC as it is and again with the kernels held to AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2): no sampled
# token, eval answer or search path changed in any preset; weights differ in the last bits. The
# largest relative difference of a metric was 4.4e-4 (ppo actor/loss -0.0011), 3.1e-4 (dpop
# eval/dpop/penalty, a difference of two log-probs near -244), 3.0e-4 (rloo actor/grad_norm); the
# rest <= 8e-5. rtol 3e-3 leaves a factor of ~7-10. Values that are 0 up to rounding need an
# absolute floor: actor/loss of the group-baseline losses (zero-mean advantages x ratio ~1; AdamW
# turns gradients at noise level into lr-sized steps, so step 2's ratios differ): |diff| up to
# 3.6e-5 (grpo, gspo, dapo), floor 2e-4; actor/logp_mismatch(_max), engine-vs-trainer rounding
# itself, multiples of one float32 ulp of a log-prob near -8 (4.8e-7), floor 1e-5; every other
# key 1e-6 (the largest need: actor/kl ~8e-6, off by 3.7e-8). Two threads instead of one (a
# pytest run without -n) stay well inside it too.
CROSS_CPU = {"rtol": 3e-3, "atol": 1e-6,
             "key_atol": {"actor/loss": 2e-4, "actor/logp_mismatch": 1e-5, "actor/logp_mismatch_max": 1e-5}}


def _close(a, b, rtol: float, atol: float) -> tuple[bool, float]:
    """(equal within tolerance, relative difference) of two scalars."""
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    if not numbers:  # strings, bools, None: exactly
        return a == b and type(a) is type(b), 0.0 if a == b else math.inf
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b), 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return True, 0.0
    diff = abs(a - b)
    scale = max(abs(a), abs(b))
    rel = diff / scale if scale else math.inf
    return diff <= atol + rtol * scale, rel


def _compare_tables(what: str, ref: dict, new: dict, rtol: float, atol: float, worst: list,
                    key_atol: dict | None = None) -> str | None:
    """The first difference of two {key: scalar} tables, or None; worst[0] = (rel, key) so far."""
    if ref.keys() != new.keys():
        only_ref, only_new = sorted(ref.keys() - new.keys()), sorted(new.keys() - ref.keys())
        return f"{what}: keys differ (only in ref: {only_ref[:5]}, only in new: {only_new[:5]})"
    first = None
    for k in ref:
        ok, rel = _close(ref[k], new[k], rtol, max(atol, (key_atol or {}).get(k, 0.0)))
        if rel > worst[0][0]:
            worst[0] = (rel, f"{what}[{k}]")
        if not ok and first is None:
            first = f"{what}[{k}]: {ref[k]!r} != {new[k]!r} (rel {rel:.3g})"
    return first


def compare(ref: dict, new: dict, rtol: float = 1e-6, atol: float | None = None, weights: bool = True,
            key_atol: dict | None = None) -> tuple[str | None, tuple[float, str]]:
    """One preset's recordings: (the first difference or None, (largest relative difference, where)).
    ``key_atol``: larger absolute floors for some metric keys (CROSS_CPU's)."""
    atol = rtol * 1e-3 if atol is None else atol
    worst = [(0.0, "")]
    if ref.get("returncode", 0) != 0 or new.get("returncode", 0) != 0:
        return f"a run failed: exit status {ref.get('returncode', 0)} (ref), {new.get('returncode', 0)} (new)", worst[0]
    if "args" in ref and "args" in new and ref["args"] != new["args"]:
        return f"recorded with other arguments: {ref['args']} != {new['args']}", worst[0]
    first = None
    if ref["metrics"].keys() != new["metrics"].keys():
        return f"metric files differ: {sorted(ref['metrics'])} != {sorted(new['metrics'])}", worst[0]
    for f in ref["metrics"]:
        a, b = ref["metrics"][f], new["metrics"][f]
        if len(a) != len(b):
            first = first or f"{f}: {len(a)} rows != {len(b)} rows"
            continue
        for i, (ra, rb) in enumerate(zip(a, b)):
            d = _compare_tables(f"{f} row {i} (step {ra.get('step')})", ra, rb, rtol, atol, worst, key_atol)
            first = first or d  # scanning on for the largest difference
    if ref["summaries"].keys() != new["summaries"].keys():
        first = first or f"summaries differ: {sorted(ref['summaries'])} != {sorted(new['summaries'])}"
    else:
        for s in ref["summaries"]:
            d = _compare_tables(s, ref["summaries"][s], new["summaries"][s], rtol, atol, worst, key_atol)
            first = first or d
    if weights and ref.get("weights") != new.get("weights"):
        first = first or f"weights differ: {ref.get('weights')} != {new.get('weights')}"
    return first, worst[0]


# -------------------------------------------------------------------------------------------------
# The command line

def default_repo() -> Path:
    """The repository whose ``relign`` this interpreter imports (found, not imported)."""
    spec = importlib.util.find_spec("relign")
    if spec is None or spec.origin is None:
        sys.exit("golden: relign is not importable here; pass --repo")
    return Path(spec.origin).resolve().parent.parent


def run_env(repo: Path, cache: Path, threads: int = 1) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", "RELIGN_CACHE": str(cache),
                "PYTHONPATH": os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])})
    return env


def cmd_record(a) -> int:
    repo = Path(a.repo).resolve() if a.repo else default_repo()
    names = a.only.split(",") if a.only else list(PRESETS)
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        sys.exit(f"golden: unknown presets {unknown}; known: {', '.join(PRESETS)}")
    model = Path(a.model).resolve()
    if not (model / "config.json").is_file():
        sys.exit(f"golden: no model at {model}; build it: python -m relign tiny-model {model} --size micro --seed 0")
    if a.keep:
        Path(a.keep).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="golden-", dir=a.keep))
    env = run_env(repo, model_cache(model, tmp / "cache"), a.threads)
    reward_fn = write_reward(tmp)
    # the relign the runs import must be the one under test, not an editable install elsewhere
    where = subprocess.run([sys.executable, "-c", "import relign; print(relign.__file__)"], cwd=repo, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(repo):
        sys.exit(f"golden: the runs would import {where}, not the relign of {repo}")
    print(f"golden: relign from {where}; model {model}; {len(names)} presets", file=sys.stderr)
    # what was run, without this machine's paths: the commit of the tree (+ "-dirty" with uncommitted changes)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=repo, capture_output=True, text=True).stdout.strip()
    out = {"commit": commit or "?", "model": Path(model).name, "python": sys.version.split()[0], "presets": {}}
    failed = 0
    for name in names:
        run = tmp / name
        args = preset_args(name, str(model), str(run), reward_fn)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "relign", *args], cwd=repo, env=env, capture_output=True,
                              text=True)
        wall = time.perf_counter() - t0
        entry = {"recipe": PRESETS[name][0], "args": preset_args(name, "{model}", "{run_dir}"),
                 "returncode": proc.returncode, "wall_s": round(wall, 2)}
        if proc.returncode == 0:
            entry.update(collect(run, PRESETS[name][0]))
        else:
            failed += 1
            entry["stderr_tail"] = proc.stderr[-3000:]
            print(proc.stderr[-3000:], file=sys.stderr)
        built = sorted(p.name for p in (tmp / "cache" / "tiny").iterdir() if p.name != "qwen2-micro")
        if built:  # a tiny:SIZE other than the golden model was built: the run did not use --model
            failed += 1
            entry["returncode"] = entry["returncode"] or -1000
            print(f"golden: {name} built its own tiny model(s) {built}: pass model.path={{model}}", file=sys.stderr)
            for b in built:
                shutil.rmtree(tmp / "cache" / "tiny" / b, ignore_errors=True)
        out["presets"][name] = entry
        print(f"{name:16s} exit {proc.returncode}  {wall:6.1f} s", file=sys.stderr)
    total = sum(e["wall_s"] for e in out["presets"].values())
    print(f"golden: {len(names)} presets in {total:.1f} s, {failed} failed", file=sys.stderr)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=False) + "\n")
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


def cmd_check(a) -> int:
    ref, new = (json.loads(Path(p).read_text())["presets"] for p in (a.ref, a.new))
    names = a.only.split(",") if a.only else sorted(ref.keys() | new.keys(), key=lambda n: list(PRESETS).index(n)
                                                     if n in PRESETS else len(PRESETS))
    bad = 0
    for name in names:
        if name not in ref or name not in new:
            print(f"{name:16s} MISSING in {'ref' if name not in ref else 'new'}")
            bad += 1
            continue
        first, (rel, where) = compare(ref[name], new[name], a.rtol, a.atol, weights=not a.metrics_only,
                                      key_atol=a.key_atol)
        worst = f"  (largest rel diff {rel:.3g} at {where})" if rel else ""
        print(f"{name:16s} {'ok' if first is None else 'DIFF ' + first}{worst}")
        bad += first is not None
    print(f"golden: {len(names) - bad} of {len(names)} presets agree (rtol {a.rtol}, atol "
          f"{a.rtol * 1e-3 if a.atol is None else a.atol}{', weights not compared' if a.metrics_only else ''})")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the presets and write their metrics and weight hashes")
    r.add_argument("out")
    r.add_argument("--only", default="", help="comma-separated preset names (default: all)")
    r.add_argument("--model", default="/tmp/golden-model",
                   help="tiny model folder (relign tiny-model OUT --size micro --seed 0)")
    r.add_argument("--repo", default="",
                   help="repository root of the relign under test (default: the importable one's)")
    r.add_argument("--keep", default=None, help="keep the run directories under this folder")
    r.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the runs (the recordings use 1)")
    c = sub.add_parser("check", help="compare two recordings")
    c.add_argument("ref")
    c.add_argument("new")
    c.add_argument("--rtol", type=float, default=1e-6)
    c.add_argument("--atol", type=float, default=None, help="absolute floor (default: rtol * 1e-3)")
    c.add_argument("--only", default="")
    c.add_argument("--metrics-only", action="store_true", help="do not compare weight hashes")
    c.add_argument("--cross-cpu", action="store_true",
                   help="the suite's tolerance across CPUs (CROSS_CPU: rtol 3e-3, atol 1e-6, larger floors for "
                        "actor/loss and actor/logp_mismatch*), weights not compared")
    a = p.parse_args(argv)
    if a.cmd == "check":
        a.key_atol = None
        if a.cross_cpu:
            a.rtol, a.atol, a.key_atol, a.metrics_only = (CROSS_CPU["rtol"], CROSS_CPU["atol"],
                                                          CROSS_CPU["key_atol"], True)
    return cmd_record(a) if a.cmd == "record" else cmd_check(a)


if __name__ == "__main__":
    sys.exit(main())
