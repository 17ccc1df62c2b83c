"""Bad data ends in a one-line error naming the file, the row and the field (or the config key), or,
with skip_bad_rows, in a counted skip: invalid UTF-8, lone surrogates, NUL, empty files, folders,
missing files, wrong columns, hub ids with no hub. And the one line of counts a recipe prints."""

from __future__ import annotations

import csv
import json
import time

import pytest

from relign.data import readers
from relign.data.preference import build_pair_examples, build_unpaired_examples
from relign.data.readers import DataError, read_records
from relign.data.sft import build_sft_examples
from relign.data.stats import DataStats, describe

from ..conftest import REPO, run_cli, write_jsonl

GOOD = {"prompt": "2+2?", "response": "4"}
GOOD_LINE = json.dumps(GOOD).encode()
UTF8_ERROR = "invalid UTF-8: byte 0xff"


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


# --------------------------------------------------------------------------- encoding


def _bad_utf8_files(tmp_path):
    """The same three rows, the second with a 0xff byte in its prompt, as JSONL, JSON and CSV."""
    bad = b'{"prompt": "x\xff", "response": "y"}'
    return {
        "jsonl": _write(tmp_path / "d.jsonl", GOOD_LINE + b"\n" + bad + b"\n" + GOOD_LINE + b"\n"),
        "json": _write(tmp_path / "d.json", b"[" + GOOD_LINE + b", " + bad + b", " + GOOD_LINE + b"]"),
        "csv": _write(tmp_path / "d.csv", b"prompt,response\n2+2?,4\nx\xff,y\n2+2?,4\n"),
    }


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv"])
def test_invalid_utf8_names_file_and_row_or_is_counted(tokenizer, tmp_path, fmt):
    path = _bad_utf8_files(tmp_path)[fmt]
    with pytest.raises(DataError) as e:
        build_sft_examples(str(path), tokenizer)
    assert (e.value.source, e.value.row, e.value.kind) == (str(path), 2, "invalid UTF-8")
    assert str(e.value).startswith(f"{path}, row 2") and UTF8_ERROR in str(e.value)
    if fmt == "jsonl":  # the line as bytes: '{"prompt": "x' is 13 bytes, the 0xff the 14th
        assert str(e.value) == f"{path}, row 2: {UTF8_ERROR} at byte 14 of the line (save the file as UTF-8)"
    else:  # decoded around the bad byte: the field and the position in it
        assert str(e.value) == f"{path}, row 2, field 'prompt': {UTF8_ERROR} at position 1 (save the file as UTF-8)"

    examples, stats = build_sft_examples(str(path), tokenizer, skip_bad_rows=True)
    assert len(examples) == 2 and (stats.rows, stats.bad_rows, dict(stats.reasons)) == (3, 1, {"invalid UTF-8": 1})


def test_lone_surrogate_is_caught_before_the_tokenizer(tokenizer, tmp_path):
    # "\ud800" is valid JSON, but no text: a fast tokenizer raises TypeError on it
    path = _write(tmp_path / "s.jsonl", GOOD_LINE + b'\n{"prompt": "ok", "response": "a\\ud800b"}\n')
    with pytest.raises(DataError) as e:
        build_sft_examples(str(path), tokenizer)
    assert str(e.value) == (f"{path}, row 2, field 'response': lone surrogate \\ud800 at position 1 is not valid "
                            "Unicode text (a broken escape in the file?)")
    _, stats = build_sft_examples(str(path), tokenizer, skip_bad_rows=True)
    assert (stats.kept, dict(stats.reasons)) == (1, {"with lone surrogates": 1})
    # nested fields are named by their path, for every reader user (RL, preference, verifier)
    chat = _write(tmp_path / "c.jsonl", b'{"chosen": [{"role": "user", "content": "q"}, '
                                        b'{"role": "assistant", "content": "\\udfff"}], "rejected": "r"}\n')
    with pytest.raises(DataError, match=r"row 1, field 'chosen\[1\].content': lone surrogate \\udfff"):
        build_pair_examples(str(chat), tokenizer)


