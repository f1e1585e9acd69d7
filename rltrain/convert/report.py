"""What a conversion is asked (its modes) and what it answers (``ConversionReport``); stdlib only.

Contract: ``MODES`` are the three directions ``rltrain convert`` offers. A ``ConversionReport`` is
filled on the conversion ranks (rank 0's is returned) and crosses the process boundary as its
``__dict__``; ``summary()`` is the text the CLI prints, ``report_json`` the same fields as JSON.
``ConversionError`` is a conversion that cannot run (bad input, found before any rank starts) or
failed (an unreadable checkpoint, a failed verification); its message is one line naming the
culprit, which the CLI prints without a traceback.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MODES = ("hf-to-mcore", "mcore-to-hf", "mcore-to-mcore")


class ConversionError(RuntimeError):
    """A conversion that cannot run or failed; the message is one line naming the culprit."""


@dataclass
class ConversionReport:
    mode: str
    layout: dict[str, int]
    num_tensors: int = 0
    bit_exact_tensors: int | None = None
    """Tensors compared bit-for-bit after converting back (None: not verified)."""
    max_abs_logit_diff: float | None = None
    logits_tolerance: float | None = None
    """What ``max_abs_logit_diff`` was held to (``megatron_bridge.verify.compare_logits``)."""
    logits_check: str | None = None
    """The logits comparison in words: dtype, probe, difference, tolerance and where it comes from."""
    peak_memory_growth_bytes: int | None = None
    """The largest growth of any rank's peak resident memory while converting (None: not measured)."""
    largest_tensor_bytes: int | None = None
    checkpoint_bytes: int | None = None
    """Bytes of all tensors of the source checkpoint (in HF terms)."""
    notes: list[str] = field(default_factory=list)
    mtp_logits_checks: list[str] = field(default_factory=list)
    """Per multi-token-prediction layer, its logits against transformers' ``MtpModel``, in words."""
    max_abs_mtp_logit_diffs: list[float] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"{self.mode} at TP={self.layout['tp']} PP={self.layout['pp']} EP={self.layout['ep']}: "
            f"{self.num_tensors} tensors"
        ]
        if self.bit_exact_tensors is not None:
            lines.append(f"  round trip: {self.bit_exact_tensors} tensors bit-exact")
        if self.logits_check is not None:
            lines.append(f"  {self.logits_check}")
        lines += [f"  {check}" for check in self.mtp_logits_checks]
        if self.peak_memory_growth_bytes is not None and self.largest_tensor_bytes:
            growth = self.peak_memory_growth_bytes
            lines.append(
                f"  peak memory while converting: +{growth / 2**20:.1f} MiB on the busiest rank "
                f"({growth / self.largest_tensor_bytes:.2f}× the largest tensor, "
                f"{growth / self.checkpoint_bytes:.3f}× the checkpoint)"
            )
        return "\n".join(lines + [f"  {n}" for n in self.notes])


def report_json(report: ConversionReport) -> str:
    return json.dumps(report.__dict__, indent=2)
