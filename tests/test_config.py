"""Config: typed dataclasses + YAML presets + dotted overrides, with one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from relign.config import ConfigError, describe_fields, field_docs, format_help, load_config
from relign.recipes.sft import Config

from .conftest import run_cli


def test_defaults_yaml_and_overrides_merge(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 0.5\nbatch_size: 8\nmodel:\n  lora:\n    r: 4\n")
    cfg = load_config(Config, p, ["optim.lr=0.25", "model.lora.enabled=true", "data.path=x.jsonl"])
    assert isinstance(cfg, Config)
    assert cfg.optim.lr == 0.25  # the override beats the preset
    assert cfg.batch_size == 8 and cfg.model.lora.r == 4 and cfg.model.lora.enabled is True
    assert cfg.micro_batch_size == 4  # untouched default
    assert cfg.model.trust_remote_code is False  # off unless the user turns it on


def test_unknown_key_in_override_names_key_and_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, ["optim.lrr=1"])
    msg = str(e.value)
    assert "optim.lrr" in msg and "did you mean 'optim.lr'" in msg
    assert "valid keys under 'optim'" in msg and "weight_decay" in msg and "\n" not in msg


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("batch_sise: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(Config, p)
    msg = str(e.value)
    assert "batch_sise" in msg and str(p) in msg and "batch_size" in msg and "micro_batch_size" in msg


def test_wrong_type_names_key():
    with pytest.raises(ConfigError) as e:
        load_config(Config, None, ["batch_size=lots"])
    assert "batch_size" in str(e.value) and "lots" in str(e.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config(Config, "nope.yaml")


def test_every_field_documented():
    rows = describe_fields(Config)
    keys = [r[0] for r in rows]
    assert "model.lora.r" in keys and "optim.lr" in keys and "data.truncation" in keys
    undocumented = [k for k, _, _, doc in rows if not doc]
    assert undocumented == []
    assert field_docs(Config)["packing"].startswith("Pack each micro-batch")
    text = format_help(Config, "sft", "summary")
    for k in keys:
        assert k in text


def test_cli_help_lists_every_field():
    out = run_cli("sft", "--help").stdout
    for key, _, _, doc in describe_fields(Config):
        assert key in out and doc[:30] in out


@pytest.mark.parametrize(
    "args, needle",
    [
        (["optim.lrr=1"], "unknown key 'optim.lrr'"),
        (["batch_size=abc"], "bad value for 'batch_size'"),
        (["missing.yaml"], "config file not found: missing.yaml"),
        (["data.path=does/not/exist.jsonl", "model.path=tiny:micro"], "does/not/exist.jsonl"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(args, needle, tmp_path):
    proc = run_cli("sft", *args, f"run_dir={tmp_path / 'run'}", check=False, env={"RELIGN_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_unknown_command():
    proc = run_cli("nope", check=False)
    assert proc.returncode == 2 and "unknown command" in proc.stderr


def test_resolved_config_round_trips(tmp_path):
    from relign.rundir import save_resolved_config

    cfg = load_config(Config, None, ["optim.lr=0.125", "data.path=a.jsonl"])
    save_resolved_config(cfg, tmp_path)
    data = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert data["optim"]["lr"] == 0.125
    again = load_config(Config, tmp_path / "config.yaml")
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("clear", ["task.path=", "task.path=null", "task.path=~", "task.path=''"])
def test_a_preset_path_is_cleared_by_an_empty_or_null_override(clear):
    """Switching a preset's task to a generated one means clearing its task.path: every spelling of
    "no value" gives the field's own default, '' (not set)."""
    from relign.commands.presets import load_preset
    from relign.recipes.rl_config import Config as RLConfig

    assert load_preset(RLConfig, "dr_grpo").task.path  # the preset names a file
    cfg = load_preset(RLConfig, "dr_grpo", [clear, "task.name=reasoning_gym"])
    assert cfg.task.path == "" and cfg.task.name == "reasoning_gym"


@pytest.mark.parametrize("override", ["optim.schedule=", "optim.schedule=null"])
def test_null_stays_an_error_for_a_string_that_must_have_a_value(override):
    with pytest.raises(ConfigError, match="'optim.schedule'"):
        load_config(Config, None, [override])
