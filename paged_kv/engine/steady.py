"""`SteadyDecode`: the scheduler's steady decode step, made from arrays.

A step is *steady* when every running sequence is one token behind (its last token not
computed) and nothing joins it: each takes that one token and is sampled after it. Its
inputs are then two ``[B]`` arrays, the tokens and their positions, which the cache's
`prepare_decode` and the model both take. They are built once a step from the sequences
or, when the step before was steady too and every one of its sequences got its one sample
in order, carried over from it: the sampled tokens at the next positions, with no pass
over the sequences at all.
"""

from __future__ import annotations

import numpy as np

from .inputs import StepInputs
from .request import Sequence

Plan = dict[Sequence, int]


class SteadyDecode:
    """The scheduler's record of its steady decode steps (`Scheduler` is its one caller:
    `start` in its planning, `arrays` and `prepared` in `prepare`, `inputs` for the model,
    `carry_over` in `update_from_output`).

    The carry is valid while the running sequences are the carried ones in the same order:
    the scheduler is the one writer of their tokens and computed counts, and only
    `advance` and `update_from_output` change those without changing the running list (an
    admission, a fork, a finish, an abort or a preemption all do). `start` compares the
    running sequences with the carried ones by identity, in C.
    """

    def __init__(self) -> None:
        self.plan: Plan | None = None  # the last plan the scheduler made steady
        self.carried = False  # that plan's arrays are the carry
        # that plan once prepared: (plan, [B] int32 tokens, [B] int64 positions)
        self._prepared: tuple[Plan | None, np.ndarray, np.ndarray] = (
            None, np.empty(0, np.int32), np.empty(0, np.int64))
        # the next step's: (its sequences, [B] int32 tokens, [B] int64 positions)
        self._carry: tuple[tuple[Sequence, ...], np.ndarray, np.ndarray] | None = None

    def start(self, batch: tuple[Sequence, ...], budget: int) -> bool:
        """A new plan of the running sequences `batch` (in order) within `budget` tokens:
        whether it is steady by the carry (else the scheduler checks the sequences)."""
        self.plan = None
        self.carried = (self._carry is not None and len(batch) <= budget
                        and batch == self._carry[0])  # identities compared, in C
        return self.carried

    def arrays(self, plan: Plan) -> tuple[np.ndarray, np.ndarray | None]:
        """``[B]`` int32 tokens of a plan of one token per sequence (each one's first not
        computed), and ``[B]`` int64 positions when carried (else None: `prepared` makes
        them if the plan is steady)."""
        if plan is self.plan and self.carried:  # the last step's samples
            _, tokens, positions = self._carry
            return tokens, positions
        return np.fromiter((seq.token_ids[seq.num_computed] for seq in plan), dtype=np.int32,
                           count=len(plan)), None

    def prepared(self, plan: Plan, tokens: np.ndarray, positions: np.ndarray | None) -> None:
        """`plan` was prepared with `tokens` (`arrays`): kept for `inputs` when steady."""
        if plan is self.plan:
            if positions is None:
                positions = np.fromiter((seq.num_computed for seq in plan), np.int64,
                                        len(plan))
            self._prepared = (plan, tokens, positions)

    def inputs(self, plan: Plan) -> StepInputs:
        """The model's inputs for `plan` (prepared last): a steady step's from its arrays
        (every sequence sampled, no per-sequence slicing), any other through
        `StepInputs.of`."""
        prepared, tokens, positions = self._prepared
        if plan is prepared:
            return StepInputs.decode(list(plan), tokens, positions)
        return StepInputs.of(plan)

    def carry_over(self, samples: list[tuple[Sequence, int, dict[int, float] | None]],
                   batch: tuple[Sequence, ...]) -> None:
        """Carry this step's arrays to the next when its plan was steady and prepared as
        such (its sequences `batch`, in row order) and `samples` are those sequences' one
        sample each, in order; else drop the carry."""
        plan, _, positions = self._prepared
        self._carry = None
        if samples and plan is not None and plan is self.plan and len(samples) == len(plan):
            seqs, tokens, _ = zip(*samples, strict=True)
            if seqs == batch:
                self._carry = (seqs, np.array(tokens, dtype=np.int32), positions + 1)
