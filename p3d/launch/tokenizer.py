"""``p3d-tokenizer``'s task: check the data config, train a byte-level BPE on its train split
(p3d.data.train_tokenizer) and write ``tokenizer.json``."""

from __future__ import annotations

from itertools import islice
from pathlib import Path

from omegaconf import DictConfig

from p3d import exit_codes
from p3d.console import say
from p3d.data.train_tokenizer import EOS, train_bpe


def tokenizer_task(cfg_node: DictConfig) -> int:
    from p3d.data.check import check_data
    from p3d.data.corpus import DataStats, iter_texts
    from p3d.launch.check import typed_config
    from p3d.launch.compose import config_error
    from p3d.layout.run_plan import P3DConfigError

    try:
        cfg = typed_config(cfg_node, resolve_auto=False)
        t = cfg.tokenizer
        if t.vocab_size < 257:
            raise P3DConfigError(
                f"tokenizer.vocab_size={t.vocab_size} must be at least 257 (256 bytes + end of "
                "text); try tokenizer.vocab_size=8192"
            )
        check_data(cfg.data, seq_len=None)
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
