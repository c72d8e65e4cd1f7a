"""calib: loaders on real small files, the embedded corpus, seeded sampling without calib/eval overlap."""

from __future__ import annotations

import importlib.util
import json
from importlib import resources
from pathlib import Path

import pytest

from pipeline.core.errors import UserError
from pipeline.quantize import calib
from pipeline.recipe import CalibrationSpec

PARAS = [f"Paragraph number {i} talks about the {w} of quantization and calibration in some detail."
         for i, w in enumerate(["history", "theory", "practice", "future", "cost", "benefit"] * 5)]


def _spec(**kw) -> CalibrationSpec:
    base = {"dataset": "embedded", "size": 8, "max_seq_length": 64, "batch_size": 3, "seed": 1234, "eval_samples": 4}
    return CalibrationSpec(**(base | kw))


def test_txt_paragraphs(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("\n\n".join(PARAS) + "\n\n  \n\n")
    src = calib.open_source("c.txt", text_field=None, base_dir=tmp_path, seed=0)
    assert src.finite and list(src.records) == PARAS


def test_jsonl_default_and_custom_field(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": p, "id": i}) for i, p in enumerate(PARAS)) + "\n")
    assert list(calib.open_source("a.jsonl", text_field=None, base_dir=tmp_path, seed=0).records) == PARAS
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": p}) for p in PARAS[:3]))
    assert list(calib.open_source("b.jsonl", text_field="body", base_dir=tmp_path, seed=0).records) == PARAS[:3]
    with pytest.raises(UserError, match=r"b\.jsonl:1: no string field 'text'"):
        calib.open_source("b.jsonl", text_field=None, base_dir=tmp_path, seed=0)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2: not valid JSON"):
        calib.open_source("bad.jsonl", text_field=None, base_dir=tmp_path, seed=0)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow (extra 'parquet') not installed")
def test_parquet_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": PARAS, "n": list(range(len(PARAS)))}), tmp_path / "d.parquet")
    assert list(calib.open_source("d.parquet", text_field="content", base_dir=tmp_path, seed=0).records) == PARAS
    with pytest.raises(UserError, match="no column 'text'"):
        calib.open_source("d.parquet", text_field=None, base_dir=tmp_path, seed=0)


def test_parquet_without_pyarrow_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    import sys

    for name in [m for m in sys.modules if m == "pyarrow" or m.startswith("pyarrow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if the extra were not installed: import fails
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(UserError, match=r"needs pyarrow: pip install 'trtpipe\[parquet\]'"):
        calib.open_source("d.parquet", text_field=None, base_dir=tmp_path, seed=0)


def test_missing_file_and_hf_dataset_offline(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file"):
        calib.open_source("nope.jsonl", text_field=None, base_dir=tmp_path, seed=0)
    # no network (and here no `datasets` either): one line that points at the offline default
    with pytest.raises(UserError) as e:
        calib.open_source("cnn_dailymail", text_field=None, base_dir=tmp_path, seed=0)
    assert "dataset: embedded" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "local_ds").mkdir()  # a local dataset directory also goes through `datasets`
    with pytest.raises(UserError, match="dataset: embedded"):
        calib.open_source("local_ds", text_field=None, base_dir=tmp_path, seed=0)


def test_embedded_corpus_is_real_offline_text() -> None:
    names = [n for n, _ in calib.embedded_texts()]
    assert any(n.startswith("pydoc_data.topics:") for n in names) and "shakespeare.txt.gz" in names
    src = calib.open_source("embedded", text_field=None, base_dir=Path("."), seed=0)
    text = "\n".join(src.records)
    assert len(text) > 900_000
    assert "To be, or not to be" in text and "assert" in text
    shipped = resources.files("pipeline.quantize.calib").joinpath("data")
    assert sum(f.stat().st_size for f in Path(str(shipped)).iterdir() if f.is_file()) < 2_000_000


def test_prepare_is_deterministic_and_split_is_disjoint(smollm2_tokenizer) -> None:
    a = calib.prepare(_spec(), smollm2_tokenizer, Path("."))
    b = calib.prepare(_spec(), smollm2_tokenizer, Path("."))
    assert [s.text for s in a.calib] == [s.text for s in b.calib] and [s.text for s in a.eval] == [s.text for s in b.eval]
    assert len(a.calib) == 8 and len(a.eval) == 4
    ranges = [s.records for s in a.calib + a.eval]
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert len(covered) == len(set(covered)), "a record is in two samples"
    assert not {s.text for s in a.calib} & {s.text for s in a.eval}
    c = calib.prepare(_spec(seed=7), smollm2_tokenizer, Path("."))
    assert [s.text for s in c.calib] != [s.text for s in a.calib]
    # the held-out set does not depend on how many calibration samples are asked for
    d = calib.prepare(_spec(size=20), smollm2_tokenizer, Path("."))
    assert [s.text for s in d.eval] == [s.text for s in a.eval] and len(d.calib) == 20
    assert a.summary()["samples_hash"] == b.summary()["samples_hash"] != c.summary()["samples_hash"]


def test_batches_shapes_and_attention_mask(smollm2_tokenizer, tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("\n\n".join(PARAS))
    data = calib.prepare(_spec(dataset="c.txt", size=50, eval_samples=1, max_seq_length=16), smollm2_tokenizer, tmp_path)
    batches = data.calib_batches(smollm2_tokenizer)
    assert sum(b["input_ids"].shape[0] for b in batches) == len(data.calib)
    assert all(b["input_ids"].shape[0] <= 3 and b["input_ids"].shape[1] <= 16 for b in batches)
    for b in batches:
        assert b["attention_mask"].shape == b["input_ids"].shape
        assert (b["input_ids"][b["attention_mask"] == 0] == smollm2_tokenizer.pad_token_id).all()
    # a short sample is right-padded with pad = eos = 2, and the mask says so
    short = next(calib.batches(smollm2_tokenizer, ["Hi.", PARAS[0]], 16, 2))
    assert short["attention_mask"][0].tolist()[:2] == [1, 1] and short["attention_mask"][0, -1] == 0
    assert short["input_ids"][0, -1] == 2


def test_pack_truncates_long_records_and_limits_streams(smollm2_tokenizer) -> None:
    long = " ".join(PARAS)  # ~500 tokens in one record
    samples = calib.pack(iter([long, long, long]), smollm2_tokenizer, 32, limit=2)
    assert len(samples) == 2 and samples[0].records == (0, 1)
    enc = next(calib.batches(smollm2_tokenizer, [samples[0].text], 32, 1))
    assert enc["input_ids"].shape == (1, 32)


def test_too_little_text_is_a_user_error(smollm2_tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text(PARAS[0])
    with pytest.raises(UserError, match="only 0 samples of 64 tokens"):
        calib.prepare(_spec(dataset="tiny.txt"), smollm2_tokenizer, tmp_path)
