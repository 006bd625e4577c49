"""The character-LM example: shipped data, vocabulary, sharded sampler, model, trainer."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from p2ptrain.examples.charlm.data import (
    DATA_FILE,
    TEXT_SHA256,
    BatchSampler,
    Corpus,
    Vocab,
    load_corpus,
    load_text,
)
from p2ptrain.examples.charlm.model import (
    ModelConfig,
    evaluate,
    generate,
    loss,
    make_model,
    make_optimizer,
)
from p2ptrain.examples.charlm.train_single import TrainConfig, lr_at, train

KJV_CHARS = "\n !'(),-.0123456789:;?ABCDEFGHIJKLMNOPQRSTUVWYZabcdefghijklmnopqrstuvwxyz"
TINY = ModelConfig(vocab_size=len(KJV_CHARS), context=32, d_model=32, n_layers=1, n_heads=2)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus()


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """The models here are tiny: one thread is fastest, and steadiest on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- data -------------------------------------------------------------------


def test_shipped_text_is_the_documented_one() -> None:
    text = load_text()
    assert hashlib.sha256(text.encode()).hexdigest() == TEXT_SHA256
    assert len(text) == 4_304_244
    assert text.startswith(
        "Genesis\n\n1:1 In the beginning God created the heaven and the earth.\n"
    )
    assert text.endswith("22:21 The grace of our Lord Jesus Christ be with you all. Amen.\n")
    assert text.count("\n\n") == 2 * 66 - 1  # a blank line after each heading, between books
    provenance = (DATA_FILE.parent / "PROVENANCE.md").read_text()
    assert TEXT_SHA256 in provenance


def test_corrupt_or_unexpected_file_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.xz"
    broken.write_bytes(b"not xz at all")
    with pytest.raises(ValueError, match="xz"):
        load_text(broken)
    with pytest.raises(ValueError, match="sha256"):
        load_text(DATA_FILE, sha256="0" * 64)


def test_vocabulary_is_fixed_and_round_trips(corpus: Corpus) -> None:
    assert corpus.vocab == Vocab(KJV_CHARS)
    assert corpus.vocab.size == 73
    tokens = torch.cat([corpus.train, corpus.val])
    assert tokens.dtype == torch.uint8
    assert int(tokens.max()) == corpus.vocab.size - 1
    text = load_text()
    piece = text[1_000_000:1_100_000]
    encoded = corpus.vocab.encode(piece)
    assert corpus.vocab.decode(encoded) == piece
    assert corpus.vocab.decode(encoded.tolist()) == piece


def test_vocabulary_rejects_what_it_cannot_represent() -> None:
    vocab = Vocab("ab")
    with pytest.raises(ValueError, match="'c'"):
        vocab.encode("abc")
    with pytest.raises(ValueError, match="'é'"):
        vocab.encode("aé")
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        vocab.decode([0, 2])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        vocab.decode([-1])
    with pytest.raises(ValueError, match="distinct"):
        Vocab("aa")
    with pytest.raises(ValueError):
        Vocab("")


def test_split_deals_every_tenth_block_to_validation(corpus: Corpus) -> None:
    total = corpus.train.numel() + corpus.val.numel()
    assert total == 4_304_244
    assert 0.09 < corpus.val.numel() / total < 0.11
    text = load_text()
    vocab = corpus.vocab
    # the first validation block is block 9, and training resumes with block 10
    assert vocab.decode(corpus.val[:16384]) == text[9 * 16384 : 10 * 16384]
    assert vocab.decode(corpus.train[9 * 16384 : 9 * 16384 + 100]) == text[10 * 16384 :][:100]


# --- sampler ----------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [2, 4, 8])
def test_shard_batches_concatenate_to_the_single_process_batch(
    corpus: Corpus, num_shards: int
) -> None:
    sampler = corpus.sampler(seq_len=64, seed=3)
    per_peer = 3
    for step in [0, 1, 2, 7, 1000]:
        single = sampler.batch(step, num_shards * per_peer)
        peers = [
            sampler.batch(step, per_peer, shard=i, num_shards=num_shards) for i in range(num_shards)
        ]
        assert torch.equal(torch.cat(peers), single)


