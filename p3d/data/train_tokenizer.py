"""``p3d-tokenizer``: train a byte-level BPE with HF ``tokenizers`` on the train split of a data
config and write ``tokenizer.json``, for ``data.tokenizer=<that file>``.

    p3d-tokenizer data=files data.path='corpus/*.jsonl' tokenizer.vocab_size=8192 tokenizer.out=tok.json
    p3d-train data=files data.path='corpus/*.jsonl' data.tokenizer=tok.json model.vocab_size=8192
"""

from __future__ import annotations

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
