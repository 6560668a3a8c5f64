"""The driver's report of one update (`runtime/step_log.summarize`), against the same figures counted by hand."""

from __future__ import annotations

import os

import pytest

from lt_opd_ray.core.wire import LearnerStepResult, Span
from lt_opd_ray.runtime.step_log import summarize


def rank(loss, divergence, tokens, sequences, spans, **extra) -> LearnerStepResult:
    fields = dict(loss=loss, divergence=divergence, importance_weight=1.0 + divergence, top_k_overlap=0.5 + divergence,
                  tokens=tokens, sequences=sequences, prompts=1, micro_batches=2, filler_micro_batches=0, vision_forwards=1,
                  grad_norm=3.0, seconds=4.0, payload_bytes=100 * tokens, payload_tokens=tokens, spans=tuple(spans))
    return LearnerStepResult(**(fields | extra))


def test_an_update_is_summarised_as_counted_by_hand():
    shared_teacher = Span("teacher", "teacher-a", "g0", 1.0, 3.0)  # one scoring batch reported by both ranks: counted once
    ranks = [
        rank(0.2, 0.1, tokens=30, sequences=4, staleness=1, seconds=4.0, clipped_share=0.1, logprob_gap=0.01, truncated_sequences=1,
             longest_response=12, spans=[shared_teacher, Span("learner", "learner-0", "mb0", 3.0, 5.0), Span("learner", "learner-0", "mb1", 4.0, 6.0)]),
        rank(0.4, 0.4, tokens=10, sequences=4, staleness=0, seconds=5.0, clipped_share=0.5, logprob_gap=0.03, truncated_sequences=0,
             longest_response=4, sequence_lengths=((5, 3), (2, 2)), computed_tokens=16, spans=[shared_teacher, Span("teacher", "teacher-a", "g1", 2.0, 4.0), Span("learner", "learner-1", "mb0", 4.0, 7.0)]),
    ]
    rollouts = [Span("rollout", "rollout-0", "g0", 0.0, 2.0), Span("rollout", "rollout-0", "g1", 1.0, 2.5)]
    driver = [Span("sync", "learner-0", "v1", 7.0, 7.5), Span("checkpoint", "driver", "step-1", 7.5, 8.5)]
    log = summarize(0, 2500, ranks, rollouts, driver, {"rollout": 1, "teacher": 2, "learner": 2}, period=10.0, sync_bytes=7,
                    accuracy={"cdpruner": 0.5}, scores={})

    assert (log.step, log.budget_bps, log.sync_bytes, log.tokens, log.sequences) == (0, 2500, 7, 40, 8)
    assert log.loss == pytest.approx((0.2 + 0.4) / 2)
    assert log.divergence == pytest.approx((0.1 * 30 + 0.4 * 10) / 40)  # token-weighted over the ranks
    assert log.importance_weight == pytest.approx((1.1 * 30 + 1.4 * 10) / 40)
    assert log.payload_bytes_per_token == pytest.approx(100.0)
    assert (log.response_tokens_mean, log.response_tokens_max, log.truncated_share) == (40 / 8, 12, 1 / 8)
    assert log.padding_share == pytest.approx(1 - 12 / 16)  # rank 0 logged no micro-batch lengths
    assert log.clipped_share == pytest.approx((0.1 * 30 + 0.5 * 10) / 40) and log.logprob_gap == pytest.approx((0.01 * 30 + 0.03 * 10) / 40)
    assert log.staleness == 1 and log.grad_norm == 3.0 and log.micro_batches == 4
    phases = log.phases
    assert (phases.rollout, phases.teacher, phases.learner) == (2.5, 3.0, 5.0)  # wall extents; the slowest rank
    assert (phases.sync, phases.checkpoint, phases.eval, phases.step) == (0.5, 1.0, 0.0, 10.0)
    # busy seconds with each actor's overlaps counted once: rollout-0 [0, 2.5]; teacher-a [1, 4]; learner-0 [3, 6], learner-1 [4, 7]
    assert phases.busy == pytest.approx({"rollout": 2.5 / 10, "teacher": 3.0 / (2 * 10), "learner": (3.0 + 3.0) / (2 * 10)})
    assert len(log.timeline) == 2 + 2 + 3 + 2 and [s.start for s in log.timeline] == sorted(s.start for s in log.timeline)
    assert log.eval_accuracy == {"cdpruner": 0.5}
    assert log.reward_mean is None  # the job has no reward
    rewarded = summarize(0, 2500, ranks, rollouts, driver, {"rollout": 1, "teacher": 2, "learner": 2}, period=10.0, sync_bytes=7,
                         accuracy={}, scores={}, rewards=[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5])
    assert rewarded.reward_mean == pytest.approx(4.5 / 8)
    from lt_opd_ray.runtime.launch import format_step
    from lt_opd_ray.runtime.tracking import step_metrics

    assert "div 0.17500  reward 0.562  is_w" in format_step(rewarded, 12) and " reward " not in format_step(log, 12)
    assert step_metrics(rewarded)["train/reward_mean"] == pytest.approx(4.5 / 8) and "train/reward_mean" not in step_metrics(log)


def rendered(text: str) -> list[str]:
    """The lines a terminal shows for `text`: each carriage return goes back to column 0 and overwrites."""
    screen = []
    for line in text.split("\n"):
        cells: list[str] = []
        for segment in line.split("\r"):
            cells[: len(segment)] = segment
        screen.append("".join(cells).rstrip())
    return screen


def test_step_lines_print_whole_with_the_bar_below_them_on_a_terminal_and_no_bar_elsewhere():
    import fcntl
    import io
    import pty
    import select
    import struct
    import termios

    from tqdm import tqdm

    from lt_opd_ray.runtime.launch import progress_bar

    lines = ["step    1/3  budget 25.00%  loss 0.0100", "step    2/3  budget 20.00%  loss 0.0090"]
    piped = io.StringIO()  # a log file or a pipe: whole lines only
    with progress_bar(3, 0, "job", piped) as bar:
        for line in lines:
            tqdm.write(line, file=piped)
            bar.update(1)
    assert piped.getvalue() == "".join(line + "\n" for line in lines)

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with os.fdopen(follower, "w") as terminal:
        with progress_bar(3, 0, "job", terminal) as bar:
            for line in lines:
                tqdm.write(line, file=terminal)
                bar.update(1)
        terminal.flush()
        shown = b""
        while select.select([leader], [], [], 0.5)[0]:
            shown += os.read(leader, 65536)
    os.close(leader)
    screen = [row for row in rendered(shown.decode()) if row]
    assert screen[:2] == lines and screen[2].startswith("job:  67%|") and len(screen) == 3, screen
