"""NVIDIA's Megatron-LM layout of pure Mamba2 models (nvidia/mamba2-8b-3t-4k): a checkpoint written
as Megatron-LM writes it (its args, RNG states and enums beside the state dict) loads with logits
equal to transformers' Mamba2 model of the same weights; nothing the pickle names runs; what
quamba cannot read is refused in one line."""
import argparse
import enum
import io
import json
import random
import re

import numpy as np
import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM

import quamba
from quamba.errors import CheckpointError
from tests.models.hybrid_checks import random_model, rel

# 4 heads of 16 in 2 groups, d_state 8, conv width 4, 2 layers, an untied head; 37 tokens: a
# partial chunk of Megatron's 128
HF_CONFIG = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                 num_heads=4, head_dim=16, n_groups=2, chunk_size=128, tie_word_embeddings=False)


class AttnMaskType(enum.Enum):  # as Megatron's enums: a class the loader must not need
    causal = 2


class RunsOnLoad:
    """An object whose unpickling would create ``path`` (as a hostile checkpoint's could)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture(scope="module")
def reference() -> Mamba2ForCausalLM:
    return random_model(Mamba2ForCausalLM, Mamba2Config(**HF_CONFIG), seed=0)


def megatron_names(reference, fused_norm: bool = False) -> dict:
    """The reference's tensors under Megatron-LM's names, with TransformerEngine's extra states."""
    out = {}
    for name, tensor in reference.state_dict().items():
        if name == "backbone.embeddings.weight":
            out["embedding.word_embeddings.weight"] = tensor
        elif name == "backbone.norm_f.weight":
            out["decoder.final_norm.weight"] = tensor
        elif name == "lm_head.weight":
            out["output_layer.weight"] = tensor
        else:
            layer, part = name.removeprefix("backbone.layers.").split(".", 1)
            if part == "norm.weight" and fused_norm:
                part = "mixer.in_proj.layer_norm_weight"
            out[f"decoder.layers.{layer}.{part}"] = tensor
            if part == "mixer.out_proj.weight":
                out[f"decoder.layers.{layer}.mixer.out_proj._extra_state"] = io.BytesIO(b"te")
    return out


def write_megatron(directory, state: dict, iteration: str = "release", ranks: int = 1,
                   **extra) -> None:
    args = argparse.Namespace(num_layers=2, hidden_size=32, mamba_state_dim=8, mamba_num_groups=2,
                              norm_epsilon=1e-5, params_dtype=torch.bfloat16,
                              attn_mask_type=AttnMaskType.causal)
    checkpoint = {"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": state,
                  "rng_state": [{"random_rng_state": random.getstate(),
                                 "np_rng_state": np.random.get_state(),
                                 "torch_rng_state": torch.get_rng_state()}], **extra}
    (directory / "latest_checkpointed_iteration.txt").parent.mkdir(parents=True, exist_ok=True)
    (directory / "latest_checkpointed_iteration.txt").write_text(iteration)
    folder = "release" if iteration == "release" else f"iter_{int(iteration):07d}"
    for rank in range(ranks):
        (directory / folder / f"mp_rank_{rank:02d}").mkdir(parents=True)
        torch.save(checkpoint, directory / folder / f"mp_rank_{rank:02d}" / "model_optim_rng.pt")


