"""``long_context`` suite: synthetic retrieval and aggregation tasks at 1k, 2k, 4k and 8k tokens.

Method: RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", arXiv:2404.06654): a haystack of filler text cut to a target length, with
generated facts ("needles") inserted at chosen depths, and a question only the needles answer.
The task wording follows RULER's templates; the haystack is our own synthetic prose
(``evals/suites/haystack.py``) and the words and numbers are generated here.

Tasks (``category``):

- ``niah_single``: one needle "One of the special magic numbers for <key> is: <7 digits>.";
  asked for that number.
- ``niah_multikey``: ``n_keys`` needles with different keys (default 4); asked for one key's.
- ``niah_multivalue``: ``n_values`` needles with the same key (default 4); asked for all.
- ``variable_tracking``: chains "VAR ABCDE = 12345." "VAR FGHIJ = VAR ABCDE." ...
  (``vt_hops`` default 4, so 5 names a chain, plus ``vt_chains - 1`` distractor chains); asked
  which variables hold the first chain's value.
- ``common_words``: a numbered list of words in which ``cwe_common`` words (default 5) appear
  ``cwe_ratio`` times (default 4) as often as the others; asked for the most common ones. The
  list replaces the haystack, as in RULER.

Lengths are in tokens of the default model's tokenizer (SmolLM2-135M-Instruct), which the
generator does not load: it sizes the haystack with characters-per-token figures measured on
that tokenizer (``CHARS_PER_TOKEN``; digits count one token each, as the tokenizer splits them).
Each prompt aims at 96% of the nominal length (983, 1966, 3932, 7864 tokens), so that the 8k
prompt, the chat template (about 30 tokens) and an answer fit the model's 8192 positions. The
measured token count of every frozen prompt is in ``meta["tokens"]`` (from
``data/long_context.tokens.json``, written by ``python -m evals.suites --write`` when the
tokenizer is present; ``None`` for prompts never measured).

Frozen form: the multi-kilobyte prompt is not stored. ``meta["construction"]`` holds how to
rebuild it from the shipped haystack (offset and length of the haystack span, the inserted
needle lines and their offsets) or, for ``common_words``, the word lists, frequencies and
shuffle seed; ``meta["prompt_sha256"]`` is checked on rebuild (``rebuild_prompt``).

Log-likelihood ranking: 4 choices. ``niah_single``: the number and near misses (one digit
changed, or two neighbours swapped). ``niah_multikey``: the values of the other keys, all in
the text. ``niah_multivalue``: the values in text order, and lists with one value replaced by a
near miss. ``variable_tracking``: the chain's names, the distractor chain's names, and mixes.
``common_words``: the common words in alphabetical order, and sets with ``cwe_swaps`` (default
1) of them replaced by rarer words of the list. Generative scoring: every string of ``target``
must occur in the reply (RULER's ``string_match_all``), ``meta["match"] == "all"``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evals.suites import haystack
from evals.suites.common import SEED, Item, SuiteError, item_id, item_rng, pick_choices, plan, sha256_text
from evals.suites.words import CWE_WORDS, KEY_ADJECTIVES, KEY_NOUNS

NAME = "long_context"
LENGTHS = {"1k": 1024, "2k": 2048, "4k": 4096, "8k": 8192}
FILL = 0.96  # of the nominal length: room for the chat template and the answer at 8k
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words")
PER_TASK = {"1k": 20, "2k": 20, "4k": 10, "8k": 10}  # 100, 100, 50, 50 items a length
FULL = {f"{length}-{task}": PER_TASK[length] for length in LENGTHS for task in TASKS}
# quick: 4 items per task at 1k and 2k (40 items; 4k/8k prompts take 20-90 s each on 2 cores).
QUICK = {f"{length}-{task}": 4 for length in ("1k", "2k") for task in TASKS}
DEFAULTS: dict[str, Any] = {
    "n_choices": 4,
    "fill": FILL,
    "n_keys": 4,
    "n_values": 4,
    "vt_hops": 4,
    "vt_chains": 2,
    "cwe_common": 5,
    "cwe_ratio": 4,
    "cwe_swaps": 1,
    "niah_distractors": "near",  # or "random": 7-digit numbers unrelated to the needle
}
TOKENS_FILE = Path(__file__).resolve().parent / "data" / "long_context.tokens.json"
# The default model's tokenizer, where `python -m pipeline model=llama` puts the converted model.
DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "artifacts" / "models" / "llama-b179c9523d0e"

# Characters per token of the default model's tokenizer, digits excluded (each digit is one
# token): measured on the haystack (200k characters: 4.69, 4.57-4.75 over 4k-character windows),
# on needle and question sentences (hyphenated keys, punctuation), on "VAR ABCDE" lines and on
# the numbered word list.
CHARS_PER_TOKEN = {"prose": 4.69, "needle": 3.8, "vars": 1.86, "list": 2.78}

HEADERS = {
    "niah": "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards.",
    "variable_tracking": "Memorize and track the chain(s) of variable assignment hidden in the following "
    "text.",
    "common_words": "Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often.",
}
_DIGIT = re.compile(r"\d")


def estimate_tokens(text: str, kind: str = "prose") -> float:
    """Tokens of ``text`` for the default model's tokenizer, estimated without it."""
    digits = len(_DIGIT.findall(text))
    return digits + (len(text) - digits) / CHARS_PER_TOKEN[kind]


