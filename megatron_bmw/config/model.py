"""The model: sizes, dropout, initialisation, and the layers of the GPT-2, BERT and Llama families."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UsageError
from ..units import DTYPE_BYTES, num_units
from .moe import MoEConfig
from .schema import check_ranges, flag

MODEL_TYPES = ("gpt", "bert")
POSITION_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
_TORCH_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype) -> str:
    """'fp32' | 'bf16' | 'fp16' from such a name or a torch dtype."""
    text = str(dtype).replace("torch.", "")
    name = _TORCH_NAMES.get(text, text)
    if name not in DTYPE_BYTES:
        raise UsageError(f"unknown parameter dtype {dtype!r} (use fp32, bf16 or fp16)")
    return name


def llama_features(values) -> list[str]:
    """The Llama-family flags a model's settings (ModelConfig fields, or a checkpoint's args) use."""
    heads = values.get("num_attention_heads")
    groups = values.get("num_query_groups") or heads
    position = values.get("position_embedding_type") or "learned_absolute"
    return [name for name, on in (
        (f"--position-embedding-type {position}", position != "learned_absolute"),
        ("--swiglu", bool(values.get("swiglu"))), ("--squared-relu", bool(values.get("squared_relu"))),
        (f"--num-query-groups {groups}", groups != heads),
        (f"--normalization {values.get('normalization')}", (values.get("normalization") or "LayerNorm") != "LayerNorm"),
        ("--disable-bias-linear", values.get("add_bias_linear") is False),
        ("--add-qkv-bias", bool(values.get("add_qkv_bias"))), ("--qk-layernorm", bool(values.get("qk_layernorm"))),
        ("--apply-layernorm-1p", bool(values.get("apply_layernorm_1p")))) if on]


M, B = "model", "bert"  # flag groups
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")  # Megatron's names (local: unfused)


@dataclass
class ModelConfig:
    num_layers: int = flag("--num-layers", group=M, default=2, minimum=1)
    hidden_size: int = flag("--hidden-size", group=M, default=64, minimum=1)
    num_attention_heads: int = flag("--num-attention-heads", group=M, default=4, minimum=1)
    vocab_size: int = flag(default=128, minimum=2)  # padded (run.padded_vocab_size of --vocab-size or the tokenizer's)
    seq_length: int = flag("--seq-length", group=M, default=32, minimum=1, cli_default=64)
    max_position_embeddings: int | None = flag("--max-position-embeddings", group=M, default=None, minimum=1)
    ffn_hidden_size: int | None = flag("--ffn-hidden-size", group=M, default=None, minimum=1)
    hidden_dropout: float = flag("--hidden-dropout", group=M, default=0.1, minimum=0.0, below=1.0)
    attention_dropout: float = flag("--attention-dropout", group=M, default=0.1, minimum=0.0, below=1.0)
    init_method_std: float = flag("--init-method-std", group=M, default=0.02, above=0.0)
    layernorm_epsilon: float = flag("--layernorm-epsilon", "--norm-epsilon", group=M, default=1e-5, above=0.0)
    untie_embeddings_and_output_weights: bool = flag("--untie-embeddings-and-output-weights", group=M, default=False,
                                                     action="store_true")
    attention_backend: str = flag(  # auto | flash | fused (cuDNN first) | unfused (Megatron's local is read as unfused)
        "--attention-backend", group=M, default="auto", choices=ATTENTION_BACKENDS,
        domain=("auto", "flash", "fused", "unfused"),
        help="auto or flash (torch's fused attention), fused (the same, cuDNN's kernel first where it runs), "
             "unfused or local (explicit softmax)")
    params_dtype: str = flag(default="fp32", domain=tuple(DTYPE_BYTES))  # a torch dtype is named; from --bf16/--fp16
    model_type: str = flag(default="gpt", domain=MODEL_TYPES)  # gpt (causal) | bert (masked LM): the entry point's
    bert_binary_head: bool = flag(  # BERT: pooler, sentence-order head and token-type embeddings
        "--bert-no-binary-head", group=B, default=True, action="store_false",
        help="no sentence-order head (and no token-type embeddings)")
    apply_residual_connection_post_layernorm: bool = flag(  # residual taken after the LayerNorm (HF BERT layout)
        "--apply-residual-connection-post-layernorm", group=B, default=False, action="store_true",
        help="residuals from the LayerNorm outputs (the layout Hugging Face's post-LN BERT converts to)")
    openai_gelu: bool = flag(  # the BERT LM head's GeLU as the tanh approximation (the MLP always uses it)
        "--openai-gelu", group=B, default=False, action="store_true", help="tanh-approximated GeLU in the LM head")
    # Llama-family GPTs (Megatron's flags of the same names)
    position_embedding_type: str = flag("--position-embedding-type", group=M, default="learned_absolute",
                                        domain=POSITION_TYPES, help="learned_absolute (GPT-2), rope (Llama) or none")
    rotary_percent: float = flag("--rotary-percent", group=M, default=1.0, above=0.0, maximum=1.0,
                                 help="of each head's dimensions rotated")
    rotary_base: int = flag("--rotary-base", group=M, default=10000, above=0)
    rotary_seq_len_interpolation_factor: float | None = flag(
        "--rotary-seq-len-interpolation-factor", group=M, default=None, type=int, minimum=1,
        help="positions divided by it (longer contexts)")
    swiglu: bool = flag("--swiglu", group=M, default=False, action="store_true",
                        help="SwiGLU MLP (fc1 holds the gate and up projections)")
    squared_relu: bool = flag("--squared-relu", group=M, default=False, action="store_true",
                              help="squared-ReLU MLP activation relu(x)^2, no gating (Megatron-LM's; Nemotron-4)")
    num_query_groups: int | None = flag(  # grouped-query attention (1: multi-query); None: one per head
        "--num-query-groups", group=M, default=None, help="with --group-query-attention (1: multi-query)", cli_default=1,
        minimum=1)
    normalization: str = flag("--normalization", group=M, default="LayerNorm", choices=NORMALIZATIONS)
    add_bias_linear: bool = flag("--disable-bias-linear", group=M, default=True, action="store_false",
                                 help="no biases in attention and MLP projections")
    add_qkv_bias: bool = flag("--add-qkv-bias", group=M, default=False, action="store_true",
                              help="a QKV bias even with --disable-bias-linear")
    qk_layernorm: bool = flag("--qk-layernorm", group=M, default=False, action="store_true",
                              help="normalise every query and key head over the head dimension (--normalization's kind)")
    apply_layernorm_1p: bool = flag("--apply-layernorm-1p", group=M, default=False, action="store_true",
                                    help="norm weights stored zero-centred (gamma - 1) and applied as weight + 1")
    # kernel fusions
    cross_entropy_loss_fusion: bool = flag(  # parallel/fused_cross_entropy.py
        "--cross-entropy-loss-fusion", group=M, default=False, action="store_true",
        help="the loss saves the logits in their dtype, not an fp32 softmax, and works over fp32 chunks of tokens")
    bias_swiglu_fusion: bool = flag("--no-bias-swiglu-fusion", group=M, default=True, action="store_false",
                                    help="SwiGLU unfused (silu and product: saves silu's output too)")
    apply_rope_fusion: bool = flag("--no-rope-fusion", group=M, default=True, action="store_false",
                                   help="rope unfused (saves cos and sin for q and for k)")

    moe: MoEConfig | None = None  # experts in place of the MLP of some layers (config/moe.py); None: dense

    def __post_init__(self) -> None:
        check_ranges(self)
        if isinstance(self.moe, dict):  # read back from a plan file
            self.moe = MoEConfig(**self.moe)
        self.params_dtype = dtype_name(self.params_dtype)
        if self.model_type not in MODEL_TYPES:
            raise UsageError(f"unknown model type {self.model_type!r} (use {' or '.join(MODEL_TYPES)})")
        if self.swiglu and self.squared_relu:
            raise UsageError("--squared-relu and --swiglu are two MLP activations; give one")
        if self.ffn_hidden_size is None and self.swiglu:  # Megatron's: 8h/3 (two input matrices), a multiple of 64
            self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
            if not self.ffn_hidden_size:
                raise UsageError(f"--swiglu with --hidden-size {self.hidden_size}: Megatron's default FFN size "
                                 "(8h/3 rounded down to a multiple of 64) is 0; give --ffn-hidden-size")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.hidden_size % self.num_attention_heads:
            raise UsageError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}"
            )
        if self.attention_backend not in ("auto", "flash", "fused", "unfused"):
            raise UsageError(f"--attention-backend must be auto, flash, fused or unfused, not "
                             f"{self.attention_backend!r}")
        self._check_llama()
        if self.seq_length > self.max_position_embeddings:
            raise UsageError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}"
            )

    def _check_llama(self) -> None:
        for name, value, choices in (("--position-embedding-type", self.position_embedding_type, POSITION_TYPES),
                                     ("--normalization", self.normalization, NORMALIZATIONS)):
            if value not in choices:
                raise UsageError(f"{name} {value}: not supported (choose {', '.join(choices)})")
        groups = self.query_groups
        if not 1 <= groups <= self.num_attention_heads or self.num_attention_heads % groups:
            raise UsageError(f"--num-query-groups {groups} must divide --num-attention-heads "
                             f"{self.num_attention_heads}")
        if self.rotary_dim % 2:
            raise UsageError(f"--rotary-percent {self.rotary_percent} rotates {self.rotary_dim} of the head's "
                             f"{self.head_dim} dimensions; the rotated part must be even")
        if self.model_type == "bert" and self.llama_features():
            raise UsageError(f"{self.llama_features()[0]}: BERT runs its classic layers only (GPT models take it)")

    def llama_features(self) -> list[str]:
        """The flags of Llama-family layers this model uses (none for a GPT-2 or BERT)."""
        return llama_features(asdict(self))

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV projection: the query heads plus a key and a value head per group."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    @property
    def fc1_rows(self) -> int:
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_units(self) -> int:
        """embedding + (attention, mlp) per layer + head."""
        return num_units(self.num_layers)

    @property
    def num_tokentypes(self) -> int:
        """Token-type (segment) embeddings: BERT with the binary head has two, as in Megatron."""
        return 2 if self.model_type == "bert" and self.bert_binary_head else 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.params_dtype]

    @property
    def flash_attention(self) -> bool:
        """The fused attention kernel (every supported torch has scaled_dot_product_attention)."""
        return self.attention_backend != "unfused"

    def splits_over(self, tp: int) -> bool:
        """Whether tp ranks split the heads, query groups, hidden and FFN sizes (the vocabulary is padded)."""
        return not any(x % tp for x in (self.num_attention_heads, self.query_groups, self.hidden_size,
                                        self.ffn_hidden_size))

    def check_tensor_parallel(self, tp: int) -> None:
        for name, value in (
            ("--num-attention-heads", self.num_attention_heads),
            ("--num-query-groups", self.query_groups),
            ("--hidden-size", self.hidden_size),
            ("--ffn-hidden-size", self.ffn_hidden_size),
            ("padded vocabulary size", self.vocab_size),
        ):
            if value % tp:
                raise UsageError(f"--tensor-model-parallel-size {tp} does not divide {name} {value}")

    def to_json(self) -> dict:
        return asdict(self)

    def moe_layer(self, layer: int) -> bool:
        """Whether transformer layer `layer` holds experts in place of its MLP."""
        return self.moe is not None and self.moe.layers(self.num_layers)[layer]

    @property
    def moe_ffn_hidden_size(self) -> int:
        """Each expert's FFN size."""
        return self.moe.ffn_hidden_size or self.ffn_hidden_size

