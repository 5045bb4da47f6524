"""Model geometry: the one home of every number that follows from a model's shape and a layout.

Validation, the run plan, the planner, the dry run, metrics (MFU, bubble) and HF import/export all
import these; nothing computes them a second time. Pure arithmetic on the config dataclasses: no
torch, no processes.

Notation (docs/planner.md uses the same): L layers, h hidden, a = n_heads, hd = head_dim (h / a unless
``model.head_dim`` says otherwise), q = a * hd, kv = n_kv_heads * hd, f = ffn_hidden_size, V vocab (V_pad: padded
to a multiple of tp), s sequence, t = tp, p = pp, m micro batches per replica per step, v virtual stages per device.
Mixture of experts (``model.moe``): E routed experts of inner size f_e, k of them per token, S shared experts;
blocks i >= first_dense_layers are MoE blocks, the others dense. "Total" counts every expert, "active" the
k routed and S shared experts a token goes through (docs/moe.md).
Multi-head latent attention (``model.attention=mla``, ``model.mla``): r_q, r_kv the query and key/value latents, d_n,
d_r, d_v the heads' widths without RoPE, with it, and of the values; a query and key head is d_qk = d_n + d_r wide.
The attention core's "q" in the 12 s q term is then a (d_qk + d_v) / 2 (``core_width``): its scores are a d_qk wide
and its weighted sum a d_v wide.
"""

from __future__ import annotations

import math

from p3d.config.schema import Arch, AttentionType, ModelConfig, Partition


def padded_vocab(vocab_size: int, tp: int) -> int:
    """V rounded up to a multiple of tp, so every vocab shard has the same rows (padded logits are masked)."""
    return math.ceil(vocab_size / tp) * tp


def layer_names(n_layers: int) -> list[str]:
    """The flat pipeline: embedding, blocks, final norm, head (the loss runs after the head)."""
    return ["embed"] + [f"block{i}" for i in range(n_layers)] + ["final_norm", "head"]


def layer_costs(m: ModelConfig) -> list[float]:
    """Forward + backward FLOPs per token of each pipeline layer (``layer_names``), the terms of
    ``model_flops_per_token``: a block 6 * (its active) matmul params + 12 s q, the head 6 h V; the embedding
    (a lookup) and the final norm count 0. The head of a large vocabulary weighs several blocks: 5.5 for
    model=small (V = 50,304, h = 768)."""
    q = core_width(m)
    blocks = [6.0 * block_matmul_params(m, layer=i, active=True) + 12.0 * m.seq_len * q for i in range(m.n_layers)]
    return [0.0, *blocks, 0.0, 6.0 * m.hidden_size * m.vocab_size]


def max_pieces(n_layers: int, partition: Partition) -> int:
    """The most stages (or chunks) ``partition`` can cut the layer list of an n_layers model into: ``blocks``
    gives every piece a block; ``cost`` keeps the embedding with the first piece and the final norm with the
    head, every other piece at least one block; ``uniform`` cuts anywhere in the n_layers + 3 layers."""
    return {Partition.blocks: n_layers, Partition.cost: n_layers + 2, Partition.uniform: n_layers + 3}[partition]


PIECES_RULE = {  # why max_pieces is what it is, for the messages that refuse more
    Partition.blocks: "every piece needs a block",
    Partition.cost: "every piece needs a block but the first and the last, which hold the embedding and the head",
    Partition.uniform: "every piece needs a layer",
}


def _fill(loads: list[float], counts: list[int], block: float, n: int, eligible: list[int]) -> None:
    """Hand n blocks, one at a time, to the eligible entry with the least load (ties: the last); in place."""
    for _ in range(n):
        i = min(reversed(eligible), key=lambda k: loads[k])
        loads[i] += block
        counts[i] += 1


