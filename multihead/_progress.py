"""Progress bars for the commands' long work, on stderr when it is a terminal: tqdm when it is
installed (the ``pretrained`` and ``train`` extras bring it), nothing drawn when it is not, so a
bare install runs the same commands without one. Logs and pipes get no bar, so an error is the
first thing on a captured stderr."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

__all__ = ["Stages", "stages"]


class Stages:
    """A bar of named stages: ``begin(name)`` as each starts (the bar shows it and counts the
    stages done); ``say(line)`` prints a line of the job's output around the bar."""

    def __init__(self, desc: str, names: Sequence[str], unit: str) -> None:
        self.done = -1  # stages finished; -1 before the first begins
        self._tqdm = None
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._tqdm = tqdm
            self._bar = tqdm(
                total=len(names),
                desc=desc,
                unit=unit,
                file=sys.stderr,
                leave=False,  # the bar goes when the job ends; its output stays
                disable=None,  # drawn on a terminal only
            )

    def begin(self, name: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.n = self.done
            self._bar.set_postfix_str(name)  # also redraws with the new count

    def say(self, line: str) -> None:
        if self._tqdm is None:
            print(line)
        else:
            self._tqdm.write(line, file=sys.stdout)  # clears the bar, prints, redraws it

    def close(self) -> None:
        if self._bar is not None:
            self._bar.n = self._bar.total
            self._bar.close()


@contextmanager
def stages(
    desc: str, names: Sequence[str], *, unit: str = "step", say: Callable[[str], None] = print
) -> Iterator[tuple[Stages, Callable[[str], None]]]:
    """A ``Stages`` bar for a job of ``len(names)`` stages, closed at the end, and the function
    to print the job's lines with: ``say`` routed around the bar when it is ``print``."""
    bar = Stages(desc, names, unit)
    try:
        yield bar, (bar.say if say is print else say)
    finally:
        bar.close()
