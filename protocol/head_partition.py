"""How tensor-parallel ranks split a model: attention heads by KV-head group, the rest evenly.

Pure Python in protocol (no torch, no gpu_workers package start-up), so the launcher checks
a TP size with the code the workers split by, before starting any process.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.model_config import attention_heads


@dataclass(frozen=True, slots=True)
class HeadShard:
    """One rank's attention heads, as contiguous ranges of global head indices."""

    q_heads: range
    kv_heads: range

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def even_split(n: int, parts: int) -> list[range]:
    """n items in `parts` contiguous ranges whose sizes differ by at most one (larger first)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


def partition_heads(num_heads: int, num_kv_heads: int, tp: int) -> list[HeadShard]:
    """The heads of each rank 0..tp-1; ValueError (one line) if this TP size cannot run.

    Query head h belongs to KV head h // (num_heads // num_kv_heads), as in Hugging Face models,
    and a rank always holds whole KV heads with only queries of those KV heads.
    - tp <= num_kv_heads: the KV heads are split into tp contiguous ranges as evenly as possible
      (the first num_kv_heads % tp ranks get one more), each with all the queries of its groups.
      9 q / 3 kv at tp=2: rank 0 has kv [0, 2) and q [0, 6), rank 1 kv [2, 3) and q [6, 9).
    - tp > num_kv_heads: the ranks are split over the KV heads the same way (the first KV heads
      get one rank more), every rank of a KV head holds a copy of it, and that group's queries
      are split evenly among them. 9 q / 3 kv at tp=4: kv 0 is on ranks 0 and 1 (q [0, 2) and
      [2, 3)), kv 1 on rank 2 (q [3, 6)), kv 2 on rank 3 (q [6, 9)).
    Every rank gets at least one query head exactly when 1 <= tp <= num_heads.
    """
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a positive multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    if not 1 <= tp <= num_heads:
        raise ValueError(
            f"tensor-parallel size must be between 1 and the model's {num_heads} attention "
            f"heads, got {tp}"
        )
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        return [
            HeadShard(range(kv.start * group, kv.stop * group), kv)
            for kv in even_split(num_kv_heads, tp)
        ]
    shards = []
    for kv, ranks in enumerate(even_split(tp, num_kv_heads)):
        for q in even_split(group, len(ranks)):
            shards.append(HeadShard(range(kv * group + q.start, kv * group + q.stop),
                                    range(kv, kv + 1)))
    return shards


def partition_from_hf_config(config: dict, tp: int) -> list[HeadShard]:
    """partition_heads for a Hugging Face config.json already read into a dict."""
    return partition_heads(*attention_heads(config), tp)
