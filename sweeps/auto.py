"""The decisions of an automatic layout search (issue 27's stage 2, "measure"): which planned
candidates to measure next, when to stop, what a failure rules out, and how the measurements
correct the planner's ranking. Pure logic over candidates and numbers: the planner supplies the
candidates and their predicted step times (``orchestrator.planner.plan_space``), a runner
supplies measurements; nothing here launches, composes or reads MLflow, so every rule is tested
on planted timings (``tests/test_auto_search.py``).

- **Order**: unmeasured, unpruned candidates by corrected prediction, fastest first, in batches
  of ``batch`` (what fills the cluster).
- **Refit**: after each batch, the predictions are corrected by what was measured: the planner's
  step times scaled by the median of measured / predicted (in log space, so one slow trial does
  not drag it), and the planner's error taken as the largest ``|log(measured / corrected)|``
  over the measured points, left-one-out (each point judged by the correction of the others),
  floored at ``min_error``. A caller with a better refit (``orchestrator.planner.calibrate`` on
  the measured trials) passes it as ``refit``.
- **Stop**: when no unmeasured candidate, credited with that error (its corrected prediction
  divided by ``exp(error)``), would beat the best measured by the win threshold, and the best has
  been measured ``confirm`` times (the incumbent runs again, in a slot of the next batch where a
  batch holds several, else alone when the rule would stop: the fastest of many short trials on a
  noisy host is often a lucky one, and a second run that comes out slower hands the lead to the
  others; its figure is the median of its runs); or when a budget is spent (``max_trials``,
  ``max_trial_seconds``, ``max_device_hours``: trial-seconds times the devices each trial
  holds), a confirming run counted as a trial.
- **Failure pruning**: a candidate that ran out of memory rules out every candidate of the same
  layout, schedule and stages that needs at least as much memory: a micro-batch as large or
  larger (under a pipeline, only while both fill it: GPipe keeps the whole replica batch whatever
  the split), no more recompute (checkpointing off where it was off), no more sharding (DDP where
  it was FSDP, no sequence parallelism where it had none). It also corrects the memory model: the
  planner gave that candidate ``planned_gb`` and it needed more than the device's ``memory_gb``, so
  every planned figure is scaled by at least ``memory_gb / planned_gb`` and each candidate whose
  scaled plan no longer fits is pruned, whatever its layout. Any other failure rules out that
  candidate alone.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from orchestrator import statuses
from orchestrator.planner.space import Candidate
from trainers.rules import DP_MODES


@dataclass
class Entry:
    """One candidate of the search and what is known of it."""

    candidate: Candidate
    predicted_s: float  # the planner's step time
    status: str = statuses.PENDING  # pending | finished | a failed status | pruned
    measured_s: Optional[float] = None  # the median of ``samples``
    trial_s: float = 0.0  # seconds its trials cost
    samples: List[float] = field(default_factory=list)  # the step time of each finished run
    runs: int = 0  # trials launched for it (a confirming run that failed included)
    reason: str = ""
    corrected_s: Optional[float] = None  # the prediction after the last refit
    planned_gb: Optional[float] = None  # the planner's memory of the most loaded rank (GiB)

    @property
    def name(self) -> str:
        return self.candidate.name


# refit(measured entries) -> (predict(entry) -> seconds, error as |log ratio|)
Refit = Callable[[Sequence[Entry]], Tuple[Callable[[Entry], float], float]]


def ratio_refit(measured: Sequence[Entry], min_error: float = 0.05) -> Tuple[Callable[[Entry], float], float]:
    """The planner's predictions scaled by the median measured / predicted ratio (log space);
    the error the largest left-one-out ``|log(measured / corrected)|``, at least ``min_error``."""
    logs = [math.log(e.measured_s / e.predicted_s) for e in measured if e.measured_s and e.predicted_s > 0]
    if not logs:
        return (lambda e: e.predicted_s), float("inf")  # nothing measured: the error is unknown
    scale = math.exp(statistics.median(logs))
    if len(logs) < 2:
        error = float("inf")  # one point says nothing of the planner's error
    else:
        error = max(abs(x - statistics.median(logs[:i] + logs[i + 1 :])) for i, x in enumerate(logs))
    return (lambda e: e.predicted_s * scale), max(error, min_error)


def _recompute(c: Candidate) -> int:
    """How much a point recomputes: none, the attention core, whole blocks."""
    return 0 if not c.activation_checkpointing else 1 if c.recompute_granularity == "selective" else 2


def implied_by_oom(failed: Candidate, other: Candidate) -> bool:
    """Whether ``other`` needs at least the memory ``failed`` ran out of: the same layout,
    schedule, stages and microbatches, a micro-batch as large or larger, and no more recompute,
    no more sharding of the replicas (``trainers.rules.DP_MODES`` in order) and no more sequence parallelism."""
    key = ("dp", "tp", "pp", "schedule", "virtual_stages")
    if any(getattr(failed, k) != getattr(other, k) for k in key):
        return False
    if other.pp > 1 and other.micro_batch != failed.micro_batch:
        # a pipeline holds min(m, p - rank) microbatches (all m under GPipe) of micro_batch each:
        # a larger micro-batch (fewer of them) keeps more only while both still fill the pipeline
        if other.schedule == "gpipe" or min(other.microbatches, failed.microbatches) < other.pp:
            return False
    # how far each shards its replicas: ddp, zero1 (states on 1/dp), fsdp (and the parameters)
    shard = [DP_MODES.index(c.dp_shard) if c.dp > 1 else 0 for c in (failed, other)]
    return (
        other.micro_batch >= failed.micro_batch
        and _recompute(other) <= _recompute(failed)
        and shard[1] <= shard[0]
        and other.sequence_parallel <= failed.sequence_parallel
    )


@dataclass
class Search:
    """The measure stage's state: every candidate, measured or not, and the budget spent."""

    entries: List[Entry]
    batch: int = 4
    threshold: float = 1.03  # a candidate must be predicted this much faster than the best measured
    max_trials: int = 0  # 0: no limit
    max_trial_seconds: float = 0.0  # 0: no limit
    max_device_hours: float = 0.0  # 0: no limit; trial-seconds x ``devices`` / 3600
    devices: int = 1  # the devices each trial holds
    memory_gb: float = 0.0  # what a device holds (GiB); 0: no memory correction from an OOM
    memory_scale: float = 1.0  # the planner's memory corrected by the OOMs seen: x this at least
    refit: Refit = ratio_refit
    exhaustive: bool = False  # measure every candidate (a grid over the planned space), budgets aside
    confirm: int = 1  # runs the best needs before the rule may stop the search (not in a grid)
    error: float = float("inf")  # the planner's error as |log ratio|, from the last refit
    log: List[str] = field(default_factory=list)

    @classmethod
    def of(cls, ranked: Sequence[Tuple[Candidate, float]], planned_gb: Optional[Sequence[float]] = None,
           **kw) -> "Search":  # fmt: skip
        """From (candidate, predicted step time) pairs, e.g. ``plan_space(...).plans``, and the
        memory planned for each (GiB of the most loaded rank) where it is known."""
        gb = list(planned_gb) if planned_gb is not None else [None] * len(ranked)
        return cls([Entry(c, float(t), planned_gb=g) for (c, t), g in zip(ranked, gb)], **kw)

    # --- what is known -----------------------------------------------------------------------

    def measured(self) -> List[Entry]:
        return [e for e in self.entries if e.status == statuses.FINISHED]

    def pending(self) -> List[Entry]:
        return [e for e in self.entries if e.status == statuses.PENDING]

    def best(self) -> Optional[Entry]:
        done = self.measured()
        return min(done, key=lambda e: e.measured_s) if done else None

    def trials(self) -> int:
        return sum(e.runs for e in self.entries)

    def trial_seconds(self) -> float:
        return sum(e.trial_s for e in self.entries)

    def device_hours(self) -> float:
        return self.trial_seconds() * self.devices / 3600.0

    # --- the decisions -----------------------------------------------------------------------

    def _rank(self) -> List[Entry]:
        return sorted(self.pending(), key=lambda e: e.corrected_s if e.corrected_s is not None else e.predicted_s)

    def unconfirmed(self) -> Optional[Entry]:
        """The best, while it has had fewer than ``confirm`` runs (never in a grid)."""
        best = self.best()
        return best if best is not None and not self.exhaustive and best.runs < self.confirm else None

    def _budget(self) -> Optional[str]:
        if self.max_trials and self.trials() >= self.max_trials:
            return f"budget: {self.trials()} trials of max_trials={self.max_trials}"
        if self.max_trial_seconds and self.trial_seconds() >= self.max_trial_seconds:
            return f"budget: {self.trial_seconds():.0f} trial-seconds of max_trial_seconds={self.max_trial_seconds:g}"
        if self.max_device_hours and self.device_hours() >= self.max_device_hours:
            return f"budget: {self.device_hours():.3g} device-hours of max_device_hours={self.max_device_hours:g}"
        return None

    def stop_reason(self) -> Optional[str]:
        """Why the search stops now, or None to measure another batch (or confirm the best)."""
        rule = self._rule() if self.unconfirmed() is None else None
        if rule is not None and not self.pending():
            return rule  # everything measured: said before a budget, as it is the reason
        return self._budget() or rule

    def _rule(self) -> Optional[str]:
        """Why the search has nothing left worth measuring, the best's confirmation aside."""
        if not self.pending():
            return "every candidate measured or ruled out"
        best = self.best()
        if self.exhaustive or best is None or not math.isfinite(self.error):
            return None  # a grid; or nothing to compare with, or the planner's error not yet known
        first = self._rank()[0]
        hope = (first.corrected_s or first.predicted_s) / math.exp(self.error)
        if hope * self.threshold > best.measured_s:
            return (
                f"no unmeasured candidate can win: the fastest left, {first.name}, is predicted "
                f"{first.corrected_s or first.predicted_s:.4g} s, at best {hope:.4g} s with the planner's "
                f"error ({100 * (math.exp(self.error) - 1):.0f}%), not {self.threshold:g}x faster than "
                f"{best.name}'s measured {best.measured_s:.4g} s"
            )
        return None

    def next_batch(self) -> List[Entry]:
        """The candidates to measure next (none when the search stops); the best alone, to run
        again, where only its confirmation keeps the rule from stopping the search."""
        if self.stop_reason() is not None:
            return []
        again = self.unconfirmed()
        if self._rule() is not None:
            return [again]
        n = self.batch
        if self.max_trials:
            n = min(n, self.max_trials - self.trials())
        if again is not None and n > 1:  # a batch of several runs the best's confirmation in one slot
            return [again, *self._rank()[: n - 1]]
        return self._rank()[: max(0, n)]

    def record(self, entry: Entry, measured_s: Optional[float], status: str = statuses.FINISHED, reason: str = "",
               trial_s: float = 0.0, samples: Optional[Sequence[float]] = None) -> None:  # fmt: skip
        """A trial's outcome: its median step time, or the status it failed with; ``trial_s`` what
        it cost. A measured entry run again (its confirmation) gains a sample; ``samples``, where
        given, are all of the entry's runs (the runner's own record of them)."""
        entry.trial_s += trial_s
        entry.runs += 1
        if status == statuses.FINISHED and measured_s is not None:
            entry.samples = [float(v) for v in samples] if samples else [*entry.samples, float(measured_s)]
            entry.status, entry.measured_s = statuses.FINISHED, statistics.median(entry.samples)
            return
        if entry.status == statuses.FINISHED:  # a confirming run that failed: its first figure stands
            self.log.append(f"{entry.name}: its run {entry.runs} did not finish ({status}: {reason[:200]})")
            return
        entry.status, entry.reason = status, reason
        if status != statuses.OOM:
            return
        implied = [e for e in self.pending() if implied_by_oom(entry.candidate, e.candidate)]
        for e in implied:
            e.status, e.reason = statuses.PRUNED, f"implied by {entry.name}: out of memory with less"
        if implied:
            self.log.append(f"{entry.name} ran out of memory: {len(implied)} candidate(s) that need more pruned")
        if self.memory_gb and entry.planned_gb:
            self._correct_memory(entry)

    def _correct_memory(self, failed: Entry) -> None:
        """``failed`` needed more than ``memory_gb`` where ``planned_gb`` was planned: scale the
        planner's memory by at least that much and prune what no longer fits."""
        self.memory_scale = max(self.memory_scale, self.memory_gb / failed.planned_gb)
        over = [e for e in self.pending() if e.planned_gb and e.planned_gb * self.memory_scale >= self.memory_gb]
        for e in over:
            e.status, e.reason = (
                statuses.PRUNED,
                (
                    f"memory corrected by {failed.name}'s out of memory (planned x {self.memory_scale:.2f}): "
                    f"{e.planned_gb * self.memory_scale:.1f} GiB >= the device's {self.memory_gb:g}"
                ),
            )
        self.log.append(
            f"memory model corrected by {failed.name} (planned {failed.planned_gb:.1f} GiB, more than "
            f"{self.memory_gb:g} needed): planned memory x {self.memory_scale:.2f}; "
            f"{len(over)} more candidate(s) pruned"
        )

    def update(self) -> None:
        """Refit on what was measured, re-rank what is left."""
        predict, self.error = self.refit(self.measured())
        for e in self.entries:
            e.corrected_s = predict(e)

    def run(self, measure: Callable[[List[Entry]], None]) -> str:
        """Measure batches until the stop rule says stop; ``measure(batch)`` calls :meth:`record`
        for each entry of the batch. Returns why it stopped."""
        self.update()
        while True:
            batch = self.next_batch()
            if not batch:
                reason = self.stop_reason() or "no candidate left"
                self.log.append(f"stop: {reason}")
                return reason
            again = [e.name for e in batch if e.status == statuses.FINISHED]
            new = [e.name for e in batch if e.status != statuses.FINISHED]
            measure(batch)
            self.update()
            best = self.best()
            self.log.append(
                (f"measured {', '.join(new)}; " if new else "")
                + (f"measured again {', '.join(again)}; " if again else "")
                + f"best {best.name if best else '-'}; "
                f"planner error {100 * (math.exp(self.error) - 1) if math.isfinite(self.error) else float('inf'):.0f}%"
            )


