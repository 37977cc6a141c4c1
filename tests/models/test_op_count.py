"""models/op_count.py: operators per unit follow the structure, not the sizes."""

from dataclasses import replace

from megatron_bmw.config import ModelConfig
from megatron_bmw.planner.cost_model import HOST_OP_S
from megatron_bmw.models.op_count import small_model, unit_op_counts

# the planner step's model of the H100 run (tools/gpu_check.py GPU.profiled, with its flags)
H100_RUN = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=50304, seq_length=1024,
                       attention_backend="flash", hidden_dropout=0.0, attention_dropout=0.0, params_dtype="bf16")


def test_counts_follow_the_structure_not_the_sizes():
    big = unit_op_counts(replace(H100_RUN, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                                 max_position_embeddings=2048))
    assert big == unit_op_counts(H100_RUN)
    assert all(f > 0 and b > 0 for f, b in big.values())
    dropout = unit_op_counts(replace(H100_RUN, hidden_dropout=0.1, attention_dropout=0.1))
    assert dropout["mlp"][0] > big["mlp"][0] and dropout["attention"][0] > big["attention"][0]
    unfused = unit_op_counts(replace(H100_RUN, attention_backend="unfused"))
    assert unfused["attention"] != big["attention"] and unfused["mlp"] == big["mlp"]


def test_the_host_time_per_operator_is_the_h100_runs():
    """HOST_OP_S is the H100 run's host-bound time per micro-batch (26.3 and 28.0 ms at micro-batch 1) over the
    operators that model's units dispatch per micro-batch: its derivation holds for the code as it is."""
    c = unit_op_counts(H100_RUN)
    per_microbatch = sum(c["embedding"]) + H100_RUN.num_layers * (sum(c["attention"]) + sum(c["mlp"])) \
        + sum(c["head"])
    assert per_microbatch == 336
    assert 26.3e-3 / per_microbatch < HOST_OP_S < 28.0e-3 / per_microbatch


def test_small_model_keeps_grouping_and_ratios():
    llama = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                        ffn_hidden_size=14336, vocab_size=128256, seq_length=8192, swiglu=True, normalization="RMSNorm")
    small = small_model(llama)
    assert (small.num_attention_heads, small.num_query_groups, small.num_layers) == (4, 1, 1)
    assert small.ffn_hidden_size * llama.hidden_size == llama.ffn_hidden_size * small.hidden_size
    assert small.swiglu and small.normalization == "RMSNorm"


def test_squared_relu_counts_its_two_kernels():
    """--squared-relu runs relu then the square where GeLU is one operator: one more forward; the attention alike."""
    gelu = unit_op_counts(H100_RUN)
    squared = unit_op_counts(replace(H100_RUN, squared_relu=True))
    assert squared["mlp"][0] == gelu["mlp"][0] + 1 and squared["mlp"][1] > gelu["mlp"][1]
    assert squared["attention"] == gelu["attention"]


def test_fused_swiglu_and_rope_count_one_operator_each_way():
    """The fused SwiGLU and rope (models/fused_ops.py, one compiled kernel each on the GPU) count one operator each
    way, whatever their bodies run on the CPU; unfused, their ops count one by one."""
    llama = replace(H100_RUN, swiglu=True, ffn_hidden_size=2816, position_embedding_type="rope",
                    normalization="RMSNorm", num_query_groups=4, add_bias_linear=False)
    fused = unit_op_counts(llama)
    unfused = unit_op_counts(replace(llama, bias_swiglu_fusion=False, apply_rope_fusion=False))
    assert fused["mlp"][0] == unfused["mlp"][0] - 1  # silu and the product: one kernel
    assert fused["mlp"][1] < unfused["mlp"][1] and fused["attention"][0] < unfused["attention"][0]
    assert fused["attention"][1] < unfused["attention"][1]
    assert fused["embedding"] == unfused["embedding"] and fused["head"] == unfused["head"]
