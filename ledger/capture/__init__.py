"""Capture from live inference: record a signed envelope for every OpenAI-compatible call.

Two ways in, one path out:

- the SDK: :func:`wrap_openai` gives an ``openai.OpenAI`` / ``AsyncOpenAI`` client whose
  completions and chat completions are recorded (an httpx transport underneath);
- the proxy: ``ledger proxy --upstream URL`` (:class:`CaptureProxy`), an OpenAI-compatible
  reverse proxy in front of vLLM, using the same transport.

Both ask the upstream for token IDs, logprobs and a seed when the caller did not, hand the
caller the answer it would have had without them, and pass each captured sequence to a
:class:`Recorder`, which signs it and ships it through a durable on-disk :class:`Spool`
on background threads. Nothing here imports torch. See ``docs/capture.md``.
"""

from ledger.capture.config import CaptureConfig, CaptureConfigError
from ledger.capture.exchange import Captured, Plan, SamplingDefaults, prepare
from ledger.capture.proxy import CaptureProxy
from ledger.capture.recorder import Recorder
from ledger.capture.spool import Spool, SpoolFull
from ledger.capture.transport import (
    AsyncRecordingTransport,
    RecordingTransport,
    UnrecordableRequest,
    wrap_openai,
)

__all__ = [
    "AsyncRecordingTransport",
    "CaptureConfig",
    "CaptureConfigError",
    "CaptureProxy",
    "Captured",
    "Plan",
    "Recorder",
    "RecordingTransport",
    "SamplingDefaults",
    "Spool",
    "SpoolFull",
    "UnrecordableRequest",
    "prepare",
    "wrap_openai",
]
