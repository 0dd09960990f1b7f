"""The random key of one sample: a function of its identity (seed, request, sample), not of
where or with whom it ran.

Every engine seeds a sample from this key: the built-in engine hashes it with a counter for each
draw (builtin/_sampling.py), the vLLM and SGLang adapters pass it as the sample's own seed. The
hash works on Python ints and on int64 tensors alike, so the host derives keys with the same
function the device uses for draws.
"""

from __future__ import annotations

MASK31 = (1 << 31) - 1
_MUL = 0x045D9F3B  # < 2**27, so (31-bit value) * _MUL never overflows int64
GOLDEN = 0x1E3779B9


def mix31(x):
    """A 31-bit integer hash (a variant of the well-known 0x45d9f3b mixer)."""
    x = ((x ^ (x >> 16)) * _MUL) & MASK31
    x = ((x ^ (x >> 16)) * _MUL) & MASK31
    return x ^ (x >> 16)


def derive_key(seed: int, request_index: int, sample_index: int) -> int:
    """The random key of one sample: a function of its identity, not of its slot."""
    key = mix31((seed & MASK31) ^ GOLDEN)
    key = mix31(key ^ ((seed >> 31) & MASK31))
    key = mix31((key + request_index) & MASK31)
    return mix31((key ^ mix31(sample_index & MASK31)) & MASK31)
