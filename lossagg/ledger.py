"""What a :class:`lossagg.DeferredPlan` records of one step on one rank, apart from its arithmetic: a
small record with explicit stages (open, then closed), testable without a process group.

While the step is open, each micro-batch records its samples' final kept tokens (each sample once,
each prompt group or session whole where the mode reads it when its micro-batch runs), each
micro-batch's terms ``J_k`` as its loss returns them (each term once), and each metric's
contributions (each metric once per sample). :meth:`StepLedger.problem` says what keeps this rank
from closing the step; the plan sends it to every rank inside its one totals gather.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence

import torch

from lossagg.micro_batch import MicroBatchLog

__all__ = ["Stage", "StepLedger"]


class Stage(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class StepLedger:
    """One step's record on one rank (module docstring).

    Args:
        num_samples: this rank's samples in the step.
        terms: the loss's terms by name (each micro-batch reduces every one of them once).
        metrics: the metric names declared up front.
        group_index, session_index: int64 ``[num_samples]`` labels, or None.
        whole: which labels must lie whole in one micro-batch (``"group"``, ``"session"``), each with
            the size a micro-batch must hold of it (``"rank"``: all of this rank's samples of it; an
            integer: exactly that many, ``n_samples_per_prompt``), and the mode that reads it.
        agreed: whether the ranks must agree on the metric names (with a process group: a metric
            reported but not declared is then this rank's problem at close, not a new entry).
    """

    def __init__(
        self,
        num_samples: int,
        terms: Sequence[str],
        metrics: Sequence[str],
        group_index: torch.Tensor | None,
        session_index: torch.Tensor | None,
        whole: dict[str, int | str],
        mode: str,
        agreed: bool,
    ):
        self.num_samples = num_samples
        self.terms = tuple(terms)
        self.declared = tuple(metrics)
        self._labels = {"group": group_index, "session": session_index}
        self._whole = dict(whole)
        self._mode = mode
        self._agreed = agreed
        self.stage = Stage.OPEN
        # each sample's final kept tokens, on the first mask's device (-1: not recorded)
        self.counts: torch.Tensor | None = None
        self.seen = torch.zeros(num_samples, dtype=torch.bool)
        self._seen_np = self.seen.numpy()  # the same memory, read by close() (numpy's all() is a quarter of torch's call)
        # the labels each micro-batch recorded whole, by kind (tensors: a step's thousands of labels are never Python ints)
        self._seen_labels: dict[str, list[torch.Tensor]] = {kind: [] for kind in self._whole}
        # each label's samples on this rank (the labels sorted, and their counts), made at the first micro-batch
        self._rank_sizes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # every micro-batch made, with the terms' J_k its loss returned
        self.logs: list[MicroBatchLog] = []
        # the metrics' contributions summed so far (every declared one from the start: a rank without samples sends the same buffer)
        self.metrics: dict[str, torch.Tensor] = {k: torch.zeros((), dtype=torch.float64) for k in self.declared}
        self._metric_samples: dict[str, torch.Tensor] = {}
        self._undeclared: list[str] = []
        # one micro-batch at a time is recorded (a plan shared by threads checks and records atomically)
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- open
    def check_open(self, what: str) -> None:
        if self.stage is not Stage.OPEN:
            raise RuntimeError(f"DeferredPlan.{what}: the step is closed (close() ran); build a new plan for the next step")

    def record(self, pos: torch.Tensor, kept: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Record a micro-batch's samples (positions ``pos``) and their final kept tokens, atomically;
        returns the labels it recorded whole, by kind (for :meth:`forget`)."""
        with self._lock:
            again = pos[self.seen[pos]]
            if again.numel():
                raise ValueError(
                    f"samples: sample {int(again[0])} already ran in an earlier micro-batch of this step (each sample's final mask is "
                    "given once, by micro_batch() or loss(); metrics() reads what they recorded)"
                )
            labels = [(kind, self._check_whole(kind, pos)) for kind in self._whole]
            if self.counts is None:
                self.counts = torch.full((self.num_samples,), -1.0, dtype=torch.float64, device=kept.device)
            self.counts[pos.to(kept.device)] = kept
            self.seen[pos] = True
            for kind, recorded in labels:
                self._seen_labels[kind].append(recorded)
            return labels

    def forget(self, pos: torch.Tensor, labels: list[tuple[str, torch.Tensor]]) -> None:
        """Forget a micro-batch whose loss failed, so that nothing is half-applied."""
        with self._lock:
            self.seen[pos] = False
            self.counts[pos.to(self.counts.device)] = -1.0
            for kind, recorded in labels:
                seen = self._seen_labels[kind]
                seen[:] = [t for t in seen if t is not recorded]

    def _check_whole(self, kind: str, pos: torch.Tensor) -> torch.Tensor:
        """Each ``kind`` label (prompt group, session) of the micro-batch holds the samples it must (all of this
        rank's, or ``n_samples_per_prompt``) and none ran before; one that straddles ranks is found at close.
        Returns the micro-batch's labels (sorted, each once). Checked as tensors, the first label that fails in
        sorted order named."""
        index = self._labels[kind]
        labels, sizes = torch.unique(index[pos], return_counts=True)
        size = self._whole[kind]
        if size == "rank":
            if kind not in self._rank_sizes:
                self._rank_sizes[kind] = torch.unique(index, return_counts=True)
            all_labels, all_sizes = self._rank_sizes[kind]
            want = all_sizes[torch.searchsorted(all_labels, labels)]  # every label of pos is one of the rank's
        else:
            want = torch.full_like(sizes, size)
        earlier = self._seen_labels[kind]
        again = torch.isin(labels, torch.cat(earlier)) if earlier else torch.zeros_like(labels, dtype=torch.bool)
        bad = torch.nonzero((sizes != want) | again)
        if bad.numel():
            at = int(bad[0, 0])
            label, got, wanted, before = int(labels[at]), int(sizes[at]), int(want[at]), bool(again[at])
            what = "prompt group" if kind == "group" else "session"
            of = f"this rank's {wanted} samples of it" if size == "rank" else f"its {wanted} samples"
            raise ValueError(
                f"DeferredPlan: {what} {label} has {got} of {of} in this micro-batch"
                + (" and more in an earlier one" if before else "")
                + f": mode={self._mode} reads its samples and tokens when its micro-batch runs, which is final only if each {what} "
                f"lies whole in one micro-batch (put a {what}'s samples in one micro-batch, or use a StepPlan of the rollout masks "
                "when the filter does not change the counts)"
            )
        return labels

    def add(self, log: MicroBatchLog) -> None:
        """List a micro-batch of the step (its loss must reduce every term before :meth:`problem` is None)."""
        with self._lock:
            self.logs.append(log)

    def metric(self, name: str, value: torch.Tensor, pos: torch.Tensor) -> None:
        """Add a metric's contribution of the samples ``pos`` (each metric once per sample)."""
        with self._lock:
            done = self._metric_samples.get(name)
            if done is not None and bool(done[pos].any()):
                again = int(pos[done[pos]][0])
                raise ValueError(
                    f"DeferredPlan.metrics: metric {name!r} was already reported for sample {again} in this step (each metric is given "
                    "once per sample: a second report would count it twice)"
                )
            self._metric_samples.setdefault(name, torch.zeros(self.num_samples, dtype=torch.bool))[pos] = True
            if name not in self.metrics and self._agreed:
                if name not in self._undeclared:
                    self._undeclared.append(name)
                return
            value = value.detach().to(torch.float64)  # on the value's device (no host sync per micro-batch)
            self.metrics[name] = value if name not in self.metrics else self.metrics[name].to(value.device) + value

    # ---------------------------------------------------------------- close
    def problem(self) -> str | None:
        """What keeps this rank from closing the step, or None."""
        if not self._seen_np.all():
            missing = torch.nonzero(~self.seen).flatten()
            shown = ", ".join(map(str, missing[:8].tolist())) + (", ..." if missing.numel() > 8 else "")
            return (
                f"DeferredPlan.close: {missing.numel()} of this rank's {self.num_samples} samples never ran a micro-batch ({shown}): "
                "every sample's final mask must be given by micro_batch() or loss() before the step closes"
            )
        idle = [log for log in self.logs if len(log.parts) != len(self.terms)]
        if idle:
            shown = ", ".join(map(str, idle[0].samples[:8].tolist()))
            lacking = [t for t in self.terms if t not in idle[0].parts]
            never = "never ran loss()" if not idle[0].parts else f"never reduced the term(s) {', '.join(lacking)} in loss()"
            return (
                f"DeferredPlan.close: {len(idle)} micro-batch(es) made by micro_batch() {never} (the first holds samples {shown}): "
                "their terms would be missing from the step's J"
            )
        if self._undeclared:
            return (
                f"DeferredPlan.close: the metric(s) {', '.join(map(repr, self._undeclared))} were reported but not declared: with a process "
                "group every rank sends the same buffer, so every metric is declared up front, DeferredPlan(..., metrics=[...])"
            )
        return None

    def sums(self) -> dict[str, torch.Tensor]:
        """The logged values by name (``term:<name>``, ``metric:<name>``), float64, each term's ``J_k`` summed over
        the micro-batches in the order they were made."""
        out = {f"metric:{k}": v for k, v in self.metrics.items()}
        for name in self.terms:
            total = torch.zeros((), dtype=torch.float64)
            for log in self.logs:
                part = log.parts.get(name)
                if part is not None:  # (a micro-batch that never reduced it is this rank's problem at close)
                    part = part.detach().to(torch.float64)
                    total = total.to(part.device) + part
            out[f"term:{name}"] = total
        return out

    def host_sums(self) -> dict[str, float] | None:
        """:meth:`sums` as Python floats, where every logged value lies on the CPU (else None): the same numbers,
        each term's added in float64 in the same order (from 0.0, micro-batch by micro-batch), with no tensor op
        (a one-process close reads them as floats anyway)."""
        out = {}
        for k, v in self.metrics.items():
            if v.device.type != "cpu":
                return None
            out[f"metric:{k}"] = float(v)
        for name in self.terms:
            total = 0.0
            for log in self.logs:
                part = log.parts.get(name)
                if part is not None:
                    if part.device.type != "cpu":
                        return None
                    total += float(part)  # float32 or float64 to float64, exactly, then added as the tensor sum adds
            out[f"term:{name}"] = total
        return dict(sorted(out.items()))  # by key, as the buffer a process group sums is laid out

    def close(self) -> None:
        self.stage = Stage.CLOSED
