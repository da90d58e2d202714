"""scripts/generate.py and model/sampling.py: the KV-cache forward equals the full forward,
temperature 0 equals transformers' greedy generate on the same exported model under tp 1 and
tp 2, sampling is reproducible with a seed, and top-k / top-p keep the tokens they should."""

import json

import pytest
import torch

from tests.support.checkpoint import ARGS, run_checkpointed
from tests.support.checkpoint_shards import allocation_peak
from tests.support.distributed import run_distributed
from tests.support.extras import require
from tests.support.generate import generate_args
from tests.support.layouts import LLAMA

PROMPT = "def add(a, b):\n"


def _hf_greedy(hf_dir, prompt_ids, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=model.config.eos_token_id
    )
    return out[0].tolist()


def _tp_generate(rank, world, hf_dir):
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training.inference import load_model
    from model.sampling import sample

    groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1))
    stage, tok = load_model(generate_args(hf_dir), groups, torch.device("cpu"))
    prompt = tok.encode(PROMPT)
    greedy = sample(stage, prompt, 24, temperature=0.0)
    drawn = [sample(stage, prompt, 24, temperature=0.9, top_k=40, top_p=0.95, seed=s) for s in (7, 7, 8)]
    return prompt, greedy, drawn


def test_kv_cache_logits_equal_the_full_forward(hf_dir):
    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from model.sampling import forward_cached

    stage, _ = load_model(generate_args(hf_dir), ProcessGroups.single(), torch.device("cpu"))
    stage.eval()
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    caches = [None] * len(stage.layers)
    steps = [forward_cached(stage, ids[:, :12], caches)] + [
        forward_cached(stage, ids[:, t : t + 1], caches) for t in range(12, 20)
    ]
    with torch.no_grad():
        full = stage(ids)[..., :300]  # (B, T, V)
    for got, t in zip(steps, range(11, 20)):
        torch.testing.assert_close(got, full[:, t], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceed the model's 64 positions"):
        forward_cached(stage, torch.zeros(1, 60, dtype=torch.long), caches)


def test_generation_stops_at_the_models_positions(hf_dir):
    """More new tokens than the model has positions: the continuation fills the 64 positions and
    stops there, as the docs say (it used to raise in the middle of decoding, naming 65)."""
    from megazero.process_groups import ProcessGroups
    from megazero.training.inference import load_model
    from model.sampling import sample

    stage, _ = load_model(generate_args(hf_dir), ProcessGroups.single(), torch.device("cpu"))
    for prompt, new in (([5, 17, 30], 70), ([1] * 64, 5), ([2] * 63, 1)):
        ids = sample(stage, prompt, new)
        assert len(ids) == min(64, len(prompt) + new) and ids[: len(prompt)] == prompt


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_transformers_generate_and_sampling_is_reproducible(hf_dir, tp):
    prompt, greedy, drawn = run_distributed(_tp_generate, tp, hf_dir)[0]
    assert greedy == _hf_greedy(hf_dir, prompt, 24)
    assert drawn[0] == drawn[1] and drawn[0] != drawn[2]  # the seed fixes the draws
    assert len(drawn[0]) > len(prompt) and drawn[0][: len(prompt)] == prompt


def _load_peak(rank, world, ckpt):
    """This tp rank's allocation peak while ``load_model`` reads ``ckpt``, its own partitions'
    bytes, the largest full tensor's bytes, the peak of reading every full tensor
    (``read_full_weights``), and whether both give the same parameters."""
    from types import SimpleNamespace

    from megazero.checkpoint import read_full_weights
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training.inference import load_model
    from model.gpt import GPTStage

    torch.set_num_threads(1)
    groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1))
    args = SimpleNamespace(load=ckpt, from_hf=None, tokenizer_model=None, tokenizer_type=None)
    got = {}
    peak = allocation_peak(lambda: got.update(stage=load_model(args, groups, torch.device("cpu"), False)[0]))
    stage = got.pop("stage")
    own = sum(p.numel() * p.element_size() for p in stage.parameters())
    layers = range(stage.cfg.num_layers)
    full_peak = allocation_peak(
        lambda: got.update(
            stage=GPTStage(stage.cfg, groups, layers, True, True, seed=0, full_weights=read_full_weights(ckpt)[1])
        )
    )
    full = read_full_weights(ckpt)[1]
    same = [torch.equal(a, b) for a, b in zip(stage.parameters(), got["stage"].parameters())]
    largest = max(t.numel() * t.element_size() for t in full.values())
    return peak, own, largest, full_peak, sum(t.numel() * t.element_size() for t in full.values()), all(same)


