"""``tool_call`` suite: a user request and JSON-Schema function definitions; the model must pick
the function(s) and their arguments, or make no call when none fits.

Method: the Berkeley Function-Calling Leaderboard (BFCL; Yan et al. 2024, "Berkeley Function
Calling Leaderboard", gorilla.cs.berkeley.edu/leaderboard): its categories and its AST scoring
of a generated call (function name, required arguments, argument types and values; see
``evals/suites/tool_ast.py``). Functions, value pools and request templates are written here.

Categories:

- ``simple``: one function offered, one call expected.
- ``multiple``: ``n_functions`` offered (default 4, related ones among them), one call to the
  right one.
- ``parallel``: one function offered, two or three calls of it expected (order-free).
- ``irrelevance``: the request needs a function that is not offered; the right answer is no
  call, ``[]``.

``prompt`` shows the schemas (one JSON object a line) and asks for a JSON list of calls
``[{"name": ..., "arguments": {...}}]``, ``[]`` for none; ``meta["functions"]`` holds the same
schemas for a wrapper with native tool syntax. ``target`` is the expected call list.

Log-likelihood ranking: ``choices`` are call lists as JSON text (``json.dumps``, arguments in
schema order), the right one and plausible wrong ones: another offered function, a wrong value,
a number or boolean written as a string (wrong type), a required argument missing, two values
swapped, an unrequested optional argument, and for parallel requests a call missing, duplicated
or merged into one. For ``irrelevance`` the no-call choice is ``[]`` among calls of the offered
functions; ``[]`` never appears in the other categories. ``meta["choice_kinds"]`` names each.

Syntax distractors: in ``simple``, ``multiple`` and ``parallel`` each item also offers the right
call list with its JSON broken (``n_syntax`` of them, 1 by default, on top of ``n_choices``): a
double quote missing, a brace or bracket unbalanced, a trailing comma, single quotes, or a colon
missing (kinds ``syntax_<name>``, in turn over the items of a category). Every semantic choice
is well-formed JSON, so damage that hits every choice alike cannot move the pick among them; a
model that has lost JSON's syntax picks a broken copy of the right call instead.

No prompt repeats within a category (``common.unique_draw``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from evals.suites.common import SEED, Item, item_id, pick_choices, plan, unique_draw

NAME = "tool_call"
FULL = {"simple": 150, "multiple": 150, "parallel": 150, "irrelevance": 150}
QUICK = 12  # per category: 48 items
DEFAULTS: dict[str, Any] = {"n_choices": 4, "n_functions": 4, "n_syntax": 1}

CITIES = (
    "Paris", "Tokyo", "Lisbon", "Nairobi", "Toronto", "Sydney", "Cairo", "Oslo", "Lima", "Seoul",
    "Berlin", "Mumbai", "Denver", "Madrid", "Hanoi", "Dublin", "Chicago", "Istanbul", "Santiago",
    "Vienna",
)  # fmt: skip
POOLS: dict[str, tuple[Any, ...]] = {
    "city": CITIES,
    "currency": ("USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "INR", "BRL", "SEK"),
    "amount": (20, 45, 120, 250, 75.5, 12.99, 300, 1500, 64.25, 980, 18.4, 5000),
    "bill": (48.5, 32, 120.75, 86, 64.2, 19.9, 150, 72.4, 240, 55),
    "percent": (10, 12, 15, 18, 20, 22, 25),
    "minutes": (5, 10, 12, 15, 20, 25, 30, 40, 45, 60, 90),
    "label": ("pasta", "laundry", "tea", "workout", "oven", "bread", "eggs"),
    "email": (
        "maria@example.com",
        "tom.lee@example.org",
        "sales@example.net",
        "kenji@example.com",
        "amara.o@example.org",
        "support@example.com",
        "lucas.b@example.net",
        "hr@example.org",
    ),
    "subject": ("Team lunch", "Project update", "Invoice", "Weekend plans", "Meeting notes", "Travel dates"),
    "body": (
        "I will be ten minutes late",
        "The report is attached",
        "Can we move it to Friday",
        "Thanks for your help",
        "Please confirm the booking",
    ),
    "restaurant": ("Blue Fig", "Casa Verde", "The Olive Tree", "Sakura House", "Golden Wok", "Le Petit Pont"),
    "people": (2, 3, 4, 5, 6, 7, 8),
    "clock": ("18:30", "19:00", "20:15", "12:45", "07:30", "21:00", "13:15", "08:45"),
    "phrase": (
        "good morning",
        "where is the train station",
        "thank you very much",
        "how much does this cost",
        "I would like a coffee",
        "see you tomorrow",
    ),
    "language": (
        "Spanish",
        "French",
        "German",
        "Japanese",
        "Italian",
        "Portuguese",
        "Korean",
        "Dutch",
        "Turkish",
    ),
    "symbol": ("AAPL", "MSFT", "NVDA", "TSLA", "AMZN", "GOOGL", "META", "IBM", "INTC", "ORCL"),
    "title": (
        "dentist appointment",
        "team meeting",
        "yoga class",
        "book club",
        "car service",
        "piano lesson",
    ),
    "date": (
        "2025-03-14",
        "2025-04-02",
        "2025-05-21",
        "2025-06-09",
        "2025-07-18",
        "2025-08-30",
        "2025-10-11",
        "2025-12-05",
    ),
    "duration": (30, 45, 90, 120),
    "artist": (
        "Miles Davis",
        "Nina Simone",
        "Daft Punk",
        "Adele",
        "Bob Marley",
        "Fela Kuti",
        "Queen",
        "Radiohead",
    ),
    "value": (3, 5, 12, 26.2, 42, 100, 7.5, 250),
    "mode": ("walking", "cycling"),  # "driving" is the default
    "task": (
        "call the plumber",
        "take out the trash",
        "water the plants",
        "pick up the kids",
        "pay the electricity bill",
        "buy a birthday card",
    ),
    "food": (
        "margherita pizza",
        "pad thai",
        "veggie burger",
        "caesar salad",
        "sushi platter",
        "falafel wrap",
    ),
    "quantity": (1, 2, 3, 4, 5, 6),
    "topic": ("climate", "football", "space exploration", "elections", "technology", "healthcare"),
    "limit": (3, 4, 8, 10),
    "temperature": (17, 18, 19, 20, 21, 22, 23, 24),
    "room": ("living room", "bedroom", "kitchen", "office", "nursery"),
    "ingredient": ("chickpeas", "spinach", "salmon", "mushrooms", "lentils", "eggplant", "tofu"),
    "max_minutes": (15, 20, 30, 45),
    "groceries": ("milk", "eggs", "bread", "rice", "bananas", "coffee", "butter", "tomatoes", "oats"),
}


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # JSON Schema type: string, integer, number, boolean, array
    description: str
    pool: str = ""  # key of POOLS ("" for booleans and enum values fixed by templates)
    required: bool = True
    enum: tuple[str, ...] = ()
    default: Any = None


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    params: tuple[Param, ...]
    templates: tuple[tuple[str, dict[str, Any]], ...]
    parallel: tuple[tuple[str, dict[str, Any]], ...] = ()
    related: tuple[str, ...] = field(default=())

    def schema(self) -> dict[str, Any]:
        properties: dict[str, Any] = {}
        for p in self.params:
            prop: dict[str, Any] = {"type": p.type, "description": p.description}
            if p.type == "array":
                prop["items"] = {"type": "string"}
            if p.enum:
                prop["enum"] = list(p.enum)
            if p.default is not None:
                prop["default"] = p.default
            properties[p.name] = prop
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": [p.name for p in self.params if p.required],
            },
        }

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)


def _t(text: str, **fixed: Any) -> tuple[str, dict[str, Any]]:
    return text, fixed


UNITS = ("kilometers", "miles", "kilograms", "pounds", "celsius", "fahrenheit", "liters", "gallons")
FUNCTIONS: tuple[Function, ...] = (
    Function(
        "get_weather",
        "Get the current weather in a city.",
        (
            Param("city", "string", "Name of the city", "city"),
            Param(
                "unit",
                "string",
                "Temperature unit",
                required=False,
                enum=("celsius", "fahrenheit"),
                default="celsius",
            ),
        ),
        (
            _t("What's the weather like in {city} right now?"),
            _t("Tell me the current weather in {city} in fahrenheit.", unit="fahrenheit"),
            _t("How warm is it in {city} today?"),
        ),
        (
            _t("What's the weather like in {city@1} and in {city@2}?"),
            _t("Check the current weather in {city@1}, {city@2} and {city@3}."),
        ),
        ("get_news", "get_distance", "set_thermostat"),
    ),
    Function(
        "convert_currency",
        "Convert an amount of money from one currency to another.",
        (
            Param("amount", "number", "Amount to convert", "amount"),
            Param("from_currency", "string", "ISO code of the source currency", "currency"),
            Param("to_currency", "string", "ISO code of the target currency", "currency"),
        ),
        (
            _t("Convert {amount} {from_currency} to {to_currency}."),
            _t("How much is {amount} {from_currency} in {to_currency}?"),
        ),
        (_t("Convert {amount} {from_currency} into {to_currency@1} and also into {to_currency@2}."),),
        ("calculate_tip", "convert_units", "get_stock_price"),
    ),
    Function(
        "set_timer",
        "Start a countdown timer.",
        (
            Param("minutes", "integer", "Length of the timer in minutes", "minutes"),
            Param("label", "string", "Name shown when the timer ends", "label", required=False),
        ),
        (
            _t("Set a timer for {minutes} minutes."),
            _t("Start a {minutes}-minute timer called {label}."),
        ),
        (_t("Set one timer for {minutes@1} minutes and another one for {minutes@2} minutes."),),
        ("set_reminder", "create_event"),
    ),
    Function(
        "send_email",
        "Send an email.",
        (
            Param("to", "string", "Email address of the recipient", "email"),
            Param("subject", "string", "Subject line", "subject"),
            Param("body", "string", "Text of the message", "body", required=False),
        ),
        (
            _t('Send an email to {to} with the subject "{subject}".'),
            _t('Email {to} with the subject "{subject}" saying "{body}".'),
        ),
        (_t('Send an email with the subject "{subject}" to {to@1} and another to {to@2}.'),),
        ("set_reminder", "translate_text"),
    ),
    Function(
        "book_table",
        "Reserve a table at a restaurant.",
        (
            Param("restaurant", "string", "Name of the restaurant", "restaurant"),
            Param("people", "integer", "Number of guests", "people"),
            Param("time", "string", "Time of the booking, HH:MM", "clock"),
        ),
        (
            _t("Book a table for {people} at {restaurant} at {time}."),
            _t("Reserve a table at {restaurant} for {people} people at {time}, please."),
        ),
        (_t("Book a table for {people} at {restaurant@1} and another at {restaurant@2}, both at {time}."),),
        ("order_food", "create_event", "find_recipes"),
    ),
    Function(
        "translate_text",
        "Translate text into another language.",
        (
            Param("text", "string", "Text to translate", "phrase"),
            Param("target_language", "string", "Language to translate into", "language"),
        ),
        (
            _t('Translate "{text}" into {target_language}.'),
            _t('How do you say "{text}" in {target_language}?'),
        ),
        (_t('Translate "{text}" into {target_language@1} and into {target_language@2}.'),),
        ("send_email",),
    ),
    Function(
        "get_stock_price",
        "Get the latest price of a stock.",
        (Param("symbol", "string", "Ticker symbol", "symbol"),),
        (
            _t("What is the current stock price of {symbol}?"),
            _t("Look up the latest share price for the ticker {symbol}."),
        ),
        (
            _t("Get the stock prices of {symbol@1} and {symbol@2}."),
            _t("Give me the current prices of {symbol@1}, {symbol@2} and {symbol@3}."),
        ),
        ("convert_currency", "get_news"),
    ),
    Function(
        "calculate_tip",
        "Calculate the tip for a restaurant bill.",
        (
            Param("bill", "number", "Bill total in dollars", "bill"),
            Param("percent", "integer", "Tip percentage", "percent"),
        ),
        (
            _t("How much is a {percent}% tip on a ${bill} bill?"),
            _t("Calculate the tip for a bill of ${bill} at {percent} percent."),
        ),
        (_t("What is the tip on a ${bill} bill at {percent@1}% and at {percent@2}%?"),),
        ("convert_currency",),
    ),
    Function(
        "create_event",
        "Add an event to the calendar.",
        (
            Param("title", "string", "Title of the event", "title"),
            Param("date", "string", "Date, YYYY-MM-DD", "date"),
            Param("duration_minutes", "integer", "Length in minutes", "duration", required=False, default=60),
        ),
        (
            _t('Add "{title}" to my calendar on {date}.'),
            _t('Create a calendar event "{title}" on {date} lasting {duration_minutes} minutes.'),
        ),
        (_t('Put "{title}" in my calendar on {date@1} and on {date@2}.'),),
        ("set_reminder", "set_timer", "book_table"),
    ),
    Function(
        "search_flights",
        "Search for flights between two cities.",
        (
            Param("origin", "string", "City of departure", "city"),
            Param("destination", "string", "City of arrival", "city"),
            Param("date", "string", "Date of travel, YYYY-MM-DD", "date"),
            Param("nonstop", "boolean", "Only nonstop flights", required=False, default=False),
        ),
        (
            _t("Find flights from {origin} to {destination} on {date}."),
            _t("Find nonstop flights from {origin} to {destination} on {date}.", nonstop=True),
        ),
        (
            _t(
                "Search flights on {date} from {origin} to {destination@1} "
                "and from {origin} to {destination@2}."
            ),
        ),
        ("get_distance", "get_weather"),
    ),
    Function(
        "play_music",
        "Play music by an artist.",
        (
            Param("artist", "string", "Name of the artist", "artist"),
            Param("shuffle", "boolean", "Play in random order", required=False, default=False),
        ),
        (
            _t("Play some songs by {artist}."),
            _t("Play {artist} on shuffle.", shuffle=True),
        ),
        (_t("Play some {artist@1}, and after that some {artist@2}."),),
        ("get_news",),
    ),
    Function(
        "convert_units",
        "Convert a measurement from one unit to another.",
        (
            Param("value", "number", "Value to convert", "value"),
            Param("from_unit", "string", "Unit of the value", enum=UNITS),
            Param("to_unit", "string", "Unit to convert into", enum=UNITS),
        ),
        (
            _t("How many miles is {value} kilometers?", from_unit="kilometers", to_unit="miles"),
            _t("Convert {value} pounds to kilograms.", from_unit="pounds", to_unit="kilograms"),
            _t("What is {value} degrees fahrenheit in celsius?", from_unit="fahrenheit", to_unit="celsius"),
            _t("How many gallons are {value} liters?", from_unit="liters", to_unit="gallons"),
        ),
        (
            _t(
                "Convert {value@1} kilometers and {value@2} kilometers to miles.",
                from_unit="kilometers",
                to_unit="miles",
            ),
        ),
        ("convert_currency", "set_thermostat"),
    ),
    Function(
        "get_distance",
        "Get the travel distance between two places.",
        (
            Param("origin", "string", "Starting point", "city"),
            Param("destination", "string", "End point", "city"),
            Param(
                "mode",
                "string",
                "Way of travelling",
                "mode",
                required=False,
                enum=("driving", "walking", "cycling"),
                default="driving",
            ),
        ),
        (
            _t("How far is it from {origin} to {destination}?"),
            _t("What is the {mode} distance from {origin} to {destination}?"),
        ),
        (_t("How far is {destination@1} from {origin}, and how far is {destination@2} from {origin}?"),),
        ("search_flights", "get_weather"),
    ),
    Function(
        "set_reminder",
        "Create a reminder at a time of day.",
        (
            Param("text", "string", "What to be reminded of", "task"),
            Param("time", "string", "Time of day, HH:MM", "clock"),
        ),
        (
            _t("Remind me to {text} at {time}."),
            _t("Set a reminder at {time} to {text}."),
        ),
        (_t("Remind me to {text@1} at {time@1} and to {text@2} at {time@2}."),),
        ("set_timer", "create_event", "send_email"),
    ),
    Function(
        "order_food",
        "Order a dish for delivery.",
        (
            Param("item", "string", "Name of the dish", "food"),
            Param("quantity", "integer", "Number of portions", "quantity"),
        ),
        (
            _t("Order {quantity} portions of {item} for delivery."),
            _t("I'd like {quantity} portions of {item} delivered."),
        ),
        (_t("Order {quantity@1} portions of {item@1} and {quantity@2} portions of {item@2}."),),
        ("book_table", "find_recipes", "add_to_shopping_list"),
    ),
    Function(
        "get_news",
        "Get the latest news headlines on a topic.",
        (
            Param("topic", "string", "Topic of the news", "topic"),
            Param("limit", "integer", "Number of headlines", "limit", required=False, default=5),
        ),
        (
            _t("Show me the latest news about {topic}."),
            _t("Give me the top {limit} headlines about {topic}."),
        ),
        (_t("What's the latest news on {topic@1} and on {topic@2}?"),),
        ("get_weather", "get_stock_price", "play_music"),
    ),
    Function(
        "set_thermostat",
        "Set the target temperature of a room in degrees Celsius.",
        (
            Param("temperature", "integer", "Target temperature in degrees Celsius", "temperature"),
            Param("room", "string", "Room of the house", "room"),
        ),
        (
            _t("Set the {room} thermostat to {temperature} degrees."),
            _t("Make the {room} {temperature} degrees, please."),
        ),
        (_t("Set the {room@1} to {temperature@1} degrees and the {room@2} to {temperature@2} degrees."),),
        ("get_weather", "convert_units"),
    ),
    Function(
        "find_recipes",
        "Find recipes that use an ingredient.",
        (
            Param("ingredient", "string", "Main ingredient", "ingredient"),
            Param("max_minutes", "integer", "Longest cooking time in minutes", "max_minutes", required=False),
        ),
        (
            _t("Find me a recipe with {ingredient}."),
            _t("Find recipes with {ingredient} that take at most {max_minutes} minutes."),
        ),
        (_t("Find recipes with {ingredient@1} and recipes with {ingredient@2}."),),
        ("order_food", "add_to_shopping_list", "book_table"),
    ),
    Function(
        "add_to_shopping_list",
        "Add items to the shopping list.",
        (Param("items", "array", "Names of the items", "groceries"),),
        (
            _t("Add {items} to my shopping list."),
            _t("Put {items} on the shopping list."),
        ),
        (),
        ("order_food", "find_recipes"),
    ),
)
BY_NAME = {f.name: f for f in FUNCTIONS}
PARALLEL = tuple(f for f in FUNCTIONS if f.parallel)
_RELATED = {f.name: set(f.related) for f in FUNCTIONS}
for _f in FUNCTIONS:
    for _other in _f.related:
        _RELATED[_other].add(_f.name)

_SLOT = re.compile(r"\{(\w+)(?:@(\d))?\}")

Call = dict[str, Any]


def call_text(calls: list[Call]) -> str:
    """The JSON text of a call list, as in ``choices``."""
    return json.dumps(calls, ensure_ascii=False)


def _render(value: Any) -> str:
    if isinstance(value, list):
        return value[0] if len(value) == 1 else ", ".join(value[:-1]) + " and " + value[-1]
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


class _Sampler:
    """Values from the pools, the same value at most once per item and pool while the pool
    lasts (so two cities of one request differ, and a wrong value differs from the right one)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: dict[str, set[str]] = {}

    def draw(self, param: Param, avoid: Any = None) -> Any:
        used = self.used.setdefault(param.pool or param.name, set())
        if param.type == "boolean":
            return not avoid if avoid is not None else self.rng.choice([True, False])
        if param.type == "array":
            options = [g for g in POOLS[param.pool] if g not in used]
            if len(options) < 3:
                options = list(POOLS[param.pool])
            while True:
                value: Any = self.rng.sample(options, self.rng.choice([2, 3]))
                if value != avoid:
                    used.update(value)
                    return value
        pool = POOLS[param.pool] if param.pool else param.enum
        options = [v for v in pool if canon(v) not in used and v != avoid]
        if not options:
            options = [v for v in pool if v != avoid]
        value = self.rng.choice(options)
        used.add(canon(value))
        return value


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _instantiate(
    function: Function, template: tuple[str, dict[str, Any]], sampler: _Sampler
) -> tuple[str, list[Call]]:
    """The request text and the expected calls of a template."""
    text, fixed = template
    slots = _SLOT.findall(text)
    n_calls = max([int(i) for _, i in slots if i] or [1])
    values: dict[tuple[str, int], Any] = {}
    for name, index in slots:
        key = (name, int(index or 0))
        if key not in values:
            values[key] = sampler.draw(function.param(name))
    request = _SLOT.sub(lambda m: _render(values[(m[1], int(m[2] or 0))]), text)
    calls = []
    for i in range(1, n_calls + 1):
        arguments = {}
        for p in function.params:
            if p.name in fixed:
                arguments[p.name] = fixed[p.name]
            elif (p.name, i) in values:
                arguments[p.name] = values[(p.name, i)]
            elif (p.name, 0) in values:
                arguments[p.name] = values[(p.name, 0)]
        calls.append({"name": function.name, "arguments": arguments})
    return request, calls


