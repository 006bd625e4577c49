"""Training tasks: the charlm default, a user's module, and the mistakes one can make."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

import p2ptrain.app.task
from p2ptrain.app.task import default_run_id, load_task, lr_schedule
from p2ptrain.errors import ConfigError
from p2ptrain.train.fingerprint import model_digest, parameters_digest


def documented_example() -> str:
    """The task module shown in p2ptrain.app.task's docstring, as a file's text."""
    doc = p2ptrain.app.task.__doc__ or ""
    block = doc.split("::\n", 1)[1].split("\nEvery peer", 1)[0]
    return textwrap.dedent(block)


def test_the_default_task_is_charlm() -> None:
    task = load_task()
    batch = task.batch(0, 4, shard=1, num_shards=8)
    assert batch.shape[0] == 4 and batch.dtype == torch.int64
    value = task.loss(batch)
    assert value.dim() == 0 and math.isfinite(value.item())
    again = task.batch(0, 4, shard=1, num_shards=8)
    assert torch.equal(batch, again)  # deterministic: every peer draws the same way


def test_the_documented_example_loads_and_learns(tmp_path: Path) -> None:
    path = tmp_path / "my_task.py"
    path.write_text(documented_example())
    task = load_task(str(path))
    first = task.loss(task.batch(0, 32, shard=0, num_shards=1)).item()
    for index in range(60):
        task.optimizer.zero_grad()
        task.loss(task.batch(index, 32, shard=0, num_shards=1)).backward()  # type: ignore[no-untyped-call]
        task.optimizer.step()
    assert task.loss(task.batch(999, 32, shard=0, num_shards=1)).item() < first / 4


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("x = 1\n", "no make_task"),
        ("def make_task():\n    return object()\n", "no .model"),
        (
            "import torch\nclass T:\n    model = torch.nn.Linear(1, 1)\n"
            "def make_task():\n    return T()\n",
            "no .optimizer",
        ),
        (
            "import torch\nclass T:\n    model = torch.nn.Linear(1, 1)\n"
            "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    def batch(self, *a, **k): ...\n"
            "def make_task():\n    return T()\n",
            r"no .loss\(\)",
        ),
        ("def make_task(:\n", "failed to load"),
    ],
)
def test_a_broken_task_module_gets_a_clear_error(tmp_path: Path, source: str, message: str) -> None:
    path = tmp_path / "task.py"
    path.write_text(source)
    with pytest.raises(ConfigError, match=message):
        load_task(str(path))


def test_missing_modules_and_files_get_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_task(str(tmp_path / "absent.py"))
    with pytest.raises(ConfigError, match="cannot import"):
        load_task("no_such_module_for_p2ptrain")


def test_lr_scale_sets_every_groups_rate_by_the_global_step() -> None:
    task = load_task()
    initial = [group["lr"] for group in task.optimizer.param_groups]
    apply = lr_schedule(task)
    apply(0)  # charlm warms up linearly over 20 global steps
    assert [g["lr"] for g in task.optimizer.param_groups] == pytest.approx(
        [lr / 20 for lr in initial]
    )
    # a downloaded state replaces the group dicts: the schedule still reaches them
    task.optimizer.load_state_dict(task.optimizer.state_dict())
    apply(40)
    assert [g["lr"] for g in task.optimizer.param_groups] == pytest.approx(initial)


def test_tasks_without_lr_scale_keep_their_rate(tmp_path: Path) -> None:
    path = tmp_path / "my_task.py"
    path.write_text(documented_example())
    task = load_task(str(path))
    lr_schedule(task)(5)
    assert task.optimizer.param_groups[0]["lr"] == 0.05


def test_a_bad_lr_scale_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "my_task.py"
    path.write_text(documented_example() + "\nLinearTask.lr_scale = lambda self, step: -1.0\n")
    with pytest.raises(ConfigError, match="lr_scale"):
        lr_schedule(load_task(str(path)))(0)


def test_the_default_run_id_is_the_tasks_name() -> None:
    assert default_run_id() == default_run_id(p2ptrain.app.task.CHARLM) == "charlm"
    assert default_run_id("/some/where/my_task.py") == "my_task"
    assert default_run_id("pkg.tasks.vision") == "vision"
    assert default_run_id("/x/@@@.py") == "task"


def test_the_model_digest_tells_layouts_apart_and_the_parameters_digest_values() -> None:
    a, b = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
    wide = torch.nn.Linear(8, 3)
    half = torch.nn.Linear(8, 1).to(torch.float16)
    digests = {model_digest(list(m.parameters())) for m in (a, wide, half)}
    assert len(digests) == 3 and model_digest(list(b.parameters())) in digests
    values = [parameters_digest(list(m.parameters())) for m in (a, b)]
    assert values[0] != values[1]
    b.load_state_dict(a.state_dict())
    assert parameters_digest(list(b.parameters())) == values[0]
