"""The state machines of disputes and replay jobs, and the outcomes of verdicts, as types.

Models, CHECK constraints (:func:`check_in`), services and the API all name states through
these enums, so a state is spelt once. A ``StrEnum`` member is its string: it compares,
hashes and serialises as the text stored in the database and served over the API.
"""

from __future__ import annotations

from enum import StrEnum


class DisputeState(StrEnum):
    OPENED = "opened"
    QUEUED = "queued"
    AWAITING_WORKER = "awaiting_worker"
    REPLAYING = "replaying"
    VERDICT = "verdict"
    RESOLVED = "resolved"


#: A dispute in one of these states has its verdict: replay events no longer move it.
DISPUTE_DECIDED = frozenset({DisputeState.VERDICT, DisputeState.RESOLVED})


class JobState(StrEnum):
    AWAITING_WORKER = "awaiting_worker"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    POISONED = "poisoned"
    FAILED = "failed"


#: A job in one of these states is finished: no worker will take it again.
JOB_FINISHED = frozenset({JobState.DONE, JobState.POISONED, JobState.FAILED})


class VerdictOutcome(StrEnum):
    REPRODUCED = "reproduced"
    DIVERGED = "diverged"
    UNVERIFIABLE = "unverifiable"
    ERROR = "error"


class Priority(StrEnum):
    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"


class Resolution(StrEnum):
    UPHELD = "upheld"
    REJECTED = "rejected"


def check_in(column: str, values: type[StrEnum]) -> str:
    """The text of a CHECK constraint that ``column`` holds one of ``values``, in
    declaration order (the text the migrations wrote): ``state IN ('a', 'b')``."""
    return f"{column} IN (" + ", ".join(f"'{v.value}'" for v in values) + ")"
