"""The benchmark on a GPU (``--device cuda``): which device a run measures, what it
records of the GPU, and the GPU training loop's model.

On a GPU the state lives in device memory, so a save's staging is a device-to-host
copy: the stall is compared with the plain D2H copy of the same tensors into pinned
host memory (:func:`benchmark.limits.bench_memcpy`), the commit with a raw write +
fsync of the same bytes, as on the CPU. The GPU training loop is issue 35's: 16 blocks
of LayerNorm + a 1024 x 4096 MLP (residual), fused AdamW, 8192 tokens a step (about
1.6 GB of float32 parameters + AdamW state), so that the training thread runs ahead
of the GPU, as in any real loop; the loop itself is :func:`benchmark.training.train_run`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: issue 35's GPU training loop: blocks, width, MLP hidden width, tokens a step.
GPU_TRAIN = {"blocks": 16, "width": 1024, "hidden": 4096, "tokens": 8192}
#: the same structure at a few MB (--quick, and the CPU tests of the GPU loop's code).
GPU_TRAIN_TINY = {"blocks": 2, "width": 64, "hidden": 256, "tokens": 256}

#: the llm workload on a GPU: scripts/train.py's GPT, 24 blocks of width 1024
#: (302 M parameters: about 3.4 GiB of float32 parameters + AdamW state in 1172 tensors).
LLM_GPU = {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 128}


def resolve_device(requested: str) -> tuple[str, str | None]:
    """The device a run measures, and why the GPU rows cannot run (``None`` where they can).

    Args:
        requested: ``"auto"`` (a GPU where torch sees one, else the CPU), ``"cpu"`` or
            ``"cuda"``.

    Returns:
        ``("cpu", None)``, ``("cuda", None)``, or ``("cuda", reason)`` when ``"cuda"``
        was asked for and torch sees no CUDA device (the reason names torch's version
        and build).
    """
    if requested == "cpu":
        return "cpu", None
    if torch.cuda.is_available():
        return "cuda", None
    if requested == "auto":
        return "cpu", None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return "cuda", f"no GPU: torch {torch.__version__} ({build}) sees no CUDA device"


def gpu_info() -> dict[str, Any]:
    """What a GPU run records of the device: name, memory (bytes), compute capability,
    torch's CUDA version and the device count; ``{}`` without a GPU."""
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_bytes": props.total_memory,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "torch_cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count(),
    }


class MlpBlock(nn.Module):
    """LayerNorm, Linear(width, hidden), GELU, Linear(hidden, width), and the residual."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MlpTrainer:
    """Issue 35's GPU training loop: ``blocks`` :class:`MlpBlock` of ``width`` and
    ``hidden``, AdamW (fused on CUDA), a regression on ``tokens`` random float32 rows of
    ``width`` a step. The same interface as :class:`benchmark.training.Trainer`
    (``forward_backward``, ``optimizer_step``, ``state_dict``, ``sync``, ``cfg``,
    ``n_params``, ``label``); its state is ``{"model", "optim", "step"}`` from
    ``get_state_dict``, on ``device``."""

    def __init__(
        self, device: str, blocks: int, width: int, hidden: int, tokens: int, seed: int = 1337, lr: float = 1e-4
    ) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self._get_state_dict = get_state_dict
        self.device = torch.device(device)
        self.cfg: dict[str, Any] = {"blocks": blocks, "width": width, "hidden": hidden, "tokens": tokens}
        torch.manual_seed(seed)
        self.model = nn.Sequential(*[MlpBlock(width, hidden) for _ in range(blocks)]).to(self.device)
        cuda = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), fused=cuda or None)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.x = torch.randn(tokens, width, device=self.device, generator=gen)
        self.y = torch.randn(tokens, width, device=self.device, generator=gen)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.label = (
            f"{blocks} blocks of LayerNorm + a {width} x {hidden} MLP (residual), AdamW"
            f"{' (fused)' if cuda else ''}, {tokens} tokens a step, on {self.device.type}"
        )
        self.step_no = 0
        self.forward_backward()
        self.opt.step()  # AdamW's state exists from here on
        self.sync()

    def forward_backward(self) -> None:
        loss = F.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.step_no += 1

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "step": self.step_no}

    def sync(self) -> None:
        """Wait for the device's queued work (the loop's time ends when the GPU is done)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
