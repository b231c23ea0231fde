"""Build a tiny random Llama model for the engine tier, with no download
(docs/design.md §10; docs/engines.md): run with the engines' virtualenv Python.

    python tinymodel.py OUT_DIR [--moe]

hidden 128, 2 layers, 4 heads of 32 (the CPU attention needs head_dim in 32, 64, ...),
vocab 1024, bf16 safetensors, and a byte-level BPE tokenizer trained on a few
sentences: about 1.1 MB, a few seconds. `--moe`: the same as a mixture of experts
(Mixtral: 4 experts, 2 per token; 2.3 MB), for what vLLM's CPU build does with expert and
data parallel (docs/engines.md, "Data parallel").
"""

from __future__ import annotations

import sys
from pathlib import Path

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A replica of a large model spans several nodes; each node runs one shard.",
    "systemd starts, orders, restarts and stops the units of every shard.",
    "Hello world, this is a tiny model for tests that never leave the machine.",
] * 50


def main() -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        PreTrainedTokenizerFast,
    )

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    shape = dict(hidden_size=128, intermediate_size=256, head_dim=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                 max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                 torch_dtype="bfloat16")
    if "--moe" in sys.argv[2:]:
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                 tie_word_embeddings=False, **shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()