def _header(task: str) -> str:
    return HEADERS["niah" if task.startswith("niah") else task]


def assemble(task: str, context: str, question: str) -> str:
    return f"{_header(task)}\n\n{context}\n\n{question}"


def _haystack_context(text: str, construction: dict[str, Any]) -> str:
    start = construction["offset"]
    span = text[start : start + construction["chars"]]
    pieces, last = [], 0
    for at, line in construction["inserts"]:
        pieces += [span[last:at], line, " " if at < len(span) and span[at : at + 1] != "\n" else ""]
        last = at
    pieces.append(span[last:])
    return "".join(pieces)


def _word_list(construction: dict[str, Any]) -> list[str]:
    words = construction["common"] * construction["freq_common"]
    words += construction["uncommon"] * construction["freq_uncommon"]
    random.Random(construction["shuffle"]).shuffle(words)
    return words


def _list_context(words: list[str]) -> str:
    return " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def build_prompt(task: str, construction: dict[str, Any], question: str, text: str | None = None) -> str:
    """The prompt of an item from its construction (haystack ``text``: the shipped one)."""
    if construction["kind"] == "words":
        context = _list_context(_word_list(construction))
    else:
        context = _haystack_context(haystack.shipped_text() if text is None else text, construction)
    return assemble(task, context, question)


def rebuild_prompt(item: Item, source: Path | str = "long_context", text: str | None = None) -> str:
    """Rebuild a frozen item's prompt and check it against ``meta["prompt_sha256"]``."""
    meta = item.meta
    prompt = build_prompt(item.category, meta["construction"], meta["question"], text)
    if sha256_text(prompt) != meta["prompt_sha256"]:
        raise SuiteError(
            f"{source}: item {item.id}: the rebuilt prompt does not match its sha256 (haystack or "
            "construction edited?); regenerate with `python -m evals.suites --write`"
        )
    return prompt


def _cut(text: str, starts: list[int], rng: random.Random, chars: int) -> tuple[int, int]:
    """A haystack span of about ``chars`` characters from a random sentence start to a sentence
    start: (offset, length)."""
    chars = max(chars, 200)
    candidates = [s for s in starts if s + chars < len(text)]
    offset = rng.choice(candidates)
    i = _first_at_or_after(starts, offset + chars)
    end = starts[i] if i < len(starts) else len(text)
    return offset, len(text[offset:end].rstrip())


