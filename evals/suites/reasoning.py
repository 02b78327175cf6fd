"""``reasoning`` suite: arithmetic and multi-step word problems generated from templates with
typed variables, plus short comparison and logic items.

Method: GSM-Symbolic (Mirzadeh et al. 2024, "GSM-Symbolic: Understanding the Limitations of
Mathematical Reasoning in Large Language Models", arXiv:2410.05229): a problem is a template
whose names, objects and numbers are typed variables drawn under constraints (results positive,
divisions exact), so every instance is new text with a computed answer and nothing can have
been memorised. Templates here are written for this project.

Categories:

- ``arithmetic``: one expression (addition, subtraction, multiplication and division signs,
  precedence and brackets); number size set by ``digits`` (default one digit).
- ``word_problem``: 14 two- and three-step templates (shopping, wages, rates, ages, ...), used
  in turn so any first N items cover them all.
- ``comparison``: order on the number line: the number just after / just before a two-digit
  number (the asks alternate).
- ``logic``: the truth value of a Boolean expression (16 forms of one to four operands built
  from not, and, or); the right value is True for half the items and False for the other half.

No prompt repeats within a category (``common.unique_draw``): a repeated question would count
one answer twice in the gate's paired statistics.

Log-likelihood ranking (tuned on SmolLM2-135M-Instruct, the default model: it ranks bare
numbers, names or statements at chance, but ranks whole equations by their arithmetic). Every
choice is a full equation or sentence that repeats the question's expression, so the choices
differ only in the answer part and a choice is preferred only for its answer:

- ``arithmetic`` / ``word_problem``: ``"<expression> = <value>"``, ``n_choices`` of them (default
  3). Arithmetic distractors are slips (the result of the wrong operation, order of operations
  ignored, off by one or ten); word-problem distractors are near misses of the same length. The
  word problem's expression is its correct computation, so these items measure multi-step
  arithmetic in context rather than the choice of operations.
- ``comparison``: ``"The number just after n is m."`` for the right neighbour, the wrong-side
  neighbour and the number ten away (at most 3 choices).
- ``logic``: ``"<expression> = True"`` and ``"<expression> = False"`` (2 choices: chance is a
  half, and a bias toward either value scores exactly a half).

Generative scoring: ``target`` is the answer as text; ``meta["match"]`` is ``number`` (compare
the last number in the reply: arithmetic, word problems, comparison) or ``choice`` (the reply
names the right choice and no other: logic).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any

from evals.suites.common import SEED, Item, item_id, pick_choices, plan, unique_draw
from evals.suites.words import PEOPLE, PRONOUNS, THINGS

NAME = "reasoning"
# 800 distinct items: the swap of two decoder layers showed 23% discordant pairs, and seeing a
# 5-point drop at that discordance takes 720 (evals/stats.py items_needed).
FULL = {"arithmetic": 250, "word_problem": 350, "comparison": 100, "logic": 100}
QUICK = 12  # per category: 48 items
DEFAULTS: dict[str, Any] = {"n_choices": 3, "digits": 1, "scale": 1}
MUL, DIV = "*", "/"  # the multiplication and division signs of the prompts (ASCII: small models read them)

Vars = dict[str, Any]


@dataclass(frozen=True)
class Template:
    name: str
    text: str
    sample: Callable[[random.Random, int], Vars]
    answer: Callable[[Vars], int]
    expr: str  # the computation of ``answer``, formatted with the values (the choices' left side)


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


TEMPLATES: tuple[Template, ...] = (
    Template(
        "packs",
        "{name} buys {a} packs of {thing}. Each pack has {b} {thing}. {He} gives {c} {thing} to "
        "{friend}. How many {thing} does {name} have left?",
        _packs,
        lambda v: v["a"] * v["b"] - v["c"],
        "{a} {mul} {b} - {c}",
    ),
    Template(
        "wages",
        "{name} earns ${a} an hour. {He} works {b} hours on Monday and {c} hours on Tuesday. How "
        "many dollars does {name} earn over the two days?",
        _wages,
        lambda v: v["a"] * (v["b"] + v["c"]),
        "{a} {mul} ({b} + {c})",
    ),
    Template(
        "spending",
        "{name} has ${a}. {He} spends ${b} on a book, then spends half of the money left on "
        "lunch. How many dollars does {name} have now?",
        _spending,
        lambda v: (v["a"] - v["b"]) // 2,
        "({a} - {b}) {div} 2",
    ),
    Template(
        "machine",
        "A machine fills {a} bottles every minute. How many bottles does it fill in {b} hours?",
        _machine,
        lambda v: v["a"] * v["b"] * 60,
        "{a} {mul} 60 {mul} {b}",
    ),
    Template(
        "share",
        "{name} has {total} {thing} and shares them equally among {b} friends. Then {name} gives "
        "each friend {c} more {thing}. How many {thing} does each friend have now?",
        _share,
        lambda v: v["q"] + v["c"],
        "{total} {div} {b} + {c}",
    ),
    Template(
        "ages",
        "{name} is {a} years old. {friend} is {b} years older than {name}. How old will {friend} "
        "be in {c} years?",
        _ages,
        lambda v: v["a"] + v["b"] + v["c"],
        "{a} + {b} + {c}",
    ),
    Template(
        "rows",
        "A garden has {a} rows with {b} plants in each row. {name} adds {c} more rows of the same "
        "size. How many plants are in the garden now?",
        _rows,
        lambda v: (v["a"] + v["c"]) * v["b"],
        "({a} + {c}) {mul} {b}",
    ),
    Template(
        "discount",
        "A jacket costs ${a}. In a sale, its price is cut by {p}%. What is the sale price in dollars?",
        _discount,
        lambda v: v["a"] - v["a"] * v["p"] // 100,
        "{a} - {a} {mul} {p} {div} 100",
    ),
    Template(
        "three",
        "{name} has {a} marbles. {friend} has {b} times as many marbles as {name}. {other} has {c} "
        "fewer marbles than {friend}. How many marbles do the three of them have together?",
        _three,
        lambda v: v["a"] + 2 * v["a"] * v["b"] - v["c"],
        "{a} + {a} {mul} {b} + {a} {mul} {b} - {c}",
    ),
    Template(
        "reading",
        "A book has {total} pages. {name} reads {a} pages every day. How many pages are left after {d} days?",
        _reading,
        lambda v: v["total"] - v["a"] * v["d"],
        "{total} - {a} {mul} {d}",
    ),
    Template(
        "bus",
        "A bus leaves the station with {a} passengers. At the first stop, {b} people get off and "
        "{c} get on. At the second stop, {d} people get off. How many passengers are on the bus "
        "now?",
        _bus,
        lambda v: v["a"] - v["b"] + v["c"] - v["d"],
        "{a} - {b} + {c} - {d}",
    ),
    Template(
        "boxes",
        "{name} has {a} {thing} to pack. Each box holds {b} {thing}. How many boxes does {name} "
        "need to pack all of them?",
        _boxes,
        lambda v: -(-v["a"] // v["b"]),
        "{a} {div} {b} rounded up",
    ),
    Template(
        "running",
        "{name} runs {a} kilometres on each weekday and {b} kilometres on each day of the "
        "weekend. How many kilometres does {he} run in one week?",
        _running,
        lambda v: 5 * v["a"] + 2 * v["b"],
        "5 {mul} {a} + 2 {mul} {b}",
    ),
    Template(
        "recipe",
        "A recipe uses {a} cups of flour to make {b} muffins. How many cups of flour are needed to "
        "make {c} muffins?",
        _recipe,
        lambda v: v["a"] * v["m"],
        "{a} {mul} {c} {div} {b}",
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
    rng: random.Random, expr: str, answer: int, slips: list[int], n: int
) -> tuple[list[str], int, list[str]]:
    """Choices ``"<expr> = <value>"``: the model ranks whole equations, so the choice it prefers
    is the result it computes for ``expr`` (ranking bare numbers mostly measures each number's
    prior, and SmolLM2-135M then scores at chance). Values: ``slips`` (results of another
    operation) in random order, then near misses of the same length."""
    rng.shuffle(slips)
    candidates = [(f"{expr} = {x}", "slip") for x in slips if x > 0 and x != answer]
    candidates += [(f"{expr} = {x}", "near") for x in _near(rng, answer)]
    return pick_choices(rng, f"{expr} = {answer}", candidates, n)


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
    expr = template.expr.format(mul=MUL, div=DIV, **values)
    # Near misses only: the wrong readings of a template (a step skipped, ...) give partial results
    # that a small model prefers to any full computation (measured below chance).
    choices, index, kinds = _number_choices(rng, expr, answer, [], params["n_choices"])
    meta = {"template": template.name, "values": values, "choice_kinds": kinds, "match": "number"}
    return f"{text} Answer with the equation.", meta, str(answer), choices, index


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
    choices, index, kinds = _number_choices(rng, expr, answer, slips, params["n_choices"])
    meta = {"template": form, "choice_kinds": kinds, "match": "number"}
    return f"What is {expr}? Answer with the equation.", meta, str(answer), choices, index


COMPARISON_FORMS = ("after", "before")


def _comparison(rng: random.Random, k: int, params: Vars) -> tuple[str, Vars, str, list[str], int]:
    """Order on the number line: the number just after or just before ``n`` (the two asks
    alternate, so a preference for the larger or the smaller number scores at most a half on
    each). The distractors are the neighbour on the wrong side (a comparison error) and the
    number ten away on the right side (a step error); every choice is the same sentence, only
    the last number differs."""
    ask = COMPARISON_FORMS[k % 2]
    n = rng.randint(11, 98)
    step = 1 if ask == "after" else -1
    answer = n + step
    wrong = [(n - step, "wrong_side"), (n + 10 * step, "wrong_step")]
    line = f"The number just {ask} {n} is {{}}."
    choices, index, kinds = pick_choices(
        rng, line.format(answer), [(line.format(x), kind) for x, kind in wrong], min(params["n_choices"], 3)
    )
    prompt = f"Which number comes just {ask} {n}? Answer with a sentence."
    meta = {"template": ask, "choice_kinds": kinds, "match": "number"}
    return prompt, meta, str(answer), choices, index


# Boolean forms over up to four operands (x, y, z, w), each a template and its value. Together
# they hold 52 distinct true and 58 distinct false expressions, room for ``FULL["logic"]``
# distinct items alternating true and false.
LogicForm = tuple[str, Callable[[bool, bool, bool, bool], bool]]
LOGIC_FORMS: dict[str, LogicForm] = {
    "not": ("not {x}", lambda x, y, z, w: not x),
    "and": ("{x} and {y}", lambda x, y, z, w: x and y),
    "or": ("{x} or {y}", lambda x, y, z, w: x or y),
    "and_not": ("{x} and not {y}", lambda x, y, z, w: x and not y),
    "or_not": ("{x} or not {y}", lambda x, y, z, w: x or not y),
    "not_and": ("not ({x} and {y})", lambda x, y, z, w: not (x and y)),
    "not_or": ("not ({x} or {y})", lambda x, y, z, w: not (x or y)),
    "not_and_not": ("not {x} and not {y}", lambda x, y, z, w: not x and not y),
    "and3": ("{x} and {y} and {z}", lambda x, y, z, w: x and y and z),
    "or3": ("{x} or {y} or {z}", lambda x, y, z, w: x or y or z),
    "or_and": ("({x} or {y}) and {z}", lambda x, y, z, w: (x or y) and z),
    "and_or": ("({x} and {y}) or {z}", lambda x, y, z, w: (x and y) or z),
    "and_paren_or": ("{x} and ({y} or {z})", lambda x, y, z, w: x and (y or z)),
    "or_and_not": ("({x} or {y}) and not {z}", lambda x, y, z, w: (x or y) and not z),
    "and_or_and": ("({x} and {y}) or ({z} and {w})", lambda x, y, z, w: (x and y) or (z and w)),
    "or_and_or": ("({x} or {y}) and ({z} or {w})", lambda x, y, z, w: (x or y) and (z or w)),
}


def _bool(value: bool) -> str:
    return "True" if value else "False"


def _logic(rng: random.Random, k: int, params: Vars) -> tuple[str, Vars, str, list[str], int]:
    """The value of a Boolean expression; True for even ``k``, False for odd, so always
    answering one value scores a half. The form and the operands are drawn until the value is
    the one wanted."""
    want = k % 2 == 0
    while True:
        form = rng.choice(sorted(LOGIC_FORMS))
        template, value_of = LOGIC_FORMS[form]
        operands = [rng.random() < 0.5 for _ in range(4)]
        if value_of(*operands) == want:
            break
    expr = template.format(**{name: _bool(v) for name, v in zip("xyzw", operands, strict=True)})
    choices = [(f"{expr} = {_bool(v)}", "correct" if v == want else "negation") for v in (True, False)]
    rng.shuffle(choices)
    texts = [t for t, _ in choices]
    kinds = [kind for _, kind in choices]
    prompt = f"What is the value of {expr}? Answer with the equation."
    meta = {"template": form, "choice_kinds": kinds, "match": "choice"}
    index = kinds.index("correct")
    return prompt, meta, texts[index], texts, index


MAKERS = {
    "arithmetic": _arithmetic,
    "word_problem": _word_problem,
    "comparison": _comparison,
    "logic": _logic,
}


def generate(size: str | int = "full", seed: int = SEED, **params: Any) -> list[Item]:
    """Items of the suite. ``params`` (difficulty): ``n_choices`` (candidates per arithmetic and
    word-problem item, 3; comparison uses at most 3, logic always 2), ``digits`` (operand digits
    in ``arithmetic``, 1), ``scale`` (multiplies the upper bound of
    the numbers in word problems, 1)."""
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown reasoning parameters {unknown}: use {sorted(DEFAULTS)}")
    settings = {**DEFAULTS, **params}
    if not 2 <= settings["n_choices"] <= 4:
        raise ValueError("reasoning: n_choices is 2 to 4 (comparison has at most 3 candidates, logic 2)")
    items = []
    seen: dict[str, set[str]] = {category: set() for category in FULL}
    for category, count in plan(size, FULL, QUICK).items():
        for k in range(count):
            make = partial(MAKERS[category], k=k, params=settings)
            _, (prompt, meta, target, choices, answer) = unique_draw(
                NAME, seed, category, k, make, itemgetter(0), seen[category]
            )
            meta["k"] = k
            items.append(
                Item(item_id(NAME, category, k), NAME, category, prompt, choices, answer, target, meta)
            )
    return items