def _cost_bounds(costs: list[float], pp: int, v: int, style: str) -> list[int]:
    """``partition=cost`` over pp * v chunks placed by ``style``: the split whose busiest rank (the sum of its
    chunks' costs: a rank runs each of its chunks once per micro batch) costs least, then whose chunks on a
    rank are most even (they take turns, so a heavy chunk stretches the fill and the drain).

    The layers are [embed, block * L, final_norm, head] with equal blocks (``layer_costs``): the embedding
    stays in chunk 0 and the norm with the head in the last chunk, and what a split decides is how many blocks
    each chunk gets. Every rank starts with one block per chunk that holds neither end; water filling then
    gives each further block to the least loaded rank, which makes the busiest rank as light as a split can
    (with v = 1: the contiguous split whose costliest stage costs least). Ties go to the later rank, which
    holds fewer micro batches in flight under 1F1B and interleaving. Each rank hands its blocks to its least
    loaded chunk the same way."""
    n_chunks, n_blocks = pp * v, len(costs) - 3
    if n_chunks == 1:
        return [0, len(costs)]
    block = sum(costs[1:-2]) / n_blocks if n_blocks else 0.0
    ends = [0.0] * n_chunks
    ends[0], ends[-1] = costs[0], costs[-2] + costs[-1]
    chunk_blocks = [0 if c in (0, n_chunks - 1) else 1 for c in range(n_chunks)]  # at least a layer each
    owner = chunk_to_rank(pp, n_chunks, style)
    chunks_of = [[c for c in range(n_chunks) if owner[c] == r] for r in range(pp)]
    floor = [sum(chunk_blocks[c] for c in mine) for mine in chunks_of]
    loads = [sum(ends[c] for c in mine) + n * block for mine, n in zip(chunks_of, floor)]
    rank_blocks = list(floor)
    _fill(loads, rank_blocks, block, n_blocks - sum(floor), list(range(pp)))
    for r, mine in enumerate(chunks_of):
        chunk_load = [ends[c] + chunk_blocks[c] * block for c in range(n_chunks)]
        _fill(chunk_load, chunk_blocks, block, rank_blocks[r] - floor[r], mine[::-1])  # ties: the first chunk
    bounds = [0, 1 + chunk_blocks[0]]  # the embedding and chunk 0's blocks
    for c in range(1, n_chunks):
        bounds.append(bounds[-1] + chunk_blocks[c])
    bounds[-1] += 2  # final_norm and head
    return bounds


def stage_bounds(
    n_layers: int,
    pp: int,
    partition: Partition,
    model: ModelConfig | None = None,
    v: int = 1,
    style: str = "loop",
    blocks: list[int] | None = None,
) -> list[int]:
    """Layer-index boundaries of the pp * v pieces (v = 1: DeepSpeed's pp stages; v > 1: the chunks of a torch
    schedule, chunk c on pp rank ``chunk_to_rank(pp, pp * v, style)[c]``) over ``layer_names(n_layers)``.

    ``blocks``: every piece gets n_layers // (pp v) blocks; the remainder goes to the middle pieces
    first, since the first also holds the embedding and the last the head and the loss
    (as Llama 3 405B's 126 layers on 16 stages: 7 on the first and last, 8 elsewhere).
    ``uniform``: all n_layers + 3 pipeline layers spread evenly, earlier pieces taking the extra.
    ``cost``: by ``layer_costs(model)``, the least loaded busiest rank given the placement (``_cost_bounds``).
    ``blocks`` (``schedule.stage_blocks``, the planner's uneven split): the blocks of each piece as given, the
    embedding with the first piece, the final norm and the head with the last; ``partition`` is not used.
    """
    n = pp * v
    if blocks:
        if len(blocks) != n or sum(blocks) != n_layers or min(blocks) < 0:
            raise ValueError(f"stage blocks {blocks} do not cut {n_layers} blocks into {n} pieces")
        bounds = [0, 1 + blocks[0]]
        for b in blocks[1:]:
            bounds.append(bounds[-1] + b)
        bounds[-1] += 2  # final_norm and head
        return bounds
    if not 1 <= n <= max_pieces(n_layers, partition):
        raise ValueError(f"{n} pieces of a {n_layers}-block model under partition={partition.value}")
    if partition == Partition.cost:
        if model is None or model.n_layers != n_layers:
            raise ValueError("partition=cost needs the model whose layers it balances")
        return _cost_bounds(layer_costs(model), pp, v, style)
    n_items = n_layers + 3
    if partition == Partition.uniform:
        base, extra = divmod(n_items, n)
        sizes = [base + (1 if s < extra else 0) for s in range(n)]
        return [sum(sizes[:s]) for s in range(n + 1)]
    base, extra = divmod(n_layers, n)
    order = list(range(1, n - 1)) + ([0, n - 1] if n > 1 else [0])  # middle, then first (the head is heavier)
    blocks = [base] * n
    for s in order[:extra]:
        blocks[s] += 1
    bounds = [0]
    for s in range(n):
        size = blocks[s] + (1 if s == 0 else 0) + (2 if s == n - 1 else 0)
        bounds.append(bounds[-1] + size)
    return bounds


