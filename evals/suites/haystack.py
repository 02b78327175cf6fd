"""The haystack of the long-context suite: synthetic English prose made here from seeded sentence
templates and the word lists in ``evals/suites/words.py``, so it is ours to redistribute
(RULER's essay haystack is copyrighted text; its other haystack repeats one sentence).

The text has no digits, no upper-case words but sentence starts, and none of the needle words
("special", "magic", "VAR"), so every number and variable name in a long-context prompt is a
needle. ``generate_text()`` is pure; ``evals/data/haystack/haystack.txt`` is its frozen copy,
which the long-context loader rebuilds prompts from (``python -m evals.suites --check``
compares the two).
"""

from __future__ import annotations

import random
import re
from functools import cache
from pathlib import Path

from evals.suites.words import (
    ADJECTIVES,
    ADVERBS,
    AGENTS,
    FEELINGS,
    INTRANSITIVE,
    OBJECTS,
    PLACES,
    TIMES,
    VERBS,
    WEATHER,
)

PATH = Path(__file__).resolve().parent.parent / "data" / "haystack" / "haystack.txt"
SEED = "haystack:1"
CHARS = 200_000  # about 44k tokens of the default model; an 8k prompt needs about 36k characters

PATTERNS = (
    "{Time}, the {adj} {agent} {verb} the {object} near the {place}.",
    "The {agent} {adv} {verb} a {adj} {object} and took it to the {place}.",
    "Near the {place}, a {adj} {agent} {intrans} {adv} while the {agent2} {verb} the {object}.",
    "{Time}, {weather}, and the {agent} {intrans} by the {place}.",
    "Nobody in the {place} knew why the {agent} had {verb} the {adj} {object}.",
    "The {adj} {object} stayed in the {place} until the {agent} {verb} it again.",
    "A {agent} and a {agent2} {intrans} {adv} at the edge of the {place}.",
    "The {agent} felt {feeling} after the {agent2} {verb} the {object}.",
    "{Time}, someone {verb} the {object} that the {agent} had left by the {place}.",
    "It was said that the {adj} {agent} {intrans} in the {place} whenever {weather}.",
    "The {place} was {adj2} that day, and the {agent} {intrans} {adv}.",
    "Before long the {agent} {verb} the {object}, and the {agent2} felt {feeling}.",
)


def _sentence(rng: random.Random) -> str:
    agent, agent2 = rng.sample(AGENTS, 2)
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    text = rng.choice(PATTERNS).format(
        Time=rng.choice(TIMES),
        adj=adj,
        adj2=adj2,
        agent=agent,
        agent2=agent2,
        verb=rng.choice(VERBS),
        intrans=rng.choice(INTRANSITIVE),
        adv=rng.choice(ADVERBS),
        object=rng.choice(OBJECTS),
        place=rng.choice(PLACES),
        feeling=rng.choice(FEELINGS),
        weather=rng.choice(WEATHER),
    )
    return text[0].upper() + text[1:]


def generate_text(chars: int = CHARS) -> str:
    """Paragraphs of 4 to 8 sentences, one paragraph a line, at least ``chars`` characters."""
    rng = random.Random(SEED)
    paragraphs: list[str] = []
    total = 0
    while total < chars:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(4, 8)))
        paragraphs.append(paragraph)
        total += len(paragraph) + 1
    return "\n".join(paragraphs) + "\n"


@cache
def shipped_text(path: Path = PATH) -> str:
    """The frozen haystack (``evals/data/haystack/haystack.txt``)."""
    return path.read_text(encoding="utf-8")


_BOUNDARY = re.compile(r"(?<=[.\n]) ?(?=[A-Z])")


def sentence_starts(text: str) -> list[int]:
    """Offsets where a sentence begins: 0 and after every ". " or newline."""
    return sorted({0, *(m.end() for m in _BOUNDARY.finditer(text))})
