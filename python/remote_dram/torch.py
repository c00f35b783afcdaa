"""PyTorch state dicts in remote DRAM.

    from remote_dram.torch import save_state_dict, load_state_dict
    save_state_dict(client, "ckpt/step-1000", model.state_dict())
    load_state_dict(client, "ckpt/step-1000", like=model.state_dict())   # fills in place

Each tensor's bytes go under ``PREFIX/NAME``; a small JSON manifest under
``PREFIX/.manifest`` (dtype, shape, order of names, each tensor's generation) is
written last, so a reader that finds a manifest finds every tensor it names. A reader
checks each tensor's generation against the manifest after reading it: a checkpoint
overwritten while being loaded raises :class:`remote_dram.Error` instead of returning a
mix of two checkpoints.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Mapping

import torch

from .errors import Error, Status

MANIFEST = ".manifest"
FORMAT = "remote_dram.torch/1"


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}"


# Devices whose tensors the client reads and writes in place (CUDA memory is staged by the client).
_IN_PLACE = ("cpu", "cuda")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (every dtype, bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8)


def save_state_dict(client, prefix: str, state_dict: Mapping[str, torch.Tensor]) -> int:
    """Writes every tensor of ``state_dict`` under ``prefix/NAME``, then the manifest.
    Returns the manifest's generation. Contiguous CPU and CUDA tensors are sent from
    where they are (CUDA memory staged by the client); others are made contiguous, and
    tensors on other devices are copied to the CPU first."""
    names = list(state_dict)
    if MANIFEST in names:
        raise ValueError(f"a tensor may not be named {MANIFEST!r} (the manifest's key)")
    tensors = []
    for name in names:
        t = state_dict[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach()
        tensors.append((t if t.device.type in _IN_PLACE else t.to("cpu")).contiguous())
    generations = client.put_many([(_key(prefix, n), _as_bytes(t)) for n, t in zip(names, tensors)])
    manifest = {
        "format": FORMAT,
        "tensors": [
            {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "nbytes": t.numel() * t.element_size(), "generation": g}
            for n, t, g in zip(names, tensors, generations)
        ],
    }
    return client.put(_key(prefix, MANIFEST), json.dumps(manifest).encode())


def load_state_dict(client, prefix: str, like: Mapping[str, torch.Tensor] | None = None):
    """Reads the checkpoint under ``prefix``: an ordered dict of CPU tensors in the order
    they were saved, or ``None`` when there is no checkpoint there.

    With ``like`` (for example ``model.state_dict()``), its tensors are filled in place
    and returned; names, dtypes and shapes must match the checkpoint's. Contiguous CPU
    and CUDA tensors receive the bytes directly (CUDA memory staged by the client);
    others go through a CPU tensor and ``copy_``."""
    entry = client.get_entry(_key(prefix, MANIFEST))
    if entry is None:
        return None
    manifest = json.loads(entry.value)
    if manifest.get("format") != FORMAT:
        raise Error(f"{prefix}: not a {FORMAT} checkpoint manifest", Status.INVALID_ARGUMENT)
    specs = manifest["tensors"]
    if like is not None:
        missing = [s["name"] for s in specs if s["name"] not in like]
        unexpected = sorted(set(like) - {s["name"] for s in specs})
        if missing or unexpected:
            raise KeyError(f"checkpoint {prefix!r} and `like` differ: missing in like {missing}, not in checkpoint {unexpected}")

    result: OrderedDict[str, torch.Tensor] = OrderedDict()
    dests = []  # where each tensor's bytes land
    staged = []  # (target, CPU tensor) pairs that need a copy after the transfer
    for s in specs:
        dtype = getattr(torch, s["dtype"])
        shape = tuple(s["shape"])
        target = like[s["name"]] if like is not None else None
        if target is not None and (target.dtype != dtype or tuple(target.shape) != shape):
            raise ValueError(f"{s['name']}: checkpoint has {s['dtype']}{list(shape)}, like has {target.dtype}{list(target.shape)}")
        if target is not None and target.device.type in _IN_PLACE and target.is_contiguous():
            dest = target
        else:
            dest = torch.empty(shape, dtype=dtype)
            if target is not None:
                staged.append((target, dest))
        dests.append(dest)
        result[s["name"]] = target if target is not None else dest

    lengths = client.get_many_into([_key(prefix, s["name"]) for s in specs], [_as_bytes(d) for d in dests])
    for s, n in zip(specs, lengths):
        if n != s["nbytes"]:
            raise Error(f"checkpoint {prefix!r} changed while loading: {s['name']} is {'missing' if n is None else f'{n} bytes'}", Status.UNAVAILABLE)
    # Every tensor read must still be the one the manifest names: a generation that is
    # unchanged now was unchanged when its bytes were read.
    for s in specs:
        now = client.get_entry(_key(prefix, s["name"]), if_not_equal=s["generation"])
        if now is None or now.value is not None:
            raise Error(f"checkpoint {prefix!r} changed while loading ({s['name']} was rewritten); load it again", Status.UNAVAILABLE)
    for target, host in staged:
        target.copy_(host)
    return result
