"""The commands a TRL user expects, through the real CLI: --version, presets by name from any
folder, chat, generate, merge-lora, and model errors that name model.path at once."""

from __future__ import annotations

import json
import re
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from ..conftest import REPO, run_cli, run_relign, write_jsonl

PRESETS = REPO / "relign" / "presets"


def cli(*args: str, stdin: str | None = None, cwd: Path | None = None, env: dict | None = None,
        unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python -m relign ...`` with text on stdin and environment variables removed if asked."""
    return run_relign(args, env=env, cwd=cwd, stdin=stdin, unset=unset, timeout=300)


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line: exit status 2, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------- version


def test_version_flag_and_command():
    out = cli("--version")
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"relign {version('relign')} (torch {torch.__version__}, transformers {version('transformers')}")
    assert re.fullmatch(r"relign \d+\.\d+\.\d+\S* \(.*python \d+\.\d+\.\d+\)", line), line
    assert cli("version").stdout.strip() == line


# ------------------------------------------------------------------------- presets


def test_presets_table_lists_every_shipped_preset():
    out = cli("presets")
    assert out.returncode == 0, out.stderr
    rows = {}
    for line in out.stdout.splitlines()[1:]:
        if not line.strip():
            break
        name, recipe, desc = line.split(None, 2)
        rows[name] = (recipe, desc)
    assert set(rows) == {p.stem for p in PRESETS.glob("*.yaml")} and len(rows) >= 20
    assert rows["grpo"] == ("rl", "GRPO as in DeepSeekMath: group-normalized advantages, k3 KL loss term (beta 0.04).")
    assert rows["sft_tiny"][0] == "sft" and rows["dpo"][0] == "dpo" and rows["eval_gsm8k"][0] == "eval"
    shown = cli("presets", "grpo")
    assert shown.returncode == 0 and shown.stdout == (PRESETS / "grpo.yaml").read_text()


def test_preset_by_name_runs_from_another_folder(tiny_model_dir, tmp_path):
    """`relign sft sft_tiny` in a folder without the repo: the packaged preset and its packaged data."""
    run = tmp_path / "run"
    proc = run_cli("sft", "sft_tiny", f"model.path={tiny_model_dir}", f"run_dir={run}", "max_steps=1", "batch_size=4",
                   "micro_batch_size=4", "eval_every=0", "data.max_rows=8", "checkpoint.save_every=0",
                   "logging.tensorboard=false", cwd=tmp_path)
    assert proc.returncode == 0
    import yaml

    resolved = yaml.safe_load((run / "config.yaml").read_text())
    shipped = REPO / "relign" / "data" / "samples" / "gsm8k_sft.jsonl"
    assert Path(resolved["data"]["path"]).resolve() == shipped.resolve()
    assert resolved["data"]["max_rows"] == 8  # the user's overrides still apply (and win)


def test_preset_under_the_wrong_recipe_names_the_right_one():
    assert error_line(cli("sft", "grpo")) == "relign sft: error: grpo is a preset of `relign rl`, not `relign sft`; run: relign rl grpo"
    assert error_line(cli("rl", "grpoo")) == (
        "relign rl: error: no config file or preset named 'grpoo' (did you mean 'grpo'?); `relign presets` lists the presets")


def test_every_preset_loads_under_its_recipe_from_any_folder(tmp_path, monkeypatch):
    """Each preset's header names its recipe, the recipe's config accepts the file, and every
    shipped file it names exists when run from outside the repository."""
    import importlib

    from relign.commands.presets import list_presets, package_overrides
    from relign.config import load_config
    from relign.recipes import RECIPES

    monkeypatch.chdir(tmp_path)
    presets = list_presets()
    assert presets
    for p in presets:
        assert p.recipe in RECIPES and p.description, p
        overrides = package_overrides(p.path)
        cfg = load_config(importlib.import_module(RECIPES[p.recipe][0]).Config, p.path, overrides)
        for section in ("data", "task"):
            path = getattr(getattr(cfg, section, None), "path", "")
            if path.startswith(("relign/", "/")):
                assert Path(path).is_file(), (p.name, section, path)


def test_docs_path_falls_back_to_the_packaged_preset(tmp_path, monkeypatch, capsys):
    from relign.commands.presets import resolve_config_arg

    monkeypatch.chdir(tmp_path)
    argv = resolve_config_arg("dpo", ["loss=ipo", "examples/dpo.yaml", "--flag"])
    shipped = REPO / "relign" / "data" / "samples" / "orca_dpo_pairs.jsonl"
    # the preset, then its packaged data path, then the user's arguments in their order
    assert argv == [str(PRESETS / "dpo.yaml"), f"data.path={shipped}", "loss=ipo", "--flag"]
    assert "note: examples/dpo.yaml is not here; using the packaged preset 'dpo'" in capsys.readouterr().err
    monkeypatch.chdir(REPO)  # from the repository root the preset's relative paths stand as they are
    assert resolve_config_arg("dpo", ["examples/dpo.yaml"]) == ["examples/dpo.yaml"]


# ------------------------------------------------------------------------- chat


def test_chat_answers_two_piped_turns(tiny_model_dir):
    proc = cli("chat", str(tiny_model_dir), "--max-new-tokens", "6", "--system", "Be brief.",
               stdin="What is 2 + 3?\n/reset\nAnd 4 * 5?\n/exit\nnever read\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("assistant: ") for line in lines) == 2, proc.stdout
    assert "(conversation reset)" in lines


class _Recorder:
    """An engine that records the prompts it is given and answers 'ok'."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, params, *, seeds=None):
        from relign.rollout.engine import Completion

        self.prompts.append(prompts[0])
        return [[Completion(token_ids=[1], logps=[0.0], finish_reason="stop", text=" ok ")]]


def test_chat_session_keeps_history_until_reset(tokenizer):
    from relign.commands.chat import ChatSession, repl
    from relign.rollout.engine import SamplingParams

    engine = _Recorder()
    session = ChatSession(engine, tokenizer, SamplingParams(max_new_tokens=4), system="Be brief.")
    import io

    out = io.StringIO()
    assert repl(session, ["first question\n", "second question\n", "/reset\n", "third question\n"], out) == 3
    texts = [tokenizer.decode(p) for p in engine.prompts]
    assert texts[1] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nfirst question<|im_end|>\n"
                        "<|im_start|>assistant\nok<|im_end|>\n<|im_start|>user\nsecond question<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert "first question" not in texts[2] and texts[2].startswith("<|im_start|>system\nBe brief.")
    assert out.getvalue().splitlines() == ["assistant: ok", "assistant: ok", "(conversation reset)", "assistant: ok"]


def test_chat_without_a_template_falls_back_to_plain_text():
    from relign.commands.chat import PLAIN_STOP, render

    class NoTemplate:
        chat_template = None

    text, stops = render(NoTemplate(), [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert text == "System: S\nUser: hi\nAssistant:" and stops == [PLAIN_STOP]


# ------------------------------------------------------------------------- generate


def test_generate_rows_n_and_seed(tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "2 + 3 =", "id": "a"},
        {"messages": [{"role": "user", "content": "What is 4 * 5?"}], "id": "b"},
        {"prompt": [{"role": "user", "content": "Say yes."}], "id": "c"},
    ])
    args = ["generate", str(tiny_model_dir), str(prompts), "--n", "2", "--max-new-tokens", "6", "--batch-size", "2"]
    first = cli(*args, "--seed", "7")
    assert first.returncode == 0, first.stderr[-2000:]
    out = tmp_path / "prompts.generated.jsonl"  # the default output, beside the input
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 1)]
    assert rows[0]["prompt"] == "2 + 3 =" and rows[2]["prompt"] == [{"role": "user", "content": "What is 4 * 5?"}]
    assert all(isinstance(r["completion"], str) and 1 <= r["num_tokens"] <= 6 for r in rows)
    assert "wrote 6 completions (3 prompts x 2)" in first.stderr
    again = cli(*args, "--seed", "7", "--out", "-")
    assert again.returncode == 0 and again.stdout == out.read_text()  # same seed, same output
    assert len({r["completion"] for r in rows}) > 1  # sampled, not one repeated string


