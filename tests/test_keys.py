"""Plain PyTorch state dicts: an optimizer's ``state`` is keyed by ``int`` parameter
indices (issue 24 item 1), and the records file never overrides ``.metadata``
(issue 25 item 10).

Everything is real: real optimizers that have stepped, checkpoints written by
``asyncckpt`` (a forked child per call) and read back by ``asyncckpt.load``,
``CheckpointManager.load``, ``read_state_dict``, stock ``torch.distributed.checkpoint``
and the ``asyncckpt`` command line (``cli.main``).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import asyncckpt
from asyncckpt import AsyncCallsQueue, CheckpointError, CheckpointManager, CorruptCheckpointError, cli
from asyncckpt.format import manifest as commit
from asyncckpt.format.records import RECORDS_NAME
from asyncckpt.loading.metadata import read_metadata

from helpers import assert_same, clone_state, counting_plans, observing_loads, zeroed


def trained(optimizer: str, seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its optimizer after ``steps`` steps (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
    return model, opt


def user_state(optimizer: str, seed: int = 0) -> dict[Any, Any]:
    """The most common state dict, plus non-tensor values under ``int`` keys (what an
    optimizer such as LBFGS keeps in its state) and an ``int`` key at the top level."""
    model, opt = trained(optimizer, seed)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {3: "three", 10: {"n": 7, 2: 2.5}, "name": "run"},
        0: torch.arange(4),
    }


def fresh(state: dict[str, Any]) -> dict[str, Any]:
    """The same structure with every leaf changed (tensors zeroed, values replaced)."""
    return zeroed(state)


def stock_load(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)


class Holder:
    """A ``Stateful`` wrapper: a top-level Stateful value sends ``asyncckpt.load`` DCP's way."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


# ----------------------------------------------------------------------------- issue 24 item 1
@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_optimizer_state_dict_saves_and_loads_with_int_keys(
    tmp_path: Path, temporal_queue: AsyncCallsQueue, optimizer: str
) -> None:
    state = user_state(optimizer)
    assert all(type(k) is int for k in state["optim"]["state"]) and state["optim"]["state"]
    expected = clone_state(state)
    ckpt = tmp_path / "ckpt"
    asyncckpt.save(state, ckpt, async_op=False, calls_queue=temporal_queue)

    # Template-free: the keys come back with their types, as from torch.load.
    reference = tmp_path / "ref.pt"
    torch.save(expected, reference)
    for verify in (True, False):
        got = read_state_dict_no_warning(ckpt, verify)
        assert_same(torch.load(reference, weights_only=True), got)
        assert list(got["optim"]["state"]) == list(expected["optim"]["state"])
        assert got["extra"] == {3: "three", 10: {"n": 7, 2: 2.5}, "name": "run"}

    # In place, on the direct path and on DCP's (a Stateful value), values under the
    # int keys they have in the target (no "3" beside 3).
    target = fresh(expected)
    with observing_loads() as loads:
        asyncckpt.load(target, ckpt)
    assert_same(expected, target)
    assert loads.paths() == {"direct": 1, "dcp": 0}
    holder = Holder(fresh(expected))
    top_key = ckpt_with_top_key(tmp_path, expected, temporal_queue)
    with observing_loads() as loads:
        asyncckpt.load({"all": holder}, top_key)
    assert_same(expected, holder.state)
    assert loads.paths() == {"direct": 0, "dcp": 1}

    # The optimizer takes what was loaded, and continues exactly as the original.
    model, opt = trained(optimizer, seed=1)
    loaded = {"model": model.state_dict(), "optim": opt.state_dict()}
    asyncckpt.load(loaded, ckpt_of(tmp_path / "mo", expected, temporal_queue))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optim"])
    original_model, original_opt = trained(optimizer, seed=0)
    for m, o in ((model, opt), (original_model, original_opt)):
        torch.manual_seed(5)
        o.zero_grad()
        m(torch.randn(8, 6)).pow(2).mean().backward()
        o.step()
    assert_same(original_model.state_dict(), model.state_dict())
    assert_same(original_opt.state_dict(), opt.state_dict())

    # Stock DCP reads the same checkpoint in place (the model and optimizer: its own
    # planner sorts the top-level keys, so it cannot take an int key beside str ones),
    # and its converter still works (giving str keys, as for any dcp.save checkpoint).
    target = {"model": fresh(expected["model"]), "optim": fresh(expected["optim"])}
    stock_load(target, ckpt)
    assert_same(expected["optim"]["state"], target["optim"]["state"])
    assert_same(expected["model"], target["model"])
    dcp_to_torch_save(ckpt, tmp_path / "stock.pt")
    assert set(torch.load(tmp_path / "stock.pt", weights_only=True)["optim"]["state"]) == {
        str(k) for k in expected["optim"]["state"]
    }


