"""Write experiments/data/instructions.jsonl: short synthetic prompt/response pairs for the fine-tuning example
(experiments/finetune_tiny.yaml), the same file on every run (a fixed seed, no other input).

    python experiments/data/make_instructions.py [OUT]

Five small tasks a tiny model learns within a hundred steps: adding two numbers, doubling one, reversing a short
word, a word's opposite, the letter after a letter. Each record is {"prompt": "Q: ...\\nR:", "response": " ..."}:
lowercase text, digits and punctuation, which the tokenizer fixture (tests/fixtures/hf/tokenizer) encodes whole.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

RECORDS = 400
SEED = 0
OPPOSITES = [("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("light", "dark"),
             ("open", "closed"), ("old", "new"), ("wet", "dry"), ("early", "late"), ("full", "empty")]
WORDS = ["cat", "dog", "sun", "tree", "fish", "bird", "moon", "star", "rain", "wind", "road", "milk"]
LETTERS = "bcdefghijklmnopqrstuvwxy"


def record(rng: random.Random) -> dict[str, str]:
    """One prompt/response pair of a task drawn at random."""
    task = rng.randrange(5)
    if task == 0:
        a, b = rng.randrange(10), rng.randrange(10)
        question, answer = f"add {a} and {b}", str(a + b)
    elif task == 1:
        a = rng.randrange(50)
        question, answer = f"double {a}", str(2 * a)
    elif task == 2:
        word = rng.choice(WORDS)
        question, answer = f"reverse {word}", word[::-1]
    elif task == 3:
        word, other = rng.choice(OPPOSITES)
        question, answer = f"opposite of {word}", other
    else:
        letter = rng.choice(LETTERS)
        question, answer = f"letter after {letter}", chr(ord(letter) + 1)
    return {"prompt": f"Q: {question}\nR:", "response": f" {answer}"}


def main(out: Path) -> None:
    rng = random.Random(SEED)
    lines = [json.dumps(record(rng)) for _ in range(RECORDS)]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} records to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("instructions.jsonl"))
