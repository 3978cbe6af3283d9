"""What the PyTorch references share: issue 11's model shapes and LoRA setup, as in
benches/common/mod.rs."""
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=1000, tie_word_embeddings=False),
    "small": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=768, vocab_size=8000, tie_word_embeddings=False),
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0),
    # google/gemma-3-270m, as rtune's scratch Gemma 3 (benches/common/mod.rs) lays it out
    "gemma3-270m": dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=2048, vocab_size=262144, tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=512, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0}, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, hidden_activation="gelu_pytorch_tanh"),
}


def lora_model(shape, max_positions):
    """A random-weight Llama (or Qwen3) of `shape` with PEFT LoRA r=8 alpha=16 dropout 0 on q/k/v/o_proj,
    in training mode, on all cores; and its AdamW (lr 2e-4, no weight decay)."""
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    config, cls = (Qwen3Config, Qwen3ForCausalLM) if shape.startswith("qwen3") else (LlamaConfig, LlamaForCausalLM)
    if shape.startswith("gemma3"):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
        config, cls = Gemma3TextConfig, Gemma3ForCausalLM
    eps = 1e-6 if shape.startswith(("qwen3", "gemma3")) else 1e-5
    cfg = config(max_position_embeddings=max_positions, rms_norm_eps=eps, **SHAPES[shape])
    model = cls(cfg)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.0)
    return cfg, model, opt
