"""Train the character model in one process: the baseline the collaborative demo is held to.

Run from any directory (the example ships in the package)::

    python -m p2ptrain.examples.charlm.train_single                 # 600 steps, 1 thread
    python -m p2ptrain.examples.charlm.train_single --time-budget 120 --threads 2

Every ``--log-every`` steps it prints the step, the wall-clock seconds since
training began (evaluations included), the samples seen, the mean training loss
over the steps since the last line, and, every ``--eval-every`` steps, the loss
on fixed validation windows. It ends with throughput and a short generated text.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from p2ptrain.examples.charlm.data import Corpus, load_corpus
from p2ptrain.examples.charlm.model import (
    CharTransformer,
    ModelConfig,
    evaluate,
    generate,
    loss,
    make_model,
    make_optimizer,
)

__all__ = ["LogRecord", "TrainConfig", "lr_at", "main", "train"]


@dataclass(frozen=True)
class TrainConfig:
    """One single-process run.

    Attributes:
        steps: Optimizer steps (the learning-rate schedule spans them).
        batch_size: Samples per step.
        seq_len: Characters of context per sample.
        lr: Peak learning rate of AdamW.
        warmup_steps: Steps of linear warm-up before the cosine decay.
        min_lr_ratio: Learning rate at the last step, as a fraction of ``lr``.
        weight_decay: AdamW weight decay on matrices and embeddings.
        grad_clip: Gradient-norm clip; 0 disables it.
        d_model: Model width.
        n_layers: Transformer blocks.
        n_heads: Attention heads.
        seed: Seeds the model initialisation and the batch sampler.
        threads: ``torch.set_num_threads`` for the run.
        log_every: Steps between progress lines.
        eval_every: Steps between validation losses (a multiple of ``log_every``).
        eval_windows: Validation samples scored per evaluation.
        time_budget: Stop at the first log line after this many seconds; ``None`` runs all steps.
    """

    steps: int = 600
    batch_size: int = 32
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seed: int = 0
    threads: int = 1
    log_every: int = 25
    eval_every: int = 100
    eval_windows: int = 256
    time_budget: float | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "threads", "log_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be positive and min_lr_ratio in [0, 1]")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("warmup_steps, weight_decay and grad_clip must be non-negative")
        if self.eval_every < 1 or self.eval_every % self.log_every:
            raise ValueError("eval_every must be a positive multiple of log_every")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError("time_budget must be positive")


@dataclass(frozen=True)
class LogRecord:
    """One progress line.

    Attributes:
        step: Optimizer steps done.
        seconds: Wall-clock seconds since training began.
        samples: Samples trained on so far.
        train_loss: Mean training loss of the steps since the previous line
            (at step 0: the loss of the first batch before any update).
        val_loss: Validation loss at this step, or ``None`` when not evaluated.
        lr: Learning rate of the last step.
    """

    step: int
    seconds: float
    samples: int
    train_loss: float
    val_loss: float | None
    lr: float

    def __str__(self) -> str:
        val = f"{self.val_loss:8.4f}" if self.val_loss is not None else " " * 8
        return (
            f"{self.step:6d} {self.seconds:8.1f} {self.samples:8d} "
            f"{self.train_loss:8.4f} {val} {self.lr:9.2e}"
        )


HEADER = "  step  seconds  samples    train      val        lr"


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine decay."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    config: TrainConfig,
    *,
    corpus: Corpus | None = None,
    out: Callable[[str], None] = print,
) -> tuple[CharTransformer, list[LogRecord]]:
    """Train a fresh model and report progress through ``out``.

    Runs with ``config.threads`` torch threads and restores the previous count after.

    Args:
        config: The run.
        corpus: The data; the shipped text is loaded when ``None``.
        out: Receives the header and every progress line.

    Returns:
        The trained model and its progress records.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _train(config, corpus if corpus is not None else load_corpus(), out)
    finally:
        torch.set_num_threads(threads)


def _train(
    config: TrainConfig, corpus: Corpus, out: Callable[[str], None]
) -> tuple[CharTransformer, list[LogRecord]]:
    model_config = ModelConfig(
        vocab_size=corpus.vocab.size,
        context=config.seq_len,
        d_model=config.d_model,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        seed=config.seed,
    )
    model = make_model(model_config)
    optimizer = make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay)
    sampler = corpus.sampler(seq_len=config.seq_len, seed=config.seed)
    windows = corpus.validation_windows(config.eval_windows, seq_len=config.seq_len)

    records: list[LogRecord] = []
    started = time.perf_counter()

    def record(step: int, train_loss: float, lr: float) -> LogRecord:
        val = evaluate(model, windows) if step % config.eval_every == 0 else None
        entry = LogRecord(
            step=step,
            seconds=time.perf_counter() - started,
            samples=step * config.batch_size,
            train_loss=train_loss,
            val_loss=val,
            lr=lr,
        )
        records.append(entry)
        out(str(entry))
        return entry

    out(HEADER)
    with torch.no_grad():
        first = loss(model, sampler.batch(0, config.batch_size)).item()
    record(0, first, 0.0)
    window_losses: list[float] = []
    for step in range(config.steps):
        lr = lr_at(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        value = loss(model, sampler.batch(step, config.batch_size))
        optimizer.zero_grad(set_to_none=True)
        value.backward()  # type: ignore[no-untyped-call]
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        window_losses.append(value.item())
        done = step + 1
        if done % config.log_every == 0 or done == config.steps:
            entry = record(done, sum(window_losses) / len(window_losses), lr)
            window_losses.clear()
            if config.time_budget is not None and entry.seconds >= config.time_budget:
                break
    return model, records


def _parse(argv: Sequence[str] | None) -> TrainConfig:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        default = getattr(defaults, field.name)
        kind = float if field.name == "time_budget" else type(default)
        parser.add_argument(flag, type=kind, default=default, help=f"default: {default}")
    namespace = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    config = _parse(argv)
    loaded = time.perf_counter()
    corpus = load_corpus()
    print(
        f"data: {corpus.train.numel()} train / {corpus.val.numel()} validation characters, "
        f"vocabulary {corpus.vocab.size}, loaded in {time.perf_counter() - loaded:.2f} s"
    )
    model, records = train(config, corpus=corpus)
    params = sum(p.numel() for p in model.parameters())
    last = records[-1]
    print(
        f"model: {params} parameters; {last.samples} samples in {last.seconds:.1f} s "
        f"= {last.samples / last.seconds:.1f} samples/s with {config.threads} thread(s)"
    )
    prompt = corpus.vocab.encode("1:1 In the beginning ").long()
    generator = torch.Generator().manual_seed(config.seed)
    text = generate(model, prompt, 200, generator=generator)
    print("sample:", corpus.vocab.decode(prompt) + corpus.vocab.decode(text))


if __name__ == "__main__":
    main()
