"""docs/design.md's hop tables hold: the Python frames each public call passes through on its way to
the engine, recorded by wrapping the engine's entry points, are the tables' Python rows in order."""

import os
import re
import sys
from pathlib import Path

import kda
import pytest
import torch
from kda import _engine, _ops

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
PACKAGE = os.path.dirname(kda.__file__)


def table_hops(heading):
    """The Python rows (file under python/kda/) of the hop table under `heading`, as qualified names
    without their module (`_ops.forward` -> `forward`, `_Path.backward` stays)."""
    text = DESIGN.read_text()
    start = text.index(heading)
    end = text.find("\n### ", start + 1)
    names = []
    for line in text[start : end if end > 0 else len(text)].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        if not cells[2].startswith("`python/kda/"):
            continue
        name = re.match(r"`([^`]+)`", cells[1]).group(1)
        module, _, rest = name.partition(".")
        if rest and not module.lstrip("_")[:1].isupper():  # a module prefix, not a class
            name = rest
        names.append(name)
    return names


@pytest.fixture
def recorded(monkeypatch):
    """Wraps the engine's entry points where the Python layer holds them (the chunked path's functions,
    `_engine.decode`): each call appends (entry, the kda frames above it, outermost first)."""
    calls = []

    def wrap(owner, attribute, entry):
        real = getattr(owner, attribute)

        def wrapper(*args, **kwargs):
            frames, f = [], sys._getframe(1)
            while f is not None:
                if f.f_code.co_filename.startswith(PACKAGE):
                    frames.append(f.f_code.co_qualname)
                f = f.f_back
            calls.append((entry, frames[::-1]))
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, attribute, wrapper)

    chunk = _ops.PATHS["chunk"]
    wrap(chunk, "engine_forward", "chunk_forward")
    wrap(chunk, "engine_backward", "chunk_backward")
    wrap(_engine, "decode", "decode")
    return calls


def inputs(T=20, H=2, K=16, V=16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    return (
        q,
        k,
        torch.randn(1, T, H, V, generator=gen),
        -torch.rand(1, T, H, K, generator=gen),
        torch.rand(1, T, H),
    )


def test_prefill_and_its_op_route(recorded):
    hops = table_hops("### `kda.chunk_kda`: prefill and the training forward")
    # The op route: hop 2 calls torch.ops.kda.chunk_fwd, whose implementation _Path.forward calls hop 3
    # (every call takes it where this torch lacks the fast route's probes).
    op_route = hops[:3] + ["_Path.forward"] + hops[3:]
    q, k, v, g, beta = inputs()
    kda.chunk_kda(q, k, v, g, beta)
    assert recorded == [("chunk_forward", hops if _ops.FAST_ROUTE else op_route)]
    recorded.clear()
    kda.chunk_kda(q.clone().requires_grad_(), k, v, g, beta)
    assert recorded == [("chunk_forward", op_route)]


def test_backward(recorded):
    q, k, v, g, beta = inputs()
    o, _ = kda.chunk_kda(q.clone().requires_grad_(), k, v, g, beta)
    recorded.clear()
    o.sum().backward()
    assert recorded == [("chunk_backward", table_hops("### `loss.backward()` through `chunk_kda`"))]


def test_serving_decode(recorded):
    q, k, v, g, beta = inputs(T=1)
    pool = torch.zeros(4, 2, 16, 16)
    kda.fused_recurrent_kda_fwd(
        q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor([1]), inplace_final_state=True
    )
    hops = table_hops("### Serving decode: `kda.fused_recurrent_kda_fwd` on a state pool")
    assert recorded == [("decode", hops)]
