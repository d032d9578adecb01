"""A small, deterministic English corpus of reviews, written for this project.

Every review reads ``"<prefix> <body>"`` where the prefix names what is reviewed (``"Review of the
new phone:"``) and the body is one to three sentences whose sentiment shows in its words:

* a positive review uses words from :data:`POSITIVE_WORDS` and none from :data:`NEGATIVE_WORDS`;
* a negative review uses words from :data:`NEGATIVE_WORDS` and none from :data:`POSITIVE_WORDS`;
* a neutral review uses words from neither list.

So a lexicon score (positive minus negative word count) recovers the label of every review, which
is what the demo rewards and what the reward model is trained on. There are no negations ("not
good") on purpose: a bag-of-words lexicon would misread them.

The prompt/completion split for RL is the prefix / the body: :attr:`Review.prompt` and
:attr:`Review.completion`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

Sentiment = Literal["positive", "negative", "neutral"]
SENTIMENTS: tuple[Sentiment, ...] = ("positive", "negative", "neutral")

# What is reviewed, by category, and the aspects a review of it can talk about.
_ITEMS: dict[str, tuple[str, ...]] = {
    "product": (
        "the new phone",
        "the laptop",
        "the wireless headphones",
        "the blender",
        "the coffee maker",
        "the hiking backpack",
        "the camera",
        "the vacuum cleaner",
        "the keyboard",
        "the smart watch",
        "the desk lamp",
        "the electric kettle",
    ),
    "movie": (
        "the new thriller",
        "the animated film",
        "the documentary",
        "the sequel",
        "the romantic comedy",
        "the space movie",
        "the horror film",
        "the period drama",
        "the spy movie",
        "the musical",
    ),
    "restaurant": (
        "the Italian place downtown",
        "the sushi bar",
        "the corner bakery",
        "the taco truck",
        "the steakhouse",
        "the vegan cafe",
        "the noodle shop",
        "the pizza place",
        "the seafood restaurant",
        "the breakfast diner",
    ),
}

_ASPECTS: dict[str, tuple[str, ...]] = {
    "product": (
        "battery",
        "screen",
        "sound",
        "design",
        "price",
        "build quality",
        "setup",
        "manual",
        "packaging",
        "weight",
        "buttons",
    ),
    "movie": (
        "acting",
        "plot",
        "soundtrack",
        "ending",
        "dialogue",
        "camera work",
        "pacing",
        "cast",
        "script",
        "opening scene",
    ),
    "restaurant": (
        "food",
        "service",
        "staff",
        "menu",
        "dessert",
        "atmosphere",
        "coffee",
        "portions",
        "bread",
        "music",
    ),
}

# Adjectives and phrases by sentiment. Every word in the positive (negative) phrases is either a
# function word or listed in POSITIVE_WORDS (NEGATIVE_WORDS); neutral phrases use neither list.
_POS_ADJ = (
    "great",
    "excellent",
    "wonderful",
    "amazing",
    "fantastic",
    "superb",
    "lovely",
    "brilliant",
    "perfect",
    "impressive",
    "delightful",
    "beautiful",
    "outstanding",
    "charming",
)
_NEG_ADJ = (
    "terrible",
    "awful",
    "horrible",
    "poor",
    "disappointing",
    "dreadful",
    "mediocre",
    "annoying",
    "bad",
    "weak",
    "lousy",
    "dismal",
    "frustrating",
    "unpleasant",
)
_NEU_ADJ = (
    "average",
    "ordinary",
    "standard",
    "typical",
    "acceptable",
    "plain",
    "simple",
    "as expected",
    "about the same as others",
    "fairly normal",
)
_POS_VERB = ("loved", "enjoyed", "adored", "liked")
_NEG_VERB = ("hated", "disliked", "regretted", "resented")
_NEU_VERB = ("noticed", "checked", "looked at", "tried")
_POS_CLOSE = (
    "I would recommend it to my friends.",
    "Highly recommended.",
    "I am very happy with it.",
    "It was a joy from start to finish.",
    "I will gladly come back for more.",
    "Best money I have spent this year.",
    "A real pleasure.",
)
_NEG_CLOSE = (
    "What a waste of money.",
    "I regret it.",
    "Avoid it.",
    "I was very unhappy with it.",
    "It was the worst part of my week.",
    "A total failure.",
    "Sadly a big letdown.",
)
_NEU_CLOSE = (
    "It is what it is.",
    "I have no strong opinion either way.",
    "It does the job.",
    "Nothing more to say about it.",
    "I might try it again some time.",
    "Make of that what you will.",
    "That is all for now.",
)
_POS_INTENSIFIER = ("really", "truly", "very", "so")
_NEG_INTENSIFIER = ("really", "truly", "very", "so")

# Sentence templates. {a} aspect, {b} a second aspect, {adj}/{adj2} adjectives, {verb} a verb,
# {i} an intensifier. Templates are shared across sentiments; the word lists carry the sentiment.
_TEMPLATES_JUDGING = (
    "The {a} is {adj}.",
    "The {a} was {i} {adj}.",
    "The {a} is {adj} and the {b} is {adj2}.",
    "I {verb} the {a}.",
    "I {verb} the {a} and the {b}.",
    "Honestly, the {a} was {adj}.",
    "The {a} felt {adj} to me.",
)
_TEMPLATES_NEUTRAL = (
    "The {a} is {adj}.",
    "The {a} was {adj}.",
    "The {a} is {adj} and the {b} is {adj2}.",
    "I {verb} the {a}.",
    "I {verb} the {a} and the {b}.",
    "The {a} seemed {adj} to me.",
    "The {a} is {adj}, I suppose.",
)

#: Words that mark a positive review (lower case). A lexicon score counts these.
POSITIVE_WORDS: frozenset[str] = frozenset(
    set(_POS_ADJ)
    | set(_POS_VERB)
    | {"recommend", "recommended", "happy", "joy", "gladly", "best", "pleasure", "highly"}
)
#: Words that mark a negative review (lower case). A lexicon score subtracts these.
NEGATIVE_WORDS: frozenset[str] = frozenset(
    set(_NEG_ADJ)
    | set(_NEG_VERB)
    | {"waste", "regret", "avoid", "unhappy", "worst", "failure", "sadly", "letdown"}
)

_WORD_RE = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Review:
    """One review: ``text == prompt + completion``.

    Attributes:
        text: the whole review, e.g. ``"Review of the laptop: The screen is superb."``.
        sentiment: the label the words were drawn for.
        prompt: the prefix up to and including the colon (``"Review of the laptop:"``).
        completion: the rest, starting with a space (``" The screen is superb."``).
    """

    text: str
    sentiment: Sentiment

    @property
    def prompt(self) -> str:
        return self.text[: self.text.index(":") + 1]

    @property
    def completion(self) -> str:
        return self.text[self.text.index(":") + 1 :]


def lexicon_score(text: str) -> int:
    """Number of :data:`POSITIVE_WORDS` minus number of :data:`NEGATIVE_WORDS` in ``text``."""
    words = _WORD_RE.findall(text.lower())
    return sum(w in POSITIVE_WORDS for w in words) - sum(w in NEGATIVE_WORDS for w in words)


def _sentence(rng: random.Random, category: str, sentiment: Sentiment) -> str:
    aspects = _ASPECTS[category]
    a, b = rng.sample(aspects, 2)
    adjs: tuple[str, ...]
    verbs: tuple[str, ...]
    ints: tuple[str, ...]
    templates: tuple[str, ...]
    if sentiment == "positive":
        adjs, verbs, ints, templates = _POS_ADJ, _POS_VERB, _POS_INTENSIFIER, _TEMPLATES_JUDGING
    elif sentiment == "negative":
        adjs, verbs, ints, templates = _NEG_ADJ, _NEG_VERB, _NEG_INTENSIFIER, _TEMPLATES_JUDGING
    else:
        adjs, verbs, ints, templates = _NEU_ADJ, _NEU_VERB, ("",), _TEMPLATES_NEUTRAL
    adj, adj2 = rng.sample(adjs, 2)
    template = rng.choice(templates)
    text = template.format(a=a, b=b, adj=adj, adj2=adj2, verb=rng.choice(verbs), i=rng.choice(ints))
    return " ".join(text.split())  # collapses the double space an empty intensifier leaves


def _closing(rng: random.Random, sentiment: Sentiment) -> str:
    if sentiment == "positive":
        return rng.choice(_POS_CLOSE)
    if sentiment == "negative":
        return rng.choice(_NEG_CLOSE)
    return rng.choice(_NEU_CLOSE)


def _review(rng: random.Random, sentiment: Sentiment) -> Review:
    category = rng.choice(sorted(_ITEMS))
    item = rng.choice(_ITEMS[category])
    n_sentences = rng.choice((1, 2, 2, 3))
    body = [_sentence(rng, category, sentiment) for _ in range(n_sentences)]
    if n_sentences < 3 and rng.random() < 0.5:
        body.append(_closing(rng, sentiment))
    return Review(text=f"Review of {item}: " + " ".join(body), sentiment=sentiment)


def review_corpus(n: int, seed: int = 0) -> list[Review]:
    """``n`` distinct reviews, a third of each sentiment (round-robin), in a seeded random order.

    Deterministic: the same ``(n, seed)`` gives the same list on every platform (it uses only
    :class:`random.Random`). Raises ``ValueError`` if ``n`` is not positive or too large for the
    templates to give ``n`` distinct reviews (well above 10,000 is fine).
    """
    if n <= 0:
        raise ValueError(f"n must be a positive number of reviews, got {n}")
    rng = random.Random(seed)
    seen: set[str] = set()
    reviews: list[Review] = []
    attempts = 0
    while len(reviews) < n:
        attempts += 1
        if attempts > 20 * n + 1000:
            raise ValueError(
                f"could not draw {n} distinct reviews (got {len(reviews)}); ask for fewer"
            )
        review = _review(rng, SENTIMENTS[len(reviews) % 3])
        if review.text not in seen:
            seen.add(review.text)
            reviews.append(review)
    rng.shuffle(reviews)
    return reviews


def review_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompt prefixes (``"Review of the camera:"``), cut from :func:`review_corpus`."""
    return [r.prompt for r in review_corpus(n, seed)]