def _first_at_or_after(values: list[int], x: int) -> int:
    lo, hi = 0, len(values)
    while lo < hi:
        mid = (lo + hi) // 2
        if values[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _place(span_starts: list[int], depths: list[float], span_chars: int) -> list[int]:
    """The sentence start nearest to each depth (0 = top of the haystack, 1 = bottom)."""
    out = []
    for depth in depths:
        x = depth * span_chars
        out.append(min(span_starts, key=lambda s: (abs(s - x), s)))
    return out


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _near_misses(rng: random.Random, value: str, avoid: set[str], n: int) -> list[str]:
    """Numbers one edit from ``value``: a digit changed, or two neighbouring digits swapped."""
    out: list[str] = []
    tries = 0
    while len(out) < n and tries < 1000:
        tries += 1
        digits = list(value)
        i = rng.randrange(len(digits))
        if rng.random() < 0.5 and i + 1 < len(digits) and digits[i] != digits[i + 1]:
            digits[i], digits[i + 1] = digits[i + 1], digits[i]
        else:
            digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (i or d != "0")])
        candidate = "".join(digits)
        if candidate[0] != "0" and candidate not in avoid and candidate not in out:
            out.append(candidate)
    return out


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = set()
    while len(pairs) < n:
        pairs.add(f"{rng.choice(KEY_ADJECTIVES)}-{rng.choice(KEY_NOUNS)}")
    keys = sorted(pairs)
    rng.shuffle(keys)
    return keys


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _variable(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken and name != "VAR":
            taken.add(name)
            return name


def _haystack_item(
    rng: random.Random,
    text: str,
    starts: list[int],
    task: str,
    target_tokens: int,
    lines: list[list[str]],
    question: str,
) -> tuple[str, dict[str, Any], list[float]]:
    """Cut the haystack to length and insert ``lines`` (each inner list keeps its order)."""
    kind = "vars" if task == "variable_tracking" else "needle"
    fixed = estimate_tokens(_header(task)) + estimate_tokens(question, "needle") + 2
    fixed += sum(estimate_tokens(line + " ", kind) for group in lines for line in group)
    chars = round((target_tokens - fixed) * CHARS_PER_TOKEN["prose"])
    offset, length = _cut(text, starts, rng, chars)
    span_starts = [s - offset for s in starts if offset <= s <= offset + length]
    inserts: list[tuple[int, int, str]] = []
    depths_out: list[float] = []
    order = 0
    for group in lines:
        depths = sorted(rng.random() for _ in group)
        for depth, at, line in zip(depths, _place(span_starts, depths, length), group, strict=True):
            inserts.append((at, order, line))
            depths_out.append(round(depth, 4))
            order += 1
    inserts.sort()
    construction = {
        "kind": "haystack",
        "offset": offset,
        "chars": length,
        "inserts": [[at, line] for at, _, line in inserts],
    }
    return build_prompt(task, construction, question, text), construction, depths_out


def _niah(
    rng: random.Random, task: str, text: str, starts: list[int], target: int, p: dict[str, Any]
) -> dict[str, Any]:
    n = {"niah_single": 1, "niah_multikey": p["n_keys"], "niah_multivalue": 1}[task]
    keys = _keys(rng, n)
    values: list[str] = []
    while len(values) < (p["n_values"] if task == "niah_multivalue" else n):
        value = _number(rng)
        if value not in values:
            values.append(value)
    if task == "niah_multivalue":
        key = keys[0]
        lines = [[_needle(key, v) for v in values]]  # in this order in the text
        question = (
            f"What are all the special magic numbers for {key} mentioned in the provided text? "
            "Answer with the numbers only, separated by commas."
        )
        correct = ", ".join(values)
        distractors = []
        positions = rng.sample(range(len(values)), len(values))
        misses = {i: _near_misses(rng, values[i], set(values), 2) for i in positions}
        for round_ in range(2):
            for i in positions:
                replaced = [*values[:i], misses[i][round_], *values[i + 1 :]]
                distractors.append((", ".join(replaced), "value_replaced"))
        target_strings = values
    else:
        key = keys[0]
        lines = [[_needle(k, v)] for k, v in zip(keys, values, strict=True)]
        question = (
            f"What is the special magic number for {key} mentioned in the provided text? "
            "Answer with the number only."
        )
        correct = values[0]
        distractors = [(v, "other_key") for v in values[1:]]
        if task == "niah_single" and p["niah_distractors"] == "near":
            distractors += [
                (v, "near_miss") for v in _near_misses(rng, values[0], set(values), p["n_choices"])
            ]
        rng.shuffle(distractors)
        distractors += [(_number(rng), "random") for _ in range(p["n_choices"] * 2)]
        target_strings = [values[0]]
    prompt, construction, depths = _haystack_item(rng, text, starts, task, target, lines, question)
    return {
        "prompt": prompt,
        "construction": construction,
        "question": question,
        "correct": correct,
        "distractors": distractors,
        "target": target_strings,
        "extra": {"keys": keys, "values": values, "depths": depths},
    }


def _variable_tracking(
    rng: random.Random, task: str, text: str, starts: list[int], target: int, p: dict[str, Any]
) -> dict[str, Any]:
    taken: set[str] = set()
    chains, values = [], []
    for _ in range(p["vt_chains"]):
        names = [_variable(rng, taken) for _ in range(p["vt_hops"] + 1)]
        value = _number(rng, 5)
        while value in values:
            value = _number(rng, 5)
        chains.append(names)
        values.append(value)
    lines = [
        [f"VAR {names[0]} = {value}.", *(f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names))]
        for names, value in zip(chains, values, strict=True)
    ]
    question = (
        f"Question: Find all variables that are assigned the value {values[0]} in the text above. "
        "Answer with the variable names only, separated by commas."
    )
    right = chains[0]
    distractors = [(", ".join(chain), "other_chain") for chain in chains[1:]]
    other = [name for chain in chains[1:] for name in chain]
    mixes = []
    for swaps in (1, 2, 1, 2):
        names = list(right)
        for i in rng.sample(range(len(names)), swaps):
            names[i] = rng.choice(other) if other else _variable(rng, taken)
        mixes.append((", ".join(names), "mixed_chain"))
    distractors = distractors[:1] + mixes + [(", ".join(rng.sample(right, len(right))), "reordered")]
    prompt, construction, depths = _haystack_item(rng, text, starts, task, target, lines, question)
    return {
        "prompt": prompt,
        "construction": construction,
        "question": question,
        "correct": ", ".join(right),
        "distractors": distractors,
        "target": right,
        "extra": {"chains": chains, "values": values, "depths": depths},
    }