@pytest.mark.parametrize("block", ["gpt", "llama"])
def test_each_tp_rank_reads_only_its_own_partitions(tmp_path, block):
    """``--load`` of a tp-1 checkpoint under tp 2: each rank's load peaks within its own
    partitions plus one full tensor (a saved chunk being read) plus 4 KiB, not every full
    tensor (``read_full_weights``: all of them plus the partitions); the parameters are those
    cut from the full tensors, also for the LLaMA block (SwiGLU's strided partition, grouped
    query attention, an untied output layer) with a vocabulary padded to 1016 rows when saved
    and 1024 when loaded."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(
        run_checkpointed, 1, ARGS + (LLAMA + ["--vocab-size", "1010"] if block == "llama" else []), 1, save=ckpt
    )
    for rank, (peak, own, largest, full_peak, every, same) in enumerate(run_distributed(_load_peak, 2, ckpt)):
        assert same, rank
        assert own < every / 2 + largest  # half of each partitioned tensor, the replicated ones whole
        assert own <= peak <= own + largest + 4096, (rank, peak, own, largest)
        assert full_peak >= every + own - largest, (rank, full_peak, every)


def test_top_k_and_top_p_keep_the_right_tokens():
    from model.sampling import choose

    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    g = torch.Generator().manual_seed(0)
    seen = lambda **kw: {int(choose(logits, 1.0, generator=g, **kw)[0]) for _ in range(400)}
    assert seen(top_k=0, top_p=1.0) == {0, 1, 2, 3}
    assert seen(top_k=2, top_p=1.0) == {0, 1}
    assert seen(top_k=0, top_p=0.5) == {0, 1}  # 0.4 < 0.5, so the 0.3 token is needed too
    assert seen(top_k=0, top_p=0.4) == {0}
    # top-p acts on the top-k renormalised distribution (0.44, 0.33, 0.22): mass before token 2 is 0.78
    assert seen(top_k=3, top_p=0.75) == {0, 1} and seen(top_k=3, top_p=0.8) == {0, 1, 2}
    assert int(choose(logits, 0.0, 0, 1.0, None)[0]) == 0
    with pytest.raises(ValueError, match="--top-p"):
        choose(logits, 1.0, 0, 0.0, g)


def test_cli_prints_the_greedy_text_and_ids(hf_dir, capsys):
    from data.tokenizer import load_tokenizer
    from scripts.generate import main

    assert (
        main(
            [
                "--from-hf",
                hf_dir,
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "10",
                "--temperature",
                "0",
                "--print-ids",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    text, ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    tok = load_tokenizer(hf_dir, "HuggingFaceTokenizer")
    assert json.loads(ids) == _hf_greedy(hf_dir, tok.encode(PROMPT), 10)
    assert text == tok.decode(json.loads(ids)) and text.startswith(PROMPT)
    assert main(["--from-hf", hf_dir, "--prompt", "", "--device", "cpu"]) == 2
    assert "non-empty prompt" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gpt2_default_dir(tmp_path_factory):
    """A ``transformers`` GPT2LMHeadModel with ``GPT2Config``'s defaults (``activation_function``
    ``gelu_new``, the tanh GELU of the public GPT-2 checkpoints) at tiny sizes, saved with
    ``save_pretrained`` (no tokenizer): the folder a user downloads, minus the tokenizer."""
    require("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=96,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.2,
    )
    assert hf_cfg.activation_function == "gelu_new"
    torch.manual_seed(3)
    out = str(tmp_path_factory.mktemp("gpt2default") / "hf")
    GPT2LMHeadModel(hf_cfg).eval().save_pretrained(out)
    return out


def _tp_logits(rank, world, hf_dir, ids):
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training.inference import load_model

    groups = ProcessGroups.build(Topology(tp=world, pp=1, dp=1))
    stage, tok = load_model(generate_args(hf_dir), groups, torch.device("cpu"), need_tokenizer=False)
    with torch.no_grad():
        return tok, stage.cfg.openai_gelu, stage.eval()(torch.tensor(ids))[..., :96]


def test_gpt2_config_default_folder_imports_under_tp2_with_the_tanh_gelu(gpt2_default_dir, capsys):
    """A GPT2Config()-default folder (gelu_new) loads under tp 2 with the tanh
    GELU (logits equal transformers' within 1e-5), --prompt-ids generates from it without a
    tokenizer (greedy ids equal transformers'), and a training run's --from-hf names
    --openai-gelu until it is given."""
    from transformers import AutoModelForCausalLM

    from megazero.checkpoint import CheckpointError
    from megazero.config import config_from_argv
    from model.build import check_from_hf
    from scripts.generate import main

    ids = [[5, 17, 30, 2, 88, 41, 7, 63], [1, 2, 3, 4, 5, 6, 7, 8]]
    hf = AutoModelForCausalLM.from_pretrained(gpt2_default_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits
    tok, tanh, ours = run_distributed(_tp_logits, 2, gpt2_default_dir, ids)[0]
    assert tok is None and tanh is True
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max().item())
    exact = (theirs - ours).abs().max().item()
    assert (
        main(
            [
                "--from-hf",
                gpt2_default_dir,
                "--prompt-ids",
                "5,17,30",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out) == _hf_greedy(gpt2_default_dir, [5, 17, 30], 6)
    assert main(["--from-hf", gpt2_default_dir, "--prompt-ids", "5,96", "--device", "cpu"]) == 2
    assert "--prompt-ids 96 is not a token id of the model's vocabulary of 96" in capsys.readouterr().err
    model = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--mock-data",
        "--from-hf",
        gpt2_default_dir,
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
    ]
    with pytest.raises(CheckpointError, match="openai_gelu = True, this run False; fix: set --openai-gelu"):
        check_from_hf(config_from_argv(model, 1), 96)
    check_from_hf(config_from_argv(model + ["--openai-gelu"], 1), 96)
    assert exact < 1e-5
