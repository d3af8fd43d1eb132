"""Integer columns packed as int32 bytes: prompts from the tokenizer to the scheduler, and a
new sequence's tokens and block table from the scheduler to the workers.

A message field annotated `array` holds an `array('i')` and travels as one msgpack bin of
little-endian int32. As a list, a prompt of thousands of tokens cost msgpack a type byte and
the decoder a type check per token, each way; packed it costs a copy. An `array('i')` yields
plain ints, compares equal to another with the same items, and numpy reads it without a
Python loop (`np.asarray(ids, np.int64)`). Whether an id is in the vocabulary or the KV pool
is the receiver's to judge; a bin that is not whole int32s is refused as malformed.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

TYPECODE = "i"
"""C int: 4 bytes on every platform the engine runs on (checked below)."""
ITEM_BYTES = 4
_SWAP = sys.byteorder != "little"  # the wire is little-endian

if array(TYPECODE).itemsize != ITEM_BYTES:
    raise ImportError(f"array typecode {TYPECODE!r} is not 4 bytes on this platform")


def int32_array(values: Iterable[int]) -> array:
    """`values` as an int32 array: the same object when it is one already, else a copy.

    Raises ValueError for anything but int32 integers (a float, an id past int32), so a
    message cannot be built with values its receivers could not store."""
    if type(values) is array and values.typecode == TYPECODE:
        return values
    if isinstance(values, bytes | bytearray | memoryview | str):  # array() would reinterpret
        raise ValueError(f"expected integers, not {type(values).__name__}")
    try:
        return array(TYPECODE, values)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"expected int32 integers: {exc}") from None


def pack(values: array) -> bytes:
    """The wire form of an int32 array: its items as little-endian int32."""
    if _SWAP:
        values = array(TYPECODE, values)
        values.byteswap()
    return values.tobytes()


def unpack(data: bytes) -> array:
    """The int32 array packed in `data`; ValueError unless it is whole int32s."""
    if len(data) % ITEM_BYTES:
        raise ValueError(f"{len(data)} bytes are not a whole number of int32 values")
    values = array(TYPECODE)
    values.frombytes(data)
    if _SWAP:
        values.byteswap()
    return values
