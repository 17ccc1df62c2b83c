"""The start banner, the end summary and the resume command: pure text from hand-built inputs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from relign import banner, rundir
from relign.models import loading


@pytest.mark.parametrize("n, text", [
    (5, "5"), (999, "999"), (1234, "1.23K"), (999_400, "999K"), (999_999, "1.00M"), (1_300_000, "1.30M"),
    (20_200_000, "20.2M"), (494_032_768, "494M"), (7_615_616_512, "7.62B"),
])
def test_human_count(n, text):
    assert banner.human_count(n) == text


def test_params_duration_data_and_steps_lines():
    assert banner.format_params(1_300_000, 1_300_000) == "1.30M (all trainable)"
    # LoRA: 20,185,088 / 7,615,616,512 = 0.265% -> two significant digits
    assert banner.format_params(7_615_616_512, 20_185_088) == "7.62B, 20.2M trainable (0.27%)"
    assert banner.format_duration(42.14) == "42.1 s"
    assert banner.format_duration(185) == "3 min 05 s"
    assert banner.format_duration(3725) == "1 h 02 min"
    assert banner.data_line(64, 54, 8) == "64 rows read, 62 used (54 train, 8 eval)"  # 2 rows dropped
    assert banner.data_line(64, 64, unit="prompts") == "64 prompts read, 64 used"
    assert banner.data_line(32, 56, 8, made="examples") == "32 rows read -> 64 examples (56 train, 8 eval)"
    # 100 rows / batch 16 = 6 steps per epoch (the tail is dropped); 2.5 epochs -> ceil(15) = 15
    assert banner.steps_line(15, epochs=2.5, steps_per_epoch=6, batch="16 examples") == \
        "15 (2.5 epochs x 6 steps per epoch) x 16 examples"
    assert banner.steps_line(60, max_steps=60) == "60 (max_steps)"


def test_cpu_name_reads_model_name_and_widest_vector_extension(tmp_path):
    # the first processor's lines decide; later ones are not read
    zen3 = tmp_path / "zen3"
    zen3.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx fma avx2 sha_ni\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: avx512f\n")
    assert banner.cpu_name(str(zen3)) == "AMD EPYC, AVX2"
    spr = tmp_path / "spr"
    spr.write_text("model name\t: Intel(R) Xeon(R) Platinum 8480C\nflags\t: avx2 avx512f avx512_bf16 amx_tile\n")
    assert banner.cpu_name(str(spr)) == "Intel(R) Xeon(R) Platinum 8480C, AMX"
    genoa = tmp_path / "genoa"
    genoa.write_text("model name\t: AMD EPYC 9R14\nflags\t: avx2 avx512f avx512_bf16\n")
    assert banner.cpu_name(str(genoa)) == "AMD EPYC 9R14, AVX-512 BF16"
    assert banner.cpu_name(str(tmp_path / "missing"))  # no /proc: platform's name, never an error


def test_format_start_is_one_aligned_line_per_fact():
    text = banner.format_start("sft", model="tiny:tiny", params="1.30M (all trainable)", dtype="fp32",
                               device="cpu, 2 CPU threads", data="64 rows read, 64 used", steps="60 (max_steps)",
                               run_dir="runs/sft-tiny")
    assert text == (
        "relign sft\n"
        "  model      tiny:tiny\n"
        "  parameters 1.30M (all trainable)\n"
        "  dtype      fp32\n"
        "  device     cpu, 2 CPU threads\n"
        "  data       64 rows read, 64 used\n"
        "  steps      60 (max_steps)\n"
        "  run dir    runs/sft-tiny"
    )


def test_format_end_names_metrics_checkpoint_report_and_resume():
    metrics = banner.format_metrics({"train/loss": 0.41234, "eval/loss": 0.5, "train/lr": 1e-5, "step": 60},
                                    ("train/loss", "eval/loss", "eval/accuracy"))
    assert metrics == "train/loss 0.4123  eval/loss 0.5"  # keys not logged are left out
    text = banner.format_end("sft", seconds=83.2, metrics=metrics, run_dir="runs/a", checkpoint="runs/a/checkpoints/step_60",
                             report="runs/a/report.html", resume="relign sft x.yaml run_dir=runs/a resume=auto")
    assert text.splitlines() == [
        "relign sft: done in 1 min 23 s",
        "  metrics    train/loss 0.4123  eval/loss 0.5",
        "  run dir    runs/a",
        "  checkpoint runs/a/checkpoints/step_60",
        "  report     runs/a/report.html",
        "  resume     relign sft x.yaml run_dir=runs/a resume=auto",
    ]
    stopped = banner.format_end("rl", seconds=5, metrics="", run_dir="runs/b", status="stopped: non-finite updates")
    assert stopped.splitlines() == ["relign rl: stopped: non-finite updates in 5.0 s", "  run dir    runs/b"]


def test_resume_command_keeps_the_arguments_and_pins_the_run():
    argv = ["/venv/bin/relign", "sft", "examples/sft_tiny.yaml", "run_dir=runs/old", "max_steps=3", "resume=none",
            "data.path=my data.jsonl", "--dry-run"]
    assert banner.resume_command("sft", "runs/old-2", argv) == \
        "relign sft examples/sft_tiny.yaml max_steps=3 'data.path=my data.jsonl' run_dir=runs/old-2 resume=auto"
    # not from the command line (a Python caller): the run's own resolved config
    assert banner.resume_command("rl", "runs/r", ["pytest", "-q"]) == \
        "relign rl runs/r/config.yaml run_dir=runs/r resume=auto"
    assert banner.resume_command("rl", "runs/r", ["relign", "rl", "grpo"], world=4) == \
        "torchrun --nproc_per_node=4 -m relign rl grpo run_dir=runs/r resume=auto"


def test_count_parameters_counts_tied_weights_once_and_frozen_ones_as_such():
    emb = torch.nn.Embedding(10, 4)  # 40
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied: still 40
    frozen = torch.nn.Linear(4, 4)  # 16 + 4 = 20, not trainable
    frozen.requires_grad_(False)
    model = torch.nn.ModuleList([emb, head, frozen])
    assert loading.count_parameters(model) == (60, 40)


def test_model_size_from_the_config_matches_the_loaded_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    loaded = loading.count_parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert loading.model_size(str(tiny_model_dir)) == loaded  # built on the meta device: no weights read


def test_model_size_of_a_folder_without_config_names_the_key(tmp_path):
    from relign.config import ConfigError

    with pytest.raises(ConfigError, match=r"^ref_model=.*: cannot read the model's config"):
        loading.model_size(str(tmp_path), key="ref_model")


def test_nested_runs_print_nothing(capsys, tmp_path):
    with rundir.nested():
        banner.end("sft", run_dir=tmp_path, seconds=1.0, metrics={"train/loss": 1.0}, keys=("train/loss",))
    assert capsys.readouterr().out == ""
    banner.end("sft", run_dir=tmp_path, seconds=1.0, metrics={"train/loss": 1.0}, keys=("train/loss",))
    out = capsys.readouterr().out
    assert out.startswith("relign sft: done in 1.0 s\n  metrics    train/loss 1\n")
    assert "resume" not in out  # no checkpoint: nothing to resume


@dataclass
class _RunCfg:
    run_dir: str = ""
    resume: str = ""
    seed: int = 0


def test_dry_run_discards_only_what_its_open_run_wrote(tmp_path):
    """What a dry run removes is what this run's open_run wrote, whatever ran before it in this
    process (an API user's earlier run, the suite's fork server): never an earlier run's files."""
    from relign.rundir import open_run

    fresh = open_run(_RunCfg(run_dir=str(tmp_path / "fresh")), "sft")  # created by this open
    assert (fresh / "config.yaml").is_file()
    assert banner._discard_new_run_dir(fresh) and not fresh.exists()

    given = tmp_path / "given"  # an empty directory the user made: only our config goes
    given.mkdir()
    (given / "notes.txt").write_text("mine")
    open_run(_RunCfg(run_dir=str(given)), "sft")
    assert banner._discard_new_run_dir(given) and sorted(p.name for p in given.iterdir()) == ["notes.txt"]

    earlier = open_run(_RunCfg(run_dir=str(tmp_path / "run")), "sft")  # a run, written just now in this process
    (earlier / "metrics.jsonl").write_text("{}\n")
    again = open_run(_RunCfg(run_dir=str(earlier), resume="auto"), "sft")  # its resume's dry run
    assert again == earlier and not banner._discard_new_run_dir(earlier)
    assert sorted(p.name for p in earlier.iterdir()) == ["config.yaml", "metrics.jsonl"]
    other = tmp_path / "other"  # a directory this process never opened
    other.mkdir()
    (other / "config.yaml").write_text("x: 1\n")
    assert not banner._discard_new_run_dir(other) and (other / "config.yaml").is_file()
