"""numpy arrays in JSON: dtype, shape and the raw little-endian bytes in base64, so a
checkpoint of the rollout state stores a trajectory's tokens as compactly as memory does."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """JSON-ready form of `array` (any numeric or bool dtype)."""
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    return {
        "shape": list(array.shape),
        "dtype": array.dtype.name,
        "data": base64.b64encode(np.ascontiguousarray(little).tobytes()).decode("ascii"),
    }


def decode_array(data: dict[str, Any]) -> np.ndarray:
    """The array encode_array wrote, in native byte order (a fresh, writable copy)."""
    dtype = np.dtype(data["dtype"]).newbyteorder("<")
    raw = np.frombuffer(base64.b64decode(data["data"]), dtype=dtype)
    return raw.astype(dtype.newbyteorder("="), copy=True).reshape(data["shape"])
