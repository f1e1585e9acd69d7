"""The bridge's errors for a user's input: one line naming the file, tensor or number at fault.

Contract: ``CheckpointError`` says a checkpoint cannot be read (a garbled header, a truncated or
overwritten shard, a missing file) or does not fit the model (tensors missing or unexpected), and
names the file or directory; ``VerificationError`` says a converted checkpoint does not reproduce
its source (a round-trip tensor or the logits differ) and names what differs and by how much. Both
are a user's problem, not a bug: callers print their message on one line, without a traceback.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, or a checkpoint that does not fit the model."""


class VerificationError(AssertionError):
    """A converted checkpoint that does not reproduce its source."""
