"""Hand-made rewarded groups for trainer.samples (calls, trajectories, groups, with placeholder logprobs unless given):
what the sample-building tests and the SFT selection tests write their expectations against."""

from __future__ import annotations

from trainer.samples import CallData, GroupData, TrajectoryData


def call(
    prompt: list[int] | None,
    completion: list[int] | None,
    logprobs: list[float] | None = None,
    *,
    seq: int = 0,
    choice: int = 0,
    version: int = 0,
    trainable: bool = True,
) -> CallData:
    if logprobs is None and completion is not None:
        logprobs = [-0.1 * (i + 1) for i in range(len(completion))]
    return CallData(seq, choice, version, prompt, completion, logprobs, trainable)


def traj(tid: str, reward: float, *calls: CallData) -> TrajectoryData:
    return TrajectoryData(tid, reward, list(calls))


def group(gid: str, *trajs: TrajectoryData) -> GroupData:
    return GroupData(gid, list(trajs))
