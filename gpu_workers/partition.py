"""The runtime's name for protocol.head_partition: how tensor-parallel ranks split a model.

The code lives in protocol so that the launcher can check a TP size without importing this
package (whose __init__ imports torch and the kernels).
"""

from protocol.head_partition import (
    HeadShard,
    even_split,
    partition_from_hf_config,
    partition_heads,
)

__all__ = ["HeadShard", "even_split", "partition_from_hf_config", "partition_heads"]
