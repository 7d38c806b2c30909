"""Classification metrics of predicted class ids against true ones: accuracy and macro F1 (the guide's metrics)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _ids(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64).reshape(-1)


def confusion(predictions: Sequence[int] | torch.Tensor, targets: Sequence[int] | torch.Tensor,
              num_classes: int) -> torch.Tensor:  # fmt: skip
    """The (num_classes, num_classes) count matrix: row = true class, column = predicted class."""
    pred, true = _ids(predictions), _ids(targets)
    if pred.shape != true.shape:
        raise ValueError(f"{pred.numel()} predictions for {true.numel()} targets; give one prediction per target")
    for name, ids in (("predictions", pred), ("targets", true)):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_classes):
            raise ValueError(f"{name} hold class ids outside [0, {num_classes}): {int(ids.min())}..{int(ids.max())}")
    flat = true * num_classes + pred
    return torch.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def accuracy(predictions: Sequence[int] | torch.Tensor, targets: Sequence[int] | torch.Tensor) -> float:
    """Share of predictions equal to their target (0-1); 0 for no samples."""
    pred, true = _ids(predictions), _ids(targets)
    if pred.shape != true.shape:
        raise ValueError(f"{pred.numel()} predictions for {true.numel()} targets; give one prediction per target")
    return float((pred == true).float().mean()) if true.numel() else 0.0


def macro_f1(predictions: Sequence[int] | torch.Tensor, targets: Sequence[int] | torch.Tensor,
             num_classes: int) -> float:  # fmt: skip
    """Unweighted mean over classes of F1 = 2 TP / (2 TP + FP + FN), over the classes that occur in the targets or
    the predictions (scikit-learn's f1_score(average="macro") without `labels`); 0 for no samples."""
    return confusion_macro_f1(confusion(predictions, targets, num_classes))


def confusion_accuracy(counts: torch.Tensor) -> float:
    """Accuracy of a confusion matrix (the trainer's evaluation sums its ranks' matrices); 0 for no samples."""
    counts = counts.double()
    total = float(counts.sum())
    return float(counts.diagonal().sum()) / total if total else 0.0


def confusion_macro_f1(counts: torch.Tensor) -> float:
    """macro_f1 of a confusion matrix (rows true classes, columns predictions)."""
    counts = counts.double()
    tp = counts.diagonal()
    fp = counts.sum(0) - tp
    fn = counts.sum(1) - tp
    seen = (tp + fp + fn) > 0
    if not bool(seen.any()):
        return 0.0
    f1 = 2 * tp[seen] / (2 * tp[seen] + fp[seen] + fn[seen])
    return float(f1.mean())