def test_four_peers_follow_the_single_process_stream_step_by_step(corpus: Corpus) -> None:
    sampler = corpus.sampler(seq_len=32, seed=0)
    single = sampler.batches(8)
    peers = [sampler.batches(2, shard=i, num_shards=4) for i in range(4)]
    for _ in range(5):
        assert torch.equal(torch.cat([next(p) for p in peers]), next(single))


def test_samples_are_windows_of_the_training_split(corpus: Corpus) -> None:
    sampler = corpus.sampler(seq_len=128, seed=1)
    batch = sampler.batch(5, 16)
    assert batch.shape == (16, 129)
    assert batch.dtype == torch.int64
    for row, start in zip(batch, sampler.starts(5 * 16, 16).tolist(), strict=True):
        assert torch.equal(row, corpus.train[start : start + 129].long())


def test_sampler_is_a_pure_function_of_seed_and_step(corpus: Corpus) -> None:
    first = corpus.sampler(seq_len=64, seed=11)
    again = load_corpus().sampler(seq_len=64, seed=11)
    other = corpus.sampler(seq_len=64, seed=12)
    assert torch.equal(first.batch(42, 8), again.batch(42, 8))
    assert torch.equal(first.batch(42, 8), first.batch(42, 8))
    assert not torch.equal(first.batch(42, 8), other.batch(42, 8))
    assert not torch.equal(first.batch(42, 8), first.batch(43, 8))


def test_each_epoch_covers_disjoint_windows_once() -> None:
    tokens = torch.arange(1000) % 251
    sampler = BatchSampler(tokens.to(torch.uint8), seq_len=9, seed=5)
    windows = sampler.windows_per_epoch
    assert windows == 1000 // 10 - 1
    epochs = [sampler.starts(e * windows, windows) for e in range(3)]
    for starts in epochs:
        assert len(set(starts.tolist())) == windows
        assert len(set((starts % 10).tolist())) == 1  # one phase per epoch
        assert int(starts.max()) + 10 <= tokens.numel()
    assert not torch.equal(epochs[0], epochs[1])
    # a range that straddles an epoch boundary agrees with the per-epoch view
    straddle = sampler.starts(windows - 3, 6)
    assert torch.equal(straddle, torch.cat([epochs[0][-3:], epochs[1][:3]]))


def test_sampler_rejects_bad_arguments(corpus: Corpus) -> None:
    sampler = corpus.sampler(seq_len=16, seed=0)
    with pytest.raises(ValueError):
        sampler.batch(-1, 4)
    with pytest.raises(ValueError):
        sampler.batch(0, 0)
    with pytest.raises(ValueError):
        sampler.batch(0, 4, shard=4, num_shards=4)
    with pytest.raises(ValueError):
        sampler.samples(-1, 2)
    with pytest.raises(ValueError):
        corpus.sampler(seq_len=0, seed=0)
    with pytest.raises(ValueError):
        corpus.sampler(seq_len=16, seed=-1)
    with pytest.raises(ValueError, match="too few"):
        BatchSampler(torch.zeros(20, dtype=torch.uint8), seq_len=16, seed=0)


def test_validation_windows_are_fixed_and_spread(corpus: Corpus) -> None:
    windows = corpus.validation_windows(64, seq_len=128)
    assert windows.shape == (64, 129)
    assert torch.equal(windows, corpus.validation_windows(64, seq_len=128))
    assert torch.equal(windows[0], corpus.val[:129].long())
    with pytest.raises(ValueError):
        corpus.validation_windows(10**6, seq_len=128)


# --- model ------------------------------------------------------------------


def test_forward_and_backward_shapes(corpus: Corpus) -> None:
    model = make_model(TINY)
    batch = corpus.sampler(seq_len=32, seed=0).batch(0, 4)
    logits = model(batch[:, :-1])
    assert logits.shape == (4, 32, TINY.vocab_size)
    value = loss(model, batch)
    assert value.shape == ()
    assert abs(value.item() - math.log(TINY.vocab_size)) < 0.1  # near uniform at init
    value.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert parameter.grad.shape == parameter.shape
    assert model(batch[:1, :5]).shape == (1, 5, TINY.vocab_size)  # shorter inputs are fine


def test_initialisation_is_seeded() -> None:
    a, b = make_model(TINY), make_model(TINY)
    c = make_model(ModelConfig(**{**TINY.__dict__, "seed": 1}))
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name


