"""The models the data-parallel checks train, built the same way by the judging process (for the
reference run) and by the workers (for the student's run); initial weights always come from the judge.

``course-toy`` and ``course-tied``: the course's test models (an MLP 10 -> 10 -> 50 -> 5 with a frozen
bias and a frozen parameter; the same with one weight tied between two layers), float32. ``toy`` and
``tied`` (beyond): a frozen layer, a buffer, an embedding tied to the output head, and a layer ``extra``
that only the samples flagged in ``use_extra`` pass through (an argument, or the attribute set before a
forward, so that a wrapper is called as the course calls it, ``model(x)``), float64 so that any mismatch is a bug, not rounding.
``LayersModel``: the course's FSDP model, of Linear / Embedding / RMSNorm classes given to it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dtypes import DTYPES

IN, HIDDEN, OUT, VOCAB = 10, 16, 5, 20


class CourseToy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, IN, bias=False)
        self.fc2 = nn.Linear(IN, 50)
        self.fc2.bias.requires_grad_(False)
        self.fc3 = nn.Linear(50, OUT, bias=False)
        self.fixed = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CourseTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, IN, bias=False)
        self.fc2 = nn.Linear(IN, 50, bias=False)
        self.fc3 = nn.Linear(50, IN, bias=False)
        self.fc4 = nn.Linear(IN, 50, bias=False)
        self.fc5 = nn.Linear(50, OUT, bias=False)
        self.fc4.weight = self.fc2.weight  # one Parameter, used twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc2(F.relu(self.fc1(x))))
        return self.fc5(F.relu(self.fc4(F.relu(self.fc3(h)))))


class ToyModel(nn.Module):
    use_extra: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)
        self.extra = nn.Linear(OUT, OUT)
        self.frozen = nn.Linear(OUT, OUT)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", 1.0 + 0.1 * torch.randn(OUT))

    def forward(self, x: torch.Tensor, use_extra: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc2(F.relu(self.ln(self.fc1(x)))) * self.scale
        use_extra = self.use_extra if use_extra is None else use_extra
        if use_extra.any():  # skipped entirely, so `extra` gets no gradient at all
            h = torch.where(use_extra[:, None], self.extra(h), h)
        return self.frozen(h)


class TiedToyModel(nn.Module):
    use_extra: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.extra = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # one Parameter, used twice

    def forward(self, tokens: torch.Tensor, use_extra: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(tokens)))
        use_extra = self.use_extra if use_extra is None else use_extra
        if use_extra.any():
            h = torch.where(use_extra[:, None, None], self.extra(h), h)
        return self.head(h)


DTYPE = torch.float64  # the beyond models' dtype

MODELS: dict[str, type[nn.Module]] = {
    "course-toy": CourseToy,
    "course-tied": CourseTied,
    "toy": ToyModel,
    "tied": TiedToyModel,
}


def make_model(
    name: str, dtype: str, state: dict[str, torch.Tensor] | None = None, seed: int = 0
) -> nn.Module:
    """``name``'s model in ``dtype``, with ``state`` loaded when given (else seeded weights)."""
    torch.manual_seed(seed)
    model = MODELS[name]().to(DTYPES[dtype])
    if state is not None:
        model.load_state_dict(state)
    return model


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "tied":
        return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
    return F.mse_loss(out, y)


class LayersModel(nn.Module):
    """The course's FSDP test model: Embedding -> RMSNorm -> Linear -> ReLU -> RMSNorm -> Linear -> Linear."""

    def __init__(self, layers: tuple[type, type, type], vocab: int, d: int, d_ff: int) -> None:
        super().__init__()
        linear, embedding, norm = layers
        self.embedding = embedding(vocab, d)
        self.norm1 = norm(d)
        self.linear1 = linear(d, d_ff)
        self.norm2 = norm(d_ff)
        self.linear2 = linear(d_ff, d)
        self.lm_head = linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm1(self.embedding(ids))
        x = self.norm2(torch.relu(self.linear1(x)))
        return self.lm_head(self.linear2(x))
