"""Fill-in-the-middle (data/fim.py): exact inverse on every sample, rates within 3 sigma, the same
samples under (tp, pp, dp) = (2, 2, 2) as on 1 rank and after a resume at any step, sentinels
added to sentencepiece and Hugging Face tokenizers, bad settings refused with exit 2."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from data.fim import FIMDataset, FIMSentinels, FIMSettings, fim_inverse
from data.gpt_dataset import GPTDataset, MockGPTDataset
from data.indexed_dataset import DataError, IndexedDataset, IndexedDatasetBuilder
from data.tokenizer import FIM_TOKEN_SETS, add_fim_sentinels, load_tokenizer, train_tokenizer
from megazero.config import config_from_argv
from megazero.topology import Topology

EOD, SPLIT = 1, 7
SENT = FIMSentinels(100, 101, 102, 103)


def _docs_dataset(prefix, num_docs=400, seed=0, max_len=90):
    """Documents of 0..max_len-1 tokens (ids 2..99, some the split token 7), each ending in EOD."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.uint16) as b:
        for _ in range(num_docs):
            b.add_document(np.append(rng.integers(2, 100, rng.integers(0, max_len)), EOD))
        b.finalize()
    return IndexedDataset(prefix)


def _settings(**kw):
    return FIMSettings(**{**dict(rate=0.5, spm_rate=0.5, sentinels=SENT, eod=EOD), **kw})


@pytest.mark.parametrize(
    "kw",
    [
        dict(rate=1.0, spm_rate=0.0),
        dict(rate=1.0, spm_rate=1.0),
        dict(rate=0.5),
        dict(rate=0.9, split_sample=SPLIT, fragment_rate=0.6),
    ],
    ids=["psm", "spm", "mixed", "fragments"],
)
def test_inverse_rebuilds_every_sample_exactly(tmp_path, kw):
    """inverse(fim(x)) is exactly the first L - 3k tokens of x (k units in FIM form); length kept."""
    fim = _settings(**kw)
    gpt = GPTDataset(_docs_dataset(str(tmp_path / "d")), (0, 400), 64, 1500, seed=3)
    ds = FIMDataset(gpt, fim, seed=11)
    units = spm = 0
    for i in range(len(ds)):
        x, y = gpt[i], ds[i]
        assert y.shape == x.shape == (65,) and y.dtype == np.int64
        k = int((y == SENT.prefix).sum())
        assert k == int((y == SENT.middle).sum()) and not (y == SENT.pad).any()
        inv = fim_inverse(y, SENT, EOD, fim.split_sample)
        assert len(inv) == 65 - 3 * k
        np.testing.assert_array_equal(inv, x[: len(inv)])
        units += k
        spm += int(((y[:-1] == SENT.prefix) & (y[1:] == SENT.suffix)).sum())
    assert units > 1500 * 0.5  # the transform did happen, in both orders where asked
    if kw.get("spm_rate") == 0.0:
        assert spm < 0.3 * units  # only PSM units with an empty prefix start <PRE> <SUF>
    if kw.get("spm_rate") == 1.0:
        assert spm == units


def test_fim_fraction_of_10000_samples_is_within_3_sigma_of_the_rate():
    """One unit per sample (no EOD in mock samples): FIM fraction ~ Binomial(N, rate) / N and the
    SPM share of those ~ --fim-spm-rate, each within 3 sigma."""
    n = 10_000
    inner = MockGPTDataset(100, 63, n, seed=5)  # ids < 100, no EOD (the settings name 999)
    for rate, spm_rate in ((0.5, 0.5), (0.1, 0.8)):
        ds = FIMDataset(inner, _settings(rate=rate, spm_rate=spm_rate, eod=999), seed=2)
        ys = np.stack([ds[i] for i in range(n)])
        fimmed = ys[:, 0] == SENT.prefix
        frac = fimmed.mean()
        assert abs(frac - rate) <= 3 * math.sqrt(rate * (1 - rate) / n), (rate, frac)
        # a PSM unit with an empty prefix (a cut point at 0: 1 - (64/65)^2) also starts <PRE> <SUF>
        want = spm_rate + (1 - spm_rate) * (1 - (64 / 65) ** 2)
        spm, m = (ys[fimmed, 1] == SENT.suffix).mean(), int(fimmed.sum())
        assert abs(spm - want) <= 3 * math.sqrt(want * (1 - want) / m), (spm_rate, spm)


def test_samples_are_a_pure_function_of_seed_and_index(tmp_path):
    """Any read order gives the same samples (Megatron's shared RandomState does not); another
    seed gives others."""
    gpt = GPTDataset(_docs_dataset(str(tmp_path / "d")), (0, 400), 64, 300, seed=3)
    a, b = FIMDataset(gpt, _settings(), 11), FIMDataset(gpt, _settings(), 11)
    forward = [a[i] for i in range(300)]
    order = np.random.default_rng(0).permutation(300)
    backward = {int(i): b[int(i)] for i in order}
    assert all(np.array_equal(forward[i], backward[i]) for i in range(300))
    other = FIMDataset(gpt, _settings(), 12)
    assert sum(not np.array_equal(forward[i], other[i]) for i in range(300)) > 100


