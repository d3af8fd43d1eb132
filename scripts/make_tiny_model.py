"""Build a tiny random-weight Hugging Face model directory with a real BPE tokenizer.

The tests compare nanopipe against transformers on these models, so the directory must load with
plain `AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained` and nothing else.
Everything is built offline and is deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small engine reads a prompt, splits it into tokens
and writes one new token at a time. Every token is a number, and every number stands for a piece of
text: a letter, a part of a word, or a whole word that appears often enough to earn its own entry.
The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.
What is the capital of Germany? The capital of Germany is Berlin. Rivers run to the sea, and the
sea gives rain back to the hills. In the morning the baker opens the shop and the street smells of
bread. Children walk to school, dogs bark at the postman, and the old clock on the tower strikes
eight. She said hello to the people she met and they said hello back. He wrote a letter to his
friend and told him about the long summer, the warm nights and the stars over the quiet lake.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text as well. So do questions: why is the sky
blue? How far away is the moon? Who wrote this book? When does the train leave? Where are my keys?
A model that has learned nothing still has to answer with some token, and a test only needs the
engine and the reference to agree on which one, step after step, until the output is long enough.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    # As Qwen3's template: enable_thinking=false writes an empty reasoning block.
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(arch: str, vocab_size: int, eos_id: int, pad_id: int, shape: dict | None = None):
    from transformers import LlamaConfig, Qwen3Config

    common = dict({**SHAPE, **(shape or {})}, vocab_size=vocab_size, eos_token_id=eos_id,
                  pad_token_id=pad_id, bos_token_id=None, torch_dtype="float32")
    if arch == "qwen3":
        return Qwen3Config(**common, rope_theta=1_000_000.0, tie_word_embeddings=True)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10_000.0, tie_word_embeddings=False,
                           attention_bias=False, mlp_bias=False)
    raise ValueError(f"unknown arch {arch!r}: expected qwen3 or llama")


def make_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, vocab_size: int = 768,
                    **shape: int) -> Path:
    """Write the model into out_dir and return its path; `shape` overrides entries of SHAPE
    (e.g. num_attention_heads=6, num_key_value_heads=3, which TP=2 and TP=4 split unevenly)."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    vocab = len(tokenizer)
    config = make_config(arch, vocab, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         tokenizer.convert_tokens_to_ids("<|endoftext|>"), shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "lm_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                # Wide enough that greedy outputs differ between prompts and positions; the
                # residual branches outweigh the (tied) input embedding, or a tied model would
                # just repeat its last token.
                scale = 8.0 if ("o_proj" in name or "down_proj" in name) else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    gen_cfg = out / "generation_config.json"
    if gen_cfg.exists():
        data = json.loads(gen_cfg.read_text())
        data.pop("bos_token_id", None)
        gen_cfg.write_text(json.dumps(data, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=768)
    parser.add_argument("out_dir")
    args = parser.parse_args()
    print(make_tiny_model(args.arch, args.out_dir, args.seed, args.vocab_size))


if __name__ == "__main__":
    main()
