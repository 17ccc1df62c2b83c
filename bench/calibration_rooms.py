"""Why one GRPO run does not learn both rooms of the ``calibration`` task on a tiny model.

    PYTHONPATH=. python bench/calibration_rooms.py OUT --mode exact --steps 200
    PYTHONPATH=. python bench/calibration_rooms.py OUT --mode exact --entropy 0.3 --steps 200
    PYTHONPATH=. python bench/calibration_rooms.py OUT --mode sampled --prompts 32 --steps 60
    PYTHONPATH=. python bench/calibration_rooms.py OUT --warm 0 --size tiny --mode exact

The policy here is only the confidence digit: the next-token distribution pi_f after the prompt of
room f (``red``, q = 0.2; ``blue``, q = 0.8) followed by ``conf: ``. The format tokens around it,
the engine and the reader are left out, so nothing but the objective and the model remains:

* ``exact``: gradient ascent on the expected log score itself, sum_f sum_d pi_f(d) S_f(d), with
  S_f(d) = q_f log(d/10) + (1 - q_f) log(1 - d/10) (clipped at 1e-4; a non-digit token gets
  log 1e-4), plus ``--entropy`` times the entropy of pi_f (both modes). No sampling.
* ``sampled``: GRPO on the digit: ``--prompts`` records per step (rooms in turn), each with its own
  hidden answer drawn with q_f, G = 8 digits sampled per record, advantage = reward minus the
  group's mean, reward = log clip(f_y, 1e-4) as ``reward.kind=reader`` (its offset cancels).

Both use AdamW at ``--lr`` (constant). The warm start is ``relign sft`` on ``--warm`` steps of the
two rooms' prompts answered ``conf: N`` with N uniform in 1..9 (the learning test's warm start, with
the rooms named); ``--warm 0`` starts from the random model. Every 10 steps it prints each room's
mean stated P(left) = sum_d pi_f(d) d/10 / sum_d pi_f(d) and the mass on digits.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

Q = {"red": 0.2, "blue": 0.8}
EPS = 1e-4


def warm_start(out: Path, model: Path, steps: int) -> Path:
    from relign.config import load_config
    from relign.envs.calibration import TEMPLATE
    from relign.recipes import sft

    rng = random.Random(0)
    rooms = list(Q)
    rows = [{"prompt": TEMPLATE.replace("{feature}", rooms[i % 2]), "response": f"conf: {rng.randint(1, 9)}"} for i in range(512)]
    (out / "warm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sft.train(load_config(sft.Config, None, [
        f"model.path={model}", f"data.path={out / 'warm.jsonl'}", f"run_dir={out / 'sft'}", f"max_steps={steps}",
        "batch_size=16", "micro_batch_size=16", "optim.lr=3e-3", "data.eval_fraction=0", "logging.progress=false",
        "logging.tensorboard=false"])).checkpoint


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--size", default="micro", help="relign tiny-model size")
    p.add_argument("--warm", type=int, default=150, help="SFT steps of the warm start (0: the random model)")
    p.add_argument("--mode", choices=("exact", "sampled"), default="exact")
    p.add_argument("--entropy", type=float, default=0.0, help="entropy bonus")
    p.add_argument("--prompts", type=int, default=32, help="records per step (sampled mode)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from relign.algorithms.scoring import log_score
    from relign.envs.calibration import TEMPLATE
    from relign.models.loading import load_causal_lm
    from relign.models.tiny import build_tiny_model

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ck = out / f"model-{a.size}"
    if not (ck / "config.json").is_file():
        build_tiny_model(ck, arch="qwen2", size=a.size, seed=0)
    if a.warm:
        ck = Path(warm_start(out, ck, a.warm))
    tok = AutoTokenizer.from_pretrained(ck)
    model = load_causal_lm(str(ck))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    digits = torch.tensor([tok.convert_tokens_to_ids(str(d)) for d in range(10)])
    prefix = tok.convert_tokens_to_ids(tok.tokenize("conf: "))
    ids = {f: torch.tensor([tok(TEMPLATE.replace("{feature}", f))["input_ids"] + prefix]) for f in Q}
    d10 = torch.arange(10) / 10
    # the reader's log score of each stated digit, per outcome (a non-digit states nothing: log eps)
    s_left = torch.tensor([log_score(d / 10, EPS) for d in range(10)])
    s_right = torch.tensor([log_score(1 - d / 10, EPS) for d in range(10)])
    score = {f: q * s_left + (1 - q) * s_right for f, q in Q.items()}  # its expectation over room f's outcomes

    def logpi(f: str) -> torch.Tensor:
        return model(ids[f]).logits[0, -1].float().log_softmax(-1)

    def report(step: int) -> None:
        with torch.no_grad():
            row = {"step": step}
            for f in Q:
                pd = logpi(f).exp()[digits]
                row[f] = {"mean_p": round(float((pd * d10).sum() / pd.sum()), 3), "digit_mass": round(float(pd.sum()), 3)}
        print(json.dumps(row), flush=True)

    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    report(0)
    for step in range(1, a.steps + 1):
        loss = torch.zeros(())
        if a.mode == "exact":
            for f in Q:
                lp = logpi(f)
                s = torch.full_like(lp, log_score(0.0, EPS))
                s[digits] = score[f]
                loss = loss - (lp.exp() * s).sum() + a.entropy * (lp.exp() * lp).sum()
        else:
            for i in range(a.prompts):
                f = list(Q)[i % 2]
                left = rng.random() < Q[f]
                lp = logpi(f)
                tokens = torch.multinomial(lp.exp(), 8, replacement=True, generator=gen)
                hit = tokens[:, None] == digits[None]
                reward = torch.where(hit.any(-1), (s_left if left else s_right)[hit.float().argmax(-1)],
                                     torch.tensor(log_score(0.0, EPS)))  # the reader reward's offset cancels in A
                loss = loss - (((reward - reward.mean()) * lp[tokens]).mean() - a.entropy * (lp.exp() * lp).sum()) / a.prompts
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 0:
            report(step)


if __name__ == "__main__":
    main()
