"""The tiny Llama of the Hugging Face tests: LLAMA flags, PROMPT, llama_gcfg and hf_llama_model."""

import torch

LLAMA = [
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "1000",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--layernorm-epsilon",
    "1e-6",
    "--max-position-embeddings",
    "32",
    "--init-method-std",
    "0.1",
]


PROMPT = "def add(a, b):\n"


def llama_gcfg(**kw):
    from model.config import GPTConfig

    base = dict(
        vocab_size=50,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=12,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-6,
        make_vocab_size_divisible_by=16,
        position_embedding_type="rope",
        rotary_base=1000,
        normalization="RMSNorm",
        swiglu=True,
        num_query_groups=2,
        add_bias_linear=False,
        tie_embeddings=False,
    )
    return GPTConfig(**{**base, **kw})


def hf_llama_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