def _with(call: Call, **arguments: Any) -> Call:
    return {"name": call["name"], "arguments": {**call["arguments"], **arguments}}


def _wrong_values(call: Call, sampler: _Sampler) -> list[Call]:
    function = BY_NAME[call["name"]]
    out = []
    names = list(call["arguments"])
    sampler.rng.shuffle(names)
    for name in names:
        param = function.param(name)
        if param.type != "boolean":
            out.append(_with(call, **{name: sampler.draw(param, avoid=call["arguments"][name])}))
    return out


def _wrong_types(call: Call) -> list[Call]:
    out = []
    for name, value in call["arguments"].items():
        if isinstance(value, bool):
            out.append(_with(call, **{name: "true" if value else "false"}))
        elif isinstance(value, int | float):
            out.append(_with(call, **{name: str(value)}))
    return out


def _missing(call: Call) -> list[Call]:
    function = BY_NAME[call["name"]]
    if len(call["arguments"]) < 2:
        return []
    return [
        {"name": call["name"], "arguments": {k: v for k, v in call["arguments"].items() if k != name}}
        for name in call["arguments"]
        if function.param(name).required
    ]


def _swapped(call: Call) -> list[Call]:
    function = BY_NAME[call["name"]]
    names = [n for n in call["arguments"] if function.param(n).type == "string"]
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pa, pb = function.param(a), function.param(b)
            if pa.pool == pb.pool or (pa.enum and pa.enum == pb.enum):
                out.append(_with(call, **{a: call["arguments"][b], b: call["arguments"][a]}))
    return out