def head_dim(m: ModelConfig) -> int:
    """hd: one attention head's width, ``model.head_dim`` or h / a."""
    return m.head_dim or m.hidden_size // m.n_heads


def head_dims(m: ModelConfig) -> tuple[int, int]:
    """(q, kv): widths of the query and of each of the key/value projections (grouped-query attention)."""
    hd = head_dim(m)
    return m.n_heads * hd, m.n_kv_heads * hd


def is_mla(m: ModelConfig) -> bool:
    """Whether the blocks' attention is multi-head latent attention (``model.attention=mla``)."""
    return m.attention == AttentionType.mla


def qk_head_dim(m: ModelConfig) -> int:
    """A query and key head's width: d_n + d_r under MLA, else hd."""
    if is_mla(m):
        assert m.mla.qk_nope_head_dim is not None and m.mla.qk_rope_head_dim is not None  # model_rules
        return m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
    return head_dim(m)


def v_head_dim(m: ModelConfig) -> int:
    """A value head's width (and the attention output's): d_v under MLA, else hd."""
    if is_mla(m):
        assert m.mla.v_head_dim is not None  # model_rules
        return m.mla.v_head_dim
    return head_dim(m)


def rope_dim(m: ModelConfig) -> int:
    """The width RoPE rotates: d_r under MLA (the rest of a head is not rotated), else the whole head hd."""
    return m.mla.qk_rope_head_dim if is_mla(m) and m.mla.qk_rope_head_dim else head_dim(m)


def core_width(m: ModelConfig) -> float:
    """The attention core's width per token as the 12 s q FLOP term reads it: q = a hd, or a (d_qk + d_v) / 2 under
    MLA (scores over d_qk, the weighted sum over d_v: 2 s a d_qk + 2 s a d_v FLOPs forward, 4 s q)."""
    if is_mla(m):
        return m.n_heads * (qk_head_dim(m) + v_head_dim(m)) / 2
    return float(head_dims(m)[0])


def mla_params(m: ModelConfig, tp: int = 1) -> tuple[int, int]:
    """(replicated, split) matrix weights of one MLA block on one tp rank: the down-projections to the latents,
    h r_q and h (r_kv + d_r), replicated over tp; the up-projections r_q a d_qk and r_kv a (d_n + d_v) and the
    output a d_v h, split by heads (/ t). Without q compression (r_q null) the queries' h a d_qk is split."""
    a, h, x = m.n_heads, m.hidden_size, m.mla
    assert x.kv_lora_rank is not None and x.qk_nope_head_dim is not None and x.qk_rope_head_dim is not None
    replicated = h * (x.kv_lora_rank + x.qk_rope_head_dim)
    split = x.kv_lora_rank * a * (x.qk_nope_head_dim + v_head_dim(m)) + a * v_head_dim(m) * h
    if x.q_lora_rank:
        replicated += h * x.q_lora_rank
        split += x.q_lora_rank * a * qk_head_dim(m)
    else:
        split += h * a * qk_head_dim(m)
    return replicated, split // tp


def mla_norm_params(m: ModelConfig) -> int:
    """The latents' RMSNorm weights of one MLA block, replicated: r_kv, and r_q with q compression."""
    return (m.mla.kv_lora_rank or 0) + (m.mla.q_lora_rank or 0)


def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    """Whether block ``layer`` has a mixture-of-experts feed-forward (the first ``first_dense_layers`` stay dense)."""
    return m.moe is not None and layer >= m.moe.first_dense_layers


def moe_layers(m: ModelConfig) -> list[int]:
    """The block indices of the MoE layers, in order (their metrics are reported in this order)."""
    return [i for i in range(m.n_layers) if is_moe_layer(m, i)]


