"""A reward model's Hugging Face export: ``GPT2ForSequenceClassification`` (GPT-2 block) or
``LlamaForSequenceClassification`` (LLaMA-style block; ``Mistral...`` / ``Qwen2...`` / ``Qwen3...``
for those families' exports) with one label.

The body is the language model's export (``model/hf.py``: the same tensor names under
``transformer.`` / ``model.``, the same checks of every setting); the output layer is dropped
and the value head ``value_head.weight`` ``[1, H]`` becomes ``score.weight``. Those classes
score the last token of each row that is not ``pad_token_id`` (transformers' rule since 4.48:
the rightmost non-pad position), which is the token megazero's value head scores
(``model/value_head.py``) once ``pad_token_id`` is the EOD and a sequence is cut after its
response, or right-padded with EOD. Experts (Mixtral, Qwen2-MoE) are refused: their reward
export is not written yet.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from model import hf_moe
from model.config import GPTConfig
from model.hf import hf_config, is_llama, to_hf_tensors
from model.hf_config import HFConversionError

HEAD = "value_head.weight"


def reward_architecture(gcfg: GPTConfig) -> str:
    """The transformers class of ``gcfg``'s reward model. Raises HFConversionError for a block
    without one here (experts)."""
    if hf_moe.is_moe(gcfg):
        raise HFConversionError(
            "a reward model with experts has no sequence-classification export here (GPT-2 and "
            "LLaMA-style blocks only); fix: keep the megazero checkpoint, or export a dense reward model"
        )
    return "LlamaForSequenceClassification" if is_llama(gcfg) else "GPT2ForSequenceClassification"


def to_hf_reward(
    full: Mapping[str, torch.Tensor], gcfg: GPTConfig, eod: Optional[int]
) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, ``config.json``) of the sequence-classification model that scores what
    ``gcfg``'s reward model scores, from its full canonical tensors (``value_head.weight``
    ``[1, H]`` among them). ``eod``: the tokenizer's EOD id, written as ``pad_token_id`` (and
    BOS/EOS). Raises HFConversionError for a missing head, no EOD, or what the language-model
    export refuses."""
    arch = reward_architecture(gcfg)
    if HEAD not in full:
        raise HFConversionError(f"the checkpoint lacks parameter {HEAD!r} (not a --post-train rm checkpoint)")
    if eod is None:
        raise HFConversionError(
            "a reward model's export needs the tokenizer's EOD as pad_token_id (the scored token is "
            "the last one before it); fix: give --tokenizer-model"
        )
    lm = dataclasses.replace(gcfg, value_head=False)
    tensors = to_hf_tensors({k: v for k, v in full.items() if k != HEAD}, lm)
    tensors.pop("lm_head.weight", None)
    tensors["score.weight"] = full[HEAD].float().reshape(1, gcfg.hidden_size).contiguous()
    config = hf_config(lm, eod)
    if arch.startswith("Llama"):  # the family's own class: Qwen2 / Qwen3 keep their model_type
        arch = config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    config.update(
        architectures=[arch],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        pad_token_id=eod,
        tie_word_embeddings=False,
    )
    return tensors, config
