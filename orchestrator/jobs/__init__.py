"""Example training jobs shipped with the package (job files a user can copy; the offline demo
trains `digits_cnn.py`). The contract: docs/job-contract.md."""

from pathlib import Path

JOBS_DIR = Path(__file__).parent
DIGITS_CNN = JOBS_DIR / "digits_cnn.py"
