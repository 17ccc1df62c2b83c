"""The bad-input corpus (issue 14): every case through the real CLI entry point, ending one of three ways.

    (a) exit 2 and ONE line ``relign <recipe>: error: ...`` naming the file, the row and the field
        (or the config key), with no traceback;
    (b) a counted skip: the run succeeds and the count is printed and logged;
    (c) a bad sample masked and counted: a failing reward scores 0 and ``reward/errors`` or
        ``reward/timeouts`` counts it.

Never a traceback, a hang or a silent success. This file is the one place a reader finds the whole
corpus; the cases call ``relign.cli.main`` in-process (most fail before any model loads). Unit-level
detail lives beside the code that handles it:

    tests/data/test_bad_data.py           readers: encodings, BOM, CSV shapes, hub ids, the counts line
    tests/envs/test_reward_signatures.py  reward pools: both signatures, every bad return, timeouts
    tests/envs/test_hostile_answers.py    graders: __import__(...), 9**9**9**9, 1 MB answers, deep nesting
                                          are graded false quickly and nothing is executed
    tests/test_config_validation.py       every count, size and rate of every recipe
    tests/test_checkpoint_integrity.py    manifests, damaged checkpoints, resume=auto falling back (CLI)
    tests/e2e/test_cli_sft.py, test_cli_rl.py
                                          kill -9 mid-run (and mid-checkpoint-write) resumes to identical
                                          per-step losses; those need a real process to kill, so live there

Case table (recipe column: where the case runs):

    data, sft / dpo / kto / rm / rl       outcome
      malformed JSON line mid-file        (a) file, row 2, "invalid JSON"
      missing field                       (a) file, row 2, field: missing
      null field                          (a) file, row 2, field: missing
      list of strings where text goes     (a) file, row 2, field[0]: expected an object with role and content
      number where text goes              (a) file, row 2, field 'prompt': expected a string
      NUL (escaped \\u0000 / raw byte)     (a) file, row 2, field / column
      invalid UTF-8                       (a) file, row 2, byte offset
      lone surrogate \\ud800               (a) file, row 2, field
      empty file / missing / empty folder (a) file named
      CSV / parquet, wrong columns        (a) file, the columns it has and those expected (rl: row 1, field)
      prompt over the max length          (b) "N rows read, 1 skipped (... too long ...)", data/* metrics
      bad rows with data.skip_bad_rows    (b) counted by reason (sft, dpo, kto, rm; rl has no skip option)
      sft response over the max length    (b) "1 truncated"
    config, sft / dpo / rm / rl
      unknown key (override / YAML)       (a) the key, the valid keys, a did-you-mean
      wrong-typed value (override / YAML) (a) the key
      a YAML section given a value / empty (a) the section's key
      zero / negative batch, micro-batch  (a) the key and the rule
      micro-batch not dividing the batch  (a) the keys (rl: algorithm.mini_batches vs prompts_per_step;
                                              rl's micro_batch_size is a cap and need not divide)
      negative max_steps                  (a) the key
      no / empty / missing model path     (a) model.path
      YAML syntax error / missing file    (a) the file, line and column
    reward functions, rl
      raises / NaN / None / a string      (c) scored 0, reward/errors counted, a warning with the first error
      hangs (task.reward_timeout)         (c) scored 0, reward/timeouts counted
      batched, list of the wrong length   (a) every reward of the first step failed: task.reward_fn named
      missing file / function / syntax    (a) the spec and the file
    checkpoint
      resume=PATH to a damaged one        (a) the damaged file (resume=auto falls back: test_checkpoint_integrity)
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

from relign.cli import main
from relign.tracking import read_metrics

# --------------------------------------------------------------------------- helpers

QUIET = ["logging.tensorboard=false", "logging.progress=false", "checkpoint.save_every=0"]


def cli(capsys, *args: str) -> tuple[int, str]:
    """``relign ARGS`` in this process: (exit status, stderr)."""
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def one_error(code: int, err: str, command: str) -> str:
    """Outcome (a): status 2, no traceback, exactly one ``relign <command>: error:`` line (returned)."""
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith(f"relign {command}: error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def line_bytes(row: dict) -> bytes:
    return json.dumps(row).encode()


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Recipe:
    args: tuple[str, ...]  # the command and what picks the flavour (loss=kto)
    key: str  # the data key
    good: tuple[dict, dict]  # two good rows with distinct prompts (KTO needs two prompts)
    field: str  # a text field every row needs
    columns: str  # the wrong-columns message after "{path}"
    train: tuple[str, ...]  # the smallest run that trains one step
    prefix: str = ""  # what the error line puts before a row's file (rl: "task: ")

    @property
    def command(self) -> str:
        return self.args[0]


SMALL = ("max_steps=1", "batch_size=1", "micro_batch_size=1", "data.eval_fraction=0", "eval_every=0")
PAIRS = ({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, {"prompt": "3+3?", "chosen": "6", "rejected": "7"})
PAIR_COLUMNS = (": wrong columns: the file has question, answer; expected 'prompt', 'chosen' and 'rejected' ('prompt' "
                "may be left out when 'chosen'/'rejected' are whole conversations)")
REWARD_OK = "def reward(prompt, response, extra_info):\n    return 1.0\n"

RECIPES = {
    "sft": Recipe(("sft",), "data.path", ({"prompt": "2+2?", "response": "4"}, {"prompt": "3+3?", "response": "6"}),
                  "response", ": wrong columns: the file has question, answer; expected 'messages', or 'prompt' and "
                  "'response' (or 'completion'), or 'text'", SMALL),
    "dpo": Recipe(("dpo",), "data.path", PAIRS, "chosen", PAIR_COLUMNS, SMALL),
    "kto": Recipe(("dpo", "loss=kto"), "data.path",
                  ({"prompt": "2+2?", "completion": "4", "label": True}, {"prompt": "3+3?", "completion": "7", "label": False}),
                  "completion", ": wrong columns: the file has question, answer; expected 'prompt', 'completion' and "
                  "'label' (or paired 'prompt', 'chosen' and 'rejected')", SMALL),
    "rm": Recipe(("rm",), "data.path", PAIRS, "chosen", PAIR_COLUMNS, SMALL),
    # RL data has no fixed columns (every other field is extra_info): a file without 'prompt' fails on its first row
    "rl": Recipe(("rl", "task.name=custom", "task.chat=false"), "task.path", ({"prompt": "Write 1:"}, {"prompt": "Write 2:"}),
                 "prompt", ", row 1, field 'prompt': missing",
                 ("max_steps=1", "task.reward_workers=0", "rollout.n=2", "rollout.max_new_tokens=4", "prompts_per_step=2"),
                 prefix="task: "),
}


def _with(row: dict, field: str, value) -> bytes:
    return line_bytes({**row, field: value})


def _without(row: dict, field: str) -> bytes:
    return line_bytes({k: v for k, v in row.items() if k != field})


# (case id, the middle line of a three-line JSONL file from the recipe, the expected text after "{path}")
ROW_CASES = [
    ("malformed-json", lambda r: b"{oops",
     lambda r: ", row 2: invalid JSON (Expecting property name enclosed in double quotes at column 2)"),
    ("missing-field", lambda r: _without(r.good[0], r.field), lambda r: f", row 2, field '{r.field}': missing"),
    ("null-field", lambda r: _with(r.good[0], r.field, None), lambda r: f", row 2, field '{r.field}': missing"),
    ("list-where-text-goes", lambda r: _with(r.good[0], r.field, ["4"]),
     lambda r: f", row 2, field '{r.field}[0]': expected an object with role and content, got str"),
    ("number-where-text-goes", lambda r: _with(r.good[0], "prompt", 7), lambda r: ", row 2, field 'prompt': expected a string"),
    ("nul-escaped", lambda r: _with(r.good[0], r.field, "a\x00b"),
     lambda r: f", row 2, field '{r.field}': NUL character at position 1 (a binary or corrupted file?)"),
    ("nul-raw-byte", lambda r: line_bytes(r.good[0]).replace(b'"prompt": "', b'"prompt": "\x00'),
     lambda r: ", row 2: NUL byte at column 13 (a binary or corrupted file?)"),  # '{"prompt": "' is 12 bytes
    ("invalid-utf8", lambda r: line_bytes(r.good[0]).replace(b'"prompt": "', b'"prompt": "\xff'),
     lambda r: ", row 2: invalid UTF-8: byte 0xff at byte 13 of the line (save the file as UTF-8)"),
    ("lone-surrogate", lambda r: line_bytes(r.good[0]).replace(b'"prompt": "', b'"prompt": "\\ud800'),
     lambda r: ", row 2, field 'prompt': lone surrogate \\ud800 at position 0 is not valid Unicode text"),
]


def _data_args(recipe: Recipe, path, model_dir, tmp_path: Path, *extra) -> list[str]:
    args = [*recipe.args, f"model.path={model_dir}", f"{recipe.key}={path}", f"run_dir={tmp_path / 'run'}", *QUIET, *extra]
    if recipe.command == "rl":
        reward = tmp_path / "reward_ok.py"
        reward.write_text(REWARD_OK)
        args.append(f"task.reward_fn={reward}:reward")
    return args


@pytest.mark.parametrize("case", [c[0] for c in ROW_CASES])
@pytest.mark.parametrize("name", list(RECIPES))
def test_a_bad_row_is_one_line_naming_file_row_and_field(name, case, tiny_model_dir, tmp_path, capsys):
    recipe = RECIPES[name]
    _, middle, expected = next(c for c in ROW_CASES if c[0] == case)
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join([line_bytes(recipe.good[0]), middle(recipe), line_bytes(recipe.good[1])]) + b"\n")
    line = one_error(*cli(capsys, *_data_args(recipe, path, tiny_model_dir, tmp_path)), recipe.command)
    assert line.startswith(f"relign {recipe.command}: error: {recipe.prefix}{path}{expected(recipe)}"), line


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), path)
    return path


FILE_CASES = [  # (case id, make the path under tmp_path, the expected text after "{path}"; None: the recipe's columns)
    ("empty-file", lambda t: _file(t / "empty.jsonl", b""), ": 0 rows read: the file is empty"),
    ("missing-file", lambda t: t / "nope.jsonl", ": file not found"),
    ("empty-folder", lambda t: _folder(t / "folder"), ": is a folder with no data files in it (expected a .jsonl"),
    ("csv-wrong-columns", lambda t: _file(t / "w.csv", b"question,answer\nq,a\n"), None),
    ("parquet-wrong-columns", lambda t: _parquet(t / "w.parquet"), None),
]


@pytest.mark.parametrize("case", [c[0] for c in FILE_CASES])
@pytest.mark.parametrize("name", list(RECIPES))
def test_a_bad_file_is_one_line_naming_it(name, case, tiny_model_dir, tmp_path, capsys):
    recipe = RECIPES[name]
    _, make, expected = next(c for c in FILE_CASES if c[0] == case)
    path = make(tmp_path)
    line = one_error(*cli(capsys, *_data_args(recipe, path, tiny_model_dir, tmp_path)), recipe.command)
    assert f"{path}{expected or recipe.columns}" in line, line


LONG = " ".join(["word"] * 100)  # far over 16 tokens


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_prompt_over_the_max_length_is_a_counted_skip(name, tiny_model_dir, tmp_path, capsys):
    recipe = RECIPES[name]
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join([line_bytes(recipe.good[0]), _with(recipe.good[0], "prompt", LONG),
                                 line_bytes(recipe.good[1])]) + b"\n")
    limit = "task.max_prompt_length=16" if name == "rl" else "data.max_length=16"
    code, err = cli(capsys, *_data_args(recipe, path, tiny_model_dir, tmp_path, *recipe.train, limit))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    if name == "rl":
        assert f"data: {path}: 3 rows read, 1 skipped (longer than task.max_prompt_length=16)\n" in err
        (step,) = [r for r in read_metrics(tmp_path / "run") if "data/prompts_skipped_long" in r]
        assert step["data/prompts_skipped_long"] == 1
    else:
        assert f"data: {path}: 3 rows read, 1 skipped (1 too long for max_length=16), 0 truncated\n" in err
        counts = read_metrics(tmp_path / "run")[0]
        assert (counts["data/rows"], counts["data/kept"], counts["data/dropped_too_long"]) == (3, 2, 1)


@pytest.mark.parametrize("name", ["sft", "dpo", "kto", "rm"])
def test_bad_rows_with_skip_bad_rows_are_counted_by_reason(name, tiny_model_dir, tmp_path, capsys):
    recipe = RECIPES[name]
    path = tmp_path / "data.jsonl"
    bad_utf8 = line_bytes(recipe.good[0]).replace(b'"prompt": "', b'"prompt": "\xff')
    path.write_bytes(b"\n".join([line_bytes(recipe.good[0]), b"{oops", bad_utf8, line_bytes(recipe.good[1])]) + b"\n")
    code, err = cli(capsys, *_data_args(recipe, path, tiny_model_dir, tmp_path, *recipe.train, "data.skip_bad_rows=true"))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert f"data: {path}: 4 rows read, 2 skipped (1 malformed JSON, 1 invalid UTF-8), 0 truncated\n" in err
    assert f"  first skipped row: {path}, row 2: invalid JSON (Expecting property name" in err
    counts = read_metrics(tmp_path / "run")[0]
    assert (counts["data/rows"], counts["data/kept"], counts["data/bad_rows"]) == (4, 2, 2)


def test_an_sft_response_over_the_max_length_is_truncated_and_counted(tiny_model_dir, tmp_path, capsys):
    recipe = RECIPES["sft"]
    path = tmp_path / "data.jsonl"
    path.write_bytes(b"\n".join([line_bytes(recipe.good[0]), _with(recipe.good[0], "response", LONG)]) + b"\n")
    code, err = cli(capsys, *_data_args(recipe, path, tiny_model_dir, tmp_path, *recipe.train, "data.max_length=16"))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert f"data: {path}: 2 rows read, 0 skipped, 1 truncated (cut to max_length=16)\n" in err
    assert read_metrics(tmp_path / "run")[0]["data/truncated"] == 1


# --------------------------------------------------------------------------- config

BATCH = {"sft": "batch_size", "dpo": "batch_size", "rm": "batch_size", "rl": "prompts_per_step"}
NOT_DIVIDING = {  # rl's micro_batch_size caps a micro-batch's rows and need not divide; its mini-batches must fit
    **dict.fromkeys(("sft", "dpo", "rm"), (["batch_size=8", "micro_batch_size=3"],
                                          "bad value for 'batch_size': 8; it must be a multiple of micro_batch_size=3 "
                                          "(set micro_batch_size to a divisor of batch_size)")),
    "rl": (["prompts_per_step=2", "algorithm.mini_batches=3"],
           "algorithm.mini_batches=3 > prompts_per_step=2: mini-batches are made of whole groups (a group's samples are "
           "never split)"),
}
YAML = {
    "unknown-key-yaml": ("modle:\n  path: x\n", "unknown key 'modle' in {yaml} (did you mean 'model'?); valid keys at the "
                                                "top level: model, "),
    "section-as-a-number-yaml": ("model:\n  path: x\noptim: 3\n", "bad value for 'optim' in {yaml}: 3 where a section of "
                                                                  "keys goes (indented 'key: value' lines under 'optim:')"),
    "empty-section-yaml": ("model:\n  path: x\noptim:\n", "bad value for 'optim' in {yaml}: an empty section (indent "
                                                          "'key: value' lines under 'optim:', or remove the line)"),
    "wrong-type-yaml": ("model:\n  path: x\nmax_steps: many\n", "bad value for 'max_steps' in {yaml}: Value 'many' of type "
                                                                "'str' could not be converted to Integer"),
    "yaml-syntax-error": ("model:\n  path: x\n batch_size: [1\n", "cannot parse {yaml}: line 3, column 2: did not find "
                                                                  "expected key (while parsing a block mapping)"),
    "yaml-file-missing": (None, "config file not found: {yaml}"),
}


def _config_cases(name: str, tmp: Path) -> dict[str, tuple[list[str], str]]:
    b = BATCH[name]
    min_micro, min_steps = (0, 1) if name == "rl" else (1, 0)  # rl: micro_batch_size=0 = no cap; max_steps counts steps
    return {
        "unknown-key": (["bogus_key=1"], "unknown key 'bogus_key' in override 'bogus_key=1'; valid keys at the top level: "),
        "unknown-nested-key": (["optim.lrr=1"], "unknown key 'optim.lrr' in override 'optim.lrr=1' (did you mean "
                                                "'optim.lr'?); valid keys under 'optim': lr, "),
        "wrong-type": ([f"{b}=abc"], f"bad value for '{b}' in override '{b}=abc': Value 'abc' of type 'str' could not be "
                                     "converted to Integer"),
        "wrong-type-float": (["optim.lr=fast"], "bad value for 'optim.lr' in override 'optim.lr=fast': Value 'fast' of "
                                                "type 'str' could not be converted to Float"),
        "zero-batch": ([f"{b}=0"], f"bad value for '{b}': 0; it must be >= 1"),
        "negative-batch": ([f"{b}=-4"], f"bad value for '{b}': -4; it must be >= 1"),
        "negative-micro-batch": (["micro_batch_size=-2"], f"bad value for 'micro_batch_size': -2; it must be >= {min_micro}"),
        "micro-batch-not-dividing": NOT_DIVIDING[name],
        "negative-max-steps": (["max_steps=-1"], f"bad value for 'max_steps': -1; it must be >= {min_steps}"),
        "no-model-path": ([], "missing value for 'model.path': give a local model folder, a hub id (org/name) or "
                              "tiny:SIZE"),
        # "model.path=" clears the preset's path to the field's default '' (not set), as for task.path
        "empty-model-path": (["model.path="], "missing value for 'model.path': give a local model folder, a hub id "
                                              "(org/name) or tiny:SIZE"),
        "missing-model-path": ([f"model.path={tmp / 'no_model'}"], f"bad value for 'model.path': '{tmp / 'no_model'}'; no "
                                                                   "such folder (give a local model folder, a hub id "
                                                                   "org/name or tiny:SIZE)"),
        **({"zero-micro-batch": (["micro_batch_size=0"], "bad value for 'micro_batch_size': 0; it must be >= 1")}
           if name != "rl" else {}),
    }


CONFIG_CASES = [(name, case) for name in BATCH for case in [*_config_cases(name, Path()), *YAML]]


@pytest.mark.parametrize("name, case", CONFIG_CASES, ids=[f"{n}-{c}" for n, c in CONFIG_CASES])
def test_a_bad_config_is_one_line_naming_the_key(name, case, tmp_path, capsys):
    if case in YAML:
        text, expected = YAML[case]
        yaml = tmp_path / "config.yaml"
        if text is not None:
            yaml.write_text(text)
        args, expected = [str(yaml)], expected.format(yaml=yaml)
    else:
        args, expected = _config_cases(name, tmp_path)[case]
        # tiny:micro is a valid model path that is never built here: every case stops before a model loads
        model = [] if case == "no-model-path" else ["model.path=tiny:micro"]
        args = [*model, *([] if name == "rl" else ["data.path=x.jsonl"]), *args]
    line = one_error(*cli(capsys, name, *args, f"run_dir={tmp_path / 'run'}"), name)
    assert line.startswith(f"relign {name}: error: {expected}"), line
    assert not (tmp_path / "run").exists()  # stopped before the run directory was made


# --------------------------------------------------------------------------- reward functions

REWARDS = '''
import time


def per_sample(prompt, response, extra_info):
    kind = extra_info["kind"]
    if kind == "raise":
        raise KeyError("solution")
    if kind == "hang":
        time.sleep(60)
    return {"nan": float("nan"), "none": None, "str": "high"}.get(kind, 1.0)


def short(prompts, completions, **kwargs):  # TRL's batched signature, one reward short
    return [1.0] * (len(completions) - 1)
'''

# the first failure's message, as the warning quotes it
NOT_A_NUMBER = "TypeError: a reward function must return a number or a dict with 'reward' (and optional 'score', 'components'), got"
FIRST_ERROR = {
    "raise": "KeyError: 'solution'",
    "nan": "ValueError: reward must be finite, got nan",
    "none": f"{NOT_A_NUMBER} NoneType: None",
    "str": f"{NOT_A_NUMBER} str: 'high'",
    "hang": "call exceeded 0.5 s; worker restarted",
}


def _rl_reward_args(tiny_model_dir, tmp_path: Path, kind: str, fn: str = "per_sample") -> list[str]:
    """4 prompts, 3 of them bad; prompts_per_step=4 draws each once: 8 samples, 6 bad, in every run."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write {i}:", "kind": kind if i < 3 else "ok"}) + "\n" for i in range(4)))
    workers = "1" if kind == "hang" else "0"  # a timeout needs a worker process to abandon
    return ["rl", f"model.path={tiny_model_dir}", "task.name=custom", f"task.path={data}", f"task.reward_fn={rewards}:{fn}",
            "task.chat=false", f"task.reward_workers={workers}", "task.reward_timeout=0.5", "rollout.n=2",
            "rollout.max_new_tokens=4", "prompts_per_step=4", "max_steps=1", f"run_dir={tmp_path / 'run'}", *QUIET]


