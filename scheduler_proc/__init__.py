"""The scheduler actor: sequences, the paged KV block pool and the step planner. No torch."""

from scheduler_proc.block_manager import Allocation, BlockManager, CachedPrefix
from scheduler_proc.config import SchedulerConfig
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.sequence import Sequence, SequenceStatus

__all__ = [
    "Allocation",
    "BlockManager",
    "CachedPrefix",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
]
