"""ReST-EM: the filter and cap by hand, the selection rules, from-base by parameter hash,
learning on the toy task, deterministic resume, and the stop when nothing is kept."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from relign.config import ConfigError, load_config
from relign.models.loading import load_causal_lm
from relign.recipes import frame, rest_em
from relign.recipes.rest_em import filter_samples, iteration_seed, select_checkpoint, sft_batch

from ..conftest import torch_threads, write_jsonl

# --------------------------------------------------------------------------- filter and cap (by hand)


def _ep(text, reward, finish="stop", score=None):
    return NS(text=text, reward=reward, score=reward if score is None else score, finish_reason=finish)


def _groups():
    return [
        NS(prompt_text="P0", draw=0, episodes=[
            _ep(" a", 1.0),              # 0 pass, kept (1st)
            _ep(" b", 1.0, "length"),    # 1 truncated: failed although the reward is 1
            _ep(" c", 0.5),              # 2 below the threshold
            _ep("  ", 1.0),              # 3 blank: nothing to imitate
            _ep(" d", 1.0),              # 4 pass, kept (2nd)
            _ep(" e", 1.0),              # 5 pass, over the cap of 2
        ]),
        NS(prompt_text="P1", draw=1, episodes=[_ep("x", 0.0), _ep("y", 1.0, "length")]),  # nothing passes
        NS(prompt_text="P5", draw=5, episodes=[_ep("z", 2.0, score=1.0)]),                 # score 1 >= 1: passes
    ]


def test_filter_keeps_correct_finished_completions_up_to_the_cap():
    records, stats = filter_samples(_groups(), threshold=1.0, max_per_prompt=2)
    # sampled 6 + 2 + 1 = 9; passing: " a", " d", " e" (P0) + "z" (P5) = 4; kept 2 + 0 + 1 = 3;
    # truncated: " b" and "y" = 2; prompts with a kept completion: P0, P5 = 2 of 3
    assert stats == {"sampled": 9, "correct": 4, "kept": 3, "prompts": 3, "prompts_with_any": 2, "truncated": 2}
    assert [(r["problem"], r["sample"], r["prompt"], r["response"]) for r in records] == [
        (0, 0, "P0", " a"), (0, 4, "P0", " d"), (5, 0, "P5", "z")]
    assert records[2]["reward"] == 2.0 and records[2]["score"] == 1.0


def test_filter_keeps_correct_answers_not_well_formatted_wrong_ones():
    """The E-step keeps correct completions. GSM8K's own reward with a format bonus of 1.0 gives
    a wrong answer written as asked ("#### 5" for 7) the reward 1.0 and the score 0: it must not
    become a fine-tuning target, whatever the bonus."""
    from relign.envs.gsm8k import reward as gsm8k_reward

    info = {"answer": "7"}
    texts = ["3 + 4 = 7\n#### 7", "3 + 4 = 5\n#### 5", "the answer is 7"]
    episodes = []
    for t in texts:
        r = gsm8k_reward("P", t, info, format_weight=1.0)
        episodes.append(_ep(t, r["reward"], score=r["score"]))
    assert [e.reward for e in episodes] == [2.0, 1.0, 1.0] and [e.score for e in episodes] == [1.0, 0.0, 1.0]
    records, stats = filter_samples([NS(prompt_text="P", draw=0, episodes=episodes)], threshold=1.0, max_per_prompt=10)
    assert [r["response"] for r in records] == [texts[0], texts[2]]  # the correct ones, formatted or not
    assert stats["correct"] == 2


def test_filter_threshold_and_cap_arithmetic():
    # threshold 0.5 lets " c" in: P0 passes " a", " c", " d", " e" (4), the cap keeps the first two in sample order
    records, stats = filter_samples(_groups(), threshold=0.5, max_per_prompt=2)
    assert stats["correct"] == 4 + 1 and stats["kept"] == 2 + 1
    assert [r["response"] for r in records] == [" a", " c", "z"]
    # a cap above every count keeps every passing completion; a threshold above every reward keeps none
    records, stats = filter_samples(_groups(), threshold=1.0, max_per_prompt=10)
    assert [r["response"] for r in records] == [" a", " d", " e", "z"] and stats["kept"] == stats["correct"] == 4
    records, stats = filter_samples(_groups(), threshold=3.0, max_per_prompt=10)
    assert records == [] and stats["kept"] == stats["correct"] == stats["prompts_with_any"] == 0 and stats["sampled"] == 9
    # groups without a draw index are numbered by position
    records, _ = filter_samples([NS(prompt_text="Q", episodes=[_ep(" w", 1.0)])] * 2, 1.0, 1)
    assert [r["problem"] for r in records] == [0, 1]
    with pytest.raises(ValueError, match="max_per_prompt"):
        filter_samples(_groups(), 1.0, 0)


# --------------------------------------------------------------------------- selection rules


@pytest.mark.parametrize("accs, first, best", [
    ([0.3, 0.5, 0.4, 0.6], 1, 3),   # 0.4 does not improve on 0.5: keep the one before it
    ([0.3, 0.5, 0.6], 2, 2),        # improves to the end: the last
    ([0.5, 0.5], 0, 0),             # equal is not an improvement; best takes the first on ties
    ([0.7, 0.2, 0.9], 0, 2),
    ([0.4], 0, 0),
])
def test_select_checkpoint_rules(accs, first, best):
    assert select_checkpoint(accs, "first_non_improving") == first
    assert select_checkpoint(accs, "best") == best
    assert select_checkpoint(accs, "last") == len(accs) - 1


def test_select_checkpoint_errors():
    with pytest.raises(ValueError, match="at least one"):
        select_checkpoint([], "best")
    with pytest.raises(ValueError, match="unknown selection rule"):
        select_checkpoint([0.1], "median")


def test_sft_batch_and_iteration_seed():
    assert sft_batch(99, 16, 4) == (16, 4)
    assert sft_batch(7, 16, 4) == (7, 1)     # 7 kept: one step of 7, micro-batches that divide it
    assert sft_batch(6, 16, 4) == (6, 3)
    assert sft_batch(12, 16, 8) == (12, 6)
    seeds = [iteration_seed(0, k) for k in range(4)]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**31 for s in seeds) and seeds == [iteration_seed(0, k) for k in range(4)]
    assert iteration_seed(1, 1) != iteration_seed(0, 1)


# --------------------------------------------------------------------------- runs on the toy task

# The toy task of tests/rl_toy.py (reward 1 when the response starts with a space; ~17% of a
# random micro model's completions do), with a stop string so that completions finish: a random
# model almost never samples EOS, and truncated completions count as failed. Validation: other
# prompts of the same kind.
REWARD = 'def reward(prompt, response, extra_info):\n    return 1.0 if response.startswith(" ") else 0.0\n'


def _toy(tmp: Path) -> tuple[Path, Path, Path]:
    train = write_jsonl(tmp / "train.jsonl", [{"prompt": f"Write something {i}:"} for i in range(64)])
    val = write_jsonl(tmp / "val.jsonl", [{"prompt": f"Write something {i}:"} for i in range(64, 96)])
    reward = tmp / "reward.py"
    reward.write_text(REWARD)
    return train, val, reward


def toy_args(model_dir, tmp: Path) -> list[str]:
    train, val, reward = _toy(tmp)
    return [f"model.path={model_dir}", "task.name=custom", f"task.path={train}", f"task.reward_fn={reward}:reward",
            "task.chat=false", "task.reward_workers=0", "rollout.stop=[e]", "rollout.max_new_tokens=8",
            "rollout.temperature=1.0", f"val.path={val}", "val.n=8", "val.temperature=1.0", "optim.lr=1e-2",
            "batch_size=8", "epochs=3", "logging.tensorboard=false", "logging.progress=false"]


def _params_hash(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _run(tiny_model_dir, tmp: Path, run: Path, *extra: str, starts: list | None = None):
    """One rest run in this process (one torch thread: the same numbers on every machine); with
    ``starts``, the path and parameter hash of every model SFT loads to start from."""
    cfg = load_config(rest_em.Config, None, [*toy_args(tiny_model_dir, tmp), f"run_dir={run}", *extra])
    with torch_threads(1), pytest.MonkeyPatch.context() as mp:
        if starts is not None:
            real = frame.trainable

            def spy(run, model, **kw):  # the model SFT is about to train, as it starts
                starts.append((str(run.cfg.model.path), _params_hash(model)))
                return real(run, model, **kw)

            mp.setattr(frame, "trainable", spy)
        return rest_em.train(cfg)


def _rows(run: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time")}
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """Two iterations, from the base model each time (the default)."""
    tmp = tmp_path_factory.mktemp("rest")
    starts: list = []
    result = _run(tiny_model_dir, tmp, tmp / "run", "iterations=2", starts=starts)
    return tmp, result, starts


def test_two_iterations_raise_held_out_accuracy(straight):
    tmp, result, _ = straight
    run = result.run_dir
    acc = [r["rest/val_accuracy"] for r in _rows(run)]  # step 0 = the base model, then one per iteration
    assert len(acc) == 3
    # measured: 0.17 -> 0.31 -> 0.46 (256 validation samples each)
    assert acc[1] > acc[0] + 0.05 and acc[2] > acc[1] and acc[2] > acc[0] + 0.2, acc
    assert result.metrics["status"] == "completed" and result.steps == 2
    log = json.loads((run / "rest.json").read_text())
    state = json.loads((run / "rest_state.json").read_text())
    assert state == {"iteration": 2, "checkpoint": log["iterations"][1]["chosen"]}
    assert result.checkpoint == run / state["checkpoint"] and (result.checkpoint / "model.safetensors").is_file()
    for k, it in enumerate(log["iterations"], 1):
        d = run / f"iter_{k}"
        samples = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
        assert len(samples) == it["kept"] > 0 and all(s["response"].startswith(" ") and s["reward"] >= 1.0 for s in samples)
        assert it["sampled"] == 64 * 8 and it["kept"] <= it["correct"]
        val = json.loads((d / "val.json").read_text())
        assert len(val["accuracy"]) == 3 == len(val["checkpoints"])  # a checkpoint per epoch
        assert val["chosen"] == it["chosen"] == val["checkpoints"][val["chosen_epoch"] - 1]
        assert val["chosen_epoch"] - 1 == select_checkpoint(val["accuracy"], "first_non_improving")
    row = _rows(run)[2]
    assert {"rest/kept", "rest/correct_frac", "rest/prompts_with_any", "rest/val_accuracy"} <= row.keys()


def test_from_base_reloads_the_initial_weights(straight, tiny_model_dir):
    tmp, result, starts = straight
    base = _params_hash(load_causal_lm(str(tiny_model_dir)))
    chosen1 = result.run_dir / json.loads((result.run_dir / "rest.json").read_text())["iterations"][0]["chosen"]
    assert [h for _, h in starts] == [base, base]  # iteration 2's fine-tune starts from the base weights ...
    assert _params_hash(load_causal_lm(str(chosen1))) != base  # ... not from iteration 1's checkpoint, which differs


def test_from_current_starts_from_the_chosen_checkpoint(tiny_model_dir, tmp_path):
    starts: list = []
    result = _run(tiny_model_dir, tmp_path, tmp_path / "run", "iterations=2", "from_base=false", "epochs=1",
                  "select=last", starts=starts)
    chosen1 = result.run_dir / json.loads((result.run_dir / "rest.json").read_text())["iterations"][0]["chosen"]
    assert starts[0][1] == _params_hash(load_causal_lm(str(tiny_model_dir)))
    assert starts[1] == (str(chosen1), _params_hash(load_causal_lm(str(chosen1))))


def test_resume_repeats_the_uninterrupted_run(straight, tiny_model_dir, tmp_path):
    _, result, _ = straight
    run = tmp_path / "run"
    first = _run(tiny_model_dir, tmp_path, run, "iterations=1")
    assert first.steps == 1 and json.loads((run / "rest_state.json").read_text())["iteration"] == 1
    resumed = _run(tiny_model_dir, tmp_path, run, "iterations=2", "resume=auto")
    assert _rows(run) == _rows(result.run_dir)  # the same samples, fine-tunes and validation numbers
    a = json.loads((result.run_dir / "rest.json").read_text())["iterations"]
    b = json.loads((run / "rest.json").read_text())["iterations"]
    def same(its):  # all but the timings (and the paths of the toy files, which differ)
        return [{k: v for k, v in x.items() if k not in ("seconds", "sft_init")} for x in its]

    assert same(a) == same(b)
    assert resumed.checkpoint.relative_to(run) == result.checkpoint.relative_to(result.run_dir)
    # nothing left to do: resuming a finished run returns at once with its result
    again = _run(tiny_model_dir, tmp_path, run, "iterations=2", "resume=auto")
    assert again.steps == 2 and len(_rows(run)) == 3


def test_keeping_nothing_stops_with_the_last_good_checkpoint(tiny_model_dir, tmp_path):
    # threshold 2: no completion of the toy (reward 0 or 1) passes
    result = _run(tiny_model_dir, tmp_path, tmp_path / "run", "threshold=2.0")
    status = result.metrics["status"]
    assert status.startswith("stopped: iteration 1 kept 0 of 512 completions (threshold 2.0")
    assert "nothing to fine-tune on; the last good checkpoint is the base model" in status
    assert result.checkpoint is None and result.steps == 0
    assert not (result.run_dir / "rest_state.json").exists()
    assert json.loads((result.run_dir / "rest.json").read_text())["status"] == status
    assert not (result.run_dir / "iter_1" / "sft").exists()


def test_validation_holds_out_training_prompts(tiny_model_dir, tmp_path, tokenizer):
    args = [a for a in toy_args(tiny_model_dir, tmp_path) if not a.startswith("val.path")]
    cfg = load_config(rest_em.Config, None, [*args, "val.size=16", "seed=3"])
    task = rest_em.build.task_for(cfg.task)
    train, val, source = rest_em._records(cfg, task, tokenizer)
    assert len(train) == 48 and len(val) == 16 and "16 training prompts held out" in source
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert rest_em._records(cfg, task, tokenizer)[1] == val  # seeded: the same slice every time
    with pytest.raises(ConfigError, match="val.size=64 held-out prompts leave none"):
        rest_em._records(load_config(rest_em.Config, None, [*args, "val.size=64"]), task, tokenizer)


@pytest.mark.parametrize("override, message", [
    ("select=median", "bad value for 'select'"),
    ("resume=/some/checkpoint", "bad value for 'resume'"),
    ("rollout.temperature=0", "rollout.temperature=0.0 is greedy"),
    ("val.n=4", "val.temperature=0.0 is greedy"),
    ("epochs=0", "must be >= 1"),
])
def test_config_errors(override, message, tmp_path):
    cfg = load_config(rest_em.Config, None, [f"run_dir={tmp_path}", "model.path=tiny:micro", override])
    with pytest.raises(ConfigError, match=message):
        rest_em.train(cfg)


def test_from_current_with_lora_is_refused(tmp_path):
    cfg = load_config(rest_em.Config, None, [f"run_dir={tmp_path}", "from_base=false", "model.lora.enabled=true"])
    with pytest.raises(ConfigError, match="from_base=false with model.lora.enabled"):
        rest_em.train(cfg)


def test_sft_rows_train_on_the_prompt_that_was_sampled(tokenizer):
    """A kept completion becomes an SFT row whose prompt tokens are exactly the sampled prompt's:
    raw prompts as prompt/response, chat prompts as a conversation ending with the response."""
    from relign.data.sft import encode_sft
    from relign.envs.tasks import render_prompt

    kept = {"problem": 0, "sample": 3, "prompt": "(rendered)", "response": " 42", "reward": 1.0, "score": 1.0}
    for task_record in ({"prompt": "Compute 7 + 5.", "extra_info": {}},
                        {"messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Compute 7 + 5."}], "extra_info": {}}):
        row = rest_em._sft_record(kept, task_record)
        if "messages" in task_record:
            assert row["messages"] == [*task_record["messages"], {"role": "assistant", "content": " 42"}]
            ids, mask = encode_sft(tokenizer, {"messages": row["messages"]})
        else:
            assert row["prompt"] == "Compute 7 + 5." and row["response"] == " 42"
            ids, mask = encode_sft(tokenizer, {"prompt": row["prompt"], "response": row["response"]})
        _, prompt_ids = render_prompt(tokenizer, task_record)
        first = mask.index(1)
        assert ids[:first] == prompt_ids and len(ids) > first  # the response (and its end) is what trains
        assert {k: row[k] for k in ("problem", "sample", "reward")} == {"problem": 0, "sample": 3, "reward": 1.0}