def test_nul_is_rejected_escaped_or_raw(tokenizer, tmp_path):
    path = _write(tmp_path / "n.jsonl", b"\n".join([
        GOOD_LINE,
        b'{"prompt": "a\\u0000b", "response": "y"}',  # valid JSON, a NUL character in the text
        b'{"prompt": "a\x00b", "response": "y"}',  # a raw NUL byte: not JSON
    ]) + b"\n")
    with pytest.raises(DataError) as e:
        build_sft_examples(str(path), tokenizer)
    assert str(e.value) == f"{path}, row 2, field 'prompt': NUL character at position 1 (a binary or corrupted file?)"
    _, stats = build_sft_examples(str(path), tokenizer, skip_bad_rows=True)
    assert stats.errors[1] == f"{path}, row 3: NUL byte at column 14 (a binary or corrupted file?)"
    assert (stats.kept, dict(stats.reasons)) == (1, {"with NUL characters": 2})


def test_byte_order_mark_is_not_data(tokenizer, tmp_path):
    jsonl = _write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + GOOD_LINE + b"\n")
    csv_path = _write(tmp_path / "bom.csv", b"\xef\xbb\xbfprompt,response\n2+2?,4\n")
    assert [r for _, r in read_records(str(jsonl))] == [GOOD]
    assert [r for _, r in read_records(str(csv_path))] == [GOOD]


def test_malformed_json_is_skipped_and_counted(tokenizer, tmp_path):
    path = _write(tmp_path / "m.jsonl", GOOD_LINE + b"\n{not json\n" + GOOD_LINE + b"\n")
    with pytest.raises(DataError, match=r"row 2: invalid JSON \(Expecting property name"):
        build_sft_examples(str(path), tokenizer)
    examples, stats = build_sft_examples(str(path), tokenizer, skip_bad_rows=True)
    assert len(examples) == 2 and dict(stats.reasons) == {"malformed JSON": 1} and stats.rows == 3


def test_csv_row_with_too_many_values(tokenizer, tmp_path):
    path = _write(tmp_path / "x.csv", b"prompt,response\n2+2?,4\na,b,c\n")
    with pytest.raises(DataError) as e:
        build_sft_examples(str(path), tokenizer)
    assert str(e.value) == f"{path}, row 2: 3 values for 2 columns"


# --------------------------------------------------------------------------- empty, missing, folders


@pytest.mark.parametrize("content", [b"", b"\n\n", b"[]"])
def test_empty_file_names_the_file(tokenizer, tmp_path, content):
    path = _write(tmp_path / ("e.json" if content == b"[]" else "e.jsonl"), content)
    for skip in (False, True):
        with pytest.raises(DataError) as e:
            build_sft_examples(str(path), tokenizer, skip_bad_rows=skip, key="data.path")
        assert str(e.value) == f"data.path={path}: 0 rows read: the file is empty"


def test_every_row_skipped_says_why(tokenizer, tmp_path):
    long = {"prompt": " ".join(["word"] * 40), "response": "x"}
    path = write_jsonl(tmp_path / "long.jsonl", [long, long])
    with pytest.raises(DataError) as e:
        build_sft_examples(str(path), tokenizer, max_length=8)
    assert str(e.value) == f"{path}: no usable rows: all 2 rows skipped (2 too long for max_length=8); raise data.max_length"
    bad = _write(tmp_path / "bad.jsonl", b'{"prompt": "q"}\n{oops\n')
    with pytest.raises(DataError) as e:
        build_sft_examples(str(bad), tokenizer, skip_bad_rows=True)
    assert str(e.value) == (f"{bad}: no usable rows: all 2 rows skipped (1 missing 'response', 1 malformed JSON); "
                            f"first: {bad}, row 1, field 'response': missing")
    with pytest.raises(DataError, match=r"no usable rows: the only row was skipped \(1 bad 'label'\)"):
        build_unpaired_examples(str(write_jsonl(tmp_path / "k.jsonl", [{"prompt": "q", "completion": "a", "label": "yes"}])),
                                tokenizer, skip_bad_rows=True)


def test_missing_file_folder_and_local_looking_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as e:
        list(read_records("train.jsonl", key="data.path"))
    assert str(e.value) == f"data.path=train.jsonl: file not found (looked in {tmp_path})"
    (tmp_path / "data").mkdir()
    # "data/train" could be a hub id, but data/ is a local folder: a typo, not a dataset
    with pytest.raises(DataError, match=r"^data.path=data/train: file not found"):
        list(read_records("data/train", key="data.path"))
    with pytest.raises(DataError) as e:
        list(read_records("data", key="data.eval_path"))
    assert str(e.value).startswith("data.eval_path=data: is a folder with no data files in it (expected a .jsonl")
    # ~ is the home folder
    monkeypatch.setenv("HOME", str(tmp_path))
    write_jsonl(tmp_path / "home.jsonl", [GOOD])
    assert [r for _, r in read_records("~/home.jsonl")] == [GOOD]


