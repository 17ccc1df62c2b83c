"""The GPU check of issue 45 (``specs/gpu_speed.md`` §6): old vs new code paths, section by section, in one run.

    python bench/gpu_ab.py                          # on a GPU: every section, Qwen2.5-0.5B's shape (random init)
    python bench/gpu_ab.py --only compile,varlen    # some sections
    python bench/gpu_ab.py --smoke                  # tiny shapes on the CPU, a few seconds a section: what the suite runs

Each section is a module ``bench/ab/<name>.py`` with ``run(smoke, device, budget_s) -> dict`` (JSON);
it builds its own inputs, compares the old and the new path on the same ones (seconds with
``torch.cuda.synchronize``, the allocator's peak, max |diff|) and should finish within
``budget_s``. They run in this order, the most useful first, so that a run cut by its time limit
keeps what matters most:

    env      versions; whether torch's varlen_attn takes 2 key-value heads for 14 query heads; its causal
             alignment when queries are fewer than keys (bottom-right: a continuation sees its whole prefix);
             Triton and torch.compile present
    profile  kernel time of 2 padded SFT micro-steps by kind (GEMM, attention, Triton, elementwise,
             reductions, copies) and the idle time between kernels
    varlen   packed attention with no host syncs vs today's (P1)
    logprob  log-probs without fp32 [T, V] kept vs today's (P2)
    compile  one SFT micro-step eager vs each decoder layer compiled (P4); bf16 compute weights (P7)
    decode   the static-shape decoder under CUDA graphs vs today's (P5)
    lora     LoRA rollouts from merged copies vs today's (P6)

A section whose module is not there (yet) is recorded as "not present"; one that raises is
recorded with its error and the run goes on; each runs under its own cap (``CAPS``, SIGALRM) and
the whole run under ``--deadline-s``. A section that keeps its results so far in a module-level
dict ``PARTIAL`` has them recorded when it times out or fails. The JSON at ``--out`` is rewritten
after every section.

The device run (``specs/gpu_speed.md`` §6). The machine has torch, transformers, peft and Triton;
relign also needs omegaconf and antlr4, carried as wheels in ``.whl/`` (git-ignored; how to make them:
``bench/gpu_checks.py``'s docstring). With ``carry=[".whl"]`` and ``timeout_s=480``:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    TORCHINDUCTOR_COMPILE_THREADS=16 && PYTHONUNBUFFERED=1 timeout 460 python3 bench/gpu_ab.py --out $OUT/gpu_ab.json

(one line on the device, ``&&`` between the parts). That leaves about 4 minutes of the 15 for one
``--only <section>`` rerun of a section that failed; otherwise hand the machine back.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SECTIONS = ("env", "profile", "varlen", "logprob", "compile", "decode", "lora")
# seconds each section may take on the GPU (est.: specs/gpu_speed.md §6); at --smoke, SMOKE_CAP each
CAPS = {"env": 20, "profile": 45, "varlen": 75, "logprob": 50, "compile": 150, "decode": 120, "lora": 45}
SMOKE_CAP = 120
MIN_LEFT_S = 10  # a section is not started with less time than this left before the deadline


class SectionTimeout(Exception):
    """A section ran past its cap."""


def _alarm(signum, frame):
    raise SectionTimeout()


def load_section(name: str):
    """``bench.ab.<name>``, or None when that module does not exist. An import error inside an
    existing module is a bug of that module and is raised (its section records it)."""
    try:
        return importlib.import_module(f"bench.ab.{name}")
    except ModuleNotFoundError as e:
        if e.name in (f"bench.ab.{name}", "bench.ab", "bench"):
            return None
        raise


def run_section(name: str, *, smoke: bool, device: str, cap: float) -> dict:
    """One section under its cap: its results, or why there are none (not present, error, timeout)."""
    t0 = time.perf_counter()
    out: dict = {"cap_s": cap}
    module = None
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(cap)))
    try:
        module = load_section(name)
        if module is None:
            out["status"] = "not present"
        else:
            out["results"] = module.run(smoke=smoke, device=device, budget_s=cap)
            out["status"] = "ok"
    except SectionTimeout:
        out["status"] = "timeout"
    except Exception as e:  # a section's bug must not cost the sections after it
        out.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
    finally:
        if out.get("status") != "ok" and getattr(module, "PARTIAL", None):
            out["partial"] = module.PARTIAL  # what a section that keeps its results as it goes had finished
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out["wall_s"] = time.perf_counter() - t0
    return out


def write_json(path: str, out: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str))
    tmp.replace(p)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks every section runs")
    p.add_argument("--only", default="", help="comma-separated sections (default: all, in order)")
    p.add_argument("--device", default="", help="default: cuda when available (cpu at --smoke)")
    p.add_argument("--deadline-s", type=float, default=440.0, help="the whole run's seconds; sections past it are skipped")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_ab.json"))
    a = p.parse_args(argv)
    import torch

    device = a.device or ("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    names = [s.strip() for s in a.only.split(",") if s.strip()] or list(SECTIONS)
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    t_start = time.perf_counter()
    out = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": device, "smoke": a.smoke,
           "argv": sys.argv[1:] if argv is None else argv, "sections": {}}
    for name in names:
        left = a.deadline_s - (time.perf_counter() - t_start)
        if left < MIN_LEFT_S:
            out["sections"][name] = {"status": "skipped", "why": f"{left:.0f} s left of --deadline-s"}
        else:
            cap = min(SMOKE_CAP if a.smoke else CAPS[name], left)
            out["sections"][name] = run_section(name, smoke=a.smoke, device=device, cap=cap)
        r = out["sections"][name]
        print(f"[gpu_ab] {name}: {r['status']}" + (f" in {r['wall_s']:.1f} s" if "wall_s" in r else "")
              + (f" ({r['error']})" if "error" in r else ""), flush=True)
        write_json(a.out, out)  # after every section: a run stopped at its limit keeps what it finished
    out["wall_s"] = time.perf_counter() - t_start
    write_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
