"""Shared fixtures."""

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted smollm2-135m registry model, pulled into the cache on first use (about 100 MB)."""
    from specdec_core.models.registry import pull

    return pull("smollm2-135m")


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    """A small prompts file in Spec-Bench's shape, so that commands under test need no checkout of shared/."""
    path = tmp_path_factory.mktemp("prompts") / "question.jsonl"
    questions = [("coding", "Write a Python function that reverses a string."), ("writing", "Describe a quiet morning.")]
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [q]}) + "\n"
                            for i, (c, q) in enumerate(questions)))
    return path


@pytest.fixture
def long_passes_dequantize(monkeypatch) -> None:
    """Long passes take the bf16 product, as on a CPU with AMX tiles, whatever this CPU is: for tests of that path
    (elsewhere every pass stays on the kernel: vnni.dequantizes_long_passes)."""
    from specdec_core.models import vnni

    monkeypatch.setattr(vnni, "dequantizes_long_passes", lambda: True)