def _extra(call: Call, sampler: _Sampler) -> list[Call]:
    """An optional argument the request did not ask for, with a non-default value."""
    function = BY_NAME[call["name"]]
    out = []
    for p in function.params:
        if not p.required and p.name not in call["arguments"]:
            value = sampler.draw(p, avoid=p.default)
            arguments = {
                q.name: value if q.name == p.name else call["arguments"].get(q.name) for q in function.params
            }
            out.append(
                {"name": call["name"], "arguments": {k: v for k, v in arguments.items() if v is not None}}
            )
    return out


def _call_of(function: Function, sampler: _Sampler, borrow: Call | None = None) -> Call:
    """A plausible call of ``function``: one of its own requests, instantiated; with ``borrow``,
    the values of that call are copied into arguments of the same kind (a city stays a city), or
    failing that its first text value into the first required text argument, as a model that
    copies the request's entities into the wrong function would."""
    call = _instantiate(function, sampler.rng.choice(function.templates), sampler)[1][0]
    if borrow is None:
        return call
    source = BY_NAME[borrow["name"]]
    values = [(source.param(n).pool, v) for n, v in borrow["arguments"].items()]
    arguments = dict(call["arguments"])
    changed = False
    for name in arguments:
        param = function.param(name)
        match = next((i for i, (pool, _) in enumerate(values) if pool and pool == param.pool), None)
        if match is not None:
            arguments[name] = values.pop(match)[1]
            changed = True
    if not changed:
        text = next((v for _, v in values if isinstance(v, str)), None)
        name = next(
            (p.name for p in function.params if p.required and p.type == "string" and not p.enum), None
        )
        if text is not None and name is not None:
            arguments[name] = text
    return {"name": function.name, "arguments": arguments}


