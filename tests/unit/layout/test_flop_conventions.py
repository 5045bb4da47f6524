"""FLOP conventions (p3d.layout.geometry.flops_per_token): each one against the figure a source computes with it.

[DGXC]  NVIDIA DGX Cloud Benchmarking cards on NGC: "The model flops for NeMoTron4 340b for GBS=1 is 1.01e16"
        (Nemotron4 340B 24.11; its worked MFU: 32 x 1.01e16 / 4.77 s / 128 / 989e12 = 53.52 %) and "for
        NeMoTron4 15b for GBS=1 is 434.5e12" (Nemotron 15B 24.11.1: 256 x 434.5e12 / 2.86 s / 64 / 989e12 = 61 %).
[NEMO]  NeMo's ``nemotron`` FLOPs formula, per sequence: s L h^2 (12 + 12 g/a + 12 f/h + 12 s/h + 6 V/(L h)),
        which with g = a (query_groups left at the head count) is 75.54 s L h^2 for the 340B model.
[N21]   Narayanan et al. 2021, Eq. 3: 96 B s L h^2 (1 + s/6h + V/16Lh) per step, full recompute counted.
[MTNLG] Smith et al. 2022, Sec. 2: 126 TFLOP/s per GPU on 2240 A100 = Eq. 3 over a 60.1 s iteration of 1920 x 2048.
"""

from __future__ import annotations

import pytest

from p3d.config.schema import Arch, ModelConfig
from p3d.layout.geometry import (
    FLOP_CONVENTIONS,
    flops_per_token,
    head_dims,
    model_flops_per_token,
    recompute_flops_per_token,
)


def gpt(layers: int, hidden: int, heads: int, kv_heads: int | None = None, vocab: int = 51200, seq: int = 2048):
    return ModelConfig(
        name="gpt",
        arch=Arch.gpt,
        n_layers=layers,
        hidden_size=hidden,
        n_heads=heads,
        n_kv_heads=kv_heads or heads,
        ffn_hidden_size=4 * hidden,
        vocab_size=vocab,
        seq_len=seq,
    )


NEMOTRON4_340B = gpt(96, 18432, 96, kv_heads=8, vocab=256000, seq=4096)
NEMOTRON4_15B = gpt(32, 6144, 48, kv_heads=8, vocab=256000, seq=4096)


@pytest.mark.parametrize("model,card", [(NEMOTRON4_340B, 1.01e16), (NEMOTRON4_15B, 434.5e12)])
def test_nemo_mha_is_the_dgx_cloud_cards_count(model, card):
    """[DGXC] the FLOPs per 4096-token sequence each card states (to its printed digits)."""
    per_sequence = flops_per_token(model, "nemo_mha") * model.seq_len
    assert per_sequence == pytest.approx(card, rel=5e-3 if card == 1.01e16 else 5e-4)


def test_nemo_mha_is_nemos_formula_with_query_groups_equal_to_heads():
    """[NEMO] exactly, for the 340B model: 12 + 12 + 12 f/h + 12 s/h + 6 V/(L h) per s L h^2."""
    m = NEMOTRON4_340B
    h, s, L = m.hidden_size, m.seq_len, m.n_layers
    nemo = s * L * h * h * (12 + 12 + 12 * m.ffn_hidden_size / h + 12 * s / h + 6 * m.vocab_size / (L * h))
    assert flops_per_token(m, "nemo_mha") * s == pytest.approx(nemo, rel=1e-12)


def test_nemo_mha_counts_more_than_p3d_only_with_grouped_query_attention():
    """K and V at the query width: 12 L h (q - kv) more per token; nothing changes when kv = q (MHA). On the 340B
    model the cards' count is 1.17x p3d's (so the card's 53.5 % MFU is 45.7 % of p3d's model FLOPs)."""
    m = NEMOTRON4_340B
    q, kv = head_dims(m)
    extra = flops_per_token(m, "nemo_mha") - flops_per_token(m, "p3d")
    assert extra == pytest.approx(12 * m.n_layers * m.hidden_size * (q - kv), rel=1e-12)
    assert flops_per_token(m, "nemo_mha") / flops_per_token(m, "p3d") == pytest.approx(1.1705, abs=1e-3)
    mha = gpt(24, 2304, 24)
    assert flops_per_token(mha, "nemo_mha") == flops_per_token(mha, "p3d")


def test_p3d_is_model_flops_per_token():
    for m in (NEMOTRON4_340B, NEMOTRON4_15B, gpt(24, 2304, 24)):
        for recompute in ("none", "selective", "full"):
            assert flops_per_token(m, "p3d", recompute) == model_flops_per_token(m)


@pytest.mark.parametrize("shape", [(96, 12288, 96), (105, 20480, 128), (24, 2304, 24)])
def test_eq3_is_narayanans_equation_3_with_full_recompute(shape):
    """[N21] Eq. 3 per token for a GPT with f = 4h: 96 L h^2 (1 + s/6h + V/16Lh); p3d's count + the recompute."""
    m = gpt(*shape)
    L, h, s, V = m.n_layers, m.hidden_size, m.seq_len, m.vocab_size
    eq3 = 96 * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert flops_per_token(m, "eq3", "full") == pytest.approx(eq3, rel=1e-12)
    for recompute in ("none", "selective", "full"):
        assert flops_per_token(m, "eq3", recompute) == model_flops_per_token(m) + recompute_flops_per_token(
            m, recompute
        )


def test_eq3_gives_mtnlg_iteration_time():
    """[MTNLG] 126 TFLOP/s per GPU on 2240 A100 is a 60.1 s iteration of 1920 sequences of 2048 tokens."""
    m = gpt(105, 20480, 128)
    seconds = flops_per_token(m, "eq3", "full") * 1920 * 2048 / (126e12 * 2240)
    assert seconds == pytest.approx(60.1, rel=0.005)


def test_causal_halves_the_attention_square():
    m = gpt(32, 4096, 32, seq=8192)
    assert flops_per_token(m, "p3d") - flops_per_token(m, "causal") == 6 * m.n_layers * m.seq_len * head_dims(m)[0]


def test_an_unknown_convention_is_refused_with_the_known_ones():
    assert set(FLOP_CONVENTIONS) == {"p3d", "eq3", "nemo_mha", "causal"}
    with pytest.raises(ValueError, match="expected one of p3d, eq3, nemo_mha, causal"):
        flops_per_token(gpt(2, 64, 4), "hfu")