def test_generate_output_does_not_depend_on_batch_size(tiny_model_dir, tokenizer):
    from relign.commands.generate import _generate, prompt_ids
    from relign.models.loading import load_causal_lm
    from relign.rollout.engine import SamplingParams
    from relign.rollout.hf_engine import HFEngine

    model = load_causal_lm(str(tiny_model_dir)).eval()
    prompts = [prompt_ids(tokenizer, t, chat=False, system="") for t in ["1 + 1 =", "the answer is", "7 * 8 ="]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=5)
    runs = [_generate(HFEngine(model, tokenizer), prompts, params, seed=3, batch_size=b, progress=lambda k: None)
            for b in (1, 3)]
    assert [[c.token_ids for c in cs] for cs in runs[0]] == [[c.token_ids for c in cs] for cs in runs[1]]


@pytest.mark.parametrize("content, problem", [
    ('{"prompt": "ok"}\n{"prompt": 3}\n', ", row 2, field 'prompt': expected a string or a list of messages, got int"),
    ('{"prompt": "ok"}\n{"messages": [{"role": "user"}]}\n', ", row 2, field 'messages[0].content': expected a string, got NoneType"),
    ('{"prompt": "ok"}\n{"text": "no prompt"}\n', ", row 2, field 'prompt': missing (give 'prompt' as text or messages, or 'messages')"),
    ('{"prompt": "ok"}\n{"prompt": "a"\n', ", row 2: invalid JSON"),
    ("", ": "),  # the reader's own words for an empty file (checked below)
])
def test_generate_bad_input_names_file_and_row(tmp_path, content, problem):
    import contextlib
    import io

    from relign.cli import main

    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    err = io.StringIO()
    # in-process (the same main() as the command line): bad input fails before any model loads
    with contextlib.redirect_stderr(err):
        assert main(["generate", "tiny:micro", str(path)]) == 2
    msg = err.getvalue()
    assert msg.startswith(f"relign generate: error: {path}{problem}") and msg.count("\n") == 1, msg
    if not content:
        assert "empty" in msg