def test_default_model_size() -> None:
    model = make_model(ModelConfig())
    assert sum(p.numel() for p in model.parameters()) == 431_945


def test_model_rejects_bad_input_and_config() -> None:
    model = make_model(TINY)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 33, dtype=torch.int64))
    with pytest.raises(ValueError):
        model(torch.zeros(33, dtype=torch.int64))
    with pytest.raises(ValueError):
        loss(model, torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="divide"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError):
        ModelConfig(n_layers=0)


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(corpus: Corpus) -> None:
    torch.manual_seed(0)
    model = make_model(TINY)
    optimizer = make_optimizer(model, lr=1e-2)
    batch = corpus.sampler(seq_len=32, seed=0).batch(0, 8)
    before = evaluate(model, batch)
    for _ in range(15):
        optimizer.zero_grad()
        loss(model, batch).backward()
        optimizer.step()
    after = evaluate(model, batch)
    assert after < before - 1.0


def test_evaluate_and_generate_leave_the_mode_alone(corpus: Corpus) -> None:
    model = make_model(TINY)
    model.train()
    windows = corpus.validation_windows(5, seq_len=32)
    value = evaluate(model, windows, batch_size=2)
    assert value == pytest.approx(loss(model, windows).item(), rel=1e-5)
    assert model.training
    prompt = corpus.vocab.encode("1:1 In the beginning").long()
    out = generate(model, prompt, 40, generator=torch.Generator().manual_seed(0))
    assert out.shape == (40,)
    assert model.training
    assert len(corpus.vocab.decode(out)) == 40
    same = generate(model, prompt, 40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, same)


# --- trainer ----------------------------------------------------------------


def test_learning_rate_schedule() -> None:
    config = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, config) == pytest.approx(1e-4)
    assert lr_at(9, config) == pytest.approx(1e-3)
    assert lr_at(99, config) > lr_at(100, config) == pytest.approx(1e-4)
    rates = [lr_at(s, config) for s in range(10, 101)]
    assert rates == sorted(rates, reverse=True)


def test_single_process_trainer_runs_and_logs(corpus: Corpus) -> None:
    lines: list[str] = []
    threads = torch.get_num_threads()
    config = TrainConfig(
        steps=20,
        batch_size=4,
        seq_len=32,
        d_model=32,
        n_layers=1,
        n_heads=2,
        lr=1e-2,
        warmup_steps=2,
        log_every=10,
        eval_every=10,
        eval_windows=8,
        threads=1,
    )
    model, records = train(config, corpus=corpus, out=lines.append)
    assert torch.get_num_threads() == threads
    assert [r.step for r in records] == [0, 10, 20]
    assert [r.samples for r in records] == [0, 40, 80]
    assert records[-1].train_loss < records[0].train_loss - 0.5
    assert all(r.val_loss is not None for r in records)
    assert len(lines) == 1 + len(records)
    assert model.config.context == 32


def test_trainer_config_is_validated() -> None:
    with pytest.raises(ValueError):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="multiple"):
        TrainConfig(log_every=25, eval_every=30)
    with pytest.raises(ValueError):
        TrainConfig(time_budget=0)


def test_command_line_run(capsys: pytest.CaptureFixture[str]) -> None:
    from p2ptrain.examples.charlm.train_single import main

    flags = {
        "steps": 4,
        "batch-size": 2,
        "seq-len": 32,
        "d-model": 32,
        "n-layers": 1,
        "n-heads": 2,
        "log-every": 2,
        "eval-every": 2,
        "eval-windows": 4,
        "warmup-steps": 1,
    }
    main([part for name, value in flags.items() for part in (f"--{name}", str(value))])
    out = capsys.readouterr().out
    assert "vocabulary 73" in out
    assert "samples/s with 1 thread(s)" in out
    assert "sample: 1:1 In the beginning " in out
    with pytest.raises(SystemExit):
        main(["--log-every", "25", "--eval-every", "30"])


def test_package_exports() -> None:
    from p2ptrain.examples import charlm

    assert sorted(charlm.__all__) == [
        "BatchSampler",
        "CharTransformer",
        "Corpus",
        "ModelConfig",
        "Vocab",
        "evaluate",
        "generate",
        "load_corpus",
        "loss",
        "make_model",
        "make_optimizer",
    ]
    assert all(hasattr(charlm, name) for name in charlm.__all__)
