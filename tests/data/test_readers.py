"""Readers for every supported format, with 1-based row numbers and errors naming file/row/field."""

from __future__ import annotations

import csv
import json

import pytest

from relign.data.readers import DataError, read_records
from relign.data.sft import build_sft_examples

ROWS = [
    {"prompt": "What is 2+2?", "response": "4"},
    {"prompt": "Capital of France?", "response": "Paris"},
    {"prompt": "", "response": "free text"},
]


def _write_all_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    paths = {}
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    paths["jsonl"] = p
    p = tmp_path / "d.json"
    p.write_text(json.dumps(ROWS))
    paths["json"] = p
    p = tmp_path / "d_wrapped.json"
    p.write_text(json.dumps({"data": ROWS}))
    paths["json-wrapped"] = p
    p = tmp_path / "d.csv"
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "response"])
        w.writeheader()
        w.writerows(ROWS)
    paths["csv"] = p
    table = pa.Table.from_pylist(ROWS)
    p = tmp_path / "d.parquet"
    pq.write_table(table, p)
    paths["parquet"] = p
    p = tmp_path / "d.arrow"
    with pa.OSFile(str(p), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    paths["arrow-file"] = p
    p = tmp_path / "d_stream.arrow"
    with pa.OSFile(str(p), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    paths["arrow-stream"] = p
    p = tmp_path / "saved"
    Dataset.from_list(ROWS).save_to_disk(str(p))
    paths["save_to_disk"] = p
    p = tmp_path / "saved_dict"
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:1])}).save_to_disk(str(p))
    paths["save_to_disk-dict"] = p
    return paths


def test_every_format_reads_the_same_rows(tmp_path):
    for name, path in _write_all_formats(tmp_path).items():
        rows = list(read_records(str(path)))
        assert [r for _, r in rows] == ROWS, name
        assert [n for n, _ in rows] == [1, 2, 3], name


def test_dataset_dict_split_and_missing_split(tmp_path):
    path = _write_all_formats(tmp_path)["save_to_disk-dict"]
    assert [r for _, r in read_records(str(path), "test")] == ROWS[:1]
    with pytest.raises(DataError, match="no split 'validation'"):
        list(read_records(str(path), "validation"))


def test_hub_id_goes_to_datasets_load_dataset(monkeypatch):
    calls = {}

    def fake_load_dataset(name, config=None, split=None):
        calls.update(name=name, config=config, split=split)
        return ROWS

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows = [r for _, r in read_records("openai/gsm8k:main", "test")]
    assert rows == ROWS and calls == {"name": "openai/gsm8k", "config": "main", "split": "test"}


def test_max_rows(tmp_path):
    path = _write_all_formats(tmp_path)["jsonl"]
    assert len(list(read_records(str(path), max_rows=2))) == 2


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        list(read_records(str(tmp_path / "nope.jsonl")))
    bad = tmp_path / "d.txt"
    bad.write_text("x")
    with pytest.raises(DataError, match="unknown file type '.txt'"):
        list(read_records(str(bad)))


def test_invalid_json_line_names_row(tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataError) as e:
        list(read_records(str(p)))
    assert e.value.row == 2 and str(p) in str(e.value)


GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize(
    "bad, field, problem",
    [
        ({"prompt": 3, "response": "x"}, "prompt", "expected a string, got int"),
        ({"prompt": "p"}, "response", "missing"),
        ({"prompt": "p", "response": "  "}, "response", "empty"),
        ({"messages": []}, "messages", "empty list of messages"),
        ({"messages": "hello"}, "messages", "expected a list of messages"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "messages[1].role", "out of order after 'user'"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "messages[0].role", "out of order as the first message"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 5}]}, "messages[1].content", "expected a string"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}]}, "messages[1].role", "expected one of"),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]}, "messages", "no assistant message"),
        ({"question": "q"}, "messages", "missing"),
    ],
)
def test_bad_row_error_names_file_row_field(tmp_path, tokenizer, bad, field, problem):
    rows = [GOOD_CHAT, {"prompt": "a", "response": "b"}, bad, GOOD_CHAT]
    p = tmp_path / "data.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        build_sft_examples(str(p), tokenizer)
    err = e.value
    assert (err.source, err.row, err.field) == (str(p), 3, field)
    assert str(err).startswith(f"{p}, row 3, field '{field}': ") and problem in str(err)

    examples, stats = build_sft_examples(str(p), tokenizer, skip_bad_rows=True)
    assert len(examples) == 3 and stats.bad_rows == 1 and stats.rows == 4
    assert stats.as_metrics()["data/bad_rows"] == 1
    assert "row 3" in stats.errors[0]


def test_csv_messages_as_json_string(tmp_path, tokenizer):
    p = tmp_path / "chat.csv"
    with open(p, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["messages"])
        w.writeheader()
        w.writerow({"messages": json.dumps(GOOD_CHAT["messages"])})
    examples, stats = build_sft_examples(str(p), tokenizer)
    assert stats.kept == 1
