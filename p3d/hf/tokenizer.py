"""Tokenizers across the Hugging Face boundary.

Export: ``tokenizer_config.json`` and ``special_tokens_map.json`` name the end-of-text token (and the
begin and padding tokens where the tokenizer has them), and ``config.json`` / ``generation_config.json``
carry their ids, so ``AutoTokenizer`` and ``generate()`` agree on where a text ends.

The byte tokenizer is exported as its HF equivalent (:func:`byte_tokenizer_json`): the same id for every
byte, its end-of-document id the special token ``<|endoftext|>``.

Import: ``model.init_from=<dir>`` whose directory has a ``tokenizer.json`` trains with that tokenizer
when ``data.tokenizer`` is left at ``auto`` (``byte`` when it is the byte tokenizer's export), and refuses
another one: the imported embeddings mean that tokenizer's ids. Either way the model's vocabulary must
hold every token of the tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from p3d.data.tokenizer import AUTO, HF_CONFIG, ByteTokenizer, HFTokenizer, load_tokenizer
from p3d.hf.names import HFImportError

ROLES = ("eos", "bos", "pad")
UNREADABLE = ("tokenizer.model", "vocab.json")  # tokenizers p3d cannot load (sentencepiece, slow BPE)
BYTE_EOS = "<|endoftext|>"  # the byte tokenizer's end-of-document id once exported (GPT-2's name for it)
# the parts of a tokenizer.json that decide its ids and its decoding (not its version or padding)
_ID_PARTS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder")


def _byte_chars() -> list[str]:
    """The character that stands for each byte in a byte-level BPE vocabulary (GPT-2's table, which the
    ByteLevel pre-tokenizer and decoder use): a byte that prints keeps its own character, the others
    (controls, space, ...) take 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    moved = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(moved)) for b in range(256)]


def byte_tokenizer_json() -> str:
    """tokenizer.json of the HF tokenizer equal to p3d's byte tokenizer: byte b is id b, and its
    end-of-document id (256) is the special token ``BYTE_EOS``. A byte-level BPE without merges: the
    ByteLevel pre-tokenizer turns each UTF-8 byte into its character (no prefix space, no split), the
    vocabulary gives that character its byte's id, the ByteLevel decoder turns ids back into bytes, so
    any text round-trips exactly. No BOS is added: p3d adds none."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS, special=True)])
    if tok.token_to_id(BYTE_EOS) != ByteTokenizer.eos_id:
        raise RuntimeError(
            f"the exported byte tokenizer gives {BYTE_EOS} id {tok.token_to_id(BYTE_EOS)}, "
            f"not p3d's end-of-document id {ByteTokenizer.eos_id}"
        )
    return tok.to_str(pretty=True)


def is_byte_tokenizer(path: Path) -> bool:
    """Whether ``path`` is the byte tokenizer as p3d-export writes it (the same ids and decoding; one
    written by another version of ``tokenizers`` may differ, and then counts as any other tokenizer)."""
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    ours = json.loads(byte_tokenizer_json())
    return isinstance(theirs, dict) and all(theirs.get(k) == ours.get(k) for k in _ID_PARTS)


def special_ids(tok) -> dict[str, int]:
    """``eos_token_id`` (and ``bos_token_id`` / ``pad_token_id`` where defined) for config.json."""
    if isinstance(tok, ByteTokenizer):
        return {"eos_token_id": tok.eos_id}
    return {f"{role}_token_id": tok.token_id(role) for role in ROLES if role in tok.special}


def tokenizer_configs(tok: HFTokenizer, source_config: Path | None, max_length: int) -> dict[str, dict]:
    """tokenizer_config.json (the source directory's, when it had one, with the roles set) and
    special_tokens_map.json for an exported tokenizer.json."""
    base = json.loads(source_config.read_text()) if source_config else {}
    names = {f"{role}_token": tok.special[role] for role in ROLES if role in tok.special}
    base.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    base.setdefault("model_max_length", max_length)
    base.setdefault("clean_up_tokenization_spaces", False)
    return {HF_CONFIG: {**base, **names}, "special_tokens_map.json": names}


def byte_tokenizer_configs(tokenizer_json: Path, max_length: int) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json beside the byte tokenizer's tokenizer.json."""
    configs = tokenizer_configs(HFTokenizer(str(tokenizer_json)), None, max_length)
    # p3d's byte tokenizer reads the text "<|endoftext|>" as its 13 bytes (id 256 only ends a document):
    # AutoTokenizer then does the same instead of matching the special token in the text
    configs[HF_CONFIG]["split_special_tokens"] = True
    return configs


def _same_tokenizer(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return json.loads(a.read_text()) == json.loads(b.read_text())
    except (OSError, ValueError):
        return False


def import_tokenizer(spec: str, hf_dir: str | None, vocab_size: int) -> str:
    """The ``data.tokenizer`` to train with: ``auto`` resolved (the tokenizer.json of ``hf_dir`` if it
    has one, else ``byte``); with ``hf_dir``, a different tokenizer is refused and the vocabulary of
    ``config.json`` (``vocab_size``) must hold the tokenizer's. Raises HFImportError."""
    if not hf_dir:
        return "byte" if spec == AUTO else spec
    root = Path(hf_dir).expanduser()
    theirs = root / "tokenizer.json"
    if not theirs.is_file():
        other = next((n for n in UNREADABLE if (root / n).is_file()), None)
        if spec == AUTO and other:
            raise HFImportError(
                f"model.init_from={hf_dir} has a tokenizer p3d cannot read ({other}, no "
                "tokenizer.json); "
                "save it as tokenizer.json (AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) "
                "or name one with data.tokenizer=<tokenizer.json>"
            )
        chosen = "byte" if spec == AUTO else spec
    elif spec in (AUTO, "byte") and is_byte_tokenizer(theirs):
        chosen = "byte"  # an export of a byte run: train on with the byte tokenizer itself, as that run did
    elif spec == AUTO:
        chosen = str(theirs.absolute())
    elif spec != "byte" and (not Path(spec).expanduser().is_file() or _same_tokenizer(Path(spec).expanduser(), theirs)):
        chosen = spec  # the same tokenizer elsewhere (or a missing file, which the launcher reports)
    else:
        raise HFImportError(
            f"data.tokenizer={spec} is not the tokenizer of model.init_from={hf_dir}, whose embeddings "
            f"mean the ids of {theirs}; drop data.tokenizer (auto uses that one) or set "
            f"data.tokenizer={theirs}"
        )
    if chosen == "byte" or Path(chosen).expanduser().is_file():
        try:
            n = load_tokenizer(chosen).vocab_size
        except ValueError as exc:
            raise HFImportError(str(exc)) from None
        if n > vocab_size:
            raise HFImportError(
                f"data.tokenizer={chosen} has {n} tokens, more than the vocab_size={vocab_size} of "
                f"model.init_from={hf_dir}/config.json; use the checkpoint's own tokenizer"
            )
    return chosen