@pytest.mark.parametrize("kind", ["raise", "nan", "none", "str", "hang"])
def test_a_failing_reward_is_scored_zero_and_counted(kind, tiny_model_dir, tmp_path, capsys, caplog):
    with caplog.at_level(logging.WARNING):
        code, err = cli(capsys, *_rl_reward_args(tiny_model_dir, tmp_path, kind))
    assert code == 0 and "Traceback" not in err, err[-3000:]
    (row,) = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    failed = "reward/timeouts" if kind == "hang" else "reward/errors"
    other = "reward/errors" if kind == "hang" else "reward/timeouts"
    assert f"data: {tmp_path / 'prompts.jsonl'}: 4 rows read, 0 skipped\n" in err
    assert (row[failed], row[other]) == (6, 0)
    assert row["reward/mean"] == pytest.approx(2 / 8)  # 6 failures scored 0, the 2 good samples 1.0
    how = "0 raised, 6 timed out" if kind == "hang" else "6 raised, 0 timed out"
    warning = (f"reward function {tmp_path / 'rewards.py'}:per_sample: 6 of 8 rewards failed ({how}) this step, "
               f"scored 0; first error: {FIRST_ERROR[kind]}\n")
    assert warning in caplog.text + err, (caplog.text + err)[-3000:]  # in-process, the warning goes to the log


