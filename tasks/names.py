"""The rule for a deployment's name: the spec checks it, and every manifest that carries the name re-checks it."""

from __future__ import annotations

NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
NAME_RULE = "1 to 63 lowercase letters, digits and '-', starting with a letter or digit"
