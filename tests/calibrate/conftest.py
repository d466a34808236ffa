"""Offline Hugging Face settings (set before `datasets` is imported, which reads them once), the
shared tokenizer and a small random model."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
_DATASETS_CACHE = tempfile.mkdtemp(prefix="quamba-test-hf-datasets-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE

import torch  # noqa: E402

from quamba.models.config import MambaConfig  # noqa: E402
from quamba.models.loading import load_tokenizer  # noqa: E402
from quamba.models.mamba import MambaLMHeadModel, randomize_  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _remove_datasets_cache():
    yield
    shutil.rmtree(_DATASETS_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(None, SHARED_DATA / "tokenizers" / "gpt-neox-20b" / "tokenizer.json")


@pytest.fixture(scope="session")
def c4_sample() -> Path:
    return SHARED_DATA / "text" / "c4_sample.jsonl"


@pytest.fixture(scope="session")
def shakespeare() -> Path:
    return SHARED_DATA / "text" / "tinyshakespeare.txt"


@pytest.fixture
def model() -> MambaLMHeadModel:
    """A fresh 2-layer random model (tests may poison its weights)."""
    config = MambaConfig(d_model=64, n_layer=2, vocab_size=256)
    return randomize_(MambaLMHeadModel(config), seed=0).eval()


@pytest.fixture(scope="session")
def tokens():
    return torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(0))
