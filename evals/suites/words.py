"""Word lists of the suite generators, written for this project (no third-party text).

Typed variables of the reasoning templates (names, objects), the vocabulary of the synthetic
haystack sentences and the pool of the common-word-extraction task. Every list is plain
lowercase English (names capitalised), free of digits, so that no number in a prompt comes from
here. Changing a list changes the generated items: rerun ``python -m evals.suites --write``.
"""

from __future__ import annotations


def _words(text: str) -> tuple[str, ...]:
    words = tuple(text.split())
    if len(set(words)) != len(words):
        duplicates = sorted({w for w in words if words.count(w) > 1})
        raise ValueError(f"duplicate words in a list: {duplicates}")
    return words


# (name, pronoun): he / she / they; the reasoning templates inflect with PRONOUNS below.
PEOPLE: tuple[tuple[str, str], ...] = (
    ("Ava", "she"), ("Liam", "he"), ("Noor", "she"), ("Mateo", "he"), ("Yuki", "she"),
    ("Omar", "he"), ("Priya", "she"), ("Lucas", "he"), ("Amara", "she"), ("Chen", "he"),
    ("Sofia", "she"), ("Tariq", "he"), ("Elena", "she"), ("Kofi", "he"), ("Hana", "she"),
    ("Diego", "he"), ("Leila", "she"), ("Felix", "he"), ("Mei", "she"), ("Ravi", "he"),
    ("Zara", "she"), ("Jonas", "he"), ("Ines", "she"), ("Arjun", "he"), ("Clara", "she"),
    ("Hugo", "he"), ("Freya", "she"), ("Emeka", "he"), ("Lucia", "she"), ("Sami", "he"),
    ("Greta", "she"), ("Pablo", "he"), ("Aisha", "she"), ("Tomas", "he"), ("Nadia", "she"),
    ("Kenji", "he"), ("Rosa", "she"), ("Ivan", "he"), ("Maya", "she"), ("Ali", "he"),
)  # fmt: skip

PRONOUNS: dict[str, dict[str, str]] = {
    "he": {"he": "he", "him": "him", "his": "his"},
    "she": {"he": "she", "him": "her", "his": "her"},
}

# Countable things a person can own, buy, pack or share (plural forms).
THINGS = _words(
    """apples stickers marbles pencils cookies shells stamps cards beads balloons candles
    buttons oranges lemons crayons erasers magnets postcards seashells ribbons"""
)

# Haystack vocabulary: agents, objects, places, times, verbs, adverbs, adjectives.
AGENTS = _words(
    """baker sailor farmer teacher painter gardener fisher weaver potter carpenter
    shepherd miller tailor porter musician traveller student merchant poet cook
    heron fox badger otter sparrow pony goat rabbit beetle raven"""
)
OBJECTS = _words(
    """basket lantern letter blanket kettle ladder bucket map rope barrel wagon lamp
    cloak scarf bell drum kite compass notebook shovel broom candle quilt jar bowl
    teapot satchel umbrella hammer saddle"""
)
PLACES = _words(
    """harbor orchard library meadow bridge market chapel garden valley river hill
    forest village square bakery mill pier cottage barn field courtyard station
    hallway kitchen workshop attic cellar greenhouse lighthouse vineyard"""
)
TIMES = (
    "In the early morning",
    "Late in the evening",
    "Before the rain began",
    "After the market closed",
    "During the long winter",
    "On a quiet afternoon",
    "At the end of the summer",
    "When the bells had stopped",
    "Long before sunrise",
    "As the fog lifted",
    "Soon after the storm",
    "Every spring",
)
VERBS = _words(
    """carried painted found repaired cleaned lifted wrapped moved dropped opened
    polished borrowed returned hid carved filled mended washed"""
)
INTRANSITIVE = _words(
    """waited rested wandered listened laughed hummed whistled paused lingered slept
    watched sang"""
)
ADVERBS = _words(
    """slowly quietly carefully gently patiently happily calmly proudly swiftly
    softly boldly eagerly"""
)
ADJECTIVES = _words(
    """old young quiet patient tired cheerful clever gentle brave curious small large
    heavy bright dark narrow wide warm cold silver golden wooden painted broken
    shiny dusty simple tall distant crowded empty"""
)
FEELINGS = _words("glad calm proud sleepy hopeful thoughtful content curious weary")
WEATHER = (
    "the wind was cold",
    "the sky was grey",
    "the air smelled of bread",
    "the river was high",
    "the road was muddy",
    "the sun was warm",
    "the clouds were low",
    "the leaves were falling",
)

# Pool of the common-word-extraction task (RULER "cwe"): common nouns and adjectives.
CWE_WORDS = _words(
    """acorn actor anchor angle ankle apple apron arrow artist attic autumn axle badge
    bagel ballad bamboo banjo banner barrel basin basket beacon beaver bench berry
    bicycle biscuit blanket blossom bonnet border bottle boulder bracelet branch breeze
    brick bridge bronze brush bubble bucket buckle buffalo bundle butter button cabin
    cactus camel candle canoe canyon carpet carrot castle cattle cedar cellar chalk
    channel chapter cherry chimney circle citizen clover coconut collar comet compass
    copper corner cotton cousin cradle crater cricket crystal cupboard curtain cushion
    daisy dancer desert diamond dinner doctor dolphin donkey dragon drawer dream eagle
    elbow engine envelope falcon feather fence fiddle finger flame flannel flavor
    flower forest fountain fox garden garlic gate ginger glacier glove goose gravel
    guitar hammer harbor harvest hazel helmet herbs hermit honey horizon hornet
    island ivory jacket jelly jewel journey jungle kettle kitten ladder lagoon lantern
    lemon lettuce lily linen lizard lobster locket magnet mango maple marble market
    meadow melon mermaid meteor mirror mitten monkey moss mountain muffin museum
    mustard needle nephew nickel noodle oasis ocean olive onion orbit orchard orchid
    otter oven owl paddle palace panther parcel parrot pasta peach peanut pebble
    pencil pepper piano pickle pillow pilot pine planet plum pocket pony poppy potato
    pottery pudding pumpkin puppet puzzle quarry quartz quill rabbit radish raft
    rainbow raisin raven ribbon riddle river robin rocket saddle salmon sandal
    satchel scarf scooter sheep shelter shovel silver sketch sled slipper socket
    spider spinach sponge squirrel staple statue stone stream sugar summit sunset
    swallow sweater table tablet teapot temple thimble thistle thunder ticket tiger
    timber toffee tomato tower trail tulip tunnel turnip turtle umbrella valley
    velvet village violin volcano wagon walnut walrus wardrobe whale wheat whistle
    willow window winter wizard wolf wool yacht yogurt zebra amber brisk calm crisp
    dusty eager fancy fluffy fragile gentle glossy golden hollow humble icy jolly
    lively lofty mellow misty modest narrow nimble noble plain polite proud quiet
    rapid rustic shiny silky sleepy smooth snowy sour spicy steady sturdy sunny swift
    tender tidy tiny vivid warm witty woolly zesty"""
)

# Key words of the needle-in-a-haystack needles (joined in pairs: "amber-falcon").
KEY_ADJECTIVES = _words(
    """amber brisk crimson dapper elder fabled gilded hidden ivory jagged keen lunar
    mossy noble opal placid quaint rustic scarlet tawny umber velvet wistful young
    zealous azure bronze coral dusky emerald"""
)
KEY_NOUNS = _words(
    """falcon harbor lantern meadow orchid pebble quarry raven saddle thistle willow
    anchor beacon cedar comet ember fjord glacier heron island juniper kestrel
    locket marble nectar oasis prism quill summit tundra"""
)
