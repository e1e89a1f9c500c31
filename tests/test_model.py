"""D1: the assignment-1 Transformer LM, its AdamW and cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.model import (
    PRESETS,
    AdamW,
    ModelConfig,
    TransformerLM,
    count_parameters,
    cross_entropy,
    get_preset,
)
from cs336_systems.model.transformer import RotaryEmbedding

# SPEC.md: parameter counts with vocab 10,000 (embedding and untied LM head included).
SPEC_PARAMETER_COUNTS = {
    "small": 128_625_408,
    "medium": 423_183_360,
    "large": 969_411_840,
    "xl": 1_998_235_200,
    "2.7B": 3_406_809_600,
}


@pytest.mark.parametrize("size", sorted(SPEC_PARAMETER_COUNTS))
def test_preset_parameter_counts_on_meta_device(size: str) -> None:
    model = TransformerLM(get_preset(size), device="meta")
    assert all(p.is_meta for p in model.parameters()), "the count must not allocate"
    assert sum(p.numel() for p in model.parameters()) == SPEC_PARAMETER_COUNTS[size]
    assert count_parameters(get_preset(size)) == SPEC_PARAMETER_COUNTS[size]


def test_parameter_count_matches_closed_form() -> None:
    # embedding + head: 2·V·d; per block: 4·d² (attention) + 3·d·d_ff (SwiGLU) + 2·d (norms); final norm d.
    c = ModelConfig(d_model=48, d_ff=100, num_layers=3, num_heads=6, vocab_size=77)
    expected = 2 * 77 * 48 + 3 * (4 * 48 * 48 + 3 * 48 * 100 + 2 * 48) + 48
    assert count_parameters(c) == expected


def test_config_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=10, d_ff=16, num_layers=1, num_heads=3)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("huge")


def _tiny_model(attention: str = "pytorch", **changes) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(PRESETS["tiny"].with_(attention=attention, **changes))


def test_forward_shape_and_dtype(tiny_config: ModelConfig, generator: torch.Generator) -> None:
    model = _tiny_model()
    tokens = torch.randint(0, tiny_config.vocab_size, (3, 17), generator=generator)
    logits = model(tokens)
    assert logits.shape == (3, 17, tiny_config.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_rejects_sequences_longer_than_context(tiny_config: ModelConfig) -> None:
    model = _tiny_model()
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, tiny_config.context_length + 1, dtype=torch.long))


@pytest.mark.parametrize("t", [0, 5, 15])
def test_causality(tiny_config: ModelConfig, generator: torch.Generator, t: int) -> None:
    model = _tiny_model()
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 16), generator=generator)
    changed = tokens.clone()
    changed[:, t + 1 :] = torch.randint(
        0, tiny_config.vocab_size, changed[:, t + 1 :].shape, generator=generator
    )
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1])
    if t + 1 < tokens.shape[1]:
        assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :]), "later tokens must matter to later logits"


def test_attention_implementations_agree(tiny_config: ModelConfig, generator: torch.Generator) -> None:
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 33), generator=generator)
    reference = _tiny_model("pytorch")
    fused = _tiny_model("sdpa")
    fused.load_state_dict(reference.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), reference(tokens), rtol=1e-4, atol=1e-4)


def test_unknown_attention_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown attention"):
        _tiny_model("no-such-kernel")


def test_rope_scores_depend_only_on_relative_position(generator: torch.Generator) -> None:
    rope = RotaryEmbedding(d_head=8, max_seq_len=64, theta=10_000.0)
    q, k = torch.randn(8, generator=generator), torch.randn(8, generator=generator)

    def score(m: int, n: int) -> torch.Tensor:
        return rope(q[None], torch.tensor([m]))[0] @ rope(k[None], torch.tensor([n]))[0]

    torch.testing.assert_close(score(10, 3), score(40, 33))
    assert not torch.allclose(score(10, 3), score(10, 4))
    # A rotation keeps norms.
    torch.testing.assert_close(rope(q[None], torch.tensor([7])).norm(), q.norm())


def test_init_is_truncated_normal() -> None:
    model = TransformerLM(get_preset("tiny", d_model=256, d_ff=512, num_heads=4))
    w = model.layers[0].ffn.w1.weight
    std = (2.0 / (w.shape[0] + w.shape[1])) ** 0.5
    assert w.abs().max() <= 3 * std + 1e-6
    assert 0.8 * std < w.std() < 1.0 * std  # truncation at 3 sigma shrinks the std by ~1.3%
    emb = model.token_embeddings.weight
    assert emb.abs().max() <= 3.0 + 1e-6


def test_backward_reaches_every_parameter(tiny_config: ModelConfig, generator: torch.Generator) -> None:
    model = _tiny_model()
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 9), generator=generator)
    cross_entropy(model(tokens)[:, :-1], tokens[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("chunk_elements", [1 << 28, 5000], ids=["one-chunk", "many-chunks"])
def test_adamw_matches_torch(
    weight_decay: float, chunk_elements: int, generator: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("cs336_systems.model.optim._CHUNK_ELEMENTS", chunk_elements)
    ours_model, torch_model = _tiny_model(), _tiny_model()
    groups = lambda m: [  # two groups with their own hyper-parameters
        {"params": [p for n, p in m.named_parameters() if "ln" in n], "lr": 3e-3, "weight_decay": 0.0},
        {"params": [p for n, p in m.named_parameters() if "ln" not in n]},
    ]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    ours, reference = AdamW(groups(ours_model), **kwargs), torch.optim.AdamW(groups(torch_model), **kwargs)
    tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (4, 12), generator=generator)
    for _ in range(5):
        for model, opt in ((ours_model, ours), (torch_model, reference)):
            opt.zero_grad()
            cross_entropy(model(tokens)[:, :-1], tokens[:, 1:]).backward()
            opt.step()
    for (name, a), b in zip(ours_model.named_parameters(), torch_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"parameter {name} diverged")
    assert ours.state[next(ours_model.parameters())]["step"] == 5


def test_adamw_rejects_bad_hyperparameters() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="learning rate"):
        AdamW(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        AdamW(p, betas=(0.9, 1.0))


def test_cross_entropy_matches_torch(generator: torch.Generator) -> None:
    logits = torch.randn(3, 5, 11, generator=generator)
    targets = torch.randint(0, 11, (3, 5), generator=generator)
    torch.testing.assert_close(
        cross_entropy(logits, targets), F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))
    )


def test_cross_entropy_is_stable_for_large_logits(generator: torch.Generator) -> None:
    logits = 1e4 + 50 * torch.randn(6, 100, generator=generator)
    targets = torch.randint(0, 100, (6,), generator=generator)
    loss = cross_entropy(logits, targets)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, F.cross_entropy(logits.double(), targets).float(), rtol=1e-5, atol=1e-4)


def test_cross_entropy_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="do not match"):
        cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
