"""How a bench command hands back its result: JSON on stdout, and in --result-json."""

from __future__ import annotations

import json
from typing import Any


def emit(result: dict[str, Any], path: str | None) -> None:
    print(json.dumps(result, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