def test_unreadable_parquet_names_the_file(tmp_path):
    path = _write(tmp_path / "broken.parquet", b"not parquet at all")
    with pytest.raises(DataError, match=rf"^{path}: not a readable parquet file"):
        list(read_records(str(path)))


# --------------------------------------------------------------------------- wrong columns


def _csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_csv_and_parquet_with_the_wrong_columns(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    sft = _csv(tmp_path / "sft.csv", ["question", "answer"], [["q", "a"]])
    for skip in (False, True):  # the file's problem: no row can be read, skipping or not
        with pytest.raises(DataError) as e:
            build_sft_examples(str(sft), tokenizer, skip_bad_rows=skip)
        assert str(e.value) == (f"{sft}: wrong columns: the file has question, answer; expected 'messages', or "
                                "'prompt' and 'response' (or 'completion'), or 'text'")
    pairs = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "good": "a", "bad": "b"}]), pairs)
    with pytest.raises(DataError) as e:
        build_pair_examples(str(pairs), tokenizer)
    assert str(e.value) == (f"{pairs}: wrong columns: the file has prompt, good, bad; expected 'prompt', 'chosen' and "
                            "'rejected' ('prompt' may be left out when 'chosen'/'rejected' are whole conversations)")
    # remapped keys are what is expected
    (ex,), _ = build_pair_examples(str(pairs), tokenizer, chosen_key="good", rejected_key="bad")
    kto = _csv(tmp_path / "kto.csv", ["prompt", "completion"], [["q", "a"]])
    with pytest.raises(DataError, match=r"wrong columns: the file has prompt, completion; expected 'prompt', 'completion' "
                                        r"and 'label' \(or paired 'prompt', 'chosen' and 'rejected'\)"):
        build_unpaired_examples(str(kto), tokenizer)


# --------------------------------------------------------------------------- hub ids


def _no_load_dataset(monkeypatch):
    import datasets

    def fail(*a, **k):
        raise AssertionError("load_dataset must not be called")

    monkeypatch.setattr(datasets, "load_dataset", fail)


