"""tasks/examples/guess_env.py — a complete multi-turn environment to copy and edit: guess a
number with hints.

    python train.py --env tasks/examples/guess_env.py:GuessEnv \
        --dataset tasks/examples/guess_rows.jsonl \
        --model YOUR_CHAT_MODEL --max-turns 6 --max-new-tokens 32

One instance per episode. `reset(**row)` gets the dataset row's columns (here `low`, `high`, `seed`)
and returns what the model sees after the prompt; each `step(action)` gets the text of the model's
turn and returns (observation, reward, done). The episode's reward is the sum of the step rewards
(define `get_reward()` to give it yourself). Make the methods `async def` if they wait on something
(HTTP, a sandbox): they are then awaited on the generator's event loop; plain methods run in worker
threads. A method that raises, takes longer than --env-timeout-s or returns a malformed value ends
only its own episode (counted in env/errors).
"""

import random
import re


class GuessEnv:
    def reset(self, low: int = 1, high: int = 20, seed: int = 0, **row) -> str:
        self.low, self.high = int(low), int(high)
        self.secret = random.Random(seed).randint(self.low, self.high)
        self.guesses = 0
        # A string follows the prompt as text; a list of {"role": "user", "content": ...} messages
        # makes it a chat turn (rendered with the model's chat template).
        return [
            {
                "role": "user",
                "content": f"I picked a number between {self.low} and {self.high}. Guess it: "
                "answer with one number.",
            }
        ]

    def step(self, action: str):
        self.guesses += 1
        found = re.findall(r"-?\d+", action)
        if not found:
            return [{"role": "user", "content": "Answer with a number."}], 0.0, False
        guess = int(found[-1])
        if guess == self.secret:
            # fewer guesses, more reward; None: nothing more to show
            return None, 1.0 / self.guesses, True
        hint = "higher" if guess < self.secret else "lower"
        return [{"role": "user", "content": f"{guess} is wrong: the number is {hint}."}], 0.0, False

    def close(self):
        pass  # free what the episode held (a sandbox, a connection)