def ids(length: int = 37) -> torch.Tensor:
    return torch.randint(0, HF_CONFIG["vocab_size"], (2, length),
                         generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fused_norm", [False, True], ids=["norm", "norm-fused-in-in_proj"])
def test_logits_equal_transformers_mamba2(reference, tmp_path, fused_norm):
    write_megatron(tmp_path, megatron_names(reference, fused_norm))
    model, tokenizer = quamba.load_model(tmp_path, tokenizer=False)
    assert tokenizer is None and model.source["layout"] == "megatron"
    c = model.config
    assert (c.layer, c.d_model, c.n_layer, c.nheads, c.headdim, c.ngroups, c.d_state) == (
        "Mamba2", 32, 2, 4, 16, 2, 8)
    assert (c.chunk_size, c.padded_vocab_size, c.tie_embeddings) == (128, 96, False)
    with torch.no_grad():
        assert rel(model(ids()), reference(ids()).logits) < 1e-4


def test_an_iteration_checkpoint_loads(reference, tmp_path):
    write_megatron(tmp_path, megatron_names(reference), iteration="1000")
    assert (tmp_path / "iter_0001000" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    model, _ = quamba.load_model(tmp_path, tokenizer=False)
    assert model.config.n_layer == 2


def test_nothing_the_pickle_names_runs(reference, tmp_path):
    """A checkpoint whose pickle would open (create) a file when unpickled: the loader builds only
    tensors and plain containers, so the file never appears and the model still loads."""
    target = tmp_path / "created_by_the_checkpoint"
    write_megatron(tmp_path / "model", megatron_names(reference), payload=RunsOnLoad(target))
    quamba.load_model(tmp_path / "model", tokenizer=False)
    assert not target.exists()


def load_error(path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as caught:
        quamba.load_model(path, **{"tokenizer": False, **kwargs})
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_what_quamba_cannot_read_is_refused_in_one_line(reference, tmp_path):
    state = megatron_names(reference)
    write_megatron(tmp_path / "tp2", state, ranks=2)
    assert "split over 2 model-parallel ranks" in load_error(tmp_path / "tp2")
    write_megatron(tmp_path / "hybrid",
                   {**state, "decoder.layers.1.self_attention.linear_qkv.weight": torch.zeros(3)})
    assert "'decoder.layers.1.self_attention.linear_qkv.weight' is not one of a pure Mamba2" in \
        load_error(tmp_path / "hybrid")
    write_megatron(tmp_path / "groups", state)
    checkpoint = tmp_path / "groups" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(checkpoint, weights_only=False)
    saved["args"].mamba_num_groups = 4
    torch.save(saved, checkpoint)
    assert "conv1d's 96 channels are not d_inner 64 + 2 · 4 groups · d_state 8" in \
        load_error(tmp_path / "groups")
    write_megatron(tmp_path / "corrupt", state)
    corrupt = tmp_path / "corrupt" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    corrupt.write_bytes(b"not a pickle")
    assert "cannot read" in load_error(tmp_path / "corrupt")
    (tmp_path / "dist" / "iter_0000005").mkdir(parents=True)
    (tmp_path / "dist" / "latest_checkpointed_iteration.txt").write_text("5")
    (tmp_path / "dist" / "iter_0000005" / "__0_0.distcp").write_bytes(b"")
    assert "distributed format (torch_dist)" in load_error(tmp_path / "dist")
    (tmp_path / "bad-iteration").mkdir()
    (tmp_path / "bad-iteration" / "latest_checkpointed_iteration.txt").write_text("latest\n")
    assert "names neither 'release' nor an iteration" in load_error(tmp_path / "bad-iteration")


def test_megatron_layout_needs_a_tokenizer(reference, tmp_path):
    write_megatron(tmp_path, megatron_names(reference))
    assert "holds no tokenizer" in load_error(tmp_path, tokenizer=None)


@pytest.fixture(scope="module")
def sentencepiece_model(shared_data_dir, tmp_path_factory):
    """A SentencePiece model of 64 pieces trained on the shared text (lowercase letters and
    spaces: few enough characters for so small a vocabulary), as NVIDIA ships Mamba2-8B's."""
    spm = pytest.importorskip("sentencepiece")
    lines = (json.loads(line)["text"] for line in
             (shared_data_dir / "text" / "c4_sample.jsonl").read_text().splitlines()[:200])
    texts = [re.sub(r"[^a-z ]+", " ", text.lower()) for text in lines]
    path = tmp_path_factory.mktemp("spm") / "mt_nlg_test_64.model"
    with open(path, "wb") as out:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=out,
                                       vocab_size=64, model_type="bpe", minloglevel=2)
    return path


def test_the_shipped_sentencepiece_model_is_the_tokenizer(reference, sentencepiece_model,
                                                           tmp_path):
    """The .model file beside the checkpoint tokenizes as Megatron-LM's GPTSentencePieceTokenizer
    does (encode_as_ids, nothing added; eos its eos_id), and travels with a quantized save."""
    import shutil
    from sentencepiece import SentencePieceProcessor
    from quamba.eval.perplexity import perplexity
    shutil.copy(sentencepiece_model, tmp_path / sentencepiece_model.name)
    write_megatron(tmp_path, megatron_names(reference))
    model, tokenizer = quamba.load_model(tmp_path)
    processor = SentencePieceProcessor(model_file=str(sentencepiece_model))
    text = "the quick brown fox jumps over the lazy dog"
    assert tokenizer.encode(text) == tokenizer(text)["input_ids"] == processor.encode_as_ids(text)
    assert tokenizer([text, "dog"])["input_ids"] == processor.encode_as_ids([text, "dog"])
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_id == processor.eos_id() and len(tokenizer) == 64
    assert perplexity(model, tokenizer, text * 3, window=16, progress=False)["perplexity"] > 1
    qmodel = quamba.quantize(model, tokenizer, config=quamba.QuantConfig(),
                             calib_data=ids(64)[:, :48], progress=False)
    qmodel.save_pretrained(tmp_path / "w8a8")
    _, reloaded = quamba.load_model(tmp_path / "w8a8")
    assert reloaded.encode(text) == processor.encode_as_ids(text)


def test_a_sentencepiece_tokenizer_without_its_package_is_one_line(sentencepiece_model,
                                                                  monkeypatch):
    from quamba.errors import ModelNotFoundError
    from quamba.models.hub import load_tokenizer
    monkeypatch.setitem(__import__("sys").modules, "sentencepiece", None)
    with pytest.raises(ModelNotFoundError, match="needs the sentencepiece package"):
        load_tokenizer(None, sentencepiece_model)


def test_quantized_from_megatron_saves_and_reloads_bit_identically(reference, tmp_path):
    write_megatron(tmp_path / "fp", megatron_names(reference))
    model, _ = quamba.load_model(tmp_path / "fp", tokenizer=False)
    qmodel = quamba.quantize(model, config=quamba.QuantConfig(), calib_data=ids(64)[:, :48],
                             progress=False)
    assert qmodel.base_model == str((tmp_path / "fp").resolve())
    qmodel.save_pretrained(tmp_path / "w8a8")
    reloaded, _ = quamba.load_model(tmp_path / "w8a8", tokenizer=False)
    with torch.no_grad():
        assert torch.equal(reloaded(ids()), qmodel(ids()))


def test_saved_in_the_transformers_layout_loads_in_transformers(reference, tmp_path):
    """The conversion a user runs once: Megatron-LM's checkpoint to a Mamba2ForCausalLM
    directory (safetensors), which transformers loads with the same logits."""
    from transformers import AutoModelForCausalLM
    write_megatron(tmp_path / "megatron", megatron_names(reference))
    model, _ = quamba.load_model(tmp_path / "megatron", tokenizer=False)
    quamba.save_model(model, tmp_path / "hf")
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(converted(ids()).logits, reference(ids()).logits)
