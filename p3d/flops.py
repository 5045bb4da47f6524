"""Model FLOPs of a Llama, the figure behind tokens/s -> TFLOP/s -> MFU.

Per token, forward + backward = 3 x forward, forward = 2 FLOPs per multiply-accumulate:
    matmuls:   6 * (L * (h*hd*(2*nh + 2*nkv) + 3*h*ffn) + h*V)       (q,k,v,o; gate,up,down; head)
    attention: 12 * L * s * h
for the attention term we follow the PaLM / Megatron convention: attention scores and values cost 12 * L * s * h per token
(forward+backward, the full s x s square, causality not discounted), and the embedding lookup is
free. Recomputation is not counted (that would be HFU).
"""
from __future__ import annotations


def model_flops_per_token(m) -> float:
    hd = m.hidden_size // m.n_heads
    matmul_params = m.n_layers * (m.hidden_size * hd * (2 * m.n_heads + 2 * m.n_kv_heads)
                                  + 3 * m.hidden_size * m.ffn_hidden_size) + m.hidden_size * m.vocab_size
    return 6.0 * matmul_params + 12.0 * m.n_layers * m.seq_len * m.hidden_size