def expert_ffn_size(m: ModelConfig) -> int:
    """f_e: one routed expert's SwiGLU inner size (``model.moe.expert_ffn_size``, else ``model.ffn_hidden_size``)."""
    assert m.moe is not None
    return m.moe.expert_ffn_size or m.ffn_hidden_size


def expert_params(m: ModelConfig, tp: int = 1) -> int:
    """One routed expert's weights on one tp rank: gate|up and down, 3 h f_e / t."""
    return 3 * m.hidden_size * expert_ffn_size(m) // tp


def attention_params(m: ModelConfig, tp: int = 1) -> int:
    """q|k|v and o of one block on one tp rank: h (q + 2 kv) + h q, over t; under MLA ``mla_params``."""
    if is_mla(m):
        return sum(mla_params(m, tp))
    q, kv = head_dims(m)
    return (m.hidden_size * (q + 2 * kv) + m.hidden_size * q) // tp


def mlp_params(m: ModelConfig, layer: int | None = None, tp: int = 1, active: bool = False, ep: int = 1) -> int:
    """The feed-forward matrices of block ``layer`` on one tp rank. Dense: 3 h f (llama), 2 h f (gpt). MoE: the
    router h E (replicated over tp: not divided), the shared experts S x 3 h f_e / t, and the routed experts: all
    E (``active=False``; E / ep of them on one ep rank) or the k a token goes through (``active=True``).
    ``layer=None``: an MoE block when the model has experts."""
    h = m.hidden_size
    if layer is None:
        layer = m.moe.first_dense_layers if m.moe is not None else 0
    if not is_moe_layer(m, layer):
        return (3 if m.arch == Arch.llama else 2) * h * m.ffn_hidden_size // tp
    assert m.moe is not None
    routed = m.moe.top_k if active else m.moe.n_experts // ep
    return h * m.moe.n_experts + (m.moe.n_shared_experts + routed) * expert_params(m, tp)


def block_matmul_params(m: ModelConfig, tp: int = 1, layer: int | None = None, active: bool = False) -> int:
    """Weights of one block's matrices on one tp rank (the ones that do 2 FLOPs per token each).

    llama: h (q + 2 kv) (q|k|v) + h q (o) + 3 h f (gate|up, down); gpt: 2 h f for the MLP. An MoE block
    (``layer`` one, or None on a model with experts): its feed-forward is ``mlp_params``, every expert or
    (``active``) the ones a token uses."""
    return attention_params(m, tp) + mlp_params(m, layer, tp, active)


