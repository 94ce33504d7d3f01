"""tasks/textarena.py — TextArena's games as episode environments
(`--env tasks.textarena:TextArenaEnv`).

Role: `TextArenaEnv(game="GuessTheNumber-v0")` plays one of TextArena's single-player games
(GuessTheNumber, Minesweeper, Sudoku, FrozenLake, ...; its word games need NLTK's word lists once:
`python -m nltk.downloader words`) for one episode: `reset(**row)` starts the game and returns its
opening text, `step(action)` forwards the model's turn as the move and returns (what the game says
next, the game's reward when it ends else 0.0, whether it ended). Offline: the games run in-process.
Why TextArena (issue 22 item 7): text in, text out, single-player games with their own rewards, and
five small packages (nltk, chess, joblib, defusedxml besides it); OpenEnv needs gradio and fastmcp
(~30 packages) and serves each environment over HTTP; verifiers pulls openai, mcp and the prime-*
sandbox clients.
Data contract: the row's `seed` column seeds the game (without one, a hash of the row's columns
does), so the episodes of a group play the same game; a `game` column picks another game than the
constructor's. Observations are only what is new since the model's last turn (TextArena's own
wrappers repeat the whole history each turn): each game message as "[GAME] text", the player's own
move left out.
May touch: the global `random` only under a lock and restored after each call (TextArena seeds and
draws from it); each game keeps its own random state, so concurrent episodes are reproducible and
independent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import threading

RANDOM_LOCK = threading.Lock()  # TextArena's games share Python's global `random`


def textarena():
    """The textarena module (its import draws from the global `random`: restored after it)."""
    with RANDOM_LOCK:
        outer = random.getstate()
        try:
            import textarena as ta
        except ImportError:
            raise RuntimeError("TextArenaEnv needs TextArena: pip install textarena") from None
        finally:
            random.setstate(outer)
    return ta


def row_seed(row: dict) -> int:
    """A seed from the row's columns (the same row, the same game)."""
    text = json.dumps(row, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


class TextArenaEnv:
    """One episode of a TextArena single-player game (see the module docstring)."""

    def __init__(self, game: str = "GuessTheNumber-v0"):
        self.game = game
        self.check_game(game)
        self.env = self.base = None
        self.random_state = None

    @staticmethod
    def check_game(game: str) -> None:
        registry = textarena().envs.registration.ENV_REGISTRY
        if game not in registry:
            raise ValueError(
                f"TextArena has no game {game!r} (single-player ones: GuessTheNumber-v0, "
                f"Minesweeper-v0, Sudoku-v0, FrozenLake-v0, TowerOfHanoi-v0, ...)"
            )

    @contextlib.contextmanager
    def own_random(self):
        """The global `random` as this game left it, for the duration of one call."""
        with RANDOM_LOCK:
            outer = random.getstate()
            if self.random_state is not None:
                random.setstate(self.random_state)
            try:
                yield
            finally:
                self.random_state = random.getstate()
                random.setstate(outer)

    def reset(self, seed=None, game: str | None = None, **row) -> str:
        ta = textarena()
        game = game or self.game
        self.check_game(game)
        seed = int(seed) if seed is not None else row_seed({"game": game, **row})
        with self.own_random():
            self.env = ta.make(game)
            try:
                self.env.reset(num_players=1, seed=seed)
            except AssertionError as e:  # TextArena asserts the number of players
                raise ValueError(f"TextArenaEnv plays single-player games; {game}: {e}") from None
        self.base = self.env
        while isinstance(self.base, ta.Wrapper):  # past the observation wrappers: only what is new
            self.base = self.base.env
        return self.observation()

    def observation(self) -> str:
        ta = textarena()
        player, messages = self.base.get_observation()
        roles = self.base.state.role_mapping
        return "\n".join(
            f"[{'GAME' if sender == ta.GAME_ID else roles.get(sender, sender)}] {text.strip()}"
            for sender, text, _ in messages
            if sender != player
        )

    def step(self, action: str) -> tuple[str, float, bool]:
        with self.own_random():
            done, _ = self.env.step(action)
        text = self.observation()
        if not done:
            return text, 0.0, False
        rewards, info = self.env.close()
        reason = (info or {}).get(0, {}).get("reason")
        text = "\n".join(part for part in (text, f"[GAME] {reason}" if reason else "") if part)
        return text, float((rewards or {}).get(0, 0.0)), True

    def close(self) -> None:
        self.env = self.base = None