def test_generate_bad_file_and_engine_through_the_cli(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert error_line(cli("generate", "tiny:micro", str(missing))) == f"relign generate: error: {missing}: file not found"
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    line = error_line(cli("generate", "tiny:micro", str(prompts), "--engine", "vllm"))
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        assert line.startswith("relign generate: error: --engine vllm: vLLM is not installed") and "relign[vllm]" in line
    else:  # the micro model's 16-dim heads are a shape vLLM's CPU attention does not take
        assert line.startswith("relign generate: error: --engine vllm: vLLM's CPU attention does not support"), line


# ------------------------------------------------------------------------- merge-lora


def _adapter(base: Path, out: Path, seed: int):
    """A LoRA adapter on the tiny model with random (non-zero) B, saved as relign saves one."""
    from transformers import AutoTokenizer

    from relign.models.loading import apply_lora, load_causal_lm

    model = apply_lora(load_causal_lm(str(base)), r=4, alpha=8, dropout=0.0, target_modules=["all-linear"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return model.eval()


IDS = torch.tensor([[5, 17, 300, 42, 8, 9, 1000, 77], [1, 2, 3, 4, 5, 6, 7, 8]])


def test_merge_lora_adapter_gives_the_same_logits(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    peft_model = _adapter(tiny_model_dir, adapter, seed=0)
    merged_dir = tmp_path / "merged"
    proc = cli("merge-lora", str(adapter), str(merged_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "tokenizer.json").is_file()
    assert not (merged_dir / "adapter_config.json").exists()  # a plain HF model, no peft needed
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        want, got = peft_model(IDS).logits, merged(IDS).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(IDS).logits
    assert (want - base).abs().max() > 1e-2  # the adapter matters ...
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # ... and the merge keeps it exactly


def test_merge_lora_run_dir_takes_the_newest_complete_checkpoint(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    models = {}
    for step in (1, 2):
        ckpt = run / "checkpoints" / f"step_{step}"
        models[step] = _adapter(tiny_model_dir, ckpt, seed=step)
        (ckpt / "relign_state.json").write_text("{}")
        torch.save({}, ckpt / "trainer_state.pt")
    (run / "checkpoints" / ".tmp-step_3-123").mkdir()  # a half-written one is never taken
    proc = cli("merge-lora", str(run), str(tmp_path / "merged"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"merging the newest checkpoint of {run}: step 2" in proc.stderr
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(IDS).logits
        torch.testing.assert_close(got, models[2](IDS).logits, atol=1e-5, rtol=1e-5)


def test_merge_lora_reward_model_adapter(tiny_model_dir, tokenizer, tmp_path):
    """A reward model's LoRA (task SEQ_CLS, the trained score head in modules_to_save) merges
    into a plain sequence classifier with the same scores."""
    from transformers import AutoModelForSequenceClassification

    from relign.cli import main
    from relign.models.loading import apply_lora

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.config.pad_token_id = tokenizer.pad_token_id
    rm = apply_lora(rm, r=4, alpha=8, dropout=0.0, target_modules=["all-linear"], task_type="SEQ_CLS",
                    modules_to_save=["score"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in rm.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    rm.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    assert main(["merge-lora", str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, rm.eval()(IDS).logits, atol=1e-5, rtol=1e-5)


def test_merge_lora_errors_name_the_folder(tiny_model_dir, tmp_path):
    import contextlib
    import io

    from relign.cli import main

    def error(*args):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(["merge-lora", *map(str, args)]) == 2
        assert err.getvalue().count("\n") == 1, err.getvalue()
        return err.getvalue().strip()

    assert error(tiny_model_dir, tmp_path / "x") == (
        f"relign merge-lora: error: {tiny_model_dir}: a full model already (config.json, no adapter_config.json); nothing to merge")
    assert error(tmp_path / "nope", tmp_path / "x") == f"relign merge-lora: error: {tmp_path / 'nope'}: no such folder"
    full_run = tmp_path / "full_run" / "checkpoints" / "step_4"
    full_run.mkdir(parents=True)
    for f in ("config.json", "relign_state.json"):
        (full_run / f).write_text("{}")
    torch.save({}, full_run / "trainer_state.pt")
    assert error(tmp_path / "full_run", tmp_path / "x").startswith(
        f"relign merge-lora: error: {tmp_path / 'full_run'}: the newest checkpoint ({full_run}) is a full model, not a LoRA adapter")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    (adapter / "adapter_model.safetensors").write_text("")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("x")
    assert error(adapter, tmp_path / "taken") == (
        f"relign merge-lora: error: {tmp_path / 'taken'}: already exists and is not empty; choose a new folder")
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    assert error(adapter, tmp_path / "y") == (
        f"relign merge-lora: error: {adapter / 'adapter_config.json'}: base_model_name_or_path={tmp_path / 'gone'}: "
        "no such folder (pass --base to use another base model)")


# ------------------------------------------------------------------------- model errors


def test_bad_model_path_names_model_path_at_once(tmp_path):
    missing = tmp_path / "missing-model"
    line = error_line(cli("sft", "sft_tiny", f"model.path={missing}", f"run_dir={tmp_path / 'r1'}"))
    # checked when the config loads (or, failing that, when the model loads): either way the key is model.path
    assert line.startswith("relign sft: error: ") and "model.path" in line and str(missing) in line, line
    assert "no such folder" in line and "model.tokenizer" not in line
    line = error_line(cli("sft", "sft_tiny", "model.path=some-org/some-model", f"run_dir={tmp_path / 'r2'}",
                          env={"HF_HUB_OFFLINE": "1"}))
    assert line.startswith("relign sft: error: model.path=some-org/some-model: no such local folder, and it cannot "
                           "come from the hub: HF_HUB_OFFLINE is set (offline mode)")


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_cached_hub_model_loads_while_the_hub_is_unreachable(tiny_model_dir, tmp_path):
    """A hub id already in the local hub cache loads with the hub down (one refused probe, then
    offline) instead of ~40 s of retries (an uncached one fails at once: tests/models/test_model_source.py)."""
    import shutil

    repo = tmp_path / "hub" / "models--some-org--tiny"
    snap = repo / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    unset = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    proc = cli("generate", "some-org/tiny", str(prompts), "--max-new-tokens", "3", "--out", "-", env=env, unset=unset)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["num_tokens"] == 3
    assert "Retrying" not in proc.stderr