def kendall_tau(entries: Sequence[Entry]) -> Optional[float]:
    """Rank agreement of the planner's (uncorrected) predictions with the measured step times."""
    from orchestrator.planner.rank_stats import kendall_tau as tau

    done = [e for e in entries if e.status == statuses.FINISHED]
    return tau([e.predicted_s for e in done], [e.measured_s for e in done])


def mean_abs_error(entries: Sequence[Entry]) -> Optional[float]:
    """The planner's mean |predicted - measured| / measured on the measured points."""
    done = [e for e in entries if e.status == statuses.FINISHED]
    if not done:
        return None
    return statistics.fmean(abs(e.predicted_s - e.measured_s) / e.measured_s for e in done)


def summary(search: Search) -> Dict[str, object]:
    best = search.best()
    return {
        "candidates": len(search.entries),
        "trials": search.trials(),
        "trial_seconds": search.trial_seconds(),
        "best_runs": best.samples if best else None,
        "device_hours": search.device_hours(),
        "memory_scale": search.memory_scale,
        statuses.PRUNED: sum(1 for e in search.entries if e.status == statuses.PRUNED),
        "best": best.name if best else None,
        "best_s": best.measured_s if best else None,
        "planner_mean_abs_error": mean_abs_error(search.entries),
        "planner_kendall_tau": kendall_tau(search.entries),
    }