def block_vector_params(m: ModelConfig, tp: int = 1) -> int:
    """Norm weights and biases of one block on one tp rank. llama: two RMSNorm weights (2 h), the q|k|v biases
    split by heads ((q + 2 kv) / t, ``model.qkv_bias``), the q and k norms' weights, replicated (2 hd,
    ``model.qk_norm``)."""
    h = m.hidden_size
    q, kv = head_dims(m)
    if is_mla(m):  # the two block norms and the latents' (replicated)
        return 2 * h + mla_norm_params(m)
    if m.arch == Arch.llama:
        return 2 * h + ((q + 2 * kv) // tp if m.qkv_bias else 0) + (2 * head_dim(m) if m.qk_norm else 0)
    return (q + 2 * kv) // tp + m.ffn_hidden_size // tp + 2 * h + 4 * h


def _embedding_params(m: ModelConfig) -> int:
    h = m.hidden_size
    embed = m.vocab_size * h * (1 if m.tie_embeddings else 2) + (m.seq_len * h if m.arch == Arch.gpt else 0)
    return embed + (h if m.arch == Arch.llama else 2 * h)  # and the final norm


def total_params(m: ModelConfig) -> int:
    """Closed form of the whole model, unpadded vocab, a tied table counted once; every expert."""
    blocks = sum(block_matmul_params(m, layer=i) + block_vector_params(m) for i in range(m.n_layers))
    return blocks + _embedding_params(m)


def active_params(m: ModelConfig) -> int:
    """The parameters one token goes through: ``total_params`` with each MoE block's routed experts cut to the
    top-k (the figure MoE models publish as "active"; equal to ``total_params`` for a dense model)."""
    blocks = sum(block_matmul_params(m, layer=i, active=True) + block_vector_params(m) for i in range(m.n_layers))
    return blocks + _embedding_params(m)


def model_flops_per_token(m: ModelConfig) -> float:
    """Model FLOPs per token, forward + backward (the MFU numerator; recompute not counted).

        6 * (sum over blocks of their active matmul params + h * V)  +  12 * L * s * q

    6 = 2 FLOPs per multiply-add x 3 (forward, and backward's two matmuls). The attention scores
    and the weighted sum cost 2 * 2 * s * q per token forward, the full s x s square (the
    Megatron / PaLM convention: causality not discounted). Embedding lookups, norms, activations
    and the softmax are not counted. For a GPT with f = 4h it is Narayanan et al. (2021) Eq. 3
    without the recompute term: 72 L h^2 (1 + s / 6h + V / 12 L h) per token. An MoE block counts the
    router and the experts a token goes through (k routed, S shared), not the others.
    """
    q = core_width(m)
    matmul = sum(block_matmul_params(m, layer=i, active=True) for i in range(m.n_layers))
    return 6.0 * (matmul + m.hidden_size * m.vocab_size) + 12.0 * m.n_layers * m.seq_len * q


def recompute_flops_per_token(m: ModelConfig, recompute: str) -> float:
    """FLOPs of the forward work that recompute repeats, per token (HFU counts them, MFU does not).

    full: every block's forward again, 2 * L * block_matmul_params + 4 * L * s * q (Narayanan Eq. 3
    counts exactly this: its factor 96 = 4 x 24). selective: the attention core, 4 * L * s * q.
    """
    q = core_width(m)
    attn = 4.0 * m.n_layers * m.seq_len * q
    if recompute == "full":
        return 2.0 * sum(block_matmul_params(m, layer=i, active=True) for i in range(m.n_layers)) + attn
    return attn if recompute == "selective" else 0.0


# How published runs count FLOPs (docs/planner.md, "FLOP conventions"): what a source's TFLOP/s or MFU means
FLOP_CONVENTIONS = {
    "p3d": "model FLOPs: the full s^2 attention square, K and V at their own width, recompute not counted "
    "(model_flops_per_token; Korthikanti et al. 2022, llm-foundry, Megatron-LM before 2025)",
    "eq3": "Narayanan et al. 2021 Eq. 3: p3d's count plus the forward that recompute repeats (HFU; Megatron-LM "
    "2021, Megatron-DeepSpeed, GPT-NeoX)",
    "nemo_mha": "NeMo's formula with query_groups = heads: p3d's count with the K and V projections at the query "
    "width (NVIDIA DGX Cloud benchmark cards)",
    "causal": "p3d's count with the attention square halved for the causal mask (Megatron-LM after 2025)",
}


def flops_per_token(m: ModelConfig, convention: str = "p3d", recompute: str = "none") -> float:
    """FLOPs per token, forward + backward, as ``convention`` (a key of ``FLOP_CONVENTIONS``) counts them.

    p3d: ``model_flops_per_token``. eq3: that + ``recompute_flops_per_token(recompute)`` (for a GPT with f = 4h
    and full recompute exactly Eq. 3's 96 L h^2 (1 + s/6h + V/16Lh)). nemo_mha: the K and V projections counted
    at the query width, + 12 L h (q - kv) (NeMo's 12 g/a term with g = a; nothing changes without GQA).
    causal: the attention's 12 L s q halved. Only eq3 depends on ``recompute``."""
    if convention not in FLOP_CONVENTIONS:
        raise ValueError(f"FLOP convention {convention!r}: expected one of {', '.join(FLOP_CONVENTIONS)}")
    base = model_flops_per_token(m)
    q, kv = (0, 0) if is_mla(m) else head_dims(m)  # MLA: every head its own key and value (no grouping)
    if convention == "eq3":
        return base + recompute_flops_per_token(m, recompute)
    if convention == "nemo_mha":
        return base + 12.0 * m.n_layers * m.hidden_size * (q - kv)
    if convention == "causal":
        return base - 6.0 * m.n_layers * m.seq_len * core_width(m)
    return base


def pipeline_bubble(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The pipeline bubble: the idle share of a step, (p - 1) / (v m + p - 1).

    A 1F1B step on p stages with m micro batches lasts (m + (p - 1) / v) micro-batch times, of
    which each stage computes for m. This one definition is what ``metrics.jsonl`` (bubble_theory,
    beside the measured ``bubble``), W&B, ``p3d-report`` and ``p3d-plan`` call the bubble.
    """
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


# ---- chunks of the torch schedules (docs/schedules.md: placement, metrics)
# A "chunk" is one of the p * v pieces ``stage_bounds(n_layers, p * v, partition, model)`` cuts the flat list
# into; chunk c is a torch ``PipelineStage`` with stage_index c. ``style``: "loop" (the interleaved schedules:
# rank r holds chunks r, r + p, ...) or "v" (zbv, dualpipev: rank r holds chunks r and 2p - 1 - r, so the
# first rank holds both the embedding and the head).
def chunk_to_rank(pp: int, n_chunks: int, style: str) -> dict[int, int]:
    """chunk index -> pp rank; the arithmetic of torch's ``generate_stage_to_rank_mapping``
    (tests/unit/pipeline/test_chunks.py checks they agree). "v" snakes: even rounds of p chunks go up
    the ranks, odd rounds come back down."""
    if style == "loop":
        return {c: c % pp for c in range(n_chunks)}
    if style == "v":
        if n_chunks % pp:
            raise ValueError(f"V placement needs chunks ({n_chunks}) divisible by pp ({pp})")
        return {c: (c % pp if (c // pp) % 2 == 0 else pp - 1 - c % pp) for c in range(n_chunks)}
    raise ValueError(f"chunk placement style {style!r}: expected 'loop' or 'v'")


def rank_chunks(pp: int, v: int, style: str, pp_rank: int) -> list[int]:
    """The chunks pp rank ``pp_rank`` holds (v of them, ascending: the order of the schedule's stage list)."""
    mapping = chunk_to_rank(pp, pp * v, style)
    return [c for c in range(pp * v) if mapping[c] == pp_rank]


INTERLEAVED = ("interleaved_1f1b", "looped_bfs")
SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv", "dualpipev")  # backward split into I (dx) and W (dw)


def schedule_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The theoretical idle share of a step for a pipeline schedule (p stages, m micro batches per replica,
    v chunks per rank), every rank's idle time over the step, as the measured ``bubble`` counts it.

    1f1b / gpipe: (p - 1) / (m + p - 1). interleaved_1f1b (Narayanan et al. SC'21 §2.2): the fill and drain
    take one chunk-time per stage, 1/v of a stage-time: (p - 1) / (v m + p - 1). The schedules that split the
    backward into I (dx) and W (dw) (Qi et al. ICLR'24) with equal F, I and W chunk times: a rank works
    3 v m chunk-times a step and idles (p - 1) of them while the first forward reaches it and the last
    backward leaves, (p - 1) / (3 v m + p - 1) for interleaved_zero_bubble and dualpipev; zbv idles
    max(p - 1, 4p - 2 - 2m), so the same from m >= (3p - 1) / 2. Each formula equals the idle share of torch's
    own action orders (torch 2.13, ``pipeline_order``) run with those times (tests/unit/planner/test_schedules.py).
    """
    if schedule in ("1f1b", "gpipe"):
        return pipeline_bubble(p, m, 1)
    if schedule in INTERLEAVED:
        return pipeline_bubble(p, m, v)
    if schedule in SPLIT_BACKWARD:
        idle = max(p - 1, 4 * p - 2 - 2 * m) if schedule == "zbv" else p - 1
        return idle / (3 * v * m + idle)
    raise ValueError(f"schedule {schedule!r}: expected 1f1b, gpipe, {', '.join(INTERLEAVED + SPLIT_BACKWARD)}")


def token_bytes(vocab_size: int) -> int:
    """Bytes of one token id of a ``vocab_size`` vocabulary in the smallest unsigned integer that holds every id (1,
    2, 4 or 8): how token stores and the streaming reader's shuffle pool keep tokens (p3d.data.store.token_dtype)."""
    return next(n for n in (1, 2, 4) if vocab_size - 1 < 1 << (8 * n)) if vocab_size - 1 < 1 << 32 else 8