def test_a_batched_reward_of_the_wrong_length_stops_at_the_first_step(tiny_model_dir, tmp_path, capsys):
    args = _rl_reward_args(tiny_model_dir, tmp_path, "ok", fn="short")
    line = one_error(*cli(capsys, *args), "rl")
    spec = f"{tmp_path / 'rewards.py'}:short"
    assert line == (f"relign rl: error: task.reward_fn={spec}: every reward of the first step failed: 8 of 8 rewards "
                    "failed (8 raised, 0 timed out); first error: ValueError: a batched reward function returned 7 "
                    "rewards for 8 completions")


@pytest.mark.parametrize("case", ["missing-file", "missing-function", "no-function-name", "syntax-error"])
def test_a_reward_that_cannot_load_is_one_line(case, tiny_model_dir, tmp_path, capsys):
    args = _rl_reward_args(tiny_model_dir, tmp_path, "ok")
    rewards, broken = tmp_path / "rewards.py", tmp_path / "broken.py"
    broken.write_text("def reward(prompt, response, extra_info)\n    return 1.0\n")  # no colon
    spec, expected = {
        "missing-file": (f"{tmp_path / 'nope.py'}:reward", f"function spec '{tmp_path / 'nope.py'}:reward': file not "
                                                           f"found: {tmp_path / 'nope.py'}"),
        "missing-function": (f"{rewards}:absent", f"function spec '{rewards}:absent': '{rewards}' has no attribute 'absent'"),
        "no-function-name": (str(rewards), f"function spec '{rewards}:reward': '{rewards}' has no attribute 'reward'"),
        "syntax-error": (f"{broken}:reward", f"function spec '{broken}:reward': cannot load {broken}: SyntaxError: "),
    }[case]
    line = one_error(*cli(capsys, *args, f"task.reward_fn={spec}"), "rl")
    assert line.startswith(f"relign rl: error: task: {expected}"), line


