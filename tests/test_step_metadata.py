"""Per-step metadata and metrics (issue 34 item 3): stored with the step in its
manifest, read back without reading any tensor, shown by the command line; the best
steps kept by BestN over 100+ steps and across a restart; a newer format refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt.cli import main as cli_main

from helpers import flip_byte


def _state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "step": step}


def test_metrics_and_metadata_round_trip_without_reading_a_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with asyncckpt.CheckpointManager(tmp_path, persistent=False) as manager:
        manager.save(3, _state(3), metrics={"val_loss": 0.25, "tokens": 1024}, metadata={"epoch": 1, "tag": "a"})
        manager.save(4, _state(4), async_op=False)
        manager.maybe_finalize(blocking=True)
        saved = manager.metadata(3)
        assert saved["metrics"] == {"val_loss": 0.25, "tokens": 1024.0}
        assert saved["metadata"] == {"epoch": 1, "tag": "a"}
        assert saved["step"] == 3 and saved["world_size"] == 1 and saved["format_version"] == 1
        assert saved["asyncckpt_version"] == asyncckpt.__version__
        assert manager.metadata()["step"] == 4 and manager.metadata()["metrics"] == {}
        with pytest.raises(asyncckpt.CheckpointNotFoundError):
            manager.metadata(5)
    step3 = tmp_path / "step_00000003"
    flip_byte(step3 / "__0_0.distcp", 100)  # no tensor is read: the damage goes unseen
    assert asyncckpt.read_metadata(step3) == saved
    with pytest.raises(asyncckpt.CorruptCheckpointError):
        asyncckpt.verify(step3)

    assert cli_main(["ls", str(tmp_path), "--json"]) == 0
    listed = {c["step"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert listed[3]["metrics"] == {"val_loss": 0.25, "tokens": 1024.0} and listed[3]["metadata"] == {
        "epoch": 1,
        "tag": "a",
    }
    assert cli_main(["inspect", str(tmp_path / "step_00000004")]) == 0
    assert "written by asyncckpt" in capsys.readouterr().out
    cli_main(["inspect", str(step3)])
    out = capsys.readouterr().out
    assert "metrics: tokens=1024, val_loss=0.25" in out and '"epoch": 1' in out


@pytest.mark.parametrize(
    "kwargs",
    [
        {"metrics": {"loss": float("nan")}},
        {"metrics": {"loss": True}},
        {"metrics": {"": 1.0}},
        {"metrics": [("loss", 1.0)]},
        {"metadata": {"when": object()}},
        {"metadata": {1: "a"}},
        {"metadata": "tag"},
    ],
)
def test_bad_metrics_or_metadata_are_refused_before_anything_is_staged(tmp_path: Path, kwargs: dict) -> None:
    with asyncckpt.CheckpointManager(tmp_path / "root", persistent=False) as manager:
        with pytest.raises(asyncckpt.InvalidArgumentError):
            manager.save(1, _state(1), **kwargs)
        assert manager.steps() == []
    with pytest.raises(asyncckpt.InvalidArgumentError):
        asyncckpt.save(_state(1), tmp_path / "free", **kwargs)
    assert not (tmp_path / "free").exists()


def test_a_manifest_of_a_newer_format_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    asyncckpt.save(_state(1), ckpt, metadata={"run": "x"})
    manifest = json.loads((ckpt / ".manifest.json").read_text())
    manifest["version"] = 99
    (ckpt / ".manifest.json").write_text(json.dumps(manifest))
    for read in (asyncckpt.read_metadata, asyncckpt.verify, lambda p: asyncckpt.load(_state(0), p)):
        with pytest.raises(asyncckpt.CorruptCheckpointError, match="newer asyncckpt"):
            read(ckpt)


def test_best_n_keeps_the_best_steps_by_their_saved_metric_over_a_restart(tmp_path: Path) -> None:
    def loss(step: int) -> float:
        return abs(step - 40) / 10  # the best steps are around 40

    policy = asyncckpt.AnyOf(asyncckpt.LatestN(1), asyncckpt.BestN("val_loss", 3, "min"))
    with asyncckpt.CheckpointManager(tmp_path, keep=policy, persistent=False) as manager:
        for step in range(0, 60, 2):
            # odd steps of this run carry no metric: never "best"
            metrics = {"val_loss": loss(step)} if step % 4 == 0 else None
            manager.save(step, _state(step), metrics=metrics, async_op=False)
        assert manager.steps() == [36, 40, 44, 58]
    with asyncckpt.CheckpointManager(tmp_path, keep=policy, persistent=False) as manager:
        for step in range(60, 110, 2):
            manager.save(step, _state(step), metrics={"val_loss": loss(step)}, async_op=False)
        assert manager.steps() == [36, 40, 44, 108]
        assert [manager.metadata(s)["metrics"]["val_loss"] for s in (36, 40, 44)] == [0.4, 0.0, 0.4]
