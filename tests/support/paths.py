"""Where things are, for tests in any folder: the repository root, the shared cases beside it,
and the fixture files of tests/support/fixtures."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
