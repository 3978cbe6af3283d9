"""The GPU benchmark's model shapes (issue 17/18) and the files both sides train on: a model folder
with random weights made by transformers, a word-level tokenizer whose every word is one token,
and a text dataset whose rows are longer than any benchmarked sequence (so that every training
row is exactly `max_seq_len` tokens after truncation)."""
import json
import os
from pathlib import Path

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

SHAPES = {
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    # HuggingFaceTB/SmolLM2-360M
    "smollm2-360m": ("llama", dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                                   intermediate_size=2560, vocab_size=49152, tie_word_embeddings=True,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    # Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                   intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)),
    # Qwen/Qwen2.5-3B
    "qwen2.5-3b": ("qwen2", dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                                 intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)),
    # Qwen/Qwen3-0.6B-Base (heads of 128 in a hidden size of 1024, q/k head norms)
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                                 rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768)),
    # google/gemma-3-270m (GELU gate, 1 + w norms around attention and the MLP, local attention
    # over 512 positions in five layers of six, heads of 256, a 262k vocabulary)
    "gemma3-270m": ("gemma3", dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                                   head_dim=256, intermediate_size=2048, vocab_size=262144, tie_word_embeddings=True,
                                   query_pre_attn_scalar=256, sliding_window=512, rms_norm_eps=1e-6,
                                   max_position_embeddings=32768)),
    # Not a real model: a small shape to dry-run the benchmark's scripts without a GPU
    # (TORCH_DEVICE=cpu DEVICE=vulkan scripts/gpu/bench.sh smoke:2x128, on lavapipe).
    "smoke": ("qwen2", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256, vocab_size=4096, tie_word_embeddings=False,
                            rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1024)),
    "smoke-qwen3": ("qwen3", dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=64, intermediate_size=256, vocab_size=4096, tie_word_embeddings=True,
                                  rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=1024)),
    "smoke-gemma3": ("gemma3", dict(hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=64, intermediate_size=256, vocab_size=4096, tie_word_embeddings=True,
                                    query_pre_attn_scalar=64, sliding_window=64, rms_norm_eps=1e-6,
                                    max_position_embeddings=1024)),
}


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return Gemma3TextConfig, Gemma3ForCausalLM


CLASSES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM), "gemma3": _gemma3()}

WORDS = 4000


def config(shape):
    arch, kw = SHAPES[shape]
    return CLASSES[arch][0](bos_token_id=1, eos_token_id=2, **kw)


def make(shape, root, device="cuda"):
    """Model folder, tokenizer and dataset for `shape` under `root` (kept if already there); the
    random weights are drawn on `device`."""
    root = Path(root)
    model_dir, data = root / shape, root / "data.jsonl"
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        cfg = config(shape)
        cls = CLASSES[SHAPES[shape][0]][1]
        with torch.device(device):
            model = cls(cfg).to(torch.bfloat16)
        model.save_pretrained(model_dir)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        write_tokenizer(model_dir)
    if not data.exists():
        g = torch.Generator().manual_seed(0)
        with open(data, "w") as f:
            for _ in range(512):
                ids = torch.randint(3, WORDS, (1100,), generator=g).tolist()
                f.write(json.dumps({"text": " ".join(f"w{i}" for i in ids)}) + "\n")
    return model_dir, data


def write_tokenizer(model_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(model_dir) / "tokenizer.json"))
    (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 32768}))
