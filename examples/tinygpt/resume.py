"""Which checkpoint ``--resume`` means: the newest, a step's, or a folder; damaged
ones named, or moved aside with --move-aside-damaged; never one passed over silently."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .checkpoint import Found, move_aside, scan_checkpoints
from .config import NEWEST


def _names(found: list[Found]) -> str:
    return ", ".join(f.path.name for f in found)


@dataclass(frozen=True)
class ResumePlan:
    """Rank 0's choice of the checkpoint to resume from, for every rank to follow."""

    path: Path | None  # None: nothing to resume (a restart before the first checkpoint)
    notes: tuple[str, ...]  # what was passed over or moved aside, and why
    error: str | None = None  # a user error: every rank raises it


def choose_checkpoint(
    root: Path, resume: str, *, move_damaged: bool, restarted: bool
) -> ResumePlan:
    """Which checkpoint ``--resume`` means, never passing one over silently (rank 0
    alone: it reads the folder and may rename damaged checkpoints).

    A damaged checkpoint (a ``step_N`` folder without ckpt's manifest) newer than the
    chosen one is in the way of this run's save of that step, so it is either moved
    aside (--move-aside-damaged) or the run stops and names that option."""
    found = scan_checkpoints(root)
    notes: list[str] = []
    chosen: Found | None
    if resume == NEWEST:
        chosen = next((f for f in found if f.committed), None)
    elif resume.isdigit():
        step = int(resume)
        chosen = next((f for f in found if f.step == step), None)
        if chosen is None:
            have = ", ".join(str(f.step) for f in found if f.committed) or "none"
            return ResumePlan(None, (), f"--resume {step}: {root} holds no checkpoint of step "
                              f"{step} (steps it holds: {have})")  # fmt: skip
        if not chosen.committed:
            return ResumePlan(None, (), f"--resume {step}: {chosen.path} is damaged (no ckpt "
                              "manifest: a save that never finished, or files removed); "
                              "choose another step")  # fmt: skip
        newer = [f for f in found if f.committed and f.step > step]
        if newer:
            notes.append(
                f"resuming from {chosen.path.name} as asked (--resume {step}), passing over "
                f"the newer {_names(newer)}, which this run replaces when it reaches their "
                "steps"
            )
    else:
        path = Path(resume)
        if not path.is_dir():
            return ResumePlan(None, (), f"--resume {resume}: not a step number and not a "
                              "checkpoint folder (--resume alone takes the newest)")  # fmt: skip
        match = [f for f in scan_checkpoints(path.parent) if f.path.name == path.name]
        step = match[0].step if match else -1
        chosen = Found(step, path, match[0].committed if match else True)
    floor = chosen.step if chosen is not None else -1
    damaged = [f for f in found if not f.committed and f.step > floor]
    if damaged:
        what = (
            f"{_names(damaged)} {'is' if len(damaged) == 1 else 'are'} damaged (no ckpt "
            "manifest: a save that never finished, or files removed)"
        )
        then = f"resume from {chosen.path.name}" if chosen is not None else "start from step 0"
        if not move_damaged:
            them = "it" if len(damaged) == 1 else "them"
            return ResumePlan(None, (), f"--resume: {what}; this run would have to pass "
                              f"{them} over and could not save over {them} later. Pass "
                              f"--move-aside-damaged to rename {them} to NAME.damaged and "
                              f"{then}, or --resume STEP to choose another checkpoint")  # fmt: skip
        for f in damaged:
            notes.append(f"moved {f.path.name} aside to {move_aside(f.path).name}: {what}")
    if chosen is None:
        if restarted:
            notes.append("restarted by the launcher before the first checkpoint: from step 0")
            return ResumePlan(None, tuple(notes))
        return ResumePlan(None, tuple(notes), f"--resume: no checkpoint in {root}; run "
                          "without --resume to start, or point --out-dir (or "
                          "--checkpoint-dir) at the run to continue")  # fmt: skip
    return ResumePlan(chosen.path, tuple(notes))
