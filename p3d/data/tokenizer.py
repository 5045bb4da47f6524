"""Tokenizers: byte-level (no files, 256 byte ids + end-of-document), or a HF ``tokenizer.json``.

``data.tokenizer=auto`` (the default) is resolved by the launcher before anything reads it: the
``tokenizer.json`` of ``model.init_from`` when that directory has one, else ``byte``."""

from __future__ import annotations

import functools
import json
from pathlib import Path

AUTO = "auto"
HF_CONFIG = "tokenizer_config.json"  # beside a tokenizer.json in a HF directory: the special tokens' roles


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 256 ends a document."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Any HF ``tokenizers`` tokenizer.json. The end-of-document token is the ``eos_token`` of a
    ``tokenizer_config.json`` beside a ``tokenizer.json``, else the first of the usual names; begin and
    padding tokens, which p3d does not use, are found the same way so that an export names them."""

    _NAMES = {
        "eos": ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"),
        "bos": ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>"),
        "pad": ("<|pad|>", "<pad>", "[PAD]"),
    }

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        declared = _declared_roles(Path(path))
        self.special: dict[str, str] = {}  # role (eos, bos, pad) -> token
        for role, names in self._NAMES.items():
            name = declared.get(role) or next((n for n in names if self._tok.token_to_id(n) is not None), None)
            if name is not None and self._tok.token_to_id(name) is not None:
                self.special[role] = name
        if "eos" not in self.special:
            raise ValueError(f"tokenizer {path} has no end-of-text token (one of {self._NAMES['eos']})")
        self.eos_id = self.token_id("eos")

    def token_id(self, role: str) -> int | None:
        return self._tok.token_to_id(self.special[role]) if role in self.special else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


def _declared_roles(path: Path) -> dict[str, str]:
    """eos/bos/pad token names of the tokenizer_config.json beside a HF directory's tokenizer.json."""
    config = path.with_name(HF_CONFIG)
    if path.name != "tokenizer.json" or not config.is_file():
        return {}
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for role in ("eos", "bos", "pad"):
        token = raw.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token:
            out[role] = token
    return out


def tokenizer_files(spec: str) -> list[Path]:
    """The files that define tokenizer ``spec``: its tokenizer.json and, in a HF directory, the
    tokenizer_config.json beside it (none for the byte tokenizer)."""
    if spec == "byte":
        return []
    path = Path(spec).expanduser()
    files = [path]
    if path.name == "tokenizer.json" and path.with_name(HF_CONFIG).is_file():
        files.append(path.with_name(HF_CONFIG))
    return files


def load_tokenizer(spec: str):
    """The tokenizer ``data.tokenizer`` names, loaded once per process and file: the launcher's checks (the vocab
    of the run plan, the data check, the HF import's) and a worker's readers all get the same object. A file
    changed on disk since (its size or mtime) is loaded again."""
    if spec in ("byte", AUTO):  # auto without model.init_from is byte (the launcher resolves it with one)
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer={spec}: no such tokenizer.json; try data.tokenizer=byte")
    st = path.stat()
    return _load_file(str(path.absolute()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load_file(path: str, size: int, mtime_ns: int) -> HFTokenizer:
    return HFTokenizer(path)
