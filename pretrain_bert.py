"""Pretrain a BERT model (masked LM + sentence-order prediction) with Megatron-LM's command-line flags (see README)."""

from megatron_bmw.training.pretrain import main

if __name__ == "__main__":
    main(model_type="bert")
