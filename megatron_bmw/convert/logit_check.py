"""--check-logits of the Hugging Face converters: one random token batch through our model (built from a checkpoint
of ours, one process, fp32) and through the transformers model of a Hugging Face folder, and the largest absolute
difference of their logits over the real (unpadded) vocabulary. Beyond the tolerance the tool exits 1.

GPT-2, Llama-family and MoE (Mixtral, Qwen2-MoE) models compare their causal LM logits; BERT its masked-LM prediction logits (no padding,
token type 0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import RunError, UsageError

DEFAULT_TOLERANCE = 1e-3
BATCH, SEQ, SEED = 2, 16, 1234
WORD_EMBEDDING = "units.embedding.word_embeddings.weight"
# a config.json without `architectures`: the class its model type loads
_HF_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
             "bert": "BertForPreTraining", "megatron-bert": "MegatronBertForPreTraining",
             "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def our_model(full: dict[str, torch.Tensor], args: dict[str, Any]) -> tuple[torch.nn.Module, ModelConfig]:
    """Our serial model in fp32 and eval mode with the checkpoint's weights (its padded vocabulary included)."""
    from ..models.chunk import ModelChunk, build_units
    from ..parallel.state import ParallelState

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    kwargs = {k: args[k] for k in names if k in args and k != "params_dtype"}
    kwargs.update(vocab_size=int(full[WORD_EMBEDDING].shape[0]), hidden_dropout=0.0, attention_dropout=0.0,
                  attention_backend="unfused", params_dtype="fp32")
    cfg = ModelConfig(**kwargs)
    model = ModelChunk(build_units(cfg, ParallelState.serial(), seed=0)).eval()
    try:
        model.load_state_dict({k: t.float() for k, t in full.items()}, strict=True)
    except RuntimeError as exc:
        raise UsageError(f"--check-logits: the checkpoint's weights do not fit the model its args describe "
                         f"({str(exc).splitlines()[0]})") from None
    return model, cfg


def our_logits(model: torch.nn.Module, cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, padded vocab] logits of our model for `tokens` [b, s]."""
    batch = {"tokens": tokens}
    if cfg.model_type == "bert":
        batch.update(types=torch.zeros_like(tokens), padding_mask=torch.ones_like(tokens, dtype=torch.bool))
    hidden = None
    with torch.no_grad():
        for name, unit in model.units.items():
            if name != "head":
                hidden = unit(hidden, batch)
            elif cfg.model_type == "bert":
                return unit.outputs(hidden, batch)[0].transpose(0, 1).float()
            else:
                return unit.logits(hidden).transpose(0, 1).float()
    raise UsageError("--check-logits: the model has no head")


def hf_model(hf_dir: str) -> Any:
    """The transformers model of a local Hugging Face folder, fp32, eval mode (its class from config.json)."""
    try:
        import transformers
    except ImportError:
        raise UsageError("--check-logits needs the transformers package") from None
    transformers.utils.logging.disable_progress_bar()  # its bars on stderr would break an error's one line
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    arch = (getattr(config, "architectures", None) or [_HF_CLASS.get(config.model_type, "")])[0]
    if not hasattr(transformers, arch):
        raise UsageError(f"--check-logits: {hf_dir}/config.json names no model class transformers has ({arch!r})")
    return getattr(transformers, arch).from_pretrained(hf_dir).float().eval()


def hf_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if "Bert" in type(model).__name__:
            out = model(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                        token_type_ids=torch.zeros_like(tokens))
            return out.prediction_logits.float()
        return model(input_ids=tokens).logits.float()


def random_tokens(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, seq), generator=torch.Generator().manual_seed(SEED))


def max_logit_difference(full: dict[str, torch.Tensor], args: dict[str, Any], hf_dir: str
                         ) -> tuple[float, tuple[int, int]]:
    """(largest |ours - transformers| over the unpadded vocabulary, the batch's shape)."""
    model, cfg = our_model(full, args)
    theirs_model = hf_model(hf_dir)
    vocab = int(theirs_model.config.vocab_size)
    limits = [SEQ, cfg.seq_length, cfg.max_position_embeddings or SEQ,
              getattr(theirs_model.config, "max_position_embeddings", None) or SEQ]
    tokens = random_tokens(vocab, min(limits))
    ours = our_logits(model, cfg, tokens)[..., :vocab]
    theirs = hf_logits(theirs_model, tokens)
    if ours.shape != theirs.shape:
        raise UsageError(f"--check-logits: our logits are {tuple(ours.shape)}, transformers' {tuple(theirs.shape)}")
    return (ours - theirs).abs().max().item(), tuple(tokens.shape)


def check_logits(load: str, hf_dir: str, tolerance: float = DEFAULT_TOLERANCE) -> float:
    """Compare the checkpoint at `load` with the Hugging Face folder `hf_dir`; print the difference, and raise
    RunError (exit 1) when it is beyond `tolerance`."""
    from .checkpoint_files import load_full

    full, args = load_full(load)
    diff, shape = max_logit_difference(full, args, hf_dir)
    print(f"check-logits: max |logits ours - transformers| = {diff:.3g} over {shape[0]}x{shape[1]} random tokens "
          f"(fp32, tolerance {tolerance:g})")
    if not math.isfinite(diff) or diff > tolerance:
        raise RunError(f"--check-logits: the logits of {load} and {hf_dir} differ by {diff:.3g}, more than "
                       f"--check-logits-tolerance {tolerance:g}")
    return diff
