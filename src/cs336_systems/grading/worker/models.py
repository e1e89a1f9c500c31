"""Small float64 models for the data-parallel checks, and the batches they train on.

``course`` tier: models shaped like the course's own test models (a bias-free MLP, and the same with one
weight tied between two layers). ``beyond`` tier: a frozen layer, a buffer, an embedding tied to the
output head, and a layer ``extra`` that only the samples flagged in a mask pass through: every rank
uses it ("all"), no rank does ("none": no gradient anywhere), or only rank 0's samples do ("rank0").
``beyond`` models are float64, so any mismatch is a bug and not rounding; ``course`` models are float32
and compared with the tolerances of ``torch.testing.assert_close``, as the course's tests compare them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPE = torch.float64
COURSE_DTYPE = torch.float32
TOL = {"course": (1e-5, 1.3e-6), "beyond": (1e-10, 0.0)}  # (atol, rtol) of |got - ref| <= atol + rtol |ref|
IN, HIDDEN, OUT, VOCAB = 10, 16, 5, 20


class CourseMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, IN, bias=False)
        self.fc2 = nn.Linear(IN, 50, bias=False)
        self.fc3 = nn.Linear(50, OUT, bias=False)

    def forward(self, x: torch.Tensor, use_extra: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CourseTiedMLP(CourseMLP):
    def __init__(self) -> None:
        super().__init__()
        self.fc4 = nn.Linear(50, IN, bias=False)
        self.fc5 = nn.Linear(IN, 50, bias=False)
        self.fc5.weight = self.fc2.weight  # one Parameter, used twice

    def forward(self, x: torch.Tensor, use_extra: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc4(F.relu(self.fc2(F.relu(self.fc1(x))))))
        return self.fc3(F.relu(self.fc5(h)))


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)
        self.extra = nn.Linear(OUT, OUT)
        self.frozen = nn.Linear(OUT, OUT)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", 1.0 + 0.1 * torch.randn(OUT))

    def forward(self, x: torch.Tensor, use_extra: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.relu(self.ln(self.fc1(x)))) * self.scale
        if use_extra.any():  # skipped entirely, so `extra` gets no gradient at all
            h = torch.where(use_extra[:, None], self.extra(h), h)
        return self.frozen(h)


class TiedToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.extra = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, used twice

    def forward(self, tokens: torch.Tensor, use_extra: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(tokens)))
        if use_extra.any():
            h = torch.where(use_extra[:, None, None], self.extra(h), h)
        return self.head(h)


MODELS: dict[str, type[nn.Module]] = {
    "course": CourseMLP,
    "course-tied": CourseTiedMLP,
    "toy": ToyModel,
    "tied": TiedToyModel,
}


def make_model(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]().to(dtype=dtype_of(name))


def dtype_of(name: str) -> torch.dtype:
    return COURSE_DTYPE if name.startswith("course") else DTYPE


def within(got: torch.Tensor, ref: torch.Tensor, tier: str) -> bool:
    atol, rtol = TOL[tier]
    return bool(((got - ref).abs() <= atol + rtol * ref.abs()).all())


def make_batch(
    name: str, step: int, global_batch: int, extra: str, world_size: int
) -> tuple[torch.Tensor, ...]:
    """The global batch of a step, the same on every rank: inputs, targets, and the per-sample flag of
    who passes through ``extra``."""
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "tied":
        x = torch.randint(VOCAB, (global_batch, 6), generator=gen)
        y = torch.randint(VOCAB, (global_batch, 6), generator=gen)
    else:
        x = torch.randn(global_batch, IN, generator=gen, dtype=DTYPE).to(dtype_of(name))
        y = torch.randn(global_batch, OUT, generator=gen, dtype=DTYPE).to(dtype_of(name))
    mask = torch.zeros(global_batch, dtype=torch.bool)
    if extra == "all":
        mask[:] = True
    elif extra == "rank0":
        mask[: global_batch // world_size] = True
    return x, y, mask


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "tied":
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return F.mse_loss(out, y)


@torch.no_grad()
def max_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = [*zip(a.parameters(), b.parameters(), strict=True), *zip(a.buffers(), b.buffers(), strict=True)]
    return max((x - y).abs().max().item() for x, y in pairs)
