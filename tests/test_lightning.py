"""``asyncckpt.lightning.AsyncckptCheckpointIO`` with a real ``lightning.Trainer`` on CPU.

- ``ModelCheckpoint`` (every k steps, top-2 by step, ``last.ckpt``) saves through the
  plugin: committed, verifiable directories; the top-k removal happened; ``last.ckpt``
  (saved to the same path again and again) holds the newest state.
- Resuming with ``trainer.fit(ckpt_path=...)`` ends bitwise where an uninterrupted run
  of the same number of steps ends (model and optimizer state).
- Lightning's checkpoint dict round-trips exactly: container types (``OrderedDict``,
  ``AttributeDict``, named tuples), non-string keys, empty containers, tuples holding
  tensors, dataclasses, enums and paths.
- Pending saves: ``load_checkpoint`` / ``remove_checkpoint`` of a path being written
  wait for it; a failed write is raised by ``teardown``; the writer process is gone
  after ``teardown``.
- Two gloo ranks with ``DDPStrategy(start_method="spawn")``: rank 0 alone saves, with no
  collective.

Every test ends with ``teardown`` (Lightning calls it at the end of ``fit``), so the
autouse ``no_leaks`` fixture sees no writer process.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import pathlib
from pathlib import Path
from typing import Any, NamedTuple

import pytest

pytest.importorskip("lightning")

import lightning
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import asyncckpt
from asyncckpt import CheckpointError, CheckpointException
from asyncckpt.lightning import STRUCTURE_KEY, AsyncckptCheckpointIO, replace_path

from helpers import bits

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

STEPS_PER_EPOCH = 8


# ----------------------------------------------------------------------------- a tiny model
class TinyModel(lightning.LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=g)
    y = (x * torch.tensor([1.0, -2.0, 0.5, 3.0])).sum(1, keepdim=True)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def make_trainer(root: Path, max_steps: int, plugin: AsyncckptCheckpointIO, **ckpt: Any) -> lightning.Trainer:
    callbacks: list[lightning.Callback] = [ModelCheckpoint(dirpath=root, **ckpt)] if ckpt else []
    return lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        logger=False,
        default_root_dir=root,
        enable_model_summary=False,
        enable_checkpointing=bool(ckpt),
        callbacks=callbacks,
        plugins=[plugin],
        deterministic=True,
    )


def fresh_model() -> TinyModel:
    lightning.seed_everything(0)
    return TinyModel()


def assert_identical(expected: Any, got: Any, path: str = "checkpoint") -> None:
    """Same types (containers included), keys in the same order, tensors bitwise."""
    assert type(got) is type(expected), f"{path}: {type(got).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert torch.equal(bits(got), bits(expected)), f"{path}: values differ"
    elif isinstance(expected, dict):
        assert list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        for k in expected:
            assert_identical(expected[k], got[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_identical(e, g, f"{path}[{i}]")
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------------------- fit, top-k, resume
def test_fit_saves_commits_prunes_and_resumes_bitwise(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    every = STEPS_PER_EPOCH
    plugin = AsyncckptCheckpointIO()
    trainer = make_trainer(
        root, 3 * every, plugin, every_n_train_steps=every, save_top_k=2, monitor="step", mode="max", save_last=True
    )
    model = fresh_model()
    trainer.fit(model, loader())  # uninterrupted: 24 steps, saves at 8, 16, 24
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optim = trainer.optimizers[0].state_dict()

    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert names == [f"epoch=1-step={2 * every}.ckpt", f"epoch=2-step={3 * every}.ckpt", "last.ckpt"], names
    assert leftovers(root) == []  # the removed step-8 directory, swap and temporary names are gone
    for name in names:
        assert (root / name).is_dir()
        asyncckpt.verify(root / name)  # committed: sizes and CRC-32s match the manifest
    last = plugin.load_checkpoint(root / "last.ckpt")
    assert last["global_step"] == 3 * every  # the newest of the three saves to that path
    assert last["optimizer_states"][0]["state"].keys() == {0, 1, 2, 3}  # int keys, as saved
    assert isinstance(last["state_dict"], collections.OrderedDict)
    # Stock readers see the tensors under their natural keys.
    tree = asyncckpt.read_state_dict(root / "last.ckpt")
    assert torch.equal(tree["state_dict"]["net.0.weight"], expected["net.0.weight"])
    assert isinstance(tree[STRUCTURE_KEY], bytes)

    # Resume from the step-16 checkpoint and run to step 24 with a new trainer.
    resumed = fresh_model()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # whatever the model holds is overwritten by the checkpoint
    plugin2 = AsyncckptCheckpointIO()
    trainer2 = make_trainer(tmp_path / "resumed", 3 * every, plugin2)
    trainer2.fit(resumed, loader(), ckpt_path=root / f"epoch=1-step={2 * every}.ckpt")
    assert trainer2.global_step == 3 * every
    got = resumed.state_dict()
    assert list(got) == list(expected)
    for k in expected:
        assert torch.equal(bits(got[k]), bits(expected[k])), k
    assert_identical(expected_optim, trainer2.optimizers[0].state_dict(), "optimizer")


# ----------------------------------------------------------------------------- the dict round trip
class Phase(enum.Enum):
    WARMUP = 1
    MAIN = 2


@dataclasses.dataclass
class RunInfo:
    name: str
    seeds: tuple[int, ...]


class Pair(NamedTuple):
    first: torch.Tensor
    second: int


def exotic_checkpoint() -> dict[Any, Any]:
    g = torch.Generator().manual_seed(3)
    weights = collections.OrderedDict(
        [
            ("layer.weight", torch.randn(3, 2, generator=g)),
            ("layer.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
        ]
    )
    return {
        "epoch": 2,
        "global_step": 40,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": weights,
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(40.0), "exp_avg": torch.randn(3, 2, generator=g)}, 1: {}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "lr_schedulers": [],
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {
                "best_model_score": torch.tensor(0.25),
                "dirpath": pathlib.PosixPath("/tmp/run"),
            }
        },
        "hyper_parameters": AttributeDict(lr=0.1, hidden=16, phase=Phase.MAIN, info=RunInfo("a", (1, 2))),
        "hparams_name": "kwargs",
        "pair": Pair(torch.arange(4), 5),
        "tensors_in_tuple": (torch.ones(2), "x"),
        (1, "non-str key"): {"set": {1, 2}, "none": None, "bytes": b"\x00\x01"},
    }


def test_lightning_checkpoint_dict_round_trips_exactly(tmp_path: Path) -> None:
    plugin = AsyncckptCheckpointIO()
    state = exotic_checkpoint()
    path = tmp_path / "run" / "epoch=2-step=40.ckpt"  # the parent is created
    try:
        plugin.save_checkpoint(state, path)
        state["state_dict"]["layer.weight"].add_(100.0)  # mutating after return changes nothing saved
        got = plugin.load_checkpoint(path)  # waits for the pending save
    finally:
        plugin.teardown()
    assert_identical(exotic_checkpoint(), got)
    asyncckpt.verify(path)

    # weights_only loading refuses the dataclass and the enum, and says what to do.
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        plugin.load_checkpoint(path, weights_only=True)
    with pytest.raises(CheckpointError, match="weights_only"):
        AsyncckptCheckpointIO(allow_pickle=False).load_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    with pytest.raises(TypeError):
        plugin.save_checkpoint(state, tmp_path / "x.ckpt", storage_options={"a": 1})


def test_weights_only_values_load_without_pickle_and_files_load_too(tmp_path: Path) -> None:
    plain = {
        "state_dict": collections.OrderedDict(w=torch.ones(2, 2)),
        "epoch": 1,
        "optimizer_states": [{"state": {0: {"m": torch.zeros(2)}}, "param_groups": [{"params": [0]}]}],
    }
    plugin = AsyncckptCheckpointIO(allow_pickle=False)
    try:
        plugin.save_checkpoint(plain, tmp_path / "a.ckpt")
        plugin.teardown()
        assert_identical(plain, plugin.load_checkpoint(tmp_path / "a.ckpt"))
        # A torch.save file (TorchCheckpointIO's format) at the path loads with torch.load.
        torch.save(plain, tmp_path / "b.ckpt")
        assert_identical(plain, plugin.load_checkpoint(tmp_path / "b.ckpt"))
        # ... and is replaced by a checkpoint directory when saved to.
        plugin.save_checkpoint(plain, tmp_path / "b.ckpt")
    finally:
        plugin.teardown()
    assert (tmp_path / "b.ckpt").is_dir() and leftovers(tmp_path) == []
    asyncckpt.verify(tmp_path / "b.ckpt")


# ----------------------------------------------------------------------------- pending saves
def test_remove_and_load_wait_for_a_pending_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCKPT_FAULT", "after_write:sleep=1")  # each write takes > 1 s
    plugin = AsyncckptCheckpointIO()
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    try:
        plugin.save_checkpoint({"w": torch.arange(10)}, a)
        plugin.save_checkpoint({"w": torch.arange(20)}, b)
        plugin.save_checkpoint({"w": torch.arange(30)}, a)  # replaces a once it commits
        assert not b.exists()  # still being written
        plugin.remove_checkpoint(b)  # waits for b (and a's first save), then removes it
        assert not b.exists() and a.is_dir()
        assert torch.equal(plugin.load_checkpoint(a)["w"], torch.arange(30))  # waits for the second save of a
    finally:
        plugin.teardown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]


def test_failed_write_is_raised_and_nothing_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCCKPT_FAULT", "after_write:raise")
    plugin = AsyncckptCheckpointIO()
    try:
        plugin.save_checkpoint({"w": torch.ones(3)}, tmp_path / "x.ckpt")
    finally:
        with pytest.raises(CheckpointException, match="injected I/O error"):
            plugin.teardown()
    assert not (tmp_path / "x.ckpt").exists()
    monkeypatch.delenv("ASYNCCKPT_FAULT")
    try:  # the plugin is usable again: the next save starts a new writer
        plugin.save_checkpoint({"w": torch.ones(3)}, tmp_path / "x.ckpt")
    finally:
        plugin.teardown()
    asyncckpt.verify(tmp_path / "x.ckpt")


def test_replace_path_without_exchange(tmp_path: Path) -> None:
    # The fallback for systems without renameat2(RENAME_EXCHANGE): rename aside, then in.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "f").write_text("old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "f").write_text("new")
    aside = replace_path(tmp_path / "new", tmp_path / "old", exchange=False)
    assert (tmp_path / "old" / "f").read_text() == "new"
    assert aside is not None and (aside / "f").read_text() == "old" and aside.name.startswith(".old.")
    assert replace_path(aside, tmp_path / "fresh") is None and (tmp_path / "fresh" / "f").read_text() == "old"


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "data.ckpt"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    plugin = AsyncckptCheckpointIO()
    try:
        with pytest.raises(FileExistsError, match="not a checkpoint"):
            plugin.save_checkpoint({"w": torch.ones(1)}, target)
    finally:
        plugin.teardown()
    assert (target / "precious.txt").read_text() == "keep me"


# ----------------------------------------------------------------------------- DDP, two gloo ranks
def test_ddp_two_ranks_rank0_saves_alone(tmp_path: Path) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    from dist_utils import TORCH_PRELOAD, preload_forkserver

    # Ranks fork from multiprocessing's forkserver, which imports torch and Lightning once
    # (shared with the other distributed tests): seconds saved per rank on a small machine.
    preload_forkserver(TORCH_PRELOAD + ("lightning.pytorch",))
    root = tmp_path / "ddp"
    every = STEPS_PER_EPOCH // 2  # DistributedSampler: 4 steps per epoch on each of 2 ranks
    plugin = AsyncckptCheckpointIO()
    trainer = lightning.Trainer(
        max_steps=2 * every,
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo", start_method="forkserver"),
        enable_progress_bar=False,
        logger=False,
        default_root_dir=root,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=root, every_n_train_steps=every, save_top_k=1, monitor="step", mode="max", save_last=True
            )
        ],
        plugins=[plugin],
    )
    model = fresh_model()
    trainer.fit(model, loader())
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert names == [f"epoch=1-step={2 * every}.ckpt", "last.ckpt"], names
    for name in names:
        manifest = asyncckpt.verify(root / name)
        assert manifest["world_size"] == 1  # saved by rank 0 alone, its own group of one
    ckpt = plugin.load_checkpoint(root / "last.ckpt")
    assert ckpt["global_step"] == 2 * every
    # The spawn launcher hands the final weights to this process through the plugin too.
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt["state_dict"][k]), k


# ----------------------------------------------------------------------------- optional dependency
def test_import_asyncckpt_never_imports_lightning() -> None:
    import subprocess
    import sys

    code = (
        "import sys, asyncckpt, asyncckpt.cli\n"
        "for name in asyncckpt.__all__: getattr(asyncckpt, name)\n"
        "found = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
        "assert not found, found\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- the benchmark
def test_bench_lightning_runs_and_reports_both_plugins(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        import bench_lightning
    finally:
        sys.path.pop(0)
    result = bench_lightning.run(reps=2, size_mb=2, directory=tmp_path)
    assert set(result["systems"]) == set(bench_lightning.SYSTEMS)
    for figures in result["systems"].values():
        assert len(figures["stall_s_all"]) == 2 and 0 < figures["stall_s"] <= figures["on_disk_s"]
    assert "| plugin |" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # every checkpoint removed
