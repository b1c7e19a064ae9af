"""`angel-jax train`'s last line: the loss it went from and to, the latest eval loss, tokens and wall time, and
every rollback."""

from __future__ import annotations

import re

from angel_jax.cli.dispatch import main


def test_the_done_line_names_eval_loss_tokens_wall_time_and_the_rollback(tmp_path, write_tiny_config, monkeypatch,
                                                                         capsys):
    # A NaN batch at step 7 (global batch 6): the guard drops its update and the run rolls back to step 4.
    monkeypatch.setenv("ANGEL_JAX_FAULTS", "nan_batch@6")
    config = write_tiny_config(tmp_path, train={"steps": 10, "eval_every": 5, "eval_batches": 1},
                               data={"val_fraction": 0.05}, checkpoint={"every": 4},
                               anomaly={"thresholds": {"step_time": {"enabled": False}}})
    assert main(["train", str(config)]) == 0
    [done] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    tokens = 10 * 4 * 32  # steps x batch x seq_len
    assert re.fullmatch(rf"done: step 10, loss [0-9.]+ \(step 1\) -> [0-9.]+ \(step 10\), eval loss [0-9.]+ "
                        rf"\(step 10\), {tokens / 1000:.3g}k tokens in [0-9.]+ s, rolled back once \(step 7 -> 4; "
                        rf"see events.jsonl\); run directory .*; newest persisted checkpoint: step 10", done), done
