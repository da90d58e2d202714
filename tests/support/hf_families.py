"""The Hugging Face family folders the family tests share (``folders``): Llama-3.x, Mistral, Qwen2,
Qwen3, Qwen3-MoE, gpt-oss and DeepSeek-V3 at tiny sizes, written by transformers' own config and model classes
(no network), with a 300-token tokenizer and a tokenized corpus; each family's run argv uses the
model flags ``python -m scripts.convert_checkpoint --print-flags`` prints for its folder, except
``HAND``'s, written by hand (tests/unit/test_hf_flags.py holds the two to the same model). What
each folder holds and why: tests/layouts/test_hf_families.py's docstring."""

import json
import shutil

import pytest
import torch

from tests.support.extras import require
from tests.support.hf_convert import MODEL
from tests.support.hf_tokenizer import corpus

SIZES = dict(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # weights large enough that positions and biases move the logits
)
# family -> (transformers config class, its options, the run's model flags). The flags are those
# ``convert_checkpoint.py --print-flags`` prints for the folder (None), except gpt-oss's, written by
# hand: test_printed_flags_give_the_folders_model holds the printed ones to them.
HAND = "gpt-oss"
FAMILIES = {
    # wavelengths 2 pi x (1, 10, 100, 1000) positions against original 64 / (1, 8): one pair kept,
    # one interpolated, two slowed 4 times
    "llama3": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=8.0,
                original_max_position_embeddings=64,
            ),
        ),
        None,
    ),
    # Llama's block with heads of 12 dimensions and Mistral-7B-v0.1's sliding window on every layer
    # (8 positions: shorter than the 16-token training sequence and the 48-token prompts), untied
    "mistral": (
        "MistralConfig",
        dict(
            head_dim=12,
            tie_word_embeddings=False,
            sliding_window=8,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        None,
    ),
    # Qwen2 with use_sliding_window: layer 0 full (max_window_layers 1), layer 1 a window of 8
    "qwen2": (
        "Qwen2Config",
        dict(
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
        None,
    ),
    # heads of 12 dimensions (q/k/v 48 wide against a hidden size of 32) with QK-norm, untied
    "qwen3": (
        "Qwen3Config",
        dict(
            head_dim=12,
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=4096,
            max_window_layers=1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=True,
            ),
        ),
        None,
    ),
    # Qwen3's attention with 4 experts of width 16, top 2 of the full softmax not renormalised
    # (norm_topk_prob false), layer 1 dense (mlp_only_layers: --moe-layer-freq 2)
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=12,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=8.0,
                original_max_position_embeddings=32,
                beta_fast=16.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=0.5,
                truncate=False,
            ),
        ),
        None,
    ),
    # gpt-oss: q/k/v/o biases, learned sinks, layer 0 sliding (window 8) and layer 1 full, yarn RoPE
    # (factor 4 over an original 64 positions, truncate false), 4 experts (top 2 of the router's
    # biased logits, softmaxed over the 2) with the clamped quick GEGLU (limit 1.0, so it bites)
    "gpt-oss": (
        "GptOssConfig",
        dict(
            head_dim=12,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.0,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),
        ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--quick-geglu"]
        + ["--glu-linear-offset", "1", "--activation-func-clamp-value", "1.0", "--ffn-hidden-size", "64"]
        + ["--group-query-attention", "--num-query-groups", "2", "--layernorm-epsilon", "1e-6"]
        + ["--max-position-embeddings", "256", "--rotary-base", "10000", "--untie-embeddings-and-output-weights"]
        + ["--kv-channels", "12", "--softmax-type", "learnable", "--window-size", "7,0"]
        + ["--window-attn-skip-freq", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-linear-bias"]
        + ["--moe-ffn-hidden-size", "64", "--yarn-rotary-scaling-factor", "4"]
        + ["--yarn-original-max-position-embeddings", "64", "--no-yarn-correction-range-round-to-int"],
    ),
    # DeepSeek-V3: MLA (q latent 16, kv latent 12, heads of 8 + 4 rope + 6 value dims, DeepSeek's
    # interleaved rope rows), layer 0 dense (first_k_dense_replace 1: --moe-layer-freq 0,1), layer 1 of
    # 8 sigmoid-routed experts of width 16 in 2 groups (top 2 inside the best group, a random
    # correction bias, weights times 2.5) plus a shared expert, yarn RoPE with mscale_all_dim
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=False,
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            rope_interleave=True,
            first_k_dense_replace=1,
            n_routed_experts=8,
            n_shared_experts=1,
            moe_intermediate_size=16,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
                truncate=True,
            ),
        ),
        None,
    ),
}


def make_folder(d, family, tokenizer_json):
    """Write ``family``'s folder at ``d`` (seeded weights, biases and norms moved off their
    starting values, ``tokenizer_json`` copied in); returns the transformers model (fp32, eval)."""
    import transformers

    cls_name, options, _ = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**SIZES, **options})
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: give them values a wrong map would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.5 * torch.randn(p.shape))
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias, a buffer: one that moves the choice
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape))
    model.save_pretrained(d)
    shutil.copy(tokenizer_json, d / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> (folder, the transformers model, the run's argv) on a 300-token corpus; the argv's
    model flags are the folder's printed ones (``model.hf_flags.folder_flags``) but for ``HAND``."""
    require("transformers")
    require("safetensors")
    from data.preprocess import preprocess
    from data.tokenizer import load_tokenizer, train_hf_tokenizer
    from model.hf_flags import folder_flags

    d = tmp_path_factory.mktemp("families")
    tok_json = train_hf_tokenizer(corpus(200), 300, str(d / "tok" / "tokenizer.json"))
    tok = load_tokenizer(tok_json, "HuggingFaceTokenizer")
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus(150)), encoding="utf-8")
    preprocess(str(src), ["text"], tok.model_path, str(d / "c"), progress=False, tokenizer_type="HuggingFaceTokenizer")
    data = ["--data-path", str(d / "c_text_document"), "--tokenizer-type", "HuggingFaceTokenizer"]
    data += ["--tokenizer-model", tok.model_path, "--train-iters", "2"]
    out = {}
    for family in FAMILIES:
        folder = d / family
        model = make_folder(folder, family, tok.model_path)
        flags = FAMILIES[family][2] or folder_flags(str(folder))
        out[family] = str(folder), model, MODEL + flags + data
    return out