def test_no_prefix_leaves_units_starting_with_it(tmp_path):
    """--fim-no-prefix: a unit whose decoded text starts with it is never transformed."""
    gpt = MockGPTDataset(100, 31, 400, seed=1)
    text = {i: chr(0x41 + i % 26) for i in range(100)}
    fim = _settings(rate=1.0, eod=999, no_prefix="AB", decode=lambda ids: "".join(text[i] for i in ids))
    ds = FIMDataset(gpt, fim, seed=0)
    starts = [(gpt[i][0] % 26, gpt[i][1] % 26) == (0, 1) for i in range(400)]
    fimmed = [ds[i][0] == SENT.prefix for i in range(400)]
    assert any(starts) and all(f != s for f, s in zip(fimmed, starts))


# -- the run's path: tokenizer, config, build_data, the sampler ------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from data.preprocess import preprocess

    d = tmp_path_factory.mktemp("fim")
    with open(d / "c.jsonl", "w") as f:
        for i in range(120):
            f.write(json.dumps({"text": f"def f{i}(x, y):\n    z = x * {i} + y\n    return z - {i % 7}\n"}) + "\n")
    model = train_tokenizer(str(d / "c.jsonl"), 300, str(d / "tok"), num_threads=1)
    preprocess(str(d / "c.jsonl"), ["text"], model, str(d / "c"), append_eod=True, workers=1, progress=False)
    return dict(dir=d, model=model, data=str(d / "c_text_document"))


def _argv(corpus, *extra):
    return [
        "--data-path",
        corpus["data"],
        "--tokenizer-model",
        corpus["model"],
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "6",
        "--eval-iters",
        "0",
        "--fim-rate",
        "0.7",
        "--fim-spm-rate",
        "0.5",
        *extra,
    ]


def _batches(data, cfg, dp_rank, dp, steps):
    from megazero import training

    groups = SimpleNamespace(dp_rank=dp_rank, dp_size=dp)
    gbs = cfg.train.global_batch_size
    return [
        np.concatenate([x.numpy() for x, _ in training.dp_micro_batches(data.train, s * gbs, cfg, groups, "cpu")])
        for s in steps
    ]


def test_layout_2_2_2_and_every_resume_see_the_single_rank_samples(corpus):
    """Each of the 8 ranks of (tp, pp, dp) = (2, 2, 2) builds its data as train.py does; the dp
    ranks' slices, joined, are the 1-rank global batches; a run resumed at step k builds its
    data again and reads the uninterrupted run's batches from k on."""
    from megazero import training

    one = config_from_argv(_argv(corpus), 1)
    base = load_tokenizer(corpus["model"]).vocab_size
    data = training.build_data(one)
    assert data.vocab_size == base + 4 and data.tokenizer.fim == FIMSentinels(base, base + 1, base + 2, base + 3)
    ref = _batches(data, one, 0, 1, range(6))
    assert sum(int((b == base).sum()) for b in ref) > 10  # FIM units present
    for b in ref:
        assert b.max() < base + 4

    three_d = config_from_argv(_argv(corpus, "--tp", "2", "--pp", "2"), 8)
    topo = Topology(tp=2, pp=2, dp=2)
    per_dp = {}
    for rank in range(8):
        dp_rank = topo.coord(rank).dp
        mine = _batches(training.build_data(three_d), three_d, dp_rank, 2, range(6))
        assert all(np.array_equal(a, b) for a, b in zip(mine, per_dp.setdefault(dp_rank, mine)))
    for s in range(6):
        np.testing.assert_array_equal(np.concatenate([per_dp[0][s], per_dp[1][s]]), ref[s])

    for k in range(6):
        resume = {"iteration": k, "extra": {"consumed_samples": k * 8}}
        resumed = training.build_data(one, resume)
        assert all(np.array_equal(a, b) for a, b in zip(_batches(resumed, one, 0, 1, range(k, 6)), ref[k:]))


def test_checkpoint_records_the_sentinels_and_a_resume_checks_them(corpus):
    from megazero import training
    from megazero.checkpoint import CheckpointError

    cfg = config_from_argv(_argv(corpus), 1)
    rec = training.tokenizer_record(cfg)
    base = load_tokenizer(corpus["model"]).vocab_size
    assert (rec["fim"]["prefix"], rec["fim"]["pad"], rec["fim"]["appended"]) == (base, base + 3, True)
    assert training.tokenizer_record(config_from_argv(_argv(corpus)[:-4], 1))["fim"] is None  # --fim-rate 0
    meta = {"iteration": 1, "extra": {"tokenizer": {**rec, "fim": {**rec["fim"], "prefix": 5}}, "model": {}}}
    with pytest.raises(CheckpointError, match="FIM sentinels"):
        training.check_resume(cfg, meta, base + 4)
    assert training.data_signature(cfg)["fim"] == [0.7, 0.5, None, None, None]


