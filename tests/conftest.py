"""Settings and paths shared by every quamba test.

Tests never reach the Hugging Face Hub. The offline switches are set when this file is imported,
before any test module imports huggingface_hub, transformers or datasets (they read them at
import time), and the datasets cache goes to a temporary directory removed at the end.
Without a CUDA device, Triton kernels run under Triton's interpreter on CPU tensors
(TRITON_INTERPRET, read when a kernel is defined), so their small-shape tests run here too.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA_DIR = REPO_ROOT.parent / "shared" / "data"  # the repo is cloned next to shared/
TINY_MODEL_DIR = REPO_ROOT / "tests" / "fixtures" / "tiny-mamba"
TINY_MAMBA2_DIR = REPO_ROOT / "tests" / "fixtures" / "tiny-mamba2"
TINY_VIM_DIR = REPO_ROOT / "tests" / "fixtures" / "tiny-vim"

_DATASETS_CACHE = tempfile.mkdtemp(prefix="quamba-tests-datasets-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_unconfigure(config):
    shutil.rmtree(_DATASETS_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    if not SHARED_DATA_DIR.is_dir():
        pytest.fail(f"offline data not found at {SHARED_DATA_DIR}: clone shared/ next to the repository")
    return SHARED_DATA_DIR


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The trained test model (scripts/train_tiny_mamba.py writes it)."""
    return TINY_MODEL_DIR


@pytest.fixture(scope="session")
def tiny_mamba2_dir() -> Path:
    """The trained Mamba2 test model (scripts/train_tiny_mamba2.py writes it)."""
    return TINY_MAMBA2_DIR


@pytest.fixture(scope="session")
def tiny_vim_dir() -> Path:
    """The trained test classifier (scripts/train_tiny_vim.py writes it)."""
    return TINY_VIM_DIR


EVAL_WINDOW = 1024  # as in the training reports


@pytest.fixture(scope="session")
def heldout_windows(shared_data_dir):
    """``heldout_windows(tokenizer, count)``: the first ``count`` 1024-token windows of wikitext-2
    test, tokenized as scripts/train_tiny_mamba.py does (every document preceded by
    <|endoftext|>)."""
    wikitext_path = shared_data_dir / "eval" / "wikitext2_test_docs.jsonl"

    def first_windows(tokenizer, count: int) -> torch.Tensor:
        ids = []
        with open(wikitext_path, encoding="utf-8") as f:
            for line in f:
                ids += [tokenizer.eos_token_id] + tokenizer(json.loads(line)["page"])["input_ids"]
                if len(ids) >= count * EVAL_WINDOW:
                    break
        return torch.tensor(ids[:count * EVAL_WINDOW]).view(count, EVAL_WINDOW)

    return first_windows
