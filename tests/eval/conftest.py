"""The offline task data, the GPT-NeoX tokenizer and a small random model saved in the Hub layout
(the offline Hugging Face settings are in tests/conftest.py)."""
import shutil
from pathlib import Path

import pytest

from quamba.models import MambaConfig, MambaLMHeadModel, randomize_, save_model
from quamba.models.loading import load_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
TASK_DATA = SHARED_DATA / "eval"
TOKENIZER_FILE = SHARED_DATA / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(None, TOKENIZER_FILE)


@pytest.fixture(scope="session")
def model():
    """A 2-layer random model over the GPT-NeoX vocabulary (fp32, cpu)."""
    config = MambaConfig(d_model=32, n_layer=2, vocab_size=50277)
    return randomize_(MambaLMHeadModel(config), seed=0).eval()


@pytest.fixture(scope="session")
def model_dir(model, tmp_path_factory):
    return save_model(model, tmp_path_factory.mktemp("models") / "tiny-random")


@pytest.fixture(scope="session")
def small_task_data(tmp_path_factory):
    """A task-data directory with piqa and only the first wikitext-2 test document."""
    data_dir = tmp_path_factory.mktemp("task-data")
    shutil.copy(TASK_DATA / "piqa_validation.jsonl", data_dir)
    first_document = (TASK_DATA / "wikitext2_test_docs.jsonl").read_text().splitlines()[0]
    (data_dir / "wikitext2_test_docs.jsonl").write_text(first_document + "\n")
    return data_dir
