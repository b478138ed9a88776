"""`StepInputs`: a step's model inputs (token ids, positions, the rows whose logits are
sampled) made from its plan, in general or, for the steady decode step and a mixed step's
decoding part, from arrays the scheduler has already built."""

from __future__ import annotations

import array
import dataclasses

import numpy as np
import torch

from .request import Request, Sequence


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What the model is called with for one plan, and which of its rows are sampled.

    Attributes
    ----------
    tokens, positions : torch.Tensor
        ``[num_tokens]`` int64: each new token and its position, sequence by sequence in
        the plan's order.
    logits_rows : torch.Tensor
        ``[len(sampled) + len(prompt_rows)]`` int64 rows of `tokens` whose logits the
        model returns: the sampled sequences' last tokens, then the prompt rows'.
    sampled : list of Sequence
        The sequences whose next token is due after this step (caught up), in order.
    prompt_rows : list of (Request, int, int)
        ``(request, row, prompt token that row predicts)`` of each prompt position whose
        log-probabilities are asked for and not yet recorded.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor
    sampled: list[Sequence]
    prompt_rows: list[tuple[Request, int, int]]

    @staticmethod
    def of(plan: dict[Sequence, int], new_tokens: dict | None = None) -> StepInputs:
        """The inputs of any plan (``{sequence: new tokens}``), one pass over it. With
        `new_tokens` (a dict), the same pass puts each sequence's tokens to compute in it
        under its ``seq_id``: the cache's `prepare` mapping of the plan, without a second
        pass over the plan (~0.2 ms at 1,024 sequences)."""
        tokens, positions, logits_rows, sampled = [], [], [], []
        # (sequence, its first row, its tokens) of each one that may compute a prompt
        # position a later prompt token follows: any but a caught-up one-token row (its
        # position is its last token's, at or past the prompt's last)
        chunks = []
        for seq, n in plan.items():
            start, ids = seq.num_computed, seq.token_ids
            if n == 1:  # a decoding sequence (most of a mixed step's): no slice, no range
                token = ids[start]
                tokens.append(token)
                positions.append(start)
                if new_tokens is not None:
                    new_tokens[seq.seq_id] = [token]
            else:
                chunks.append((seq, len(tokens), n))
                chunk = ids[start: start + n]
                tokens += chunk
                positions += range(start, start + n)
                if new_tokens is not None:
                    new_tokens[seq.seq_id] = chunk
            if start + n == len(ids):  # caught up: its next token is due
                logits_rows.append(len(tokens) - 1)
                sampled.append(seq)
            elif n == 1:
                chunks.append((seq, len(tokens) - 1, 1))
        prompt_rows = _prompt_logprob_rows(chunks)  # their logits follow the sampled rows
        return StepInputs(_long_tensor(tokens), _long_tensor(positions),
                          _long_tensor(logits_rows + [row for _, row, _ in prompt_rows]),
                          sampled, prompt_rows)

    @staticmethod
    def decode(seqs: list[Sequence], tokens: np.ndarray, positions: np.ndarray) -> StepInputs:
        """The inputs of a steady decode step: each of `seqs` takes its one token not yet
        computed, ``tokens [len(seqs)]`` (its last), at ``positions [len(seqs)]`` int64 (its
        computed count), so each is caught up and sampled, in row order. No prompt rows: a
        sequence with a single token left has computed every prompt position but the last,
        whose logits predict no prompt token."""
        return StepInputs(torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(positions),
                          torch.arange(len(seqs)), seqs, [])

    @staticmethod
    def joined(seqs: list[Sequence], tokens: np.ndarray, positions: np.ndarray,
               rest: StepInputs) -> StepInputs:
        """The inputs of a mixed step: `seqs` decoding first, as in `decode` (``tokens``
        and ``positions [len(seqs)]``, each sampled), then the other sequences' inputs
        `rest` (`of` of them alone), their rows after the decoding ones."""
        k = len(seqs)
        return StepInputs(torch.cat((torch.from_numpy(tokens.astype(np.int64)), rest.tokens)),
                          torch.cat((torch.from_numpy(positions), rest.positions)),
                          torch.cat((torch.arange(k), rest.logits_rows + k)),
                          seqs + rest.sampled,
                          [(request, row + k, token) for request, row, token in rest.prompt_rows])


def _long_tensor(values: list[int]) -> torch.Tensor:
    """``[len(values)]`` int64 from a list of ints, a third of `torch.tensor`'s cost."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values \
        else torch.zeros(0, dtype=torch.int64)


def _prompt_logprob_rows(chunks: list[tuple[Sequence, int, int]],
                         ) -> list[tuple[Request, int, int]]:
    """``(request, row in this step's tokens, prompt token that row predicts)`` for each
    prompt position whose log-probabilities are asked for and not yet recorded (a
    recomputed one is not recorded twice), from ``(sequence, its first row, its tokens)``
    of the plan's sequences that may compute one, in plan order."""
    rows = []
    for seq, offset, n in chunks:
        request = seq.request
        if request.params.prompt_logprobs is not None and seq.index == 0:
            prompt = request.prompt_token_ids
            first = max(seq.num_computed, len(request.prompt_logprobs) - 1)
            rows += [(request, offset + position - seq.num_computed, prompt[position + 1])
                     for position in range(first, min(seq.num_computed + n, len(prompt) - 1))]
    return rows
