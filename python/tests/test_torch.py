"""remote_dram.torch: state dicts through a real server (see conftest.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed in this venv (make test installs CPU torch from PyPI; the install failed or was skipped)")

import remote_dram as rd  # noqa: E402
from remote_dram.torch import load_state_dict, save_state_dict  # noqa: E402


def model_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    state = model.state_dict()
    state["extra.bf16"] = torch.randn(3, 5).to(torch.bfloat16)
    state["extra.int64"] = torch.arange(10)
    state["extra.scalar"] = torch.tensor(3.5)
    state["extra.empty"] = torch.empty(0, 4)
    state["extra.bool"] = torch.tensor([True, False, True])
    return state


def test_state_dict_round_trip(client, prefix):
    state = model_state()
    save_state_dict(client, prefix + "ckpt", state)
    loaded = load_state_dict(client, prefix + "ckpt")
    assert list(loaded) == list(state), "names come back in the order they were saved"
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape, name
        assert torch.equal(loaded[name], t), name


def test_load_fills_like_in_place(client, prefix):
    state = model_state()
    save_state_dict(client, prefix + "ckpt", state)
    like = {name: torch.zeros_like(t) for name, t in state.items()}
    like["0.weight"] = torch.zeros(32, 16).t().contiguous().t()  # not contiguous: filled through a copy
    pointers = {name: t.data_ptr() for name, t in like.items()}
    loaded = load_state_dict(client, prefix + "ckpt", like=like)
    for name, t in state.items():
        assert loaded[name] is like[name] and like[name].data_ptr() == pointers[name], name
        assert torch.equal(like[name], t), name


def test_load_refuses_what_does_not_match(client, prefix):
    state = model_state()
    save_state_dict(client, prefix + "ckpt", state)
    assert load_state_dict(client, prefix + "nothing-here") is None
    wrong_shape = dict(state, **{"0.bias": torch.zeros(7)})
    with pytest.raises(ValueError, match="0.bias"):
        load_state_dict(client, prefix + "ckpt", like=wrong_shape)
    with pytest.raises(KeyError):
        load_state_dict(client, prefix + "ckpt", like={"0.bias": torch.zeros(32)})


def test_a_rewritten_tensor_is_detected(client, prefix):
    state = model_state()
    save_state_dict(client, prefix + "ckpt", state)
    # A writer overwrote one tensor after the manifest was written (a new save in progress).
    client.put(prefix + "ckpt/2.bias", torch.ones(4))
    with pytest.raises(rd.Error, match="changed while loading"):
        load_state_dict(client, prefix + "ckpt")
