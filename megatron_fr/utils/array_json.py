"""A numpy array as JSON-ready data and back: its raw bytes in base64, little-endian, with its
shape and dtype. What the trajectories' compact arrays (routed experts, top-K log-probs) are
written as in rollout-state checkpoints, so a checkpoint reads the same on any machine."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def array_to_json(array: np.ndarray) -> dict[str, Any]:
    """{"shape", "dtype", "data"}: the array's bytes, little-endian, in base64."""
    data = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {
        "shape": list(array.shape),
        "dtype": array.dtype.name,
        "data": base64.b64encode(data.tobytes()).decode("ascii"),
    }


def array_from_json(data: dict[str, Any]) -> np.ndarray:
    """The array `array_to_json` wrote, in the machine's byte order (a fresh, writable copy)."""
    dtype = np.dtype(data["dtype"]).newbyteorder("<")
    raw = np.frombuffer(base64.b64decode(data["data"]), dtype=dtype)
    return raw.astype(dtype.newbyteorder("="), copy=True).reshape(data["shape"])
