"""RUN/tb/ read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path


def events(folder: Path) -> dict[tuple[str, int], list[float]]:
    """(tag, step) -> the values of every scalar and text summary in the event files of `folder`."""
    # tensorboard is heavy and a dev extra only: imported by the tests that read event files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    out: dict[tuple[str, int], list[float]] = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            out.setdefault((tag, ev.step), []).append(ev.value)
    for tag in acc.Tags()["tensors"]:
        for ev in acc.Tensors(tag):
            out.setdefault((tag.removesuffix("/text_summary"), ev.step), []).append(
                ev.tensor_proto.string_val[0].decode()
            )
    return out
