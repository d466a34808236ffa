"""A SentencePiece model as Megatron-LM's GPTSentencePieceTokenizer uses it: the tokenizer of
NVIDIA's Mamba2-8B (nvidia/mamba2-8b-3t-4k ships it as a ``.model`` file beside the checkpoint,
no transformers tokenizer). Text is the model's ``encode_as_ids`` (no BOS or EOS added, as
Megatron-LM trained it), ids are decoded by ``decode_ids``, the end of a document is its
``eos_id``. The class offers the calls quamba makes of a transformers tokenizer (calls on a text
or a list of texts, encode, decode, eos_token_id, save_pretrained). Needs the ``sentencepiece``
package."""
from __future__ import annotations

import shutil
from pathlib import Path

from quamba.errors import ModelNotFoundError

SAVED_NAME = "sentencepiece.model"  # what save_pretrained writes, and load_tokenizer looks for


class SentencePieceTokenizer:
    def __init__(self, model_file):
        try:
            from sentencepiece import SentencePieceProcessor
        except ImportError:
            raise ModelNotFoundError(f"the tokenizer {str(model_file)!r} is a SentencePiece model, "
                                     "which needs the sentencepiece package "
                                     "(pip install sentencepiece)") from None
        self.model_file = Path(model_file)
        self.name_or_path = str(model_file)
        try:
            self.processor = SentencePieceProcessor(model_file=str(model_file))
        except (OSError, RuntimeError) as exc:
            raise ModelNotFoundError(f"cannot load the SentencePiece model {str(model_file)!r}: "
                                     f"{str(exc).splitlines()[0]}") from None
        self.eos_token_id, self.bos_token_id, self.pad_token_id = (
            _id_or_none(self.processor.eos_id()), _id_or_none(self.processor.bos_id()),
            _id_or_none(self.processor.pad_id()))

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False, **kwargs) -> list[int]:
        """The model's ids of ``text``; Megatron-LM adds no special tokens, so neither does this."""
        return self.processor.encode_as_ids(text)

    def __call__(self, text, add_special_tokens: bool = False, **kwargs) -> dict:
        """``{"input_ids": ids}`` of a text, or a list of them for a list of texts."""
        return {"input_ids": self.processor.encode_as_ids(text)}

    def decode(self, ids, **kwargs) -> str:
        return self.processor.decode_ids([int(i) for i in ids])

    def save_pretrained(self, directory) -> None:
        shutil.copyfile(self.model_file, Path(directory) / SAVED_NAME)


def sentencepiece_file(model_dir: Path | None) -> Path | None:
    """The SentencePiece model a directory holds for its tokenizer: the one quamba saved, else its
    only ``*.model`` file (a Megatron-LM checkpoint's, such as NVIDIA's Mamba2-8B); None if none
    or several."""
    if model_dir is None or not model_dir.is_dir():
        return None
    if (model_dir / SAVED_NAME).is_file():
        return model_dir / SAVED_NAME
    candidates = sorted(p for p in model_dir.glob("*.model") if p.is_file())
    return candidates[0] if len(candidates) == 1 else None


def _id_or_none(token_id: int) -> int | None:
    return None if token_id < 0 else token_id
