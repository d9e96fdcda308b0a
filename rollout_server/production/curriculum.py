"""Which problems production skips (data.curriculum = "skip_settled"): a problem whose last group had all
rewards equal (every sample solved it, or none did) teaches GRPO nothing, so it sits out the next
data.curriculum_skip_epochs epochs and is then tried again. Its state, each skipped problem and the epoch
it returns in, is saved beside the cursor after every put; a skipped prompt index is journaled like a
queued one (with no group), so a restart neither skips nor repeats a prompt."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from shared.files import write_atomic

log = logging.getLogger("tandem.server")


class Curriculum:
    def __init__(self, path: Path, skip_epochs: int):
        self.path, self.skip_epochs = path, skip_epochs
        self.until: dict[str, int] = {}  # problem id -> the first epoch it is drawn again
        if path.is_file():
            try:
                saved = json.loads(path.read_text())
                self.until = {str(k): int(v) for k, v in saved["until"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                log.warning("%s unreadable (%s): every problem is drawn again", path, type(e).__name__)

    def skips(self, problem_id: str, epoch: int) -> bool:
        return epoch < self.until.get(problem_id, 0)

    def observe(self, problem_id: str, epoch: int, settled: bool) -> None:
        """A group of `problem_id` drawn in `epoch` was made: settled (all rewards equal) or not."""
        if settled:
            self.until[problem_id] = epoch + 1 + self.skip_epochs
        else:
            self.until.pop(problem_id, None)

    def skipped(self, epoch: int) -> int:
        """Problems sitting out `epoch`."""
        return sum(epoch < e for e in self.until.values())

    def save(self) -> None:
        write_atomic(self.path, json.dumps({"until": self.until}))