def test_hf_tokenizer_uses_its_own_fim_tokens_and_refuses_a_partial_set(tmp_path):
    hf = pytest.importorskip("tokenizers")
    from data.tokenizer import train_hf_tokenizer

    path = train_hf_tokenizer(["def f(x):\n    return x\n"] * 20, 300, str(tmp_path / "a" / "tokenizer.json"))
    raw = hf.Tokenizer.from_file(path)
    raw.add_special_tokens(list(FIM_TOKEN_SETS[1]))
    raw.save(str(tmp_path / "full.json"))
    tok = load_tokenizer(str(tmp_path / "full.json"), "HuggingFaceTokenizer")
    size = tok.vocab_size
    s = add_fim_sentinels(tok)
    assert s.ids() == tuple(tok.token_id(t) for t in FIM_TOKEN_SETS[1]) and tok.vocab_size == size
    assert not s.appended and tok.decode([s.prefix] + tok.encode("x")) == "x"

    raw = hf.Tokenizer.from_file(path)
    raw.add_special_tokens(["<fim_prefix>", "<fim_middle>"])
    raw.save(str(tmp_path / "partial.json"))
    with pytest.raises(DataError, match=r"^--fim-tokens: .* has the FIM token '<fim_prefix>' but not '<fim_suffix>'"):
        add_fim_sentinels(load_tokenizer(str(tmp_path / "partial.json"), "HuggingFaceTokenizer"))

    plain = load_tokenizer(path, "HuggingFaceTokenizer")  # none of the sets: 4 ids appended
    n = plain.vocab_size
    assert add_fim_sentinels(plain).ids() == (n, n + 1, n + 2, n + 3) and plain.vocab_size == n + 4
    assert plain.decode([n, n + 2] + plain.encode("x")) == "x"


def test_sentencepiece_sentinels_are_appended_and_decode_to_nothing(corpus):
    tok = load_tokenizer(corpus["model"])
    n = tok.vocab_size
    assert add_fim_sentinels(tok) == FIMSentinels(n, n + 1, n + 2, n + 3) and tok.vocab_size == n + 4
    assert tok.decode([n] + tok.encode("def f") + [n + 3]) == "def f"
    assert add_fim_sentinels(tok).ids() == (n, n + 1, n + 2, n + 3) and tok.vocab_size == n + 4  # idempotent


BAD = {  # case: (extra argv, strings the one-line message must contain); config rules
    "rate_above_1": (["--fim-rate", "1.5"], ["--fim-rate 1.5", "[0, 1]"]),
    "spm_rate_above_1": (["--fim-spm-rate", "2"], ["--fim-spm-rate 2.0"]),
    "fragment_rate_without_split": (["--fim-fragment-rate", "0.5"], ["--fim-fragment-rate", "--fim-split-sample"]),
    "three_tokens": (["--fim-tokens", "a", "b", "c"], ["--fim-tokens a b c", "four distinct"]),
    "split_is_a_sentinel": (
        ["--fim-tokens", "a", "b", "c", "d", "--fim-split-sample", "c"],
        ["--fim-split-sample 'c'", "--fim-tokens"],
    ),
    "with_sft": (["--sft"], ["--fim-rate 0.7 with --sft", "drop one of them"]),
}
DATA_BAD = {  # data rules, refused by the launcher's preflight
    "named_token_missing": (["--fim-tokens", "<p>", "<m>", "<s>", "<pad>"], ["--fim-tokens: '<p>' is not a token"]),
    "named_tokens_collide_with_eod": (
        ["--fim-tokens", "<|eod|>", "<0x41>", "<0x42>", "<0x43>"],
        ["--fim-tokens", "share an id"],
    ),
    "split_not_a_token": (["--fim-split-sample", "<file_sep>"], ["--fim-split-sample '<file_sep>' is not a token"]),
}


@pytest.mark.parametrize("case", sorted(BAD) + sorted(DATA_BAD))
def test_bad_fim_settings_exit_2_naming_the_setting(case, corpus, capsys):
    from megazero import training

    extra, expected = {**BAD, **DATA_BAD}[case]
    argv = _argv(corpus, *extra)
    if case in BAD:
        with pytest.raises(SystemExit) as exc:
            config_from_argv(argv, 1)
        assert exc.value.code == 2
    else:
        assert training.preflight(argv, 1) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fix" in err, err
    for text in expected:
        assert text in err, (case, err)


def test_fim_with_mock_data_is_refused(capsys):
    with pytest.raises(SystemExit):
        config_from_argv(["--mock-data", "--fim-rate", "0.5"], 1)
    assert "--fim-rate has no effect with --mock-data" in capsys.readouterr().err
