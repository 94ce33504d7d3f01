"""tasks/textarena.py: TextArena's single-player games as episode environments, offline, against
the real library.

Fast, in-process, no engine and no episode runner: scripted policies call `reset`/`step` directly. A
binary search wins GuessTheNumber (reward 1 on the winning move); a policy that goes against the
hints runs out of turns (the game's closeness reward, < 1); a reply without a move is told so, then
loses. The row's seed fixes the game (the same for every episode of a group) without touching the
global `random`.
"""

import random
import re

import pytest

from tasks.textarena import TextArenaEnv


def play(env, policy, seed, limit=20):
    """Run one episode; the observations seen, the rewards, the number of turns."""
    seen, rewards = [env.reset(seed=seed, prompt="ignored", answer="")], []
    for turn in range(limit):
        observation, reward, done = env.step(policy(seen))
        seen.append(observation)
        rewards.append(reward)
        if done:
            return seen, rewards, turn + 1
    raise AssertionError(f"the game did not end in {limit} turns")


class BinarySearch:
    """Halves the range on each hint: wins GuessTheNumber (1..20) in at most 5 guesses."""

    def __init__(self):
        self.low, self.high, self.last = 1, 20, None

    def __call__(self, seen):
        hint = re.search(r"The target number is (higher|lower)", seen[-1])
        if hint and hint.group(1) == "higher":
            self.low = self.last + 1
        elif hint:
            self.high = self.last - 1
        self.last = (self.low + self.high) // 2
        return f"My guess: [{self.last}]"


def far_from(target):
    """Guesses the numbers farthest from the target first, never the target itself: a sure loss."""
    guesses = iter(sorted((g for g in range(1, 21) if g != target), key=lambda g: -abs(g - target)))
    return lambda seen: f"[{next(guesses)}]"


def test_a_scripted_search_wins_and_a_policy_that_walks_away_loses():
    before = random.getstate()
    search = BinarySearch()
    seen, rewards, turns = play(TextArenaEnv("GuessTheNumber-v0"), search, seed=7)
    assert "You are playing Guess The Number" in seen[0] and "between 1 and 20" in seen[0]
    assert all("My guess" not in text for text in seen)  # the model's own move is not echoed back
    # only what is new, never the history
    assert all("You are playing" not in text for text in seen[1:])
    assert rewards[-1] == 1.0 and all(r == 0.0 for r in rewards[:-1]) and turns <= 5
    assert "Congratulations" in seen[-1]
    # the same seed: the same target
    seen, rewards, turns = play(TextArenaEnv(), far_from(search.last), seed=7)
    assert 5 < turns < 19 and 0.0 <= rewards[-1] < 1.0 and all(r == 0.0 for r in rewards[:-1])
    assert "turn limit" in seen[-1]
    assert random.getstate() == before  # the games drew from their own random state


def test_no_move_is_told_once_then_loses():
    env = TextArenaEnv()
    env.reset(seed=3)
    observation, reward, done = env.step("I think it is seven.")
    assert not done and reward == 0.0 and "invalid move" in observation.lower()
    observation, reward, done = env.step("still no brackets")
    assert done and reward == 0.0


def test_the_row_seeds_the_game_and_bad_games_are_refused():
    def hints(**row):
        env = TextArenaEnv()
        env.reset(**row)
        return [env.step(f"[{guess}]")[0] for guess in (10, 5, 15)]

    # one seed, one game: the episodes of a group play the same
    assert hints(seed=11) == hints(seed=11)
    # no seed column: the row decides
    assert hints(question="q1", level=2) == hints(question="q1", level=2)
    games = {str(hints(seed=seed)) for seed in range(8)}
    assert len(games) > 1  # and other seeds other games
    sudoku = TextArenaEnv()
    assert "Sudoku" in sudoku.reset(seed=1, game="Sudoku-v0")  # a `game` column picks the game
    with pytest.raises(ValueError, match="TextArena has no game 'NoSuchGame-v0'"):
        TextArenaEnv("NoSuchGame-v0")
    with pytest.raises(ValueError, match="single-player games; ConnectFour-v0"):
        TextArenaEnv("ConnectFour-v0").reset(seed=1)