def read_state_dict_no_warning(ckpt: Path, verify: bool) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a committed checkpoint: nothing to warn about
        return asyncckpt.read_state_dict(ckpt, verify=verify)


def ckpt_of(path: Path, state: dict[str, Any], queue: AsyncCallsQueue) -> Path:
    asyncckpt.save(state, path, async_op=False, calls_queue=queue)
    return path


def ckpt_with_top_key(tmp_path: Path, state: dict[str, Any], queue: AsyncCallsQueue) -> Path:
    return ckpt_of(tmp_path / "held", {"all": Holder(state)}, queue)


@pytest.mark.timeout(120)
def test_manager_saves_steady_optimizer_state_and_resumes(tmp_path: Path) -> None:
    """Repeated saves of the same structure reuse the cached plan (its lookup paths hold
    the int keys) and every one reads back with its int keys; the manager loads the
    latest one into a new model and optimizer."""
    model, opt = trained("adamw")
    saved: dict[int, dict[str, Any]] = {}
    with CheckpointManager(tmp_path / "ckpts", persistent=False) as manager:
        with counting_plans() as plans:
            for step in (1, 2, 3):
                opt.zero_grad()
                model(torch.randn(8, 6)).pow(2).mean().backward()
                opt.step()
                state = {"model": model.state_dict(), "optim": opt.state_dict()}
                saved[step] = clone_state(state)
                manager.save(step, state, async_op=False)
        assert plans.n == 1, plans.n  # saves 2 and 3 reused the plan
        for step, expected in saved.items():
            got = asyncckpt.read_state_dict(manager.step_dir(step))
            assert_same(expected, got)
        # The metadata of the cached plans keeps DCP's planner_data (str keys), as
        # stock dcp.save writes it; the int keys are in the manifest.
        stock = tmp_path / "stock"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(saved[3], checkpoint_id=str(stock), no_dist=True)
        planner_data = read_metadata(stock).planner_data
        assert planner_data["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")
        for step in saved:
            assert read_metadata(manager.step_dir(step)).planner_data == planner_data
            manifest = json.loads((manager.step_dir(step) / commit.MANIFEST_NAME).read_text())
            assert manifest["int_keys"]["optim.state.0.exp_avg"] == [2]
        new_model, new_opt = trained("adamw", seed=3)
        target = {"model": new_model.state_dict(), "optim": new_opt.state_dict()}
        assert manager.load(target) == 3
    new_opt.load_state_dict(target["optim"])
    assert_same(saved[3]["optim"], new_opt.state_dict())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "state, message",
    [
        ({"d": {0: torch.ones(1), "0": torch.zeros(1)}}, r"state_dict\['d'\]: keys 0 and '0' would both be stored"),
        ({"d": {1.5: torch.ones(1)}}, r"state_dict\['d'\]: key 1\.5 is a float; keys must be str or int"),
        ({"d": {True: torch.ones(1)}}, r"state_dict\['d'\]: key True is a bool; keys must be str or int"),
        ({"d": {(1, 2): 3}}, r"key \(1, 2\) is a tuple"),
    ],
)
def test_keys_that_cannot_round_trip_are_refused(
    tmp_path: Path, temporal_queue: AsyncCallsQueue, state: dict[str, Any], message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        asyncckpt.save(state, tmp_path / "ckpt", async_op=False, calls_queue=temporal_queue)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.timeout(120)
def test_cli_inspect_and_convert_give_the_int_keys(
    tmp_path: Path, temporal_queue: AsyncCallsQueue, capsys: pytest.CaptureFixture
) -> None:
    """The command line's ``inspect --json`` and ``convert`` (``cli.main``, in this process:
    test_cli.py runs both in a subprocess, through ``python -m asyncckpt``)."""
    state = user_state("adamw")
    ckpt = ckpt_of(tmp_path / "ckpt", state, temporal_queue)
    capsys.readouterr()
    assert cli.main(["inspect", "--json", str(ckpt)]) == 0
    paths = {e["fqn"]: e["path"] for e in json.loads(capsys.readouterr().out)["entries"]}
    assert paths["optim.state.0.exp_avg"] == ["optim", "state", 0, "exp_avg"]
    assert paths["optim.param_groups.0.lr"] == ["optim", "param_groups", 0, "lr"]  # a list index
    assert paths["extra.10.2"] == ["extra", 10, 2] and paths["0"] == [0]
    assert cli.main(["convert", str(ckpt), str(tmp_path / "c.pt")]) == 0
    assert_same(state, torch.load(tmp_path / "c.pt", weights_only=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "int_keys",
    [
        {"optim.state.0.step": [1]},
        {"nope": [2]},
        {"optim.state.0.step": [9]},
        {"optim.state.0.step": "2"},
        [],
        {"model.0.weight": [1]},
    ],
)
def test_int_keys_that_do_not_fit_the_metadata_are_refused(
    tmp_path: Path, temporal_queue: AsyncCallsQueue, int_keys: Any
) -> None:
    """The manifest's ``int_keys`` only turns ``str`` keys that are the ``str`` of an
    int back into ints, in entries the metadata has; anything else is corrupt."""
    ckpt = ckpt_of(tmp_path / "ckpt", user_state("adamw"), temporal_queue)
    manifest_path = ckpt / commit.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["int_keys"] = int_keys
    os.chmod(manifest_path, 0o644)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match="int_keys"):
        asyncckpt.read_state_dict(ckpt, verify=False)


# ----------------------------------------------------------------------------- issue 25 item 10
@pytest.mark.timeout(120)
def test_records_swapped_without_the_metadata_are_not_used(tmp_path: Path, temporal_queue: AsyncCallsQueue) -> None:
    """Two entries' places swapped in ``.records.json`` (still naming the CRC-32 of the
    intact ``.metadata``): ``load(verify=False)`` must read what ``.metadata`` says, as
    ``dcp.load`` and ``read_state_dict`` do, not what the records say."""
    state = {"a": torch.full((64,), 1.0), "b": torch.full((64,), 2.0), "n": 5}
    ckpt = ckpt_of(tmp_path / "ckpt", state, temporal_queue)
    target = fresh(state)
    with observing_loads() as loads:
        asyncckpt.load(target, ckpt, verify=False)  # the records file as committed: used
    assert (loads.records, loads.metadata) == (1, 0)
    assert_same(state, target)

    records_path = ckpt / RECORDS_NAME
    obj = json.loads(records_path.read_bytes())
    rows = {row[0]: row for rows in obj["files"].values() for row in rows}
    rows["a"][1], rows["b"][1] = rows["b"][1], rows["a"][1]
    os.chmod(records_path, 0o644)
    records_path.write_bytes(json.dumps(obj).encode())

    stock = fresh(state)
    stock_load(stock, ckpt)
    assert_same(state, stock)
    assert_same(state, asyncckpt.read_state_dict(ckpt, verify=False))
    target = fresh(state)
    with warnings.catch_warnings(record=True) as caught, observing_loads() as loads:
        warnings.simplefilter("always")
        asyncckpt.load(target, ckpt, verify=False)
    assert_same(state, target)
    assert any(".records.json or .metadata does not match the manifest" in str(w.message) for w in caught)
    assert (loads.records, loads.metadata) == (0, 1)
    # With verification the swapped file is corruption, named.
    for verify in (True, "inline"):
        with pytest.raises(CorruptCheckpointError, match=r"\.records\.json"):
            asyncckpt.load(fresh(state), ckpt, verify=verify)
