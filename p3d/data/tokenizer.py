"""Tokenizers: byte-level (no files, 256 byte ids + end-of-document), or a HF ``tokenizer.json``."""
from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 256 ends a document."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Any HF ``tokenizers`` tokenizer.json; the end-of-document token is its eos (or </s>, <|end_of_text|>)."""

    _EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = [self._tok.token_to_id(n) for n in self._EOS_NAMES]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"tokenizer {path} has no end-of-text token (one of {self._EOS_NAMES})")
        self.eos_id = found[0]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer={spec}: no such tokenizer.json; try data.tokenizer=byte")
    return HFTokenizer(str(path))
