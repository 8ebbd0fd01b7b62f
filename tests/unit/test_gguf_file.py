"""The project's GGUF reader (common/model/gguf_file.py) against the `gguf` package's GGUFReader on
the embedded SmolLM2 file: every metadata field the same value, every tensor the same name,
type, shape, dtype and bytes; in a fraction of the time; and a damaged file is a ValueError."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGUFReader

from pdserve.common.model.config import resolve_model
from pdserve.common.model.gguf_file import GgufFile


@pytest.fixture(scope="module")
def path():
    return resolve_model(None).path


@pytest.fixture(scope="module")
def gguf_reader(path) -> tuple[GGUFReader, float]:
    """gguf's reader of the file, and the seconds it took (~2.4 s of CPU: parsed once)."""
    start = time.perf_counter()
    ref = GGUFReader(str(path))
    return ref, time.perf_counter() - start


def test_every_field_and_tensor_equals_gguf_readers(path, gguf_reader):
    start = time.perf_counter()
    ours = GgufFile(path)
    ours_s = time.perf_counter() - start
    ref, ref_s = gguf_reader
    theirs = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # its header
    assert ours.fields.keys() == theirs.keys()
    for key, field in theirs.items():
        assert ours.fields[key] == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.tensor_type == int(theirs.tensor_type)
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data.view(np.uint8), theirs.data.view(np.uint8))
    # the point of it (measured 0.15 s against 3.7 s on an AMD EPYC Zen 5): a wide margin
    assert ours_s < ref_s / 4, (ours_s, ref_s)


@pytest.mark.parametrize("cut", [3, 20, 5000, -100])
def test_a_damaged_file_is_a_value_error(path, tmp_path, cut):
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:cut])  # the header, a field, a tensor cut short
    with pytest.raises(ValueError):
        GgufFile(bad)
    bad.write_bytes(b"GGUF\x09\x00\x00\x00" + data[8:64])  # a version it does not read
    with pytest.raises(ValueError, match="version"):
        GgufFile(bad)


def test_string_arrays_are_decoded_only_when_read(path, gguf_reader, monkeypatch):
    """A node's model config needs none of the vocabulary's ~100k strings (its tokenizer is
    cached): they stay undecoded (~0.25 s of every engine's start), and a read gives what
    the eager parse gave."""
    from pdserve.common.model import config, gguf_file

    decoded: list[int] = []
    eager = gguf_file._Strings.decode
    monkeypatch.setattr(gguf_file._Strings, "decode", lambda s: decoded.append(s.count) or eager(s))
    config.open_gguf.cache_clear()  # this process's reader, parsed again under the counter
    try:
        cfg = config.load_model_config(config.resolve_model(None))
        assert decoded == [] and cfg.vocab_size == 49152
        reader = config.open_gguf(path)
        tokens = reader.fields["tokenizer.ggml.tokens"]
        assert decoded == [49152] and reader.fields["tokenizer.ggml.tokens"] is tokens  # kept
        assert tokens == gguf_reader[0].fields["tokenizer.ggml.tokens"].contents()
    finally:
        config.open_gguf.cache_clear()


def _tiny(tmp_path, name: str = "blk.0.attn_q.weight", **arrays) -> bytes:
    import gguf

    out = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_tokenizer_model("gpt2")  # a tokenizer the loader reads, up to the bad bytes
    writer.add_token_list(["a", "b", "zzzz"])
    for key, value in arrays.items():
        writer.add_array(key, value)
    writer.add_tensor(name, np.ones((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out.read_bytes()


def test_hostile_fields_are_clear_errors_not_crashes_or_a_long_read(tmp_path):
    """Each was a raw exception past the loader's error handling, or (a dimension count of
    2^32 - 1) a read of the whole rest of the file 8 bytes at a time into a tuple first."""
    from pdserve.common.errors import ModelLoadError
    from pdserve.common.model.config import gguf_field, open_gguf
    from pdserve.common.model.tokenizer import Tokenizer

    good = _tiny(tmp_path)
    bad = tmp_path / "bad.gguf"
    at = good.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight")
    assert good[at : at + 4] == (2).to_bytes(4, "little")  # the tensor's dimension count
    for count in (0xFFFFFFFF, 0, 5):
        bad.write_bytes(good[:at] + count.to_bytes(4, "little") + good[at + 4 :] + bytes(1 << 20))
        with pytest.raises(ValueError, match="dimensions"):
            GgufFile(bad)
    cases = {
        "alignment": _tiny(tmp_path, **{"general.alignment": [32]}),
        "utf8": good.replace(b"zzzz", b"z\xffzz"),
    }
    for case, data in cases.items():
        path = tmp_path / f"{case}.gguf"
        path.write_bytes(data)
        with pytest.raises(ModelLoadError):
            gguf_field(open_gguf(path), "tokenizer.ggml.tokens")
        if case == "utf8":
            with pytest.raises(ModelLoadError):
                Tokenizer.load(str(path))


def test_a_layer_tensor_named_out_of_pattern_is_a_model_load_error(tmp_path):
    from pdserve.common.engine.loader import _iter_gguf
    from pdserve.common.errors import ModelLoadError

    path = tmp_path / "named.gguf"
    path.write_bytes(_tiny(tmp_path, name="blk.0.attn_q"))
    with pytest.raises(ModelLoadError, match=r"blk\.N\.KIND\.SUFFIX"):
        next(_iter_gguf(path, None, None))  # type: ignore[arg-type]
