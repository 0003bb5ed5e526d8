"""fathom's own figures in DeepSpeed's monitors: what metrics.jsonl records, the monitor gets too
(test_pipeline.py::test_resume_matches_uninterrupted_run reads them back from a real run's csv_monitor)."""

from fathom.pipeline.reports.metrics import MetricsLog


class Monitor:
    enabled = True

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events += events


def test_every_figure_of_a_record_goes_to_the_monitor_at_its_step(tmp_path):
    monitor = Monitor()
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True, resume_step=0, monitor=monitor)
    log.write({"step": 7, "loss": 3.5, "grad_norm": 1.25, "tokens_per_s": 900.0, "alpha": 0.5, "tokens": 40})
    log.write({"step": 8, "loss": 9.0, "skipped": True, "nonfinite": "inf in the loss"})  # the guard's skip
    log.write({"step": 8, "valid_loss": 3.1, "valid_bleu": 12.5, "best_valid_loss": 3.1, "best_tag": "global_step8"})
    assert monitor.events == [
        ("fathom/loss", 3.5, 7), ("fathom/grad_norm", 1.25, 7), ("fathom/tokens_per_s", 900.0, 7),
        ("fathom/alpha", 0.5, 7), ("fathom/tokens", 40.0, 7),
        ("fathom/loss", 9.0, 8), ("fathom/skipped", 1.0, 8),
        ("fathom/valid_loss", 3.1, 8), ("fathom/valid_bleu", 12.5, 8), ("fathom/best_valid_loss", 3.1, 8),
    ]  # fmt: skip
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # metrics.jsonl stays the record


def test_no_monitor_and_other_ranks_send_nothing(tmp_path):
    idle, other_rank = Monitor(), Monitor()
    idle.enabled = False
    MetricsLog(tmp_path / "a.jsonl", enabled=True, resume_step=0, monitor=idle).write({"step": 1, "loss": 2.0})
    MetricsLog(tmp_path / "b.jsonl", enabled=False, resume_step=0, monitor=other_rank).write({"step": 1, "loss": 2.0})
    assert idle.events == other_rank.events == []