def _shuffled(rng: random.Random, options: list[tuple[list[Call], str]]) -> list[tuple[list[Call], str]]:
    rng.shuffle(options)
    return options


def _more_values(call: Call, sampler: _Sampler, rounds: int) -> list[tuple[list[Call], str]]:
    """Fallback distractors: further wrong values."""
    return [([c], "wrong_value") for _ in range(rounds) for c in _wrong_values(call, sampler)]


def _single(rng: random.Random, k: int) -> tuple[Function, str, Call, _Sampler]:
    """One function (in turn, so any first N items cover them), a request and its one call."""
    function = FUNCTIONS[k % len(FUNCTIONS)]
    sampler = _Sampler(rng)
    template = function.templates[(k // len(FUNCTIONS)) % len(function.templates)]
    request, calls = _instantiate(function, template, sampler)
    return function, request, calls[0], sampler


def _simple(
    rng: random.Random, k: int, params: dict[str, Any]
) -> tuple[list[Function], str, list[Call], list]:
    function, request, call, sampler = _single(rng, k)
    options = [([c], "wrong_value") for c in _wrong_values(call, sampler)[:1]]
    options += [([c], "wrong_type") for c in _wrong_types(call)[:1]]
    options += [([c], "missing_argument") for c in _missing(call)[:1]]
    options += [([c], "swapped") for c in _swapped(call)[:1]]
    options += [([c], "extra_argument") for c in _extra(call, sampler)[:1]]
    options = _shuffled(rng, options)
    return [function], request, [call], options + _more_values(call, sampler, params["n_choices"])


def _multiple(
    rng: random.Random, k: int, params: dict[str, Any]
) -> tuple[list[Function], str, list[Call], list]:
    function, request, call, sampler = _single(rng, k)
    related = sorted(_RELATED[function.name])
    rng.shuffle(related)
    others = [f for f in FUNCTIONS if f.name != function.name and f.name not in related]
    rng.shuffle(others)
    offered_others = ([BY_NAME[n] for n in related[:2]] + others)[: params["n_functions"] - 1]
    offered = [function, *offered_others]
    rng.shuffle(offered)
    # A call of a related offered function first, then a mix of the other kinds of mistake.
    options = [([_call_of(f, sampler, borrow=call)], "wrong_function") for f in offered_others]
    mix = options[1:2]
    mix += [([c], "wrong_value") for c in _wrong_values(call, sampler)[:1]]
    mix += [([c], "wrong_type") for c in _wrong_types(call)[:1]]
    mix += [([c], "missing_argument") for c in _missing(call)[:1]]
    return (
        offered,
        request,
        [call],
        options[:1] + _shuffled(rng, mix) + options[2:] + _more_values(call, sampler, params["n_choices"]),
    )


def _parallel(
    rng: random.Random, k: int, params: dict[str, Any]
) -> tuple[list[Function], str, list[Call], list]:
    function = PARALLEL[k % len(PARALLEL)]
    sampler = _Sampler(rng)
    template = function.parallel[(k // len(PARALLEL)) % len(function.parallel)]
    request, calls = _instantiate(function, template, sampler)
    options: list[tuple[list[Call], str]] = [(calls[:-1], "missing_call")]
    i = rng.randrange(len(calls))
    options += [
        ([*calls[:i], c, *calls[i + 1 :]], "wrong_value") for c in _wrong_values(calls[i], sampler)[:1]
    ]
    options += [([*calls[:i], c, *calls[i + 1 :]], "wrong_type") for c in _wrong_types(calls[i])[:1]]
    varying = [n for n in calls[0]["arguments"] if calls[0]["arguments"][n] != calls[1]["arguments"][n]]
    if len(varying) == 1 and isinstance(calls[0]["arguments"][varying[0]], str):
        name = varying[0]
        merged = _render([c["arguments"][name] for c in calls])
        options.append(([_with(calls[0], **{name: merged})], "merged"))
    options = _shuffled(rng, options)
    options.append(([calls[0]] * len(calls), "duplicate"))
    for _ in range(max(3, params["n_choices"])):
        options += [
            ([*calls[:i], c, *calls[i + 1 :]], "wrong_value") for c in _wrong_values(calls[i], sampler)
        ]
    return [function], request, calls, options


def _irrelevance(
    rng: random.Random, k: int, params: dict[str, Any]
) -> tuple[list[Function], str, list[Call], list]:
    function, request, call, sampler = _single(rng, k)
    unrelated = [f for f in FUNCTIONS if f.name != function.name and f.name not in _RELATED[function.name]]
    offered = rng.sample(unrelated, rng.randint(1, max(1, params["n_functions"] - 1)))
    options = []
    for f in offered:
        misused = _call_of(f, sampler, borrow=call)
        borrowed = any(v in call["arguments"].values() for v in misused["arguments"].values())
        options.append(([misused], "misused_call" if borrowed else "unrelated_call"))
    options += [([_call_of(f, sampler)], "unrelated_call") for f in offered]
    options += [([_call_of(f, sampler)], "unrelated_call") for f in offered * params["n_choices"]]
    return offered, request, [], options


MAKERS = {"simple": _simple, "multiple": _multiple, "parallel": _parallel, "irrelevance": _irrelevance}


def _missing_quote(rng: random.Random, text: str) -> str:
    i = rng.choice([m.start() for m in re.finditer('"', text)])
    return text[:i] + text[i + 1 :]


def _unbalanced(rng: random.Random, text: str) -> str:
    # never the last closer dropped: that copy would be a prefix of the right call, which a
    # log-likelihood ranking cannot tell from it (the continuation just stops early)
    i = rng.choice([m.start() for m in re.finditer(r"[}\]]", text)])
    if rng.random() < 0.5 and i < len(text) - 1:
        return text[:i] + text[i + 1 :]
    return text[:i] + text[i] + text[i:]


def _trailing_comma(rng: random.Random, text: str) -> str:
    i = rng.choice([m.start() for m in re.finditer(r"(?<=[^\[{])[}\]]", text)])
    return text[:i] + "," + text[i:]


def _single_quotes(rng: random.Random, text: str) -> str:
    return text.replace('"', "'")


def _missing_colon(rng: random.Random, text: str) -> str:
    i = rng.choice([m.start() for m in re.finditer(r'(?<=")(?=: )', text)])
    return text[:i] + text[i + 1 :]


# JSON syntax errors a model that has lost the format makes (the list): each breaks the
# text for json.loads, and each keeps every name and value of the right call.
SYNTAX_BREAKS: dict[str, Callable[[random.Random, str], str]] = {
    "syntax_missing_quote": _missing_quote,
    "syntax_unbalanced": _unbalanced,
    "syntax_trailing_comma": _trailing_comma,
    "syntax_single_quotes": _single_quotes,
    "syntax_missing_colon": _missing_colon,
}


def syntax_distractors(rng: random.Random, correct: str, k: int, n: int) -> list[tuple[str, str]]:
    """``n`` copies of ``correct`` (a call list's JSON text) with its syntax broken, of kinds in
    turn from item ``k`` on, each one that ``json.loads`` refuses and none a prefix of
    ``correct``."""
    kinds = list(SYNTAX_BREAKS)
    out = []
    for j in range(n):
        kind = kinds[(k + j) % len(kinds)]
        broken = SYNTAX_BREAKS[kind](rng, correct)
        if correct.startswith(broken):  # a generator bug: ranking cannot tell a prefix
            raise AssertionError(f"{kind} made {broken!r}, a prefix of the right call")
        try:
            json.loads(broken)
        except ValueError:
            out.append((broken, kind))
            continue
        raise AssertionError(f"{kind} left {broken!r} valid JSON")  # a generator bug
    return out


INSTRUCTIONS = (
    "You can call these functions (JSON schemas, one a line):\n{schemas}\n\n"
    'Reply with a JSON list of the calls that answer the request, each as {{"name": <function '
    'name>, "arguments": {{<argument>: <value>}}}}. Reply with [] if none of the functions fits '
    "the request.\n\nRequest: {request}"
)


def prompt_for(functions: list[dict[str, Any]], request: str) -> str:
    """The user message of an item: schemas, the answer format, the request."""
    schemas = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return INSTRUCTIONS.format(schemas=schemas, request=request)


def _drawn(
    rng: random.Random, maker: Callable[..., Any], k: int, settings: dict[str, Any]
) -> tuple[Any, ...]:
    """One draw of a maker, with the offered functions as schemas (what the prompt shows)."""
    offered, request, calls, options = maker(rng, k, settings)
    return [f.schema() for f in offered], request, calls, options


def generate(size: str | int = "full", seed: int = SEED, **params: Any) -> list[Item]:
    """Items of the suite. ``params`` (difficulty): ``n_choices`` (candidate call lists per item,
    4), ``n_functions`` (functions offered in ``multiple``, at most that many in
    ``irrelevance``, 4) and ``n_syntax`` (syntax-broken copies of the right call added to the
    choices of every category but ``irrelevance``, 1)."""
    unknown = sorted(set(params) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown tool_call parameters {unknown}: use {sorted(DEFAULTS)}")
    settings = {**DEFAULTS, **params}
    if settings["n_functions"] < 2:
        raise ValueError("tool_call: n_functions must be at least 2")
    if not 0 <= settings["n_syntax"] <= len(SYNTAX_BREAKS):
        raise ValueError(f"tool_call: n_syntax is 0 to {len(SYNTAX_BREAKS)}")
    items = []
    seen: dict[str, set[str]] = {category: set() for category in FULL}
    for category, count in plan(size, FULL, QUICK).items():
        for k in range(count):
            make = partial(_drawn, maker=MAKERS[category], k=k, settings=settings)
            rng, (schemas, request, calls, options) = unique_draw(
                NAME, seed, category, k, make, lambda drawn: prompt_for(drawn[0], drawn[1]), seen[category]
            )
            correct = call_text(calls)
            distractors = [(call_text(c), kind) for c, kind in options]
            n_syntax = 0 if category == "irrelevance" else settings["n_syntax"]
            broken = syntax_distractors(rng, correct, k, n_syntax)
            choices, answer, kinds = pick_choices(
                rng, correct, broken + distractors, settings["n_choices"] + len(broken)
            )
            meta = {
                "functions": schemas,
                "request": request,
                "choice_kinds": kinds,
                "match": "ast",
                "k": k,
            }
            items.append(
                Item(
                    item_id(NAME, category, k),
                    NAME,
                    category,
                    prompt_for(schemas, request),
                    choices,
                    answer,
                    calls,
                    meta,
                )
            )
    return items
