"""``reasoning`` suite: arithmetic and multi-step word problems generated from templates with
typed variables, plus short comparison and logic items.

Method: GSM-Symbolic (Mirzadeh et al. 2024, "GSM-Symbolic: Understanding the Limitations of
Mathematical Reasoning in Large Language Models", arXiv:2410.05229): a problem is a template
whose names, objects and numbers are typed variables drawn under constraints (results positive,
divisions exact), so every instance is new text with a computed answer and nothing can have
been memorised. Templates here are written for this project.

Categories:

- ``arithmetic``: one expression (addition, subtraction, multiplication and division signs,
  precedence and brackets); number size set by ``digits``.
- ``word_problem``: 14 two- and three-step templates (shopping, wages, rates, ages, ...), used
  in turn so any first N items cover them all.
- ``comparison``: a chain of "taller than" facts (who is the tallest / shortest / second), or
  decimals of different lengths (which is the largest / smallest).
- ``logic``: modus ponens / tollens, disjunctive syllogism, two categorical syllogisms, and the
  two classic fallacies (affirming the consequent, denying the antecedent: "Nothing can be
  concluded."), over nonsense category words so world knowledge does not help.

Log-likelihood ranking: ``n_choices`` candidates (default 4). Number distractors are the results
of the usual slips for that template (a step skipped, an addition for a product, the wrong sign, order of
operations ignored), then near misses; so a guesser stays at chance and copying a number from
the question rarely wins. Comparison and logic choices are the names or statements themselves,
listed in the prompt.

Generative scoring: ``target`` is the answer as text; ``meta["match"]`` is ``number`` (compare
the last number in the reply) or ``choice`` (the reply names the right choice and no other).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evals.suites.common import SEED, Item, item_id, item_rng, pick_choices, plan
from evals.suites.words import PEOPLE, PRONOUNS, THINGS

NAME = "reasoning"
FULL = {"arithmetic": 150, "word_problem": 250, "comparison": 100, "logic": 100}
QUICK = 12  # per category: 48 items
DEFAULTS: dict[str, Any] = {"n_choices": 4, "digits": 2, "scale": 1}
MUL, DIV = "\u00d7", "\u00f7"  # the multiplication and division signs of the prompts

Vars = dict[str, Any]


@dataclass(frozen=True)
class Template:
    name: str
    text: str
    sample: Callable[[random.Random, int], Vars]
    answer: Callable[[Vars], int]
    slips: tuple[Callable[[Vars], int], ...]


def _people(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return rng.sample(PEOPLE, n)


def _v(rng: random.Random, lo: int, hi: int, scale: int = 1) -> int:
    return rng.randint(lo, hi * scale)


def _packs(r: random.Random, s: int) -> Vars:
    a, b = _v(r, 2, 9), _v(r, 3, 12, s)
    return {"a": a, "b": b, "c": r.randint(1, a * b - 1)}


def _wages(r: random.Random, s: int) -> Vars:
    return {"a": _v(r, 8, 30, s), "b": _v(r, 2, 9), "c": _v(r, 2, 9)}


def _spending(r: random.Random, s: int) -> Vars:
    while True:
        a = _v(r, 20, 120, s)
        b = r.randint(2, a - 4)
        if (a - b) % 2 == 0 and a // 2 > b:
            return {"a": a, "b": b}


def _machine(r: random.Random, s: int) -> Vars:
    return {"a": _v(r, 2, 15, s), "b": _v(r, 2, 8)}


def _share(r: random.Random, s: int) -> Vars:
    b, q = _v(r, 2, 8), _v(r, 2, 12, s)
    return {"b": b, "q": q, "total": b * q, "c": _v(r, 1, 9)}


def _ages(r: random.Random, s: int) -> Vars:
    return {"a": _v(r, 5, 40, s), "b": _v(r, 2, 15), "c": _v(r, 2, 10)}


def _rows(r: random.Random, s: int) -> Vars:
    return {"a": _v(r, 2, 12), "b": _v(r, 3, 15, s), "c": _v(r, 2, 9)}


def _discount(r: random.Random, s: int) -> Vars:
    p = r.choice([10, 20, 25, 30, 40, 50])
    step = 100 // math.gcd(100, p)
    return {"p": p, "a": step * r.randint(max(1, 20 // step), 200 * s // step)}


def _three(r: random.Random, s: int) -> Vars:
    a, b = _v(r, 2, 15, s), _v(r, 2, 5)
    return {"a": a, "b": b, "c": r.randint(1, a * b - 1)}


def _reading(r: random.Random, s: int) -> Vars:
    a, d = _v(r, 5, 30, s), _v(r, 2, 9)
    return {"a": a, "d": d, "total": r.randint(a * d + 1, a * d + 200 * s)}


def _bus(r: random.Random, s: int) -> Vars:
    a = _v(r, 15, 50, s)
    b = r.randint(2, a - 5)
    c = _v(r, 2, 20, s)
    return {"a": a, "b": b, "c": c, "d": r.randint(1, a - b + c - 1)}


def _boxes(r: random.Random, s: int) -> Vars:
    b = _v(r, 3, 12)
    while True:
        a = r.randint(b + 1, b * 12 * s)
        if a % b:
            return {"a": a, "b": b}


def _running(r: random.Random, s: int) -> Vars:
    return {"a": _v(r, 2, 12, s), "b": _v(r, 2, 20, s)}


def _recipe(r: random.Random, s: int) -> Vars:
    b, m = _v(r, 4, 12), _v(r, 2, 6)
    return {"a": _v(r, 2, 9, s), "b": b, "m": m, "c": b * m}


# Slips: the results of a common mistake in that template (non-positive or repeated ones are
# dropped by the choice picker's caller).
TEMPLATES: tuple[Template, ...] = (
    Template(
        "packs",
        "{name} buys {a} packs of {thing}. Each pack has {b} {thing}. {He} gives {c} {thing} to "
        "{friend}. How many {thing} does {name} have left?",
        _packs,
        lambda v: v["a"] * v["b"] - v["c"],
        (
            lambda v: v["a"] * v["b"] + v["c"],
            lambda v: v["a"] * v["b"],
            lambda v: v["a"] + v["b"] - v["c"],
            lambda v: v["a"] * (v["b"] - v["c"]),
        ),
    ),
    Template(
        "wages",
        "{name} earns ${a} an hour. {He} works {b} hours on Monday and {c} hours on Tuesday. How "
        "many dollars does {name} earn over the two days?",
        _wages,
        lambda v: v["a"] * (v["b"] + v["c"]),
        (
            lambda v: v["a"] * v["b"] + v["c"],
            lambda v: v["a"] * v["b"],
            lambda v: v["a"] + v["b"] + v["c"],
            lambda v: v["a"] * v["c"],
        ),
    ),
    Template(
        "spending",
        "{name} has ${a}. {He} spends ${b} on a book, then spends half of the money left on "
        "lunch. How many dollars does {name} have now?",
        _spending,
        lambda v: (v["a"] - v["b"]) // 2,
        (
            lambda v: v["a"] - v["b"],
            lambda v: v["a"] // 2 - v["b"],
            lambda v: (v["a"] - v["b"]) // 2 + v["b"],
            lambda v: v["a"] - v["b"] // 2,
        ),
    ),
    Template(
        "machine",
        "A machine fills {a} bottles every minute. How many bottles does it fill in {b} hours?",
        _machine,
        lambda v: v["a"] * v["b"] * 60,
        (
            lambda v: v["a"] * v["b"],
            lambda v: v["a"] * v["b"] * 100,
            lambda v: v["a"] * 60,
            lambda v: v["a"] * v["b"] * 30,
        ),
    ),
    Template(
        "share",
        "{name} has {total} {thing} and shares them equally among {b} friends. Then {name} gives "
        "each friend {c} more {thing}. How many {thing} does each friend have now?",
        _share,
        lambda v: v["q"] + v["c"],
        (
            lambda v: v["q"],
            lambda v: v["q"] + v["c"] * v["b"],
            lambda v: v["total"] + v["c"],
            lambda v: v["q"] * v["c"],
        ),
    ),
    Template(
        "ages",
        "{name} is {a} years old. {friend} is {b} years older than {name}. How old will {friend} "
        "be in {c} years?",
        _ages,
        lambda v: v["a"] + v["b"] + v["c"],
        (
            lambda v: v["a"] + v["b"],
            lambda v: v["a"] + v["c"],
            lambda v: v["a"] - v["b"] + v["c"],
            lambda v: v["a"] + v["b"] - v["c"],
        ),
    ),
    Template(
        "rows",
        "A garden has {a} rows with {b} plants in each row. {name} adds {c} more rows of the same "
        "size. How many plants are in the garden now?",
        _rows,
        lambda v: (v["a"] + v["c"]) * v["b"],
        (
            lambda v: v["a"] * v["b"] + v["c"],
            lambda v: v["a"] * v["b"],
            lambda v: v["a"] + v["b"] + v["c"],
            lambda v: v["a"] * v["b"] * v["c"],
        ),
    ),
    Template(
        "discount",
        "A jacket costs ${a}. In a sale, its price is cut by {p}%. What is the sale price in dollars?",
        _discount,
        lambda v: v["a"] - v["a"] * v["p"] // 100,
        (
            lambda v: v["a"] * v["p"] // 100,
            lambda v: v["a"] - v["p"],
            lambda v: v["a"] + v["a"] * v["p"] // 100,
            lambda v: v["a"] - v["a"] * v["p"] // 1000,
        ),
    ),
    Template(
        "three",
        "{name} has {a} marbles. {friend} has {b} times as many marbles as {name}. {other} has {c} "
        "fewer marbles than {friend}. How many marbles do the three of them have together?",
        _three,
        lambda v: v["a"] + 2 * v["a"] * v["b"] - v["c"],
        (
            lambda v: v["a"] + v["a"] * v["b"],
            lambda v: v["a"] + 2 * v["a"] * v["b"] + v["c"],
            lambda v: v["a"] + v["a"] * v["b"] - v["c"],
            lambda v: v["a"] + v["a"] + v["b"] + v["a"] + v["b"] - v["c"],
        ),
    ),
    Template(
        "reading",
        "A book has {total} pages. {name} reads {a} pages every day. How many pages are left after {d} days?",
        _reading,
        lambda v: v["total"] - v["a"] * v["d"],
        (
            lambda v: v["total"] - v["a"] - v["d"],
            lambda v: v["a"] * v["d"],
            lambda v: v["total"] - v["a"] * (v["d"] - 1),
            lambda v: v["total"] - v["a"],
        ),
    ),
    Template(
        "bus",
        "A bus leaves the station with {a} passengers. At the first stop, {b} people get off and "
        "{c} get on. At the second stop, {d} people get off. How many passengers are on the bus "
        "now?",
        _bus,
        lambda v: v["a"] - v["b"] + v["c"] - v["d"],
        (
            lambda v: v["a"] - v["b"] - v["c"] - v["d"],
            lambda v: v["a"] + v["b"] + v["c"] - v["d"],
            lambda v: v["a"] - v["b"] + v["c"],
            lambda v: v["a"] - v["b"] + v["c"] + v["d"],
        ),
    ),
    Template(
        "boxes",
        "{name} has {a} {thing} to pack. Each box holds {b} {thing}. How many boxes does {name} "
        "need to pack all of them?",
        _boxes,
        lambda v: -(-v["a"] // v["b"]),
        (
            lambda v: v["a"] // v["b"],
            lambda v: -(-v["a"] // v["b"]) + 1,
            lambda v: v["a"] - v["b"],
            lambda v: v["a"] % v["b"],
        ),
    ),
    Template(
        "running",
        "{name} runs {a} kilometres on each weekday and {b} kilometres on each day of the "
        "weekend. How many kilometres does {he} run in one week?",
        _running,
        lambda v: 5 * v["a"] + 2 * v["b"],
        (
            lambda v: v["a"] + v["b"],
            lambda v: 7 * v["a"] + 2 * v["b"],
            lambda v: 5 * v["a"] + v["b"],
            lambda v: 7 * (v["a"] + v["b"]),
        ),
    ),
    Template(
        "recipe",
        "A recipe uses {a} cups of flour to make {b} muffins. How many cups of flour are needed to "
        "make {c} muffins?",
        _recipe,
        lambda v: v["a"] * v["m"],
        (
            lambda v: v["a"] * v["c"],
            lambda v: v["a"] + v["m"],
            lambda v: v["a"] * v["b"],
            lambda v: v["c"] // v["a"] if v["c"] // v["a"] else v["m"] + 1,
        ),
    ),
)


def _near(rng: random.Random, value: int) -> list[int]:
    """Near misses of ``value`` with the same number of digits where possible."""
    steps = [1, 2, 10, 3, 20, 5, 100]
    out = []
    for step in steps:
        out.extend([value + step, value - step])
    rng.shuffle(out)
    same = [x for x in out if x > 0 and len(str(x)) == len(str(value))]
    return same + [x for x in out if x > 0 and x not in same]


def _number_choices(
    rng: random.Random, answer: int, slips: list[int], n: int
) -> tuple[list[str], int, list[str]]:
    rng.shuffle(slips)
    candidates = [(str(x), "slip") for x in slips if x > 0 and x != answer]
    candidates += [(str(x), "near") for x in _near(rng, answer)]
    return pick_choices(rng, str(answer), candidates, n)


def _word_problem(rng: random.Random, k: int, params: Vars) -> tuple[str, Vars, str, list[str], int]:
    template = TEMPLATES[k % len(TEMPLATES)]
    values = template.sample(rng, params["scale"])
    (name, pronoun), (friend, _), (other, _) = _people(rng, 3)
    forms = PRONOUNS[pronoun]
    text = template.text.format(
        name=name,
        friend=friend,
        other=other,
        thing=rng.choice(THINGS),
        He=forms["he"].capitalize(),
        he=forms["he"],
        **values,
    )
    answer = template.answer(values)
    slips = [f(values) for f in template.slips]
    choices, index, kinds = _number_choices(rng, answer, slips, params["n_choices"])
    meta = {"template": template.name, "values": values, "choice_kinds": kinds, "match": "number"}
    return f"{text} Answer with a number.", meta, str(answer), choices, index


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1) if digits > 1 else rng.randint(2, 9)


def _arithmetic(rng: random.Random, k: int, params: Vars) -> tuple[str, Vars, str, list[str], int]:
    d = params["digits"]
    a, b = _operand(rng, d), _operand(rng, d)
    c = rng.randint(2, 9)
    form = ("add", "subtract", "multiply", "divide", "add_mul", "bracket", "mul_sub")[k % 7]
    if form == "add":
        expr, answer, slips = f"{a} + {b}", a + b, [a + b + 10, a + b - 10, a + b + 1, abs(a - b)]
    elif form == "subtract":
        a, b = max(a, b) + 1, min(a, b)
        expr, answer, slips = f"{a} - {b}", a - b, [a - b + 10, a - b - 10, a + b, a - b - 1]
    elif form == "multiply":
        expr, answer, slips = f"{a} {MUL} {c}", a * c, [a * (c - 1), a * (c + 1), a + c, a * c + 10]
    elif form == "divide":
        expr, answer, slips = f"{a * c} {DIV} {c}", a, [a + 1, a - 1, a * c - c, a + 10]
    elif form == "add_mul":
        expr, answer = f"{a} + {b} {MUL} {c}", a + b * c
        slips = [(a + b) * c, a + b + c, a * b + c, a + b * (c + 1)]
    elif form == "bracket":
        expr, answer = f"({a} + {b}) {MUL} {c}", (a + b) * c
        slips = [a + b * c, a * c + b, a + b + c, (a + b) * (c - 1)]
    else:
        expr, answer = f"{a} {MUL} {c} - {b}", a * c - b
        if answer <= 0:
            expr, answer = f"{a} {MUL} {c} + {b}", a * c + b
            slips = [a * (c + b), a * c - b, a + c + b, a * c]
        else:
            slips = [a * (c - b), a * c + b, a * c, a + c - b]
    choices, index, kinds = _number_choices(rng, answer, slips, params["n_choices"])
    meta = {"template": form, "choice_kinds": kinds, "match": "number"}
    return f"What is {expr}? Answer with a number.", meta, str(answer), choices, index


RELATIONS = (  # (attribute, more, less, most, least)
    ("height", "taller", "shorter", "tallest", "shortest"),
    ("age", "older", "younger", "oldest", "youngest"),
    ("speed", "faster", "slower", "fastest", "slowest"),
    ("weight", "heavier", "lighter", "heaviest", "lightest"),
)


def _listing(choices: list[str]) -> str:
    return "\n".join(f"- {c}" for c in choices)


def _comparison(rng: random.Random, k: int, params: Vars) -> tuple[str, Vars, str, list[str], int]:
    n = params["n_choices"]
    if k % 2 == 0:
        _, more, less, most, least = RELATIONS[(k // 2) % len(RELATIONS)]
        people = [p for p, _ in _people(rng, max(4, n))]  # ordered from most to least
        facts = []
        for upper, lower in itertools.pairwise(people):
            facts.append(
                f"{upper} is {more} than {lower}."
                if rng.random() < 0.5
                else f"{lower} is {less} than {upper}."
            )
        rng.shuffle(facts)
        ask = rng.choice(["most", "least", "second"])
        if ask == "most":
            question, answer = f"Who is the {most}?", people[0]
        elif ask == "least":
            question, answer = f"Who is the {least}?", people[-1]
        else:
            question, answer = f"Who is the second {most}?", people[1]
        others = [(p, "other_person") for p in people if p != answer]
        rng.shuffle(others)
        choices, index, kinds = pick_choices(rng, answer, others, n)
        prompt = f"{' '.join(facts)} {question}\n{_listing(choices)}\nAnswer with the name only."
        meta = {"template": f"order_{ask}", "choice_kinds": kinds, "match": "choice"}
        return prompt, meta, answer, choices, index
    whole = rng.randint(0, 9)
    # Decimals whose length misleads: 0.5 > 0.45 > 0.405 > 0.054 for digits 5, 4 ...
    d1, d2, d3 = rng.sample(range(1, 10), 3)
    values = {
        f"{whole}.{d1}",
        f"{whole}.{d2}{d1}",
        f"{whole}.{d2}0{d1}",
        f"{whole}.0{d1}{d2}",
        f"{whole}.{d3}{d3}",
        f"{whole}.{d1}{d3}{d2}",
    }
    pool = sorted(values, key=lambda v: (float(v), v))
    rng.shuffle(pool)
    shown = sorted(pool[: max(n, 4)], key=float)
    largest = rng.random() < 0.5
    answer = shown[-1] if largest else shown[0]
    others = [(v, "other_number") for v in shown if v != answer]
    rng.shuffle(others)
    choices, index, kinds = pick_choices(rng, answer, others, n)
    word = "largest" if largest else "smallest"
    prompt = f"Which number is the {word}?\n{_listing(choices)}\nAnswer with the number only."
    meta = {"template": f"decimal_{word}", "choice_kinds": kinds, "match": "choice"}
    return prompt, meta, answer, choices, index


NONSENSE = (
    "blickets", "wugs", "daxes", "feps", "zorbs", "glims", "tovs", "plinks", "snarps", "vorks",
    "quibs", "mibbles", "trelks", "yoffs", "gorps", "fendles",
)  # fmt: skip
FACTS = (  # (fact, its negation)
    ("the red lamp is on", "the red lamp is off"),
    ("the blue door is open", "the blue door is closed"),
    ("the bell rings", "the bell does not ring"),
    ("the fan is running", "the fan is not running"),
    ("the gate is locked", "the gate is unlocked"),
    ("the green flag is up", "the green flag is down"),
    ("the kettle is hot", "the kettle is cold"),
    ("the tap is dripping", "the tap is not dripping"),
    ("the screen is lit", "the screen is dark"),
    ("the window is shut", "the window is open"),
)
NOTHING = "Nothing can be concluded."
LOGIC_FORMS = (
    "modus_ponens",
    "modus_tollens",
    "disjunctive",
    "barbara",
    "celarent",
    "affirming_consequent",
    "denying_antecedent",
)


def _cap(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def _logic(rng: random.Random, k: int, params: Vars) -> tuple[str, Vars, str, list[str], int]:
    form = LOGIC_FORMS[k % len(LOGIC_FORMS)]
    if form in ("barbara", "celarent"):
        a, b, c = rng.sample(NONSENSE, 3)
        if form == "barbara":
            premises = f"All {a} are {b}. All {b} are {c}."
            answer = f"All {a} are {c}."
            wrong = [f"All {c} are {a}.", f"No {a} are {c}.", f"All {b} are {a}.", f"No {b} are {c}."]
        else:
            premises = f"All {a} are {b}. No {b} are {c}."
            answer = f"No {a} are {c}."
            wrong = [f"All {a} are {c}.", f"All {c} are {a}.", f"All {c} are {b}.", f"No {a} are {b}."]
    else:
        (p, not_p), (q, not_q) = rng.sample(FACTS, 2)
        if_pq = f"If {p}, then {q}."
        premises, answer, wrong = {
            "modus_ponens": (f"{if_pq} {_cap(p)}", _cap(q), [_cap(not_q), _cap(not_p), NOTHING]),
            "modus_tollens": (f"{if_pq} {_cap(not_q)}", _cap(not_p), [_cap(p), _cap(q), NOTHING]),
            "disjunctive": (f"Either {p} or {q}. {_cap(not_p)}", _cap(q), [_cap(not_q), _cap(p), NOTHING]),
            "affirming_consequent": (f"{if_pq} {_cap(q)}", NOTHING, [_cap(p), _cap(not_p), _cap(not_q)]),
            "denying_antecedent": (f"{if_pq} {_cap(not_p)}", NOTHING, [_cap(not_q), _cap(q), _cap(p)]),
        }[form]
    distractors = [(w, "invalid") for w in wrong]
    rng.shuffle(distractors)
    choices, index, kinds = pick_choices(rng, answer, distractors, params["n_choices"])
    question = "Which of these statements must be true?"
    prompt = f"{premises} {question}\n{_listing(choices)}\nAnswer with the statement only."
    meta = {"template": form, "choice_kinds": kinds, "match": "choice"}
    return prompt, meta, answer, choices, index


MAKERS = {
    "arithmetic": _arithmetic,
    "word_problem": _word_problem,
    "comparison": _comparison,
    "logic": _logic,
}


def generate(size: str | int = "full", seed: int = SEED, **params: Any) -> list[Item]:
    """Items of the suite. ``params`` (difficulty): ``n_choices`` (candidates per item, 4),
    ``digits`` (operand digits in ``arithmetic``, 2), ``scale`` (multiplies the upper bound of
    the numbers in word problems, 1)."""
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown reasoning parameters {unknown}: use {sorted(DEFAULTS)}")
    settings = {**DEFAULTS, **params}
    if settings["n_choices"] > 4:
        raise ValueError("reasoning: n_choices is at most 4 (logic and comparison have 4 candidates)")
    items = []
    for category, count in plan(size, FULL, QUICK).items():
        for k in range(count):
            rng = item_rng(NAME, seed, category, k)
            prompt, meta, target, choices, answer = MAKERS[category](rng, k, settings)
            meta["k"] = k
            items.append(
                Item(item_id(NAME, category, k), NAME, category, prompt, choices, answer, target, meta)
            )
    return items
