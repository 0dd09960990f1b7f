"""Dynamic sampling in rounds: draw -> generate and judge -> keep, round after round, until the
sampler says every rank is full (or a stop signal ends the rounds).

    num_rounds = judge_in_rounds(sampler, draw=loader_draw, judge_round=my_round,
                                 keep=my_keep, should_stop=flag)

    round r:  n = sampler.num_to_draw()          local: this rank's missing groups
              n > 0: judged = judge_round(draw(n), r)   (ScoringStopped -> request_stop)
              n = 0: judged = []                 a full rank still joins the round
              keep(judged)                       the caller's keep rule -> sampler.add(...)
              should_stop()? -> sampler.request_stop()
              sampler.is_done()                  collective: every rank calls it once a round

`sampler` is a yatt.core.DynamicSampler in mode "rounds" (anything with num_to_draw(),
is_done(), request_stop()): genrm does not depend on core. `keep` must offer the round to the
sampler even when `judged` is empty (an empty add), as the round's collective pairs up ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from yatt.genrm._stopping import ScoringStopped


class _RoundSampler(Protocol):  # e.g. yatt.core.DynamicSampler(mode="rounds")
    def num_to_draw(self) -> int: ...

    def is_done(self) -> bool: ...

    def request_stop(self) -> None: ...


def judge_in_rounds(
    sampler: _RoundSampler,
    *,
    draw: Callable[[int], Sequence[Any]],
    judge_round: Callable[[Sequence[Any], int], Sequence[Any]],
    keep: Callable[[Sequence[Any]], None],
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Rounds until sampler.is_done(); returns how many rounds drew prompts on this rank.
    draw(n): n prompts; judge_round(prompts, r): the judged responses of round r (1, 2, ...;
    a seed's offset); keep(judged): the caller's keep rule, called once per round, an empty
    list for a rank with nothing to draw. A stop signal: should_stop() read after each round,
    or ScoringStopped raised inside judge_round (the judge stopped while it waited; that round
    keeps nothing: add() is local, the next is_done() ends the rounds on every rank)."""
    num_rounds = 0
    while not sampler.is_done():
        num_prompts = sampler.num_to_draw()
        judged: Sequence[Any] = []
        if num_prompts:
            prompts = draw(num_prompts)
            num_rounds += 1
            try:
                judged = judge_round(prompts, num_rounds)
            except ScoringStopped:
                sampler.request_stop()
                continue
        keep(judged)
        if should_stop():  # the next is_done() ends the rounds on every rank
            sampler.request_stop()
    return num_rounds