def _common_words(
    rng: random.Random, task: str, text: str, starts: list[int], target: int, p: dict[str, Any]
) -> dict[str, Any]:
    k, ratio = p["cwe_common"], p["cwe_ratio"]
    question = (
        f"Question: What are the {k} most common words in the above list? "
        "Answer with the words only, separated by commas."
    )
    budget = target - estimate_tokens(_header(task)) - estimate_tokens(question, "needle") - 2
    pool = list(CWE_WORDS)
    rng.shuffle(pool)
    common, rest = sorted(pool[:k]), pool[k:]
    # Entries of the list: the estimated tokens of entry i are its digits plus ". word ".
    per_word = sum(len(w) + 3 for w in CWE_WORDS) / len(CWE_WORDS) / CHARS_PER_TOKEN["list"]
    entries, used = 0, 0.0
    while used < budget:
        entries += 1
        used += len(str(entries)) + per_word
    rare = 2
    while math.ceil((entries - k * ratio * rare) / rare) > len(rest):
        rare += 1
    n_rare = max(k, round((entries - k * ratio * rare) / rare))
    construction = {
        "kind": "words",
        "common": common,
        "uncommon": sorted(rest[:n_rare]),
        "freq_common": ratio * rare,
        "freq_uncommon": rare,
        "shuffle": f"{rng.random():.12f}",
    }
    distractors = []
    for _ in range(p["n_choices"] * 3):
        swapped = set(rng.sample(common, p["cwe_swaps"]))
        words = sorted(
            [w for w in common if w not in swapped] + rng.sample(construction["uncommon"], p["cwe_swaps"])
        )
        distractors.append((", ".join(words), "rare_words"))
    prompt = build_prompt(task, construction, question)
    return {
        "prompt": prompt,
        "construction": construction,
        "question": question,
        "correct": ", ".join(common),
        "distractors": distractors,
        "target": common,
        "extra": {"entries": len(common) * ratio * rare + n_rare * rare},
    }


MAKERS = {
    "niah_single": _niah,
    "niah_multikey": _niah,
    "niah_multivalue": _niah,
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
}


def measure_tokens(prompts: Sequence[str], tokenizer_dir: Path = DEFAULT_TOKENIZER) -> list[int]:
    """Tokens of each prompt (no special tokens, no chat template) with the tokenizer in
    ``tokenizer_dir`` (its ``tokenizer.json``; the same counts as ``AutoTokenizer``)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [len(e.ids) for e in tokenizer.encode_batch(list(prompts), add_special_tokens=False)]


def load_measured(path: Path = TOKENS_FILE) -> dict[str, tuple[str, int]]:
    """Measured token counts: item id -> (prompt sha256, tokens)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {key: (sha, n) for key, (sha, n) in data.get("tokens", {}).items()}


def generate(
    size: str | int = "full", seed: int = SEED, *, tokens_file: Path = TOKENS_FILE, **params: Any
) -> list[Item]:
    """Items of the suite, full prompts included. ``params`` (difficulty) are listed in
    ``DEFAULTS``: choices, prompt fill, needles, chain length, word-list frequencies.
    ``tokens_file``: the measured token counts to copy into ``meta["tokens"]``."""
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown long_context parameters {unknown}: use {sorted(DEFAULTS)}")
    settings = {**DEFAULTS, **params}
    text = haystack.generate_text()
    starts = haystack.sentence_starts(text)
    measured = load_measured(tokens_file)
    items = []
    for group, count in plan(size, FULL, QUICK).items():
        length, task = group.split("-", 1)
        target = round(LENGTHS[length] * settings["fill"])
        for k in range(count):
            rng = item_rng(NAME, seed, group, k)
            made = MAKERS[task](rng, task, text, starts, target, settings)
            choices, answer, kinds = pick_choices(
                rng, made["correct"], made["distractors"], settings["n_choices"]
            )
            prompt = made["prompt"]
            digest = sha256_text(prompt)
            identifier = item_id(NAME, group, k)
            sha, tokens = measured.get(identifier, (None, None))
            meta = {
                "length": length,
                "target_tokens": target,
                "tokens": tokens if sha == digest else None,
                "prompt_chars": len(prompt),
                "prompt_sha256": digest,
                "question": made["question"],
                "construction": made["construction"],
                "choice_kinds": kinds,
                "match": "all",
                "k": k,
                **made["extra"],
            }
            items.append(Item(identifier, NAME, task, prompt, choices, answer, made["target"], meta))
    return items
