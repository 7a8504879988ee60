"""A bounded, evenly downsampled series of (step, time, value) points for plotting.

Appends are O(1). When the buffer fills, every other point is dropped and the
stride doubles, so a run of any length keeps at most ``capacity`` points spread
evenly over the whole run, and the latest point is always present.
"""

from __future__ import annotations

__all__ = ["BoundedSeries"]


def _as_list(sequence) -> list:
    # array.array and numpy arrays both have tolist(): plain ints and floats.
    tolist = getattr(sequence, "tolist", None)
    return tolist() if tolist is not None else list(sequence)


def _plain(value):
    item = getattr(value, "item", None)
    return item() if item is not None else value


class BoundedSeries:
    __slots__ = ("capacity", "stride", "_seen", "steps", "times", "values", "_last")

    def __init__(self, capacity: int = 2000) -> None:
        if capacity < 4:
            raise ValueError("capacity must be at least 4")
        self.capacity = capacity
        self.stride = 1
        self._seen = 0
        self.steps: list[int] = []
        self.times: list[float] = []
        self.values: list[float] = []
        self._last: tuple[int, float, float] | None = None

    def append(self, step: int, time: float, value: float) -> None:
        self._last = (step, time, value)
        if self._seen % self.stride == 0:
            self.steps.append(step)
            self.times.append(time)
            self.values.append(value)
            if len(self.steps) >= self.capacity:
                del self.steps[1::2], self.times[1::2], self.values[1::2]
                self.stride *= 2
        self._seen += 1

    def extend(self, steps, times, values) -> None:
        """Append many points at once (sequences of equal length), sampled as
        :meth:`append` would, at C speed."""
        count = len(steps)
        if not count:
            return
        self._last = (_plain(steps[-1]), _plain(times[-1]), _plain(values[-1]))
        first = (-self._seen) % self.stride
        self.steps.extend(_as_list(steps[first :: self.stride]))
        self.times.extend(_as_list(times[first :: self.stride]))
        self.values.extend(_as_list(values[first :: self.stride]))
        self._seen += count
        while len(self.steps) >= self.capacity:
            del self.steps[1::2], self.times[1::2], self.values[1::2]
            self.stride *= 2

    def __len__(self) -> int:
        return len(self.steps) + (1 if self._has_unsampled_last() else 0)

    def _has_unsampled_last(self) -> bool:
        return self._last is not None and (
            not self.steps or self.steps[-1] != self._last[0] or self.times[-1] != self._last[1]
        )

    def snapshot(self, max_points: int | None = None) -> tuple[list[int], list[float], list[float]]:
        """Copies of (steps, times, values), the latest point included, thinned to
        ``max_points`` when given."""
        steps, times, values = list(self.steps), list(self.times), list(self.values)
        if self._has_unsampled_last():
            assert self._last is not None
            steps.append(self._last[0])
            times.append(self._last[1])
            values.append(self._last[2])
        if max_points is not None and len(steps) > max_points:
            keep = max(1, -(-len(steps) // max_points))
            idx = list(range(0, len(steps) - 1, keep)) + [len(steps) - 1]
            steps, times, values = (
                [steps[i] for i in idx],
                [times[i] for i in idx],
                [values[i] for i in idx],
            )
        return steps, times, values

    @property
    def count(self) -> int:
        """How many points were appended in all (not how many are kept)."""
        return self._seen