def test_hub_id_with_no_hub_fails_at_once_naming_the_key(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(readers, "_probe_hub", lambda timeout=3.0: "huggingface.co:443: Name or service not known")
    _no_load_dataset(monkeypatch)
    with pytest.raises(DataError) as e:
        list(read_records("org/name", key="data.path"))
    assert str(e.value) == ("data.path=org/name: not a local file or folder, and the Hugging Face hub cannot be reached "
                            "(huggingface.co:443: Name or service not known); give a local path, or set HF_HUB_OFFLINE=1 "
                            "to use a cached copy")


def test_hub_offline_tries_the_cache_only(monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(readers, "_probe_hub", lambda timeout=3.0: pytest.fail("no probe when offline"))

    def not_cached(name, config=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", not_cached)
    with pytest.raises(DataError) as e:
        list(read_records("org/name:main", key="data.path"))
    assert str(e.value) == ("data.path=org/name:main: not a local file or folder, and no cached copy on this machine with "
                            "HF_HUB_OFFLINE=1 (Couldn't reach 'org/name' on the Hub (OfflineModeIsEnabled))")


def test_probe_is_one_quick_connection(monkeypatch):
    """The probe against a local port: open -> None; closed -> the reason, without retries."""
    import socket

    for var in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    try:
        assert readers._probe_hub(timeout=2.0) is None
    finally:
        server.close()
    start = time.monotonic()
    why = readers._probe_hub(timeout=2.0)  # nothing listens there now
    assert why.startswith(f"127.0.0.1:{port}: ") and "refused" in why.lower()
    assert time.monotonic() - start < 2.0


# --------------------------------------------------------------------------- counts


def test_describe_by_hand():
    stats = DataStats(rows=1000, bad_rows=7, dropped_too_long=5, truncated=30, kept=988, source="train.jsonl",
                      max_length=1024, truncation="truncate")
    stats.reasons.update({"malformed JSON": 7})
    assert describe(stats) == ("data: train.jsonl: 1,000 rows read, 12 skipped (7 malformed JSON, 5 too long for "
                               "max_length=1024), 30 truncated (cut to max_length=1024)")
    assert describe(DataStats(rows=1, kept=1), "eval.jsonl") == "data: eval.jsonl: 1 row read, 0 skipped, 0 truncated"


def test_describe_counts_a_real_file(tokenizer, tmp_path):
    path = _write(tmp_path / "mix.jsonl", b"\n".join([
        GOOD_LINE,
        b"{not json",  # malformed
        json.dumps({"prompt": " ".join(["word"] * 40), "response": "x"}).encode(),  # the prompt alone is too long
        json.dumps({"prompt": "q", "response": " ".join(["word"] * 40)}).encode(),  # the response is cut
        b'{"prompt": "q"}',  # no response
    ]) + b"\n")
    examples, stats = build_sft_examples(str(path), tokenizer, max_length=16, skip_bad_rows=True)
    assert len(examples) == 2
    assert describe(stats) == (
        f"data: {path}: 5 rows read, 3 skipped (1 malformed JSON, 1 missing 'response', 1 too long for max_length=16), "
        f"1 truncated (cut to max_length=16)\n"
        f"  first skipped row: {path}, row 2: invalid JSON (Expecting property name enclosed in double quotes at column 2)")
    assert stats.describe() == describe(stats)


def test_describe_kto_pairs_give_two_examples(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    _, stats = build_unpaired_examples(str(path), tokenizer)
    assert describe(stats) == f"data: {path}: 1 row read, 0 skipped, 0 truncated, 2 examples"


def test_rl_task_data_names_the_file(tmp_path):
    from relign.envs import get_task

    task = get_task("gsm8k")
    empty = _write(tmp_path / "empty.jsonl", b"")
    with pytest.raises(DataError, match=rf"^{empty}: 0 rows read: the file is empty$"):
        task.load(str(empty))
    bad = _write(tmp_path / "bad.jsonl", b'{"question": "q\\ud800", "answer": "#### 4"}\n')
    with pytest.raises(DataError, match=rf"^{bad}, row 1, field 'question': lone surrogate"):
        task.load(str(bad))


# --------------------------------------------------------------------------- through the CLI


def _cli_cases(tmp_path):
    bad_utf8 = _write(tmp_path / "bad_utf8.jsonl", GOOD_LINE + b'\n{"prompt": "x\xff", "response": "y"}\n')
    surrogate = _write(tmp_path / "pairs.jsonl", b'{"prompt": "q", "chosen": "a\\ud800", "rejected": "b"}\n')
    columns = _csv(tmp_path / "pairs.csv", ["question", "good", "bad"], [["q", "a", "b"]])
    all_bad = _write(tmp_path / "all_bad.jsonl", b'{"prompt": "x\xff", "response": "y"}\n{"prompt": "q"}\n')
    return [
        ("sft", "sft_tiny", bad_utf8, [], f"{bad_utf8}, row 2: {UTF8_ERROR} at byte 14 of the line"),
        ("sft", "sft_tiny", all_bad, ["data.skip_bad_rows=true"],
         f"{all_bad}: no usable rows: all 2 rows skipped (1 invalid UTF-8, 1 missing 'response')"),
        ("dpo", "dpo", surrogate, [], f"{surrogate}, row 1, field 'chosen': lone surrogate \\ud800"),
        ("rm", "rm", columns, [], f"{columns}: wrong columns: the file has question, good, bad; expected 'prompt'"),
    ]


def _preset(name: str) -> str:
    """A shipped preset file (package data; the examples/ folder in older trees)."""
    for folder in (REPO / "relign" / "presets", REPO / "examples"):
        if (folder / f"{name}.yaml").is_file():
            return str(folder / f"{name}.yaml")
    raise FileNotFoundError(name)


@pytest.mark.parametrize("case", range(4))
def test_cli_reports_bad_data_in_one_line(tiny_model_dir, tmp_path, case):
    command, preset, path, extra, expected = _cli_cases(tmp_path)[case]
    proc = run_cli(command, _preset(preset), f"model.path={tiny_model_dir}",
                   f"data.path={path}", f"run_dir={tmp_path / 'run'}", "logging.tensorboard=false", *extra, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"relign {command}: error: ")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
