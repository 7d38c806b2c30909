"""The distill section of a deployment spec: the teacher's architecture, read when the spec is parsed.

A spec names the teacher (distill.teacher_url) and may leave its architecture out; it is then read from the
teacher's model.json (our checkpoint) or config.json (a Hugging Face folder) here, so that a teacher that cannot
teach the spec's model (another vocabulary, a missing folder) is refused with the spec's other problems, before
anything is launched. The payload checks the teacher it loads against the same architecture again.
"""

from __future__ import annotations

from training.config import DistillConfig, Problem
from training.storage import StorageConfig


def with_teacher_model(distill: DistillConfig, storage: StorageConfig) -> tuple[DistillConfig, list[Problem]]:
    """`distill` with teacher_model filled in from the teacher's own record, or the problems that kept it out."""
    if distill.teacher_model is not None:
        return distill, []
    from training.distill import TeacherError, teacher_architecture  # torch: only for a teacher to read

    try:
        model = teacher_architecture(distill, storage)
    except TeacherError as err:
        loc = tuple(err.field.split("."))
        return distill, [(loc, err.value, f"{err.problem}; {err.fix}")]
    except (OSError, ValueError) as err:  # an unreachable folder, or a record that is not one
        fix = "check distill.teacher_url and distill.teacher_kind, or state the teacher's architecture as teacher_model"
        problem = f"the teacher cannot be read ({err}); {fix}"
        return distill, [(("distill", "teacher_url"), distill.teacher_url, problem)]
    return distill.model_copy(update={"teacher_model": model}), []
