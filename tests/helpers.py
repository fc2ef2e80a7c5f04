"""Helpers shared by the test files (a test file never imports another test file)."""

import hashlib
from pathlib import Path


def snapshot(root: Path) -> dict:
    """{relative path: sha256} of every file under ``root``: equal before and after means nothing was written."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}