# --------------------------------------------------------------------------- a damaged checkpoint


def test_resume_from_a_damaged_checkpoint_path_names_the_file(tiny_model_dir, tmp_path, capsys):
    """resume=PATH (an explicit checkpoint) is never skipped over: a damaged file is one line naming it.
    resume=auto falling back past a damaged checkpoint is tests/test_checkpoint_integrity.py's CLI test."""
    recipe = RECIPES["sft"]
    path = tmp_path / "data.jsonl"
    path.write_bytes(line_bytes(recipe.good[0]) + b"\n" + line_bytes(recipe.good[1]) + b"\n")
    args = [*_data_args(recipe, path, tiny_model_dir, tmp_path, *recipe.train)]
    code, err = cli(capsys, *args, "checkpoint.save_every=1")
    assert code == 0, err[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    weights, state = ckpt / "model.safetensors", ckpt / "trainer_state.pt"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    line = one_error(*cli(capsys, *args, f"resume={ckpt}"), "sft")
    assert line == (f"relign sft: error: resume={ckpt}: damaged checkpoint: {weights}: {len(good) // 2} bytes where "
                    f"manifest.json says {len(good)} (truncated or overwritten)")
    weights.write_bytes(good)
    state.write_bytes(b"garbage")
    line = one_error(*cli(capsys, *args, f"resume={ckpt}"), "sft")
    assert line.startswith(f"relign sft: error: resume={ckpt}: damaged checkpoint: {state}: "), line
