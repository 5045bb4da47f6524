"""``p3d-tokenizer``: train a byte-level BPE with HF ``tokenizers`` on the train split of a data
config and write ``tokenizer.json``, for ``data.tokenizer=<that file>``.

    p3d-tokenizer data=files data.path='corpus/*.jsonl' tokenizer.vocab_size=8192 tokenizer.out=tok.json
    p3d-train data=files data.path='corpus/*.jsonl' data.tokenizer=tok.json model.vocab_size=8192
"""

from __future__ import annotations

import sys
from itertools import islice
from pathlib import Path

from omegaconf import DictConfig

from p3d import exit_codes
from p3d.console import say

EOS = "<|endoftext|>"


def train_bpe(texts, vocab_size: int, min_frequency: int = 2):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_task(cfg_node: DictConfig) -> int:
    from p3d.config.validate import P3DConfigError
    from p3d.data.check import check_data
    from p3d.data.corpus import DataStats, iter_texts
    from p3d.launch.hydra_app import config_error
    from p3d.launch.prepare import typed_config

    try:
        cfg = typed_config(cfg_node, resolve_auto=False)
        t = cfg.tokenizer
        if t.vocab_size < 257:
            raise P3DConfigError(
                f"tokenizer.vocab_size={t.vocab_size} must be at least 257 (256 bytes + end of "
                "text); try tokenizer.vocab_size=8192"
            )
        check_data(cfg.data, seq_len=1)
    except (P3DConfigError, OSError, ValueError, KeyError) as exc:
        return config_error(str(exc).strip(chr(39)))
    stats = DataStats()
    texts = islice(iter_texts(cfg.data, "train", stats), t.max_documents)
    tok = train_bpe(texts, t.vocab_size, t.min_frequency)
    out = Path(t.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    size = tok.get_vocab_size(with_added_tokens=True)
    say(
        f"wrote {out} ({size} tokens, end of text {EOS}={tok.token_to_id(EOS)}); train with "
        f"data.tokenizer={out} model.vocab_size={size}",
        "p3d-tokenizer",
    )
    if stats.summary():
        say(stats.summary(), "p3d-tokenizer")
    return exit_codes.OK


def main() -> None:
    """Console script ``p3d-tokenizer``."""
    from p3d.launch.hydra_app import run_hydra

    sys.exit(run_hydra(tokenizer_task, writes_outputs=False))


if __name__ == "__main__":
    main()  # exits through sys.exit
