"""Checkpoint converters: Hugging Face GPT-2 and BERT, Megatron-LM; tensor-parallel (un)sharding by name."""
