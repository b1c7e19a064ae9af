"""Training progress in a log file: plain lines instead of tqdm's `\\r` bar when the stream is not a terminal."""

from __future__ import annotations

import io

from angel_jax.train.progress import PlainProgress, progress_display


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_every_n_steps_at_least_every_30_s_and_at_the_ends():
    out, clock = io.StringIO(), Clock()
    bar = PlainProgress("run", total=25, every=10, stream=out, clock=clock)
    for step in range(1, 26):
        clock.now += 40.0 if step == 14 else 0.5  # step 14 took 40 s: a line although 14 is not a multiple of 10
        bar.set_postfix({"loss": f"{1 / step:.3f}", "tok/s": "100"}, refresh=False)
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["run: step 1/25 (4%)", "run: step 10/25 (40%)",
                                                      "run: step 14/25 (56%)", "run: step 20/25 (80%)",
                                                      "run: step 25/25 (100%)"]
    assert lines[-1].endswith("0:52 elapsed, loss=0.040, tok/s=100") and "\r" not in out.getvalue()
    bar.n = 20  # a rollback
    bar.refresh()
    assert out.getvalue().splitlines()[-1].startswith("run: step 20/25 (80%)")


def test_a_terminal_gets_the_bar_and_a_file_the_lines():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_display("run", 10, 0, every=1, stream=io.StringIO()), PlainProgress)
    bar = progress_display("run", 10, 0, every=1, stream=Terminal())
    assert not isinstance(bar, PlainProgress) and type(bar).__name__ == "tqdm"
    bar.close()
