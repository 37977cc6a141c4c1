"""A mixture of experts in place of the MLP of some layers (Megatron-core's MoE flags and meanings): the router,
the experts, how tokens reach them and what keeps their load even. `ModelConfig.moe` holds one (None: dense).
The parallel sizes of the experts (--expert-model-parallel-size, --expert-tensor-parallel-size) are
ParallelConfig's."""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass

from ..errors import UsageError
from .schema import check_ranges, flag

E = "mixture of experts"
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
DISPATCHERS = ("allgather", "alltoall")
DROP_POLICIES = ("probs", "position")


@dataclass
class MoEConfig:
    num_experts: int = flag("--num-experts", group=E, default=8, cli_default=None, minimum=1,
                            help="experts per MoE layer (a model without it is dense)")
    router_topk: int = flag("--moe-router-topk", group=E, default=2, minimum=1, help="experts each token goes to")
    ffn_hidden_size: int | None = flag("--moe-ffn-hidden-size", group=E, default=None, minimum=1,
                                       dest="moe_ffn_hidden_size",  # (not --ffn-hidden-size's)
                                       help="each expert's FFN size (default --ffn-hidden-size)")
    layer_freq: str = flag("--moe-layer-freq", group=E, default="1", type=str,
                           help="which layers are MoE: every N-th (N), or a list over the layers such as "
                                "[1,0,1,0] or ([0]+[1]*23)")
    load_balancing_type: str = flag("--moe-router-load-balancing-type", group=E, default="aux_loss",
                                    choices=LOAD_BALANCING)
    aux_loss_coeff: float = flag("--moe-aux-loss-coeff", group=E, default=0.0, minimum=0.0)
    z_loss_coeff: float | None = flag("--moe-z-loss-coeff", group=E, default=None, minimum=0.0)
    score_function: str = flag("--moe-router-score-function", group=E, default="softmax", choices=SCORE_FUNCTIONS)
    pre_softmax: bool = flag("--moe-router-pre-softmax", group=E, default=False, action="store_true",
                             help="softmax over all experts before the top-k (else over the k chosen)")
    topk_scaling_factor: float | None = flag("--moe-router-topk-scaling-factor", group=E, default=None, above=0.0)
    shared_expert_intermediate_size: int | None = flag(
        "--moe-shared-expert-intermediate-size", group=E, default=None, minimum=1,
        help="FFN size of the shared experts every token also passes through (none by default)")
    shared_expert_gate: bool = flag("--moe-shared-expert-gate", group=E, default=False, action="store_true",
                                    help="a sigmoid gate per token on the shared experts' output (Qwen-MoE)")
    token_dispatcher_type: str = flag("--moe-token-dispatcher-type", group=E, default="allgather",
                                      choices=DISPATCHERS)
    expert_capacity_factor: float | None = flag(
        "--moe-expert-capacity-factor", group=E, default=None, above=0.0,
        help="tokens an expert takes, as a multiple of its even share; the rest are dropped (default: dropless)")
    token_drop_policy: str = flag("--moe-token-drop-policy", group=E, default="probs", choices=DROP_POLICIES)
    pad_expert_input_to_capacity: bool = flag("--moe-pad-expert-input-to-capacity", group=E, default=False,
                                              action="store_true")
    grouped_gemm: bool = flag("--moe-grouped-gemm", group=E, default=False, action="store_true",
                              help="accepted: the experts always run as one grouped GEMM (or a loop of GEMMs)")

    def __post_init__(self) -> None:
        check_ranges(self)
        self.layer_freq = str(self.layer_freq)
        if self.router_topk > self.num_experts:
            raise UsageError(f"--moe-router-topk {self.router_topk} exceeds --num-experts {self.num_experts}")
        if self.shared_expert_gate and self.shared_expert_intermediate_size is None:
            raise UsageError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
        if self.pad_expert_input_to_capacity and self.expert_capacity_factor is None:
            raise UsageError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        if self.load_balancing_type == "sinkhorn" and self.router_topk != 1:
            raise UsageError("--moe-router-load-balancing-type sinkhorn routes each token to one expert: give "
                             "--moe-router-topk 1")

    def layers(self, num_layers: int) -> tuple[bool, ...]:
        """Which of `num_layers` layers hold experts."""
        return moe_layer_pattern(self.layer_freq, num_layers)

    def to_json(self) -> dict:
        return asdict(self)


def moe_layer_pattern(text: str, num_layers: int) -> tuple[bool, ...]:
    """--moe-layer-freq as Megatron reads it: an integer N (layers 0, N, 2N, ... hold experts) or a list of 0/1
    over the layers, written with list literals, `*` by an integer and `+` (read as data, never run)."""
    flag_name = "--moe-layer-freq"
    try:
        node = ast.parse(text.strip(), mode="eval").body
        value = _pattern_value(node)
    except (SyntaxError, ValueError) as exc:
        raise UsageError(f"{flag_name} {text!r}: expected an integer or a list such as [1,0,1,0] or ([0]+[1]*3) "
                         f"({exc})") from None
    if isinstance(value, int):
        if value < 1:
            raise UsageError(f"{flag_name} {value}: must be >= 1")
        return tuple(i % value == 0 for i in range(num_layers))
    if len(value) != num_layers or any(v not in (0, 1) for v in value):
        raise UsageError(f"{flag_name} {text!r}: needs one 0 or 1 per layer ({num_layers}), got {len(value)} "
                         "values")
    return tuple(bool(v) for v in value)


def _pattern_value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
            return left * right
    raise ValueError("only integers, lists, list + list and list * integer")
