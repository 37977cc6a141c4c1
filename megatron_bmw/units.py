"""The model as a list of units, in numbers only (no torch): what the model, the partition, the memory and the
cost models and the planner agree on.

A GPT is [embedding, attn_0, mlp_0, ..., attn_{L-1}, mlp_{L-1}, head]; between any two units flows the hidden
state [seq, batch, hidden] (seq/tp with sequence parallelism). A BERT (ModelConfig.model_type "bert") has the same
units and kinds; its embedding and head differ in size and work, which the memory model and FLOPs read from the
ModelConfig.
"""

from __future__ import annotations

from functools import lru_cache

from .errors import UsageError

UNIT_KINDS = ("embedding", "attention", "mlp", "head")  # a dense model's (unit_kind answers these)
ALL_UNIT_KINDS = UNIT_KINDS + ("moe",)  # "moe": an mlp_i unit holding experts (unit_kind_of; docs/moe.md)
RECOMPUTE = (None, "selective", "full")  # per unit; None = keep every activation
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# --cross-entropy-loss-fusion (parallel/fused_cross_entropy.py): the loss works over chunks of tokens, each upcast to
# one fp32 [tokens, v/t] buffer of at most this many bytes (one token at least); the memory model counts that buffer
CROSS_ENTROPY_CHUNK_BYTES = 64 << 20


def cross_entropy_chunk_tokens(tokens: int, vocab_local: int, chunk_bytes: int = CROSS_ENTROPY_CHUNK_BYTES) -> int:
    """Tokens per chunk of the fused cross entropy: the fp32 rows of `vocab_local` logits that fit in
    `chunk_bytes` (at least one), at most `tokens`."""
    return max(1, min(tokens, chunk_bytes // (4 * vocab_local)))


def unit_names(num_layers: int) -> list[str]:
    return list(_unit_names(num_layers))


@lru_cache(maxsize=64)
def _unit_names(num_layers: int) -> tuple[str, ...]:
    names = ["embedding"]
    for i in range(num_layers):
        names += [f"attn_{i}", f"mlp_{i}"]
    return tuple(names + ["head"])


def num_units(num_layers: int) -> int:
    return 2 * num_layers + 2


def unit_kind(name: str) -> str:
    """'attn_3' -> 'attention', 'mlp_0' -> 'mlp', 'embedding', 'head'."""
    if name.startswith("attn_"):
        return "attention"
    if name.startswith("mlp_"):
        return "mlp"
    if name in ("embedding", "head"):
        return name
    raise ValueError(f"unknown unit {name!r}")


def unit_kind_of(model, name: str) -> str:
    """The kind of unit `name` in `model` (a ModelConfig): "moe" for an MLP unit whose layer holds experts
    (`model.moe_layer(i)`, docs/moe.md), else unit_kind(name)."""
    kind = unit_kind(name)
    if kind == "mlp" and getattr(model, "moe", None) is not None and model.moe_layer(unit_layer(name)):
        return "moe"
    return kind


def model_unit_kinds(model) -> tuple[str, ...]:
    """The unit kinds `model` is made of, in ALL_UNIT_KINDS order ("moe" only where some layer holds experts, "mlp"
    only where some does not)."""
    kinds = {unit_kind_of(model, n) for n in _unit_names(model.num_layers)}
    return tuple(k for k in ALL_UNIT_KINDS if k in kinds)


def unit_layer(name: str) -> int | None:
    """Transformer layer of an attention or MLP unit; None for the embedding and the head."""
    return int(name.split("_")[1]) if name.startswith(("attn_", "mlp_")) else None


def owns_output_weight(untied: bool, pp: int, names: list[str]) -> bool:
    """Whether a rank holding units `names` keeps its own output matrix: untied, or the tied copy on a last
    pipeline stage, rather than sharing the embedding's Parameter on the same rank."""
    return untied or pp > 1 or "embedding" not in names


def hidden_shape(seq_length: int, micro_batch_size: int, hidden_size: int, tp: int = 1,
                 sp: bool = False) -> tuple[int, int, int]:
    """[seq, batch, hidden] of the hidden state one tensor-parallel rank holds between units."""
    return (seq_length // tp if sp and tp > 1 else seq_length, micro_batch_size, hidden_size)


def parse_recompute(text: str | list | tuple | None, n_units: int, where: str = "recompute") -> tuple | None:
    """A per-unit recomputation list: None, or one of none/selective/full per unit (names or None)."""
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    if len(items) != n_units:
        raise UsageError(f"{where}: {len(items)} entries given, but the model has {n_units} units")
    out = []
    for i, x in enumerate(items):
        x = None if x in (None, "none", "") else x
        if x not in RECOMPUTE:
            raise UsageError(f"{where}: unit {i} has {x!r}; use none, selective or full")
        if x is not None and (i == 0 or i == n_units - 1):
            raise UsageError(f"{where}: the embedding and the head are never recomputed (unit {i} is {x})")
        if x == "selective" and i % 2 == 0:
            raise UsageError(f"{where}: selective recomputation (the attention core) applies to attention units "
                             f"only; unit {i} is an MLP unit")
        out.append(x)
    return tuple(out) if any(out) else None


def recompute_from_flags(granularity: str | None, method: str | None, num_layers_flag: int | None,
                         num_layers: int, stage_units: list[list[int]]) -> tuple | None:
    """Megatron's recomputation flags as a per-unit list. `stage_units`: unit indices of each pipeline rank
    (all its chunks); the block method recomputes the first N layers of each rank."""
    if granularity is None:
        return None
    names = unit_names(num_layers)
    out: list[str | None] = [None] * len(names)
    if granularity == "selective":
        for i, n in enumerate(names):
            if n.startswith("attn_"):
                out[i] = "selective"
        return tuple(out)
    for units in stage_units:
        layers = sorted({unit_layer(names[i]) for i in units if unit_layer(names[i]) is not None})
        limit = len(layers)
        if method == "block" and num_layers_flag is not None:
            limit = min(num_layers_flag, len(layers))
        chosen = set(layers[:limit])
        for i in units:
            if unit_layer(names[i]) in chosen:
                out[i] = "full"
    return tuple(out)
